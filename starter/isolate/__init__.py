"""What the job sees: namespaces, mounts, devices, the syscall filter, the shim's spec."""
