"""starter: launch one batch job in its own namespaces, cgroup and network."""
__version__ = "0.1.0"
