"""The cgroup interface: one Backend per host, one JobCgroup per job.

Here: JobCgroup (and the hook check both classes use); Backend is in
backend.py, what they share below them in limits.py (Limits), dirs.py
(directories, the events watch) and kill.py (the kill loop).  Call sites
use only the interface.  Which cgroup version sits behind it is
decided once, by open_backend() in __init__.py; optional kernel features are
capabilities (`supports_kill`, ...) probed from the files that exist, never
from version numbers.

    Backend.create(id) -> JobCgroup      make job-<id> under the parent in every hierarchy
    Backend.view() -> [(fstype, path, options)]   the job's cgroup namespace view
    JobCgroup: add_pid holds pids kill destroy close stats keep_open paths,
               the hooks below, and the optional ones with their defaults
               (clone_fd events_fd drain_events end_on_oom oom_kills set_devices,
               delegate open_leaf remove_leaf own_oom payload_stats)

The hooks: what every backend must provide, marked @abstractmethod below
(each with its contract in one line; Backend's in backend.py).  A
backend's job class is composed of
mixins (unified.py, v1.py, v2.py) ahead of JobCgroup; a class that misses a
hook is refused when it is defined (TypeError naming the hook), not when a
job first needs it.

    JobCgroup  is_empty freeze thaw frozen set_limits _kill_round
               _tracking_stats _resource_stats
    Backend    roles supports_memory_peak supports_pids_peak; class
               attributes kind and job_class

Why not abc.ABC: ABCMeta refuses a class only when it is instantiated (on a
node, at a job's start); a check in __init_subclass__ refuses it at import,
in every test run.  abc.abstractmethod is only the marker (it sets
__isabstractmethod__): `abc` costs nothing on the run path, the interpreter
has imported it before the first line of the starter runs (io needs it;
python -IS -X importtime -c pass lists it).

Layout on disk (one `starter` parent per hierarchy, under the starter's own
cgroup unless configured otherwise):

    <hierarchy>/<own cgroup>/starter/job-<id>/...      (anything the job makes below)
"""

import os
from abc import abstractmethod   # in sys.modules already: see above

from ..spec import values
from ..errors import CgroupError
from . import files
from .dirs import rmdir_tree, subdirs_bottom_up
from .kill import kill_until_empty

JOB_PREFIX = "job-"
# --delegate: the leaf the job's processes start in, and `starter enter`'s
# own leaves (enter-<pid>-<random>), in the job's cgroup.
DELEGATE_LEAF = "job"
ENTER_PREFIX = "enter-"


# v1 has no delegation boundary: a v1 cgroup's owner can move its tasks to
# any cgroup it can write, its limit files sit in the same directory, and the
# hybrid layout's v1 half is the same.  The kernel's docs call v1 delegation
# unsafe; --delegate is cgroup v2 only.
DELEGATE_V1_REFUSAL = ("--delegate needs a pure cgroup v2 host: delegating "
                       "cgroup v1 hierarchies (v1 or hybrid) is not safe")
DELEGATE_V1_HINT = "run the job without --delegate, or on a node booted with cgroup v2 only"


def check_job_id(job_id):
    """Refuse ids that could name a path outside the parent: the same rule
    as spec/jobspec.py's (values.job_id), checked again as the last line of defence."""
    return values.job_id("job id", job_id)


# --------------------------------------------------------------------------
# the interface


def require_hooks(cls, interface):
    """Refuse `cls`, a subclass of `interface`, unless it provides every
    hook (@abstractmethod) of it: TypeError naming what is missing."""
    missing = [name for name in dir(cls)
               if getattr(getattr(cls, name, None), "__isabstractmethod__", False)]
    if missing:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} lacks the {interface.__name__} "
                        f"hook{'s' if len(missing) > 1 else ''} {', '.join(missing)}: a backend "
                        f"provides every hook (itself, or a mixin ahead of {interface.__name__})")


class JobCgroup:
    """One job's cgroups: one directory per hierarchy, all named job-<id>.

    `paths` maps a role ("unified" for cgroup2, or a v1 controller name:
    memory, pids, cpu, cpuacct, blkio, freezer) to the directory.  Controllers
    mounted together (cpu,cpuacct) map to the same directory.  File
    descriptors handed out (clone_fd, events_fd) belong to this object and are
    closed by close()/destroy().

    A subclass must provide every hook marked @abstractmethod (checked when
    it is defined); `abstract=True` in its class statement puts that off to
    its own subclasses.
    """

    def __init_subclass__(cls, abstract=False, **kw):
        super().__init_subclass__(**kw)
        if not abstract:
            require_hooks(cls, JobCgroup)

    def __init__(self, backend, job_id, paths):
        self.backend = backend
        self.id = job_id
        self.paths = dict(paths)
        self._clone_fd = None
        self._events = None
        self._oom = None
        self.kept = files.Kept()    # the job's own files, open from first use to close()

    def __repr__(self):
        return f"<{type(self).__name__} {self.id} {self.paths}>"

    def dirs(self):
        """Distinct directories, each once, tracking hierarchy first."""
        return list(dict.fromkeys(self.paths.values()))

    def exists(self):
        return any(os.path.isdir(d) for d in self.dirs())

    def _text(self, path):
        """A file of the job's own cgroup directories (see files.Kept)."""
        return self.kept.text(path)

    def _int(self, path):
        return files.int_or_none(self.kept.text(path))

    def keep_open(self):
        """Open, while the job runs, the files its end reads and writes: a
        finished job's usage and removal are then preads and rmdirs, the
        kill one write.  Here: one stats() that opens what it would read
        and reads nothing.  close() (destroy()) closes them."""
        self.kept.keep = self.kept.priming = True
        try:
            self.stats()
        finally:
            self.kept.priming = False

    # -- hooks every backend provides (tracking and resource mixins) -----
    @abstractmethod
    def is_empty(self):
        """No process left in the job or any cgroup below it (the tracking hierarchy's word)."""

    @abstractmethod
    def freeze(self, timeout=5.0):
        """Freeze every process of the job and below; return once frozen, CgroupError after `timeout`."""

    @abstractmethod
    def thaw(self, timeout=5.0):
        """Undo freeze(); return once thawed, CgroupError after `timeout`."""

    @abstractmethod
    def frozen(self):
        """Is the job frozen now (by freeze(), as the kernel reports it)?"""

    @abstractmethod
    def set_limits(self, limits):
        """Apply `limits` (a Limits, validated again) to every hierarchy; CgroupError if any cannot be."""

    @abstractmethod
    def _kill_round(self, left, deadline):
        """SIGKILL what is in the job, sub-cgroups included; `left`: its pids just read (kill()'s loop)."""

    @abstractmethod
    def _tracking_stats(self):
        """-> {stats() key: value} from the tracking side: cpu_user_s, cpu_system_s, psi."""

    @abstractmethod
    def _resource_stats(self):
        """-> {stats() key: value} from the resource controllers: memory, pids, io, oom_kills."""

    # -- optional hooks, with what a backend without them does -------------
    def clone_fd(self):
        return None

    def events_fd(self):
        return None

    def drain_events(self):
        pass

    def add_pid(self, pid, cloned=False):
        """Attach `pid` to the job in every hierarchy (idempotent).

        Tracking hierarchy first, so a process is never limited but
        untracked.  cloned=True: the process was cloned into clone_fd()'s
        cgroup already; writing it there again is a no-op migration that
        still costs an RCU grace period (measured 15 ms here)."""
        skip = self.paths.get("unified") if cloned else None
        for d in self.dirs():
            if d != skip:
                files.write(os.path.join(d, "cgroup.procs"), int(pid))

    def _kept(self):
        """The job's cgroup in the hierarchy no job process can leave: the
        tracking one, or where the batch system gave the caller's user the
        tracking directory (v1-only), the one Backend.reference_role names."""
        role = self.backend.reference_role
        return self.paths[role] if role else self.dirs()[0]

    def holds(self, pid):
        """Is `pid` in the job's cgroup or one below it, in the hierarchy a
        job process cannot leave?"""
        return any(pid in files.read_pids(os.path.join(d, "cgroup.procs"))
                   for d in subdirs_bottom_up(self._kept()))

    def moved_out(self, roles):
        """Pids in the job's cgroup of the hierarchy no job process can leave
        (_kept) that are missing from the job's cgroup of any of `roles` (v1
        hierarchies where its user may move processes: directories the batch
        system gave it), read twice so that a process forking meanwhile is
        not counted: [] while every job process is where it belongs."""
        top = self._kept()

        def outside():
            kept = _pids_below(top)
            missing = set()
            for role in roles:
                d = self.paths.get(role)
                if d is not None and d != top and kept:
                    missing |= kept - _pids_below(d)
            return missing

        first = outside()
        return sorted(first & outside()) if first else []

    def pids(self):
        """Every pid in the job's cgroups and their sub-cgroups, in every
        hierarchy (sorted, unique)."""
        found = set()
        for d in self.dirs():
            found |= _pids_below(d)
        return sorted(found)

    def oom_kills(self):
        """Processes of the job killed by the OOM killer so far (None: the
        kernel does not count them)."""
        return self.stats().get("oom_kills")

    def end_on_oom(self):
        """Make an OOM kill anywhere in the job end the whole job.

        Returns None when the kernel does that by itself (cgroup v2
        memory.oom.group), else a watch (.fd, .mask for poll(), .drain())
        that fires when the job may have had an OOM kill: the supervisor
        then checks oom_kills() and kills the job.  Owned by this object.
        Call before the job runs."""
        return None

    def set_devices(self, rules):
        """Let the job's processes open (and mknod) only the device nodes
        `rules` allow: [(type "c"|"b", major, minor or None for any, access
        of "rwm")], everything else EPERM, by whatever path it is reached.
        Call before anything runs in the cgroup.  Raises CgroupError where
        the backend cannot (the job must not run then).  -> who holds the
        rules: "starter", or "ancestor" (an exclusive program of a cgroup
        above the job's, which nothing below may replace)."""
        raise CgroupError(f"job {self.id}: this cgroup backend cannot restrict devices",
                          "mount the v1 devices controller, or use a kernel with cgroup BPF")

    # -- delegation (--delegate; cgroup v2 only) ---------------------------
    def delegate(self, pid, uid, gid):
        """Hand the job's cgroup subtree to uid:gid, `pid` in a leaf of it.
        Backend.check_delegation() refuses first where this cannot work."""
        raise CgroupError(DELEGATE_V1_REFUSAL, DELEGATE_V1_HINT)

    def open_leaf(self, name):
        """A root-owned leaf in a delegated job's cgroup -> a directory fd."""
        raise CgroupError(DELEGATE_V1_REFUSAL, DELEGATE_V1_HINT)

    def remove_leaf(self, name):
        pass

    def own_oom(self):
        """Did the OOM killer act for the job as a whole (not only inside a
        sub-cgroup a delegated job limited itself)?"""
        return bool(self.oom_kills())

    def payload_stats(self, limit=None):
        """-> ([figures of each sub-cgroup], number left out); ([], 0) where
        nothing is delegated."""
        return [], 0

    def kill(self, timeout=5.0, then=None):
        """SIGKILL every process of the job, in every hierarchy and every
        sub-cgroup, until none is left.  -> the pids still there after
        `timeout` ([] = empty).  With timeout 0: one round, no waiting.
        then(): called once, when the first look after a kill still finds
        processes.  The loop, one for every backend: kill.py."""
        return kill_until_empty(self, timeout, then)

    def _exit_watch(self):
        """Hook: an EventsWatch that fires when the job may have emptied, or
        None (kill() polls)."""
        return None

    def _kill_tree(self):
        """Hook: SIGKILL the whole tree with one write, without reading its
        pids first, if the backend can (cgroup.kill).  -> whether it did."""
        return False

    def destroy(self, timeout=5.0, prune=True):
        """Kill what is left, then rmdir depth-first in every hierarchy.

        Idempotent; a cgroup that is already gone is fine.  Raises
        CgroupError naming the survivors when processes outlive `timeout`."""
        if not self.is_empty():
            survivors = self.kill(timeout)
            if survivors:
                raise CgroupError(
                    f"job {self.id}: {len(survivors)} unkillable processes survived {timeout}s: "
                    f"{survivors[:20]}",
                    "they are probably in uninterruptible sleep (D state, e.g. a hung NFS mount); "
                    "`starter gc` retries later",
                )
        self.close()
        for d in self.dirs():
            self._thaw_tree(d)
            rmdir_tree(d)
        if prune:
            self.backend.prune()

    def close(self):
        """Close the file descriptors this object handed out."""
        if self._clone_fd is not None:
            os.close(self._clone_fd)
            self._clone_fd = None
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._oom is not None:
            self._oom.close()
            self._oom = None
        self.kept.close()

    def _thaw_tree(self, d):
        """Hook: make sure nothing under `d` stays frozen before rmdir."""

    # -- stats -----------------------------------------------------------
    def stats(self):
        """Usage read from the cgroup files now (call before destroy()).

        cpu_user_s, cpu_system_s   CPU time of every process ever in the job
        memory_peak_bytes          high-water mark of memory use (None: kernel lacks it)
        memory_current_bytes       memory in use now
        memory_shmem_bytes         of that, tmpfs and shared memory (memory.stat shmem):
                                   the job's /dev/shm, /tmp, SysV/POSIX shm; at the end
                                   of a job usually 0 (its tmpfs went with its mounts)
        pids_peak                  most tasks at once (None: kernel lacks pids.peak)
        pids_current               tasks now
        io_read_bytes, io_write_bytes   block-device bytes
        oom_kills                  processes killed by the OOM killer in the job
        psi                        {"cpu"|"memory"|"io": {"some": us, "full": us}} or None
        """
        out = dict.fromkeys(
            (
                "cpu_user_s",
                "cpu_system_s",
                "memory_peak_bytes",
                "memory_current_bytes",
                "memory_shmem_bytes",
                "pids_peak",
                "pids_current",
                "io_read_bytes",
                "io_write_bytes",
                "oom_kills",
                "psi",
            )
        )
        out.update(self._tracking_stats())
        out.update(self._resource_stats())
        return out


def _pids_below(top):
    """Every pid in cgroup `top` and the cgroups below it (a set)."""
    return {p for d in subdirs_bottom_up(top) for p in files.read_pids(os.path.join(d, "cgroup.procs"))}
