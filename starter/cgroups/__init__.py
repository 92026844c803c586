"""Job cgroups behind one interface; the backend is chosen once per process.

    from starter.cgroups import open_backend, Limits
    be = open_backend()                  # probes /proc/self/mountinfo once
    cg = be.create("abc", Limits(memory_bytes=2 << 30, pids=1000))
    ...
    stats = cg.stats(); cg.destroy(); be.close()

See base.py for the interface (backend.py: Backend), v2.py / v1.py / hybrid.py for the backends.
"""

import os
import stat
import time
from _thread import allocate_lock as _allocate_lock

from . import files, hierarchy

__all__ = ["open_backend", "backend_for", "Limits", "Backend", "JobCgroup", "check_job_id",
           "warm_up", "warm_up_done"]

# The backends are imported on first use, not with the package: `starter run`
# calls warm_up() (which needs only files.py and hierarchy.py) before anything else, and the
# ~2.5 ms of importing base/v1/v2/hybrid then runs after the warm-up thread
# has started instead of before it.
def __getattr__(name):
    if name in ("JobCgroup", "check_job_id"):
        from . import base

        return getattr(base, name)
    if name == "Backend":
        from .backend import Backend

        return Backend
    if name == "Limits":
        from .limits import Limits

        return Limits
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backend_class(kind):
    """Only the host's backend is imported: a pure v2 node loads no v1 code."""
    if kind == "v2":
        from .v2 import V2Backend

        return V2Backend
    if kind == "v1":
        from .v1 import V1Backend

        return V1Backend
    from .hybrid import HybridBackend

    return HybridBackend


def backend_for(layout, parent=None):
    """The backend for a detected hierarchy.Layout (testable without a host)."""
    if layout.kind not in ("v2", "v1", "hybrid"):
        raise KeyError(layout.kind)
    return _backend_class(layout.kind)(layout, parent)


def open_backend(parent=None, mountinfo=None, proc_cgroup=None):
    """Probe the host's cgroup mounts and return its backend.

    parent: None puts jobs under <starter's own cgroup>/starter in each
    hierarchy (which nests them inside a batch system's step cgroup); a
    relative path ("starter-test") goes under the own cgroup instead; an
    absolute one ("/htcondor/starter") is used as is in every hierarchy.
    mountinfo/proc_cgroup: text to use instead of /proc/self/* (tests).
    """
    global _early_layout
    if mountinfo is None and proc_cgroup is None and _early_layout is not None:
        (layout, until), _early_layout = _early_layout, None
        if time.monotonic() < until:        # probed by warm_up() in this start
            return backend_for(layout, parent)
    if mountinfo is None:
        mountinfo = files.read_text("/proc/self/mountinfo")
    if proc_cgroup is None:
        proc_cgroup = files.read_text("/proc/self/cgroup")
    return backend_for(hierarchy.detect_layout(mountinfo, proc_cgroup), parent)


# --------------------------------------------------------------------------
# Hiding the first v1 migration's RCU grace period
#
# Moving a task between cgroups by writing a pid takes the global
# cgroup_threadgroup_rwsem for writing.  That percpu rwsem makes its first
# writer wait for an RCU grace period (rcu_sync_enter); a writer that comes
# while the previous writer's exit has not yet been followed by a grace
# period does not wait.  Measured on this project's hybrid host (6.18, 2 CPUs)
# by writing a child's pid to a v1 cgroup.procs: cold 5-7 ms; 5 or 15 ms after
# any migration, even a no-op one (a thread moved into the cgroup it is in):
# 0.04 ms; 30 ms after one: cold again.  A pid that does not exist (ESRCH)
# or "0" (the writer itself) does not take the lock and warms nothing.
#
# The job is cloned straight into its cgroup2 cgroup (CLONE_INTO_CGROUP: no
# migration), but on layouts where the job also joins v1 hierarchies every
# start pays one cold migration.  warm_up() starts a thread at the start of
# `starter run` that moves itself (by its tid) into the v1 cgroup it is already
# in, every WARM_EVERY_S, so the grace period runs while the main thread
# parses the spec and builds the job; warm_up_done() (after the job's
# migrations) ends it.  Layouts without a v1 hierarchy the job joins start no
# thread.  Costs: ~50 us of the node-wide migration lock per round; the
# thread ends by itself after WARM_MAX_S.  Where the `starter` command (the C
# launcher, native/launcher_warm.c) ran, a process of its own already does this,
# from before the interpreter started, until warm_up_done() closes the pipe
# it handed over in $STARTER_WARM_FD: then no thread is started (its turns at
# the GIL cost the main thread 0.4-0.6 ms per start).
#
# A migration holds cgroup_mutex while it waits for the grace period, so
# making the job's cgroup (mkdir) waits for whatever is left of it: job/run.py
# plans the mounts before making the cgroup, to fill that wait with work.
# Only the thread itself is moved, into the cgroup it is in: a batch system
# moving the whole starter elsewhere at the same moment could at worst leave
# this thread (never the job) behind in the old cgroup until it ends.
WARM_EVERY_S = 0.004
WARM_MAX_S = 1.0
_early_layout = None
_warm_stop = [True]
_warm_exited = _allocate_lock()     # held while the thread runs (tests wait on it)
_launcher_fd = [None]               # the launcher's pipe: closing it ends its warm-up


def warm_up():
    """Probe the layout (kept for open_backend()) and, if the job will be
    migrated into a v1 hierarchy, start the warm-up thread.  Never raises:
    open_backend() reports a broken layout properly later."""
    global _early_layout, _warm_stop
    by_launcher = _take_launcher_fd()
    try:
        layout = hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"),
                                     files.read_text("/proc/self/cgroup"))
    except Exception:
        return
    _early_layout = (layout, time.monotonic() + WARM_MAX_S)
    if by_launcher:
        return
    target = _warm_target(layout)
    if target is None or _warm_exited.locked():     # nothing to warm, or already warming
        return
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    import _thread

    _warm_stop = stop = [False]
    _warm_exited.acquire()
    try:
        _thread.start_new_thread(_keep_warm, (fd, stop, time.monotonic() + WARM_MAX_S))
    except RuntimeError:
        _warm_exited.release()
        os.close(fd)


def warm_up_done():
    """The job's migrations are done: let the warm-up (thread or the
    launcher's process) end."""
    _warm_stop[0] = True
    fd, _launcher_fd[0] = _launcher_fd[0], None
    if fd is not None:
        os.close(fd)


def _take_launcher_fd():
    """Is the launcher's process warming up for us?  Then keep the write end
    of its pipe ($STARTER_WARM_FD, removed from the environment), not
    inherited by anything we start."""
    value = os.environ.pop("STARTER_WARM_FD", "")
    if not value.isdigit() or _launcher_fd[0] is not None:
        return False
    fd = int(value)
    if fd < 3:          # the launcher never hands over stdio
        return False
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        os.set_inheritable(fd, False)
    except OSError:
        return False
    _launcher_fd[0] = fd
    return True


def _warm_target(layout):
    """The v1 `tasks` file of the starter's own cgroup in a hierarchy a job
    joins (None: the job joins no v1 hierarchy)."""
    for role in sorted(hierarchy.V1_RESOURCE_CONTROLLERS):
        m, own = layout.v1.get(role), layout.own.get(role)
        if m is not None and own is not None:
            return hierarchy.join(m.mount_point, own, "tasks")
    return None


def _keep_warm(fd, stop, until):
    import _thread

    tid = str(_thread.get_native_id()).encode()
    try:
        while not stop[0] and time.monotonic() < until:
            os.write(fd, tid)       # a no-op move of this thread; the GIL is free meanwhile
            time.sleep(WARM_EVERY_S)
    except OSError:
        pass
    finally:
        os.close(fd)
        _warm_exited.release()
