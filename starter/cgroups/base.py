"""The cgroup interface: one Backend per host, one JobCgroup per job.

Call sites use only what is here.  Which cgroup version sits behind it is
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
(each with its contract in one line).  A backend's job class is composed of
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

import errno
import math
from abc import abstractmethod   # in sys.modules already: see above
import os
import time

from .. import values
from ..errors import CgroupError, SpecError
from . import files

JOB_PREFIX = "job-"
# --delegate: the leaf the job's processes start in, and `starter enter`'s
# own leaves (enter-<pid>-<random>), in the job's cgroup.
DELEGATE_LEAF = "job"
ENTER_PREFIX = "enter-"

CPU_PERIOD_US = 100_000
CPU_WEIGHT_MIN, CPU_WEIGHT_MAX = 1, 10_000
CPU_SHARES_MIN, CPU_SHARES_MAX = 2, 262_144
# pids.max accepts up to PID_MAX_LIMIT (2^22); larger values are the kernel's to refuse.
PIDS_MAX_SANE = 2**31 - 1


# v1 has no delegation boundary: a v1 cgroup's owner can move its tasks to
# any cgroup it can write, its limit files sit in the same directory, and the
# hybrid layout's v1 half is the same.  The kernel's docs call v1 delegation
# unsafe; --delegate is cgroup v2 only.
DELEGATE_V1_REFUSAL = ("--delegate needs a pure cgroup v2 host: delegating "
                       "cgroup v1 hierarchies (v1 or hybrid) is not safe")
DELEGATE_V1_HINT = "run the job without --delegate, or on a node booted with cgroup v2 only"


def check_job_id(job_id):
    """Refuse ids that could name a path outside the parent: the same rule
    as spec.py's (values.job_id), checked again as the last line of defence."""
    return values.job_id("job id", job_id)


class Limits(files._Record):
    """Resource limits for one job.  None means "not limited" for that resource.

    memory_bytes  RAM limit; swap is not allowed beyond it (v2 memory.swap.max=0,
                  v1 memory.memsw.limit_in_bytes = the same value).
    cpus          CPU bandwidth in cores (1.5 = 150 ms per 100 ms period).
    cpu_weight    relative share under contention, 1..10000 (cgroup v2 scale,
                  default 100; mapped to v1 cpu.shares, 100 -> 1024).
    pids          most tasks (processes + threads) alive at once.
    cpuset, mems  the CPUs / NUMA nodes the job may use (sorted tuples of
                  ids; cpuset.cpus / cpuset.mems); within the parent's.
    io_max        ((major, minor, rbps, wbps, riops, wiops), ...): bytes and
                  operations per second per block device, None = no limit
                  (v2 io.max, v1 blkio.throttle.*_device).
    """

    __slots__ = ("memory_bytes", "cpus", "cpu_weight", "pids", "cpuset", "mems", "io_max")

    def validate(self):
        def _int(name, v, lo, hi):
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"limits.{name}", f"must be an integer, not {v!r}")
            if not lo <= v <= hi:
                raise SpecError(f"limits.{name}", f"{v} is out of range {lo}..{hi}")

        _int("memory_bytes", self.memory_bytes, 4096, 2**62)
        _int("cpu_weight", self.cpu_weight, CPU_WEIGHT_MIN, CPU_WEIGHT_MAX)
        _int("pids", self.pids, 1, PIDS_MAX_SANE)
        if self.cpus is not None:
            c = self.cpus
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
                raise SpecError("limits.cpus", f"must be a number of cores, not {c!r}")
            if cpu_quota_us(c) < 1000:
                raise SpecError("limits.cpus", f"{c} is below the kernel's minimum of 0.01 cores")
            if c > 1_000_000:
                raise SpecError("limits.cpus", f"{c} cores is not a plausible limit")
        for name in ("cpuset", "mems"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, tuple) or not v
                                  or any(type(i) is not int or not 0 <= i <= values.MAX_CPU_ID for i in v)):
                raise SpecError(f"limits.{name}", f"must be a non-empty tuple of ids, not {v!r}")
        for dev in self.io_max or ():
            if (not isinstance(dev, tuple) or len(dev) != 2 + len(IO_KEYS)
                    or any(type(x) is not int or x < 0 for x in dev[:2])
                    or any(x is not None and (type(x) is not int or x < 1) for x in dev[2:])):
                raise SpecError("limits.io_max", f"must be (major, minor, {', '.join(IO_KEYS)}), not {dev!r}")
        return self

    def empty(self):
        return all(v is None for v in (self.memory_bytes, self.cpus, self.cpu_weight, self.pids,
                                       self.cpuset, self.mems)) and not self.io_max


# io.max keys, in the order of Limits.io_max's per-device tuples; the v1
# blkio throttle file of each.
IO_KEYS = ("rbps", "wbps", "riops", "wiops")
IO_V1_FILES = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device",
               "blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device")


def check_within(job_id, what, want, effective):
    """Refuse ids of `want` (CPUs or NUMA nodes) the job's parent cannot
    give it, named in one line: v1 would refuse them with a bare EINVAL, v2
    would quietly leave them out of the job's effective set.  effective:
    the parent's cpuset.cpus.effective (v2) or cpuset.effective_cpus (v1)."""
    text = files.read_text_or_none(effective)
    if text is None:
        raise CgroupError(f"cannot bind job {job_id} to {what}: {effective} does not exist",
                          "the cpuset controller is not available to the job's cgroup parent")
    have = set(values.id_list(effective, text, what)) if text.strip() else set()
    extra = sorted(set(want) - have)
    if extra:
        raise CgroupError(
            f"cannot bind job {job_id} to {what} {values.format_id_list(want)}: "
            f"{values.format_id_list(extra)} {'is' if len(extra) == 1 else 'are'} not among the {what} "
            f"its cgroup parent may use "
            f"({values.format_id_list(have) or 'none'}, {effective})",
            f"choose {what} from {values.format_id_list(have) or 'those of the parent'}")


def cpu_quota_us(cpus):
    return int(round(cpus * CPU_PERIOD_US))


def weight_to_shares(weight):
    """cgroup v2 cpu.weight -> v1 cpu.shares, the inverse of runc's
    ConvertCPUSharesToCgroupV2Value (the quadratic-in-log2 form that maps the
    defaults onto each other: 1 -> 2, 100 -> 1024, 10000 -> 262144)."""
    if weight <= CPU_WEIGHT_MIN:
        return CPU_SHARES_MIN
    if weight >= CPU_WEIGHT_MAX:
        return CPU_SHARES_MAX
    # runc: weight = ceil(10 ** ((l*l + 125*l) / 612 - 7/34)), l = log2(shares)
    e = math.log10(weight) + 7.0 / 34.0
    l = (-125.0 + math.sqrt(125.0 * 125.0 + 4.0 * 612.0 * e)) / 2.0
    shares = int(round(2.0**l))
    # The forward map rounds up (ceil), so several shares values give one
    # weight; keep the exact inverse when it maps back, else step onto it.
    while shares < CPU_SHARES_MAX and shares_to_weight(shares) < weight:
        shares += 1
    while shares > CPU_SHARES_MIN and shares_to_weight(shares) > weight:
        shares -= 1
    return shares


def shares_to_weight(shares):
    """runc's ConvertCPUSharesToCgroupV2Value (for tests and the inverse)."""
    if shares <= CPU_SHARES_MIN:
        return CPU_WEIGHT_MIN
    if shares >= CPU_SHARES_MAX:
        return CPU_WEIGHT_MAX
    l = math.log2(shares)
    return int(math.ceil(10 ** ((l * l + 125 * l) / 612.0 - 7.0 / 34.0)))


# --------------------------------------------------------------------------
# small filesystem helpers shared by the backends


def mkdir(path):
    """mkdir that reports (made_it: bool); EEXIST is fine."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        err = CgroupError(
            f"cannot create cgroup {path}: {errno.errorcode.get(e.errno, e.errno)} ({os.strerror(e.errno)})",
            files.hint_for(e.errno),
        )
        err.errno = e.errno
        raise err from None


def subdirs_bottom_up(top):
    """Every cgroup below `top`, deepest first, then `top` itself.

    Tolerates directories vanishing while walking (ENOENT) and modes the job
    set on its own sub-cgroups (root reads them anyway)."""
    out = []

    def walk(d):
        try:
            it = os.scandir(d)
        except FileNotFoundError:
            return
        with it:
            children = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        for c in children:
            walk(c)
        out.append(d)

    walk(top)
    return out


def _busy_after_rmdir(d):
    """rmdir one cgroup -> True if it is busy (EBUSY: children, or a task
    still leaving); gone already is fine; anything else raises."""
    try:
        os.rmdir(d)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise CgroupError(f"cannot remove cgroup {d}: {errno.errorcode.get(e.errno, e.errno)}",
                              files.hint_for(e.errno)) from None
        return True
    return False


def rmdir_tree(top, attempts=50):
    """rmdir every cgroup under `top` depth-first, then `top`.  ENOENT is
    fine; EBUSY (a task still leaving) is retried briefly, then raised."""
    # A job's cgroup usually has no sub-cgroups (only a delegated job can
    # make them): one rmdir, no walk.
    if not _busy_after_rmdir(top):
        return
    delay = 0.001
    for i in range(attempts):
        busy = [d for d in subdirs_bottom_up(top) if _busy_after_rmdir(d)]
        if not busy:
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    raise CgroupError(
        f"cannot remove cgroup {busy[-1]}: EBUSY (it still has processes or children)",
        "kill the processes listed in its cgroup.procs (starter gc does this)",
    )


def kill_pids(pids, sig=9):  # SIGKILL; `import signal` builds enums (~3 ms)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class EventsWatch:
    """Wakes when a cgroup2 file such as cgroup.events changes.

    kernfs reports POLLPRI|POLLERR on an open cgroup file once its content
    has changed since it was last read, so one read arms it and poll() waits.
    Not inotify: closing an inotify instance waits for an SRCU grace period
    (measured 15 ms of every job here), and reaching it from Python needs
    ctypes (~2 ms to import)."""

    # What to poll() it for: kernfs files always poll readable (POLLIN).
    mask = 0x2 | 0x8  # POLLPRI | POLLERR; `import select` only where we wait

    def __init__(self, path, kept=None):
        """kept: a files.Kept that keeps its files (keep_open()) owns the
        descriptor, which stays open after close(); else this watch opens
        and owns one."""
        self.kept = kept if kept is not None and kept.keep else None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if self.kept is None else self.kept.open(path)
        except OSError as e:
            raise CgroupError(f"cannot open {path}: {os.strerror(e.errno)}", files.hint_for(e.errno)) from None
        if self.fd is None:
            raise CgroupError(f"cannot open {path}: it does not exist", files.hint_for(errno.ENOENT))
        self.drain()

    def drain(self):
        """Read the file again: re-arms the next wakeup."""
        try:
            os.pread(self.fd, 4096, 0)
        except OSError:
            pass

    def wait(self, timeout):
        import select

        if timeout <= 0:
            return False
        p = select.poll()
        p.register(self.fd, select.POLLPRI | select.POLLERR)
        ready = p.poll(int(timeout * 1000) + 1)
        if ready:
            self.drain()
        return bool(ready)

    def close(self):
        if self.fd is not None and self.kept is None:
            os.close(self.fd)
        self.fd = None


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

    def holds(self, pid):
        """Is `pid` in the job's cgroup or one below it, in the tracking
        hierarchy (the one a job process cannot leave)?"""
        top = self.dirs()[0]
        return any(pid in files.read_pids(os.path.join(d, "cgroup.procs"))
                   for d in subdirs_bottom_up(top))

    def pids(self):
        """Every pid in the job's cgroups and their sub-cgroups, in every
        hierarchy (sorted, unique)."""
        found = set()
        for d in self.dirs():
            for sub in subdirs_bottom_up(d):
                found.update(files.read_pids(os.path.join(sub, "cgroup.procs")))
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
        the backend cannot (the job must not run then)."""
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
        processes.  Most kills are over within milliseconds, and what the
        caller records about one (the entry's "killing": a file write, 0.35
        ms of a 200-process kill here) would only compete with them.

        One loop for every backend; each says how to kill (_kill_round) and
        whether it can be told when the job is empty (_exit_watch).  Rounds
        repeat at growing gaps up to 1 s for stragglers (processes attached
        after a round); between them, a watch if there is one, else polling
        on a back-off up to 1 s: a task stuck in D state costs no CPU."""
        deadline = time.monotonic() + timeout
        watch = self._exit_watch()
        poll, gap, next_round = 0.001, 0.2, 0.0
        try:
            # Where one write kills the whole tree, it comes first: listing
            # the pids of every hierarchy before it (each directory walked,
            # each cgroup.procs read) only delays the kill.  Then the first
            # look is after the tree says it is empty.
            killed = self._kill_tree()
            if killed and watch is not None:
                watch.wait(min(gap, deadline - time.monotonic()))
            while True:
                # is_empty(): one cgroup.events read where the tree says so
                # (every process of a job is in its cgroup2 cgroup, and leaves
                # its v1 ones in the same exit); a listing of every hierarchy
                # only while something is left.
                left = [] if self.is_empty() else self.pids()
                if not left:
                    return []
                if killed and then is not None:
                    then()
                    then = None
                if time.monotonic() >= next_round:
                    self._kill_round(left, deadline)
                    killed = True
                    next_round = time.monotonic() + gap
                    gap = min(gap * 2, 1.0)
                now = time.monotonic()
                if now >= deadline:
                    return self.pids()
                until = min(next_round, deadline)
                if watch is not None and not self.is_empty():
                    watch.wait(until - now)
                else:   # killed tasks leave their cgroups as they exit
                    time.sleep(max(0.0, min(poll, until - now)))
                    poll = min(poll * 2, 1.0)
        finally:
            if watch is not None:
                watch.close()

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


class Backend:
    """The host's cgroup setup, probed once.  Subclasses: V2Backend,
    V1Backend, HybridBackend.

    `parents` maps each role this backend uses to its parent directory
    (default: <hierarchy>/<starter's own cgroup>/starter).
    """

    kind = None         # every backend names its kind: "v2", "v1", "hybrid"
    job_class = None    # ... and its JobCgroup subclass
    cpuset = False      # v1 layouts: is the job's cgroup made in the cpuset hierarchy too?

    def __init_subclass__(cls, abstract=False, **kw):
        super().__init_subclass__(**kw)
        if abstract:
            return
        require_hooks(cls, Backend)
        if not isinstance(cls.kind, str):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} lacks the Backend hook kind: "
                            "a class attribute naming the layout (\"v2\", \"v1\", \"hybrid\")")
        if not (isinstance(cls.job_class, type) and issubclass(cls.job_class, JobCgroup)):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} lacks the Backend hook job_class: "
                            "a class attribute naming its JobCgroup subclass")

    def __init__(self, layout, parent=None):
        self.layout = layout
        self.parent_setting = parent
        self.parents = {}
        for role in self.roles():
            self.parents[role] = self._parent_dir(role, parent)

    def __repr__(self):
        return f"<{type(self).__name__} {self.parents}>"

    # -- which hierarchies ------------------------------------------------
    @abstractmethod
    def roles(self):
        """-> the roles ("unified", v1 controller names) a job's cgroup is made in, tracking first."""

    def add_cpuset(self):
        """A job bound to CPUs or NUMA nodes (--cpuset, --mems).  On v2 the
        cpuset controller sits in the job's one directory; v1 layouts
        (V1ResourcesBackend) add the cpuset hierarchy for this job only."""
        return self

    def mount_for(self, role):
        return self.layout.unified if role == "unified" else self.layout.v1[role]

    def _parent_dir(self, role, parent):
        """parent None -> <own>/starter; "name" (relative) -> <own>/name;
        "/a/b" (absolute) -> that cgroup, in every hierarchy."""
        m = self.mount_for(role)
        parent = check_parent("starter" if parent is None else parent)
        if parent.startswith("/"):
            return files.join(m.mount_point, parent)
        own = self.layout.own.get(role)
        if own is None:
            raise CgroupError(
                f"cannot find the starter's own {role} cgroup under {m.mount_point}",
                "set the cgroup parent to an absolute cgroup path like /starter",
            )
        return files.join(m.mount_point, own, parent)

    def view(self):
        """What a job sees at /sys/fs/cgroup inside its cgroup namespace:
        [(fstype, path below /sys/fs/cgroup or "", mount options)], one fresh
        mount per hierarchy the job is attached to (mounted inside the
        namespace, each shows only the job's own subtree).  One cgroup2
        hierarchy is mounted at /sys/fs/cgroup itself; several go below a
        tmpfs there.  Hierarchies the job is not in (name=systemd, cpuset unless
        bound: add_cpuset, devices on hybrid hosts) are left out: their
        namespace root would be the starter's cgroup."""
        mounts = []
        for role in self.roles():
            m = self.mount_for(role)
            if m not in mounts:
                mounts.append(m)
        if len(mounts) == 1 and mounts[0].fstype == "cgroup2":
            return [("cgroup2", "", "")]
        out = [("tmpfs", "", "mode=755,size=64k")]
        for m in mounts:
            if m.mount_point.startswith("/sys/fs/cgroup/"):
                rel = m.mount_point[len("/sys/fs/cgroup/"):]
            else:
                rel = "unified" if m.fstype == "cgroup2" else ",".join(m.controllers)
            opts = ",".join(m.controllers + ((f"name={m.name}",) if m.name else ()))
            out.append((m.fstype, rel, "" if m.fstype == "cgroup2" else opts))
        return out

    def distinct_parents(self):
        return list(dict.fromkeys(self.parents.values()))

    def check_caller_parents(self):
        """For a caller that is not root (starter/caller.py): its job's
        cgroups go under the caller's own cgroup in every hierarchy, which
        must be root's all the way up.  A cgroup the caller may write (one
        delegated to it, say by systemd's user@.service) would let it move
        the job's processes out of the job's cgroup, past its limits and
        its kill.  And no job may start one: the caller's cgroup is not
        inside a job's (the set-user-ID bit already does nothing there,
        under no_new_privs)."""
        import stat

        for role in self.roles():
            m, own = self.mount_for(role), self.layout.own.get(role)
            if own is None:
                continue
            parts = [c for c in own.split("/") if c]
            if any(a.startswith("starter") and b.startswith("job-") for a, b in zip(parts, parts[1:])):
                raise CgroupError(f"a process inside a job cannot start a job (its {role} cgroup is {own})")
            d = m.mount_point
            for name in [""] + parts:
                d = os.path.join(d, name) if name else d
                try:
                    st, procs = os.lstat(d), os.lstat(os.path.join(d, "cgroup.procs"))
                except OSError as e:
                    raise CgroupError(f"cannot check the caller's cgroup {d}: {e.strerror}") from None
                if (not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or procs.st_uid != 0
                        or st.st_mode & 0o022 or procs.st_mode & 0o022):
                    raise CgroupError(
                        f"the caller's cgroup {d} is not root's alone (owner uid {st.st_uid}, "
                        f"cgroup.procs owner uid {procs.st_uid}): a job of its user could leave its own cgroup",
                        "something gave this cgroup to the user: systemd's user@.service, or a batch system "
                        "(Slurm's cgroup/v1 chowns the step's directory with ConstrainRAMSpace; see "
                        "docs/admin-guide.md); start the job from a cgroup only root may write")

    def check_delegation(self, mountinfo=None):
        """Raise CgroupError unless jobs can get a delegated subtree here."""
        raise CgroupError(DELEGATE_V1_REFUSAL, DELEGATE_V1_HINT)

    # -- capabilities (probed from files, cached once known) ---------------
    def _probe_dirs(self, role):
        """Existing non-root cgroups of `role` to look for optional files in."""
        m = self.mount_for(role)
        cands = [self.parents[role]]
        own = self.layout.own.get(role)
        if own and own != "/":
            cands.append(files.join(m.mount_point, own))
        try:
            with os.scandir(m.mount_point) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        cands.append(e.path)
                        if len(cands) > 8:
                            break
        except OSError:
            pass
        return [c for c in cands if os.path.isdir(c)]

    def _probe_file(self, role, name):
        """Does a non-root cgroup of `role` have file `name`?  Cached.

        Looks in cgroups that exist; if there are none (a fresh node where
        the starter runs in the root cgroup), makes a short-lived probe-<pid>
        cgroup inside the parent and removes it (and the parent, if made)."""
        key = (role, name)
        cache = self.__dict__.setdefault("_probed", {})
        if key in cache:
            return cache[key]
        if role not in self.parents:
            return False
        dirs = self._probe_dirs(role)
        if dirs:
            found = any(os.path.exists(os.path.join(d, name)) for d in dirs)
        else:
            parent = self.parents[role]
            probe = os.path.join(parent, f"probe-{os.getpid()}")
            made_parent = self._make_parent(parent)
            try:
                mkdir(probe)
                found = os.path.exists(os.path.join(probe, name))
            finally:
                _rmdir_quiet(probe)
                if made_parent:
                    try:
                        os.rmdir(parent)
                    except OSError:
                        pass
        cache[key] = found
        return found

    @property
    @abstractmethod
    def supports_memory_peak(self):
        """Will stats() report memory_peak_bytes (not None) for this host's jobs?"""

    @property
    @abstractmethod
    def supports_pids_peak(self):
        """Will stats() report pids_peak (not None) for this host's jobs?"""

    @property
    def supports_kill(self):
        """cgroup.kill exists: the whole tree dies in one write."""
        return "unified" in self.parents and self._probe_file("unified", "cgroup.kill")

    @property
    def supports_oom_group(self):
        """memory.oom.group: the kernel itself ends a job on an OOM kill."""
        return "unified" in self.parents and self._probe_file("unified", "memory.oom.group")

    @property
    def supports_psi(self):
        if "unified" not in self.parents:
            return False
        m = self.layout.unified.mount_point
        return files.read_text_or_none(os.path.join(m, "cpu.pressure")) is not None

    # -- jobs ---------------------------------------------------------------
    def job_paths(self, job_id):
        check_job_id(job_id)
        return {role: os.path.join(p, JOB_PREFIX + job_id) for role, p in self.parents.items()}

    def create(self, job_id, limits=None):
        """Make job-<id> in every hierarchy and apply `limits`.

        Fails closed: on any error everything made here is removed and
        CgroupError (or SpecError for an invalid limit) is raised."""
        if limits is not None:
            limits.validate()
        paths = self.job_paths(job_id)
        job = self.job_class(self, job_id, paths)
        made = []
        try:
            for attempt in range(5):
                try:
                    self._ensure_parents()
                    for d in job.dirs():
                        if not mkdir(d):
                            raise CgroupError(
                                f"cgroup {d} already exists: job {job_id} is running or was not cleaned up",
                                "run `starter gc` or pick another job id",
                            )
                        made.append(d)
                    break
                except CgroupError as e:
                    # A concurrent prune() removed a parent between our mkdirs.
                    if getattr(e, "errno", None) == errno.ENOENT and attempt < 4:
                        for d in reversed(made):
                            _rmdir_quiet(d)
                        made.clear()
                        continue
                    raise
            if limits is not None and not limits.empty():
                job.set_limits(limits)
        except BaseException:
            for d in reversed(made):
                _rmdir_quiet(d)
            self.prune()
            raise
        return job

    def _ensure_parents(self):
        for p in self.distinct_parents():
            self._make_parent(p)

    @property
    def parent_is_absolute(self):
        return str(self.parent_setting or "").startswith("/")

    def _make_parent(self, p):
        """A relative parent (NAME, below the starter's own cgroup) is made
        when missing and pruned when empty.  An absolute --cgroup-parent /PATH
        is the admin's: it must exist, and is never created or removed (the
        starter never makes cgroups at arbitrary places in a hierarchy)."""
        if not self.parent_is_absolute:
            return mkdir(p)
        if not os.path.isdir(p):
            raise CgroupError(f"cgroup parent {p} does not exist",
                              f"create {self.parent_setting} in every hierarchy (delegated to the starter), "
                              "or give a relative NAME to use a cgroup below the starter's own")
        return False

    def open_job(self, job_id, must_exist=True):
        job = self.job_class(self, job_id, self.job_paths(job_id))
        if must_exist and not job.exists():
            raise CgroupError(f"no cgroup for job {job_id} under {self.distinct_parents()}")
        return job

    def list_jobs(self):
        """Job ids with a cgroup under any parent (sorted)."""
        ids = set()
        for p in self.distinct_parents():
            try:
                with os.scandir(p) as it:
                    for e in it:
                        if e.name.startswith(JOB_PREFIX) and e.is_dir(follow_symlinks=False):
                            ids.add(e.name[len(JOB_PREFIX) :])
            except (FileNotFoundError, NotADirectoryError):
                pass
        return sorted(ids)

    def prune(self):
        """Remove the `starter` parents that hold no job.  Returns True when
        none is left.  A parent still in use (EBUSY) or already gone (ENOENT)
        is fine: another starter may be using it right now."""
        clean = True
        for p in self.distinct_parents():
            self._prune_extra(p)
            if self.parent_is_absolute:
                continue
            try:
                os.rmdir(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno in (errno.EBUSY, errno.ENOTEMPTY, errno.EEXIST):
                    clean = False
                else:
                    raise CgroupError(f"cannot remove {p}: {os.strerror(e.errno)}", files.hint_for(e.errno))
        return clean

    def _prune_extra(self, parent):
        """Hook: remove backend-specific leftovers inside a parent."""

    def close(self):
        """Undo what this process did to its own cgroup, then prune()."""
        return self.prune()


def _rmdir_quiet(d):
    try:
        rmdir_tree(d, attempts=5)
    except CgroupError:
        pass


def check_parent(parent):
    """A cgroup parent: absolute ("/htcondor/starter", from the hierarchy's
    root) or relative ("starter", below the starter's own cgroup)."""
    if not isinstance(parent, str):
        raise SpecError("cgroup parent", f"{parent!r} must be a cgroup path like /starter or starter")
    parts = [p for p in parent.split("/") if p]
    if not parts or any(p in (".", "..") or p.startswith(JOB_PREFIX) for p in parts) or "\0" in parent:
        raise SpecError(
            "cgroup parent",
            f"{parent!r} must name a cgroup below the root, without '.', '..' or a job-* component",
        )
    return ("/" if parent.startswith("/") else "") + "/".join(parts)
