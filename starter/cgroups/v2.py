"""cgroup v2 (the unified hierarchy).

The job is tracked, frozen and killed through unified.py's UnifiedTracking
(the cgroup2 half that v2 and hybrid share); V2Resources adds the
controllers (memory, cpu, pids, io) found in the same directory.

Where job cgroups live on pure v2, and why the starter may move itself
--------------------------------------------------------------------
Jobs are <parent>/job-<id>, parent = <own cgroup>/starter by default.  For
job-<id> to have memory.max etc., the controllers must be enabled in
starter/cgroup.subtree_control, which needs them in starter/cgroup.controllers,
which needs them enabled in <own>/cgroup.subtree_control.  The kernel's
no-internal-processes rule refuses that (EBUSY) while <own> holds processes,
and the starter itself is one of them.  So, like a systemd delegate, the
starter moves itself into a leaf <own>/starter/supervisor-<pid>, then
enables the controllers in <own> and in starter/.  If <own> still holds
other processes (a caller's relay, the batch script that ran `starter run`
in Slurm's task cgroup), they follow into the same leaf: every one of them
stays below <own>, so whatever <own> and its ancestors impose (the batch
system's memory limit, freeze, kill, accounting) still covers them, and
covers the job's cgroups beside them.  A starter started from such a leaf
(the batch script's next `starter run`) takes <own> as the leaf's owner, not
the leaf.  prune() (called by JobCgroup.destroy()) undoes all of it once no
job is left: controllers disabled again, every process of the leaves moved
back to <own>, the leaves and starter/ removed, so the node looks as before.

The caller's cgroup may be a directory its user owns (Slurm's cgroup/v2 with
its constraints on hands the task cgroup's directory to the user): the
kernel moves a process only for a writer that may write cgroup.procs of the
common ancestor of where it is and where it goes, so while every
cgroup.procs and cgroup.threads from the root down to <own> and in what the
starter makes is root's, nothing of the job can be moved out of the job's
cgroup.  What the user's directory does allow is removing an empty cgroup
in it, or making one first under the name the starter is about to use: the
parent starter/ is checked to be root's once it holds the starter's leaf or
a job (Backend.verify_parents()), when it can no longer be removed.

Under Slurm
-----------
Slurm's cgroup/v2 plugin (22.05) signals a step (scancel, the SIGKILL after
KillWait) through the pids directly in each task cgroup's cgroup.procs,
job_<J>/step_<S>/user/task_<T>, and nothing below them; it freezes the
step through step_<S>/user/cgroup.freeze, and limits memory, CPUs and
devices at step_<S>/user and above.  A starter started in a task cgroup
therefore leaves itself, the batch script and the relay where they are,
and takes step_<S>/user as <own>: its parent is step_<S>/user/starter,
beside the task cgroups.  user/ holds no processes, so the controllers are
enabled there without moving anything; Slurm's signal reaches the starter
(which ends the job: vacate), and its freeze and limits cover the job.
What Slurm reads per task (jobacct_gather/cgroup: task_<T>'s cpu.stat and
memory.stat) no longer includes the job; the step's figures and the
starter's report do.

Starters sharing <own> (a batch script's `starter run &` twice) take turns:
making the parents and the job's cgroup, and prune()'s check for jobs left
and its undoing, happen under an flock on <own>'s directory.  Without it
one starter's prune() could disable the controllers, move everything back
and remove starter/ between another's setup of the parents and its mkdir
of the job.  A user who owns <own> and holds the lock only stalls his own
jobs, for LOCK_WAIT seconds, then gets a one-line error.
"""

import errno
import fcntl
import os
import time

from ..errors import CgroupError
from . import files, hierarchy, parsers, subtree
from ..spec import values
from .backend import Backend
from .base import DELEGATE_LEAF, JobCgroup
from .dirs import EventsWatch, mkdir
from .limits import CPU_PERIOD_US, IO_KEYS, check_within, cpu_quota_us
from .unified import UnifiedTracking

CONTROLLERS = ("cpu", "cpuset", "io", "memory", "pids")
SUPERVISOR_PREFIX = "supervisor-"


class V2Resources:
    """memory, cpu, cpuset, pids and io controllers in the job's cgroup2 directory."""

    def set_limits(self, limits):
        """Apply `limits`; raise CgroupError if any cannot be applied (the
        caller must not run the job then)."""
        limits.validate()
        d = self.upath

        def need(name, what):
            p = os.path.join(d, name)
            if not os.path.exists(p):
                raise CgroupError(
                    f"cannot limit {what} for job {self.id}: {p} does not exist",
                    f"the {name.split('.')[0]} controller is not enabled for {os.path.dirname(d)} "
                    "(cgroup.subtree_control of its parent); starter refuses to run unlimited",
                )
            return p

        if limits.memory_bytes is not None:
            files.write(need("memory.max", "memory"), limits.memory_bytes)
            swap = os.path.join(d, "memory.swap.max")
            if os.path.exists(swap):
                files.write(swap, 0)
            elif files.swap_active():
                raise CgroupError(
                    f"cannot keep job {self.id} from swapping: {swap} does not exist but swap is on",
                    "boot with swapaccount=1 (or turn swap off); starter refuses a memory limit that swap can bypass",
                )
        if limits.cpus is not None:
            files.write(need("cpu.max", "cpu bandwidth"), f"{cpu_quota_us(limits.cpus)} {CPU_PERIOD_US}")
        if limits.cpu_weight is not None:
            files.write(need("cpu.weight", "cpu weight"), limits.cpu_weight)
        if limits.pids is not None:
            files.write(need("pids.max", "the number of processes"), limits.pids)
        # Empty cpuset.cpus/mems (the default) means the parent's: only what
        # was asked is written, after a check the kernel would not make (v2
        # takes CPUs the parent lacks and leaves them out of the effective set).
        for ids, name, what in ((limits.cpuset, "cpuset.cpus", "CPUs"), (limits.mems, "cpuset.mems", "NUMA nodes")):
            if ids is not None:
                p = need(name, what)
                check_within(self.id, what, ids, os.path.join(os.path.dirname(d), name + ".effective"))
                files.write(p, values.format_id_list(ids))
        for maj, mn, *rates in limits.io_max or ():
            files.write(need("io.max", "I/O"), f"{maj}:{mn} " + " ".join(
                f"{k}={v}" for k, v in zip(IO_KEYS, rates) if v is not None),
                hint="io.max takes whole disks, not partitions, on devices with a request queue")

    def _resource_stats(self):
        d = self.upath
        out = {}
        rd = self._int
        out["memory_current_bytes"] = rd(os.path.join(d, "memory.current"))
        out["memory_peak_bytes"] = rd(os.path.join(d, "memory.peak"))
        mstat = self._text(os.path.join(d, "memory.stat"))
        if mstat is not None:
            out["memory_shmem_bytes"] = parsers.parse_flat_keyed(mstat).get("shmem")
        out["pids_current"] = rd(os.path.join(d, "pids.current"))
        out["pids_peak"] = rd(os.path.join(d, "pids.peak"))
        io = self._text(os.path.join(d, "io.stat"))
        if io is not None:
            out["io_read_bytes"], out["io_write_bytes"] = parsers.io_stat_totals(io)
        ev = self._text(os.path.join(d, "memory.events"))
        if ev is not None:
            # memory.events is hierarchical (memory.events.local is not):
            # it counts OOM kills in sub-cgroups the job made too.
            out["oom_kills"] = parsers.parse_flat_keyed(ev).get("oom_kill", 0)
        return out


    def oom_kills(self):
        ev = self._text(os.path.join(self.upath, "memory.events"))
        return None if ev is None else parsers.parse_flat_keyed(ev).get("oom_kill", 0)

    def end_on_oom(self):
        """memory.oom.group=1: when the OOM killer picks a task of the job
        (limit or global OOM), the kernel kills every task in it at once
        (those with oom_score_adj -1000 excepted).  Kernels before 4.19 lack
        the file: then memory.events (POLLPRI on change) is the watch."""
        group = os.path.join(self.upath, "memory.oom.group")
        if os.path.exists(group):
            files.write(group, 1)
            return None
        if self._oom is None and os.path.exists(os.path.join(self.upath, "memory.events")):
            self._oom = EventsWatch(os.path.join(self.upath, "memory.events"))
        return self._oom


class V2Delegation:
    """--delegate: the job's cgroup handed to the job's user (cgroup-v2.rst,
    "Delegation"), the starter's limits and kill staying above it.

        job-<id>/                 limits, memory.oom.group, cgroup.max.*: root's
          cgroup.procs, cgroup.subtree_control, cgroup.threads, the dir: the user's
          job/                    the job's first process (no internal processes)
          <whatever the job makes: payload cgroups, its own limits in them>
          enter-<pid>-<random>/   `starter enter` (root-owned, removed after)

    The job's cgroup namespace is rooted at job-<id> (shim: cgroupns_at_clone),
    so it sees that as /sys/fs/cgroup; nsdelegate on the host's cgroup2 mount
    makes the namespace root a delegation boundary (checked by
    V2Backend.check_delegation)."""

    def delegate(self, pid, uid, gid):
        """Move `pid` (cloned into the job's cgroup, not yet released) into
        the leaf job/, enable the controllers the job's cgroup has for its
        children, bound the subtree, then chown the delegation files of the
        job's cgroup and of job/ to uid:gid.  Raises CgroupError (the job
        must not start then; destroy() removes what was made)."""
        d = self.upath
        leaf = os.path.join(d, DELEGATE_LEAF)
        mkdir(leaf)
        files.write(os.path.join(leaf, "cgroup.procs"), int(pid))
        files.write(os.path.join(d, "cgroup.max.depth"), DELEGATE_MAX_DEPTH)
        files.write(os.path.join(d, "cgroup.max.descendants"), DELEGATE_MAX_DESCENDANTS)
        want = [c for c in CONTROLLERS if c in _controllers(d)]
        if want:
            files.write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in want))
        for cg in (d, leaf):
            for name in DELEGATED_FILES:
                p = os.path.join(cg, name) if name else cg
                try:
                    os.chown(p, uid, gid, follow_symlinks=False)
                except OSError as e:
                    raise CgroupError(f"cannot hand {p} to uid {uid}: {os.strerror(e.errno)}",
                                      files.hint_for(e.errno)) from None

    def open_leaf(self, name):
        """Make a root-owned leaf `name` in the job's cgroup (for `starter
        enter` into a delegated job) -> an O_DIRECTORY fd for
        CLONE_INTO_CGROUP; the caller closes it and calls remove_leaf()."""
        p = os.path.join(self.upath, name)
        if not mkdir(p):
            # The job owns the directory and may have made `name` first: a
            # cgroup the job controls is no place for the admin's process.
            raise CgroupError(f"{p} already exists: the job made it", "try again (the name has the pid in it)")
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            _rmdir_quiet(p)
            raise CgroupError(f"cannot open {p}: {os.strerror(e.errno)}", files.hint_for(e.errno)) from None
        if os.fstat(fd).st_uid != 0:
            # The job owns the parent: it can rmdir our leaf between the
            # mkdir and the open and make its own under the same name.
            os.close(fd)
            raise CgroupError(f"{p} was replaced by the job's own cgroup", "try again")
        return fd

    def remove_leaf(self, name):
        p = os.path.join(self.upath, name)
        try:
            os.rmdir(p)
        except FileNotFoundError:
            pass
        except OSError:
            pass   # still busy: destroy() removes it with the job

    def own_oom(self):
        """The OOM killer acted for the job as a whole: the job's own limit
        was reached (memory.events.local "oom") or the job was group-killed
        (a global OOM; "oom_group_kill").  An OOM inside a sub-cgroup the job
        limited itself counts in neither."""
        ev = parsers.parse_flat_keyed(files.read_text_or_none(os.path.join(self.upath, "memory.events.local")))
        return ev.get("oom", 0) > 0 or ev.get("oom_group_kill", 0) > 0

    def payload_stats(self, limit=None):
        """Figures of every cgroup below the job's (depth first, at most
        `limit`) -> (list of dicts, number left out).  The names are the
        job's: escaped, bounded, and the walk never follows a link."""
        return subtree.subtree_figures(self.upath, PAYLOADS_MAX if limit is None else limit)


# The files of a cgroup that delegation hands over ("" = the directory).
DELEGATED_FILES = ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads")
# Bounds on a delegated subtree (cgroup.max.depth / .descendants of the job's
# cgroup, root's): keep walks, the report and cleanup bounded.
DELEGATE_MAX_DEPTH = 16
DELEGATE_MAX_DESCENDANTS = 1024
# Sub-cgroups listed in the report (depth first); the rest are counted.
PAYLOADS_MAX = 64


def _rmdir_quiet(p):
    try:
        os.rmdir(p)
    except OSError:
        pass


class V2Job(UnifiedTracking, V2Resources, V2Delegation, JobCgroup):
    pass


class V2Backend(Backend):
    kind = "v2"
    job_class = V2Job

    def __init__(self, layout, parent=None):
        super().__init__(_own_for_jobs(layout, parent), parent)
        self._moved_self = None  # the supervisor leaf we moved into, if any
        self._enabled_above = []  # controllers we enabled in the parent's parent
        self._lock_fd, self._lock_depth = None, 0

    def create(self, job_id, limits=None):
        self._lock()
        try:
            return super().create(job_id, limits)
        finally:
            self._unlock()

    def _lock(self):
        """Take the flock on <own> (module docstring); reentrant, since
        create() prunes on failure.  Not for an absolute parent: nothing is
        moved, enabled or removed there."""
        if self._lock_depth == 0 and not self.parent_is_absolute:
            self._lock_fd = _flock_dir(os.path.dirname(self.parents["unified"]))
        self._lock_depth += 1

    def _unlock(self):
        self._lock_depth -= 1
        if self._lock_depth == 0 and self._lock_fd is not None:
            os.close(self._lock_fd)   # releases the flock
            self._lock_fd = None

    def roles(self):
        return ("unified",)

    def check_delegation(self, mountinfo=None):
        """--delegate needs nsdelegate on the cgroup2 mount (a cgroup
        namespace is then a delegation boundary: the job can neither move a
        process out of it nor write its root's limit files) and cgroup.kill
        (one write ends the whole subtree, whatever the job built)."""
        m = self.layout.unified
        if mountinfo is None:
            mountinfo = files.read_text("/proc/self/mountinfo")
        opts = hierarchy.super_options(mountinfo, m.mount_point)
        if "nsdelegate" not in opts:
            raise CgroupError(
                f"--delegate needs the nsdelegate option on the cgroup2 mount {m.mount_point}",
                f"remount it with `mount -o remount,nsdelegate {m.mount_point}` (systemd mounts it so), "
                "or run the job without --delegate")
        if not self.supports_kill:
            raise CgroupError("--delegate needs cgroup.kill (Linux 5.14 or later)",
                              "run the job without --delegate on this kernel")

    @property
    def supports_memory_peak(self):
        return self._probe_file("unified", "memory.peak")

    @property
    def supports_pids_peak(self):
        return self._probe_file("unified", "pids.peak")

    def _ensure_parents(self):
        p = self.parents["unified"]
        up = os.path.dirname(p)
        self._make_parent(p)
        avail = set((files.read_text_or_none(os.path.join(up, "cgroup.controllers")) or "").split())
        have = _controllers(p)
        missing = [c for c in CONTROLLERS if c in avail and c not in have]
        if missing:
            self._enable_above(up, p, missing)
        have = _controllers(p)
        sub = set((files.read_text_or_none(os.path.join(p, "cgroup.subtree_control")) or "").split())
        todo = [c for c in CONTROLLERS if c in have and c not in sub]
        if todo:
            files.write(
                os.path.join(p, "cgroup.subtree_control"),
                " ".join("+" + c for c in todo),
                hint=f"{p} must not hold processes itself (cgroup v2 no-internal-processes rule); "
                "move them into a leaf below it",
            )

    def _enable_above(self, up, p, missing):
        value = " ".join("+" + c for c in missing)
        target = os.path.join(up, "cgroup.subtree_control")
        try:
            files.write(target, value)
            self._enabled_above = missing
            return
        except CgroupError as e:
            if getattr(e, "errno", None) != errno.EBUSY or not self._is_own(up):
                raise CgroupError(
                    f"cannot enable controllers {missing} for {p}: {e}",
                    f"enable them in {target} (possible only while {up} holds no processes), "
                    "or set the cgroup parent to a delegated cgroup that has them",
                ) from None
        # The starter's own cgroup holds processes, at least the starter:
        # move the starter, then whatever else is there, into a leaf below
        # the parent and try again.
        leaf = os.path.join(p, f"{SUPERVISOR_PREFIX}{os.getpid()}")
        mkdir(leaf)
        files.write(os.path.join(leaf, "cgroup.procs"), os.getpid())
        self._moved_self = leaf
        for _ in range(MOVE_ROUNDS):
            try:
                files.write(target, value)
                self._enabled_above = missing
                return
            except CgroupError as e:
                if getattr(e, "errno", None) != errno.EBUSY:
                    break
            # A process forking meanwhile puts its child where it is: repeat.
            if not _move_all(up, leaf):
                break
        self._move_back()
        raise CgroupError(
            f"cannot enable controllers {missing} for {p}: {up} keeps holding processes the starter "
            "cannot move below it",
            "give the starter a cgroup of its own (systemd Delegate=yes, Slurm's task cgroup) "
            "or set the cgroup parent to a delegated cgroup with these controllers enabled",
        )

    def _is_own(self, d):
        own = self.layout.own.get("unified")
        return own is not None and d == hierarchy.join(self.layout.unified.mount_point, own)

    def _move_back(self):
        """Every process of our leaf (the starter, and what followed it)
        back into the starter's own cgroup; the leaf removed."""
        leaf = self._moved_self
        if leaf is None:
            return True
        up = os.path.dirname(os.path.dirname(leaf))
        try:
            files.write(os.path.join(up, "cgroup.procs"), os.getpid())
        except CgroupError:
            return False
        self._moved_self = None
        _move_all(leaf, up)
        try:
            os.rmdir(leaf)
        except OSError:
            pass
        return True

    def _prune_extra(self, parent, move_back=False):
        # Leaves of starters that have exited are empty: rmdir succeeds only
        # then, unless move_back (no job left, controllers off): what the
        # other starters moved there (a batch script) goes back first.
        for n in _leaves(parent):
            leaf = os.path.join(parent, n)
            if move_back:
                _move_all(leaf, os.path.dirname(parent))
            try:
                os.rmdir(leaf)
            except OSError:
                pass

    def prune(self):
        """Once no job is left: disable the controllers enabled for the
        leaves' sake, move every process of the leaves back into the
        starter's own cgroup, remove starter/ (JobCgroup.destroy() calls
        this, so a starter that destroys its job leaves nothing behind).
        The last starter of several sharing <own> does it for all: the one
        that enabled the controllers may be gone."""
        self._lock()
        try:
            return self._prune_locked()
        finally:
            self._unlock()

    def _prune_locked(self):
        p = self.parents["unified"]
        if not self.parent_is_absolute and not self.list_jobs() and (
                self._moved_self is not None or _leaves(p)):
            up = os.path.dirname(p)
            sub = os.path.join(p, "cgroup.subtree_control")
            enabled = (files.read_text_or_none(sub) or "").split()
            try:
                if enabled:
                    files.write(sub, " ".join("-" + c for c in enabled))
                # <own> held processes when a leaf was made, so nothing was
                # enabled there before the starters came.
                above = (files.read_text_or_none(os.path.join(up, "cgroup.subtree_control")) or "").split()
                if above:
                    files.write(os.path.join(up, "cgroup.subtree_control"), " ".join("-" + c for c in above))
                self._enabled_above = []
                self._move_back()
                self._prune_extra(p, move_back=True)
            except CgroupError:
                pass  # another starter shares <own>; its prune() finishes
        return super().prune()


MOVE_ROUNDS = 8
LOCK_WAIT = 60.0


def _flock_dir(d):
    """An O_DIRECTORY fd of `d` holding an exclusive flock on it."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CgroupError(f"cannot open {d}: {os.strerror(e.errno)}", files.hint_for(e.errno)) from None
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise CgroupError(f"{d} stayed locked for {LOCK_WAIT:.0f}s (flock): another starter "
                                  "sharing this cgroup is stuck, or its owner holds the lock",
                                  "end the process holding it (`fuser -v` shows it), then start the job again") from None
            time.sleep(0.01)


def _move_all(src, dst):
    """Move every process of cgroup `src` into `dst` (one that exits
    meanwhile is skipped).  -> False if one could not be moved."""
    try:
        pids = files.read_text(os.path.join(src, "cgroup.procs")).split()
    except (CgroupError, OSError):
        return False
    ok = True
    for pid in pids:
        try:
            files.write(os.path.join(dst, "cgroup.procs"), pid)
        except CgroupError as e:
            if getattr(e, "errno", None) != errno.ESRCH:
                ok = False
    return ok


def _leaves(p):
    try:
        with os.scandir(p) as it:
            return [e.name for e in it if e.name.startswith(SUPERVISOR_PREFIX)]
    except OSError:
        return []


def _own_for_jobs(layout, parent):
    """The cgroup a relative parent goes below, where it is not the
    starter's own (then `layout` as it is):
    - a starter started from a supervisor leaf (a batch script's second
      `starter run`, after the first moved the script there) takes the
      leaf's owner: its jobs go beside the first one's, in the same
      starter/, not in a starter/ below the leaf;
    - in a Slurm step under its cgroup/v2 plugin (own cgroup
      .../job_<J>/step_<S>/user/task_<T>), jobs go beside the task cgroup,
      in .../step_<S>/user/starter: the starter and the batch script stay in
      the task cgroup, where Slurm looks for the pids it signals (module
      docstring, "Under Slurm")."""
    own = layout.own.get("unified")
    name = "starter" if parent is None else str(parent)
    if own is None or name.startswith("/"):
        return layout
    parts = own.rstrip("/").split("/")
    if "/" not in name and len(parts) >= 3 and parts[-2] == name and _slurm_id(parts[-1], SUPERVISOR_PREFIX):
        owner = "/".join(parts[:-2]) or "/"
    elif len(parts) >= 5 and parts[-2] == "user" and _slurm_id(parts[-1], "task_", "special") \
            and parts[-3].startswith("step_") and _slurm_id(parts[-4], "job_"):
        owner = "/".join(parts[:-1])
    else:
        return layout
    return hierarchy.Layout(kind=layout.kind, unified=layout.unified, v1=layout.v1,
                            own={**layout.own, "unified": owner})


def _slurm_id(name, prefix, *words):
    """`name` is `prefix` followed by a number or one of `words`."""
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return rest.isdigit() or rest in words


def _controllers(d):
    return set((files.read_text_or_none(os.path.join(d, "cgroup.controllers")) or "").split())
