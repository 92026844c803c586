"""What the admin can do about a failed spawn: errno -> hint tables for
clone3 (clone_hint) and for the shim's failing step (step_hint).  Loaded
only when a spawn fails.
"""

from starter.isolate import mounts as _mounts

# fail_link() in shim_mountfd.c: a mount destination with a link on it
LINK_STEP, LINK_END = "mount destination ", " is a symlink (not followed)"


def clone_hint(err, nsflags, cgroup_fd):
    import errno as E
    if err == E.EPERM:
        return "creating namespaces needs root (CAP_SYS_ADMIN): run the starter as root"
    if err == E.ENOSPC:
        return ("the namespace limit is reached: raise user.max_pid_namespaces, "
                "user.max_net_namespaces, user.max_mnt_namespaces (sysctl), or gc old jobs")
    if err == E.EBUSY and cgroup_fd is not None:
        return ("the target cgroup has controllers enabled for children "
                "(cgroup v2 no-internal-process rule): use a leaf cgroup")
    if err in (E.EINVAL, E.EOPNOTSUPP) and cgroup_fd is not None:
        return "cgroup_fd must be a directory fd of a cgroup2 (unified) hierarchy"
    if err == E.EAGAIN:
        return "process limit reached (pids cgroup, ulimit -u or kernel.pid_max)"
    if err == E.ENOMEM:
        return "the kernel is out of memory, or pid namespace init already exited"
    return None


def step_hint(step, err, spec):
    import errno as E
    uid = getattr(spec, "uid", 0)
    if step.startswith("execve"):
        if err == E.ENOENT:
            path = spec.env.get("PATH") if spec is not None else None
            if "/" in step[7:]:
                return "no such file in the job's view of the filesystem"
            return f"not found in the job's PATH={path}" if path else "the job's env has no PATH: give an absolute path"
        if err == E.EACCES:
            return f"not executable for uid {uid}, or on a noexec mount"
        if err == E.ENOEXEC:
            return "not a binary this kernel can run; scripts need a #! line"
        return None
    if step.startswith("chdir"):
        return f"the working directory must exist in the job's view and be searchable by uid {uid}"
    if step.startswith(LINK_STEP) and err == E.ELOOP:
        return ("mount destinations are resolved in the job's view without following links, "
                "the last component included: give the path the link leads to; a link a job or "
                "user made is refused on purpose")
    if step.startswith("bind source") and err == E.ENOENT:
        return "the source of the bind does not exist on the host"
    if step.startswith(_mounts.KINDS + ("mkdir",)):
        if err == E.ENOENT:
            return ("the source or the mount point does not exist; mount points are "
                    "created only inside a tmpfs the job mounts (e.g. the private /tmp)")
        if err == E.ENOTDIR:
            return "a directory can only be bound onto a directory, a file onto a file"
    if step.startswith("mount") and err == E.EPERM:
        return "mounting needs CAP_SYS_ADMIN; is the starter itself in a restricted container?"
    if step in ("setresuid", "setresgid", "setgroups", "capset") and err == E.EPERM:
        return "changing credentials needs root: run the starter as root"
    if step == "unshare cgroup namespace" and err == E.EINVAL:
        return "the kernel lacks cgroup namespaces (CONFIG_CGROUPS, Linux 4.6+)"
    if step.startswith("mount /sys/fs/cgroup") and err == E.EBUSY:
        return "the host's cgroup hierarchies changed since the starter probed them (mount options differ)"
    if step.startswith("keyctl") and err == E.EDQUOT:
        return "the job user's key quota is full (kernel.keys.maxkeys/maxbytes): old keys of that user remain"
    if step == "unshare user namespace" and err in (E.EPERM, E.ENOSPC, E.EACCES):
        return ("--userns-root needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0 "
                "(and kernel.unprivileged_userns_clone=1 where it exists)")
    if step.startswith("setrlimit") and err == E.EPERM:
        return ("--rlimit above what the starter may grant: raising a hard limit needs "
                "CAP_SYS_RESOURCE, and nofile cannot exceed the sysctl fs.nr_open")
    if step.startswith("setns") and err == E.EINVAL:
        return "not a namespace of that type: the namespaces given to enter are wrong"
    return None
