"""Job cgroups behind one interface; the backend is chosen once per process.

    from starter.cgroups import open_backend, Limits
    be = open_backend()                  # probes /proc/self/mountinfo once
    cg = be.create("abc", Limits(memory_bytes=2 << 30, pids=1000))
    ...
    stats = cg.stats(); cg.destroy(); be.close()

See base.py for the interface, v2.py / v1.py / hybrid.py for the backends.
"""

from . import files
from .base import Backend, JobCgroup, Limits, check_job_id
from .hybrid import HybridBackend
from .v1 import V1Backend
from .v2 import V2Backend

__all__ = ["open_backend", "backend_for", "Limits", "Backend", "JobCgroup", "check_job_id"]

BACKENDS = {"v2": V2Backend, "v1": V1Backend, "hybrid": HybridBackend}


def backend_for(layout, parent=None):
    """The backend for a detected files.Layout (testable without a host)."""
    return BACKENDS[layout.kind](layout, parent)


def open_backend(parent=None, mountinfo=None, proc_cgroup=None):
    """Probe the host's cgroup mounts and return its backend.

    parent: None puts jobs under <starter's own cgroup>/starter in each
    hierarchy (which nests them inside a batch system's step cgroup); a
    relative path ("starter-test") goes under the own cgroup instead; an
    absolute one ("/htcondor/starter") is used as is in every hierarchy.
    mountinfo/proc_cgroup: text to use instead of /proc/self/* (tests).
    """
    if mountinfo is None:
        mountinfo = files.read_text("/proc/self/mountinfo")
    if proc_cgroup is None:
        proc_cgroup = files.read_text("/proc/self/cgroup")
    return backend_for(files.detect_layout(mountinfo, proc_cgroup), parent)
