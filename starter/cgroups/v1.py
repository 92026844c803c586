"""cgroup v1: one hierarchy per controller (or per group: cpu,cpuacct).

V1Resources (limits and accounting in the memory, cpu, cpuacct, pids and
blkio hierarchies) is shared with the hybrid backend.  V1Devices (the
devices hierarchy: the job's device allow list) is v1-only's: hybrid hosts
attach a BPF program to the job's cgroup2 directory instead.  V1Tracking is used
only on v1-only hosts: membership is the union of cgroup.procs over every
hierarchy (v1 has no "populated" file, and a v1 cgroup.procs lists only its
own cgroup, not sub-cgroups), freezing is freezer.state, and killing is
freeze -> SIGKILL every listed pid -> thaw, repeated until empty: on v1 a
frozen task does not die until thawed, and while frozen nothing can fork.

v1-only hosts have no fd to wait on for "job empty" (notify_on_release runs
a usermode helper, which is impractical here): events_fd() returns None and
the caller polls is_empty() on a timer.
"""

import errno
import os
import time

from ..spec import values
from ..errors import CgroupError
from . import files, parsers
from .backend import Backend
from .base import JobCgroup
from .dirs import subdirs_bottom_up
from .kill import kill_pids
from .limits import CPU_PERIOD_US, IO_V1_FILES, check_within, cpu_quota_us, weight_to_shares

V1_ROLES = ("freezer", "memory", "pids", "cpu", "cpuacct", "blkio", "devices")
# The hybrid backend freezes and kills through cgroup2; it needs no v1 freezer.
HYBRID_V1_ROLES = ("memory", "pids", "cpu", "cpuacct", "blkio")
# Only jobs bound with --cpuset/--mems get a cgroup in the cpuset hierarchy
# (Backend.add_cpuset): every hierarchy costs each job a mkdir, a migration
# and an rmdir.
CPUSET = "cpuset"


def _file(job, role, name):
    d = job.paths.get(role)
    return None if d is None else os.path.join(d, name)


def _need(job, role, name, what):
    p = _file(job, role, name)
    if p is None or not os.path.exists(p):
        raise CgroupError(
            f"cannot limit {what} for job {job.id}: the v1 {role} controller "
            + ("is not mounted" if p is None else f"has no {p}"),
            f"mount the {role} cgroup controller; starter refuses to run unlimited",
        )
    return p


class V1Resources:
    def set_limits(self, limits):
        """Apply `limits`; raise CgroupError if any cannot be applied."""
        limits.validate()
        if limits.memory_bytes is not None:
            self._set_memory(limits.memory_bytes)
        if limits.cpus is not None:
            files.write(_need(self, "cpu", "cpu.cfs_period_us", "cpu bandwidth"), CPU_PERIOD_US)
            files.write(_need(self, "cpu", "cpu.cfs_quota_us", "cpu bandwidth"), cpu_quota_us(limits.cpus))
        if limits.cpu_weight is not None:
            files.write(_need(self, "cpu", "cpu.shares", "cpu weight"), weight_to_shares(limits.cpu_weight))
        if limits.pids is not None:
            files.write(_need(self, "pids", "pids.max", "the number of processes"), limits.pids)
        if limits.cpuset is not None or limits.mems is not None:
            self._set_cpuset(limits.cpuset, limits.mems)
        for maj, mn, *rates in limits.io_max or ():
            for name, rate in zip(IO_V1_FILES, rates):
                if rate is not None:
                    files.write(_need(self, "blkio", name, "I/O"), f"{maj}:{mn} {rate}",
                                hint="blkio throttling takes block devices with a request queue")

    def _set_cpuset(self, cpus, mems):
        """A v1 cpuset runs nothing until both cpuset.cpus and cpuset.mems
        are set (a task cannot join: ENOSPC): what the job does not name
        is its parent's.  Set before any task joins (add_pid)."""
        d = _need(self, CPUSET, "cpuset.cpus", "CPUs")
        parent = os.path.dirname(os.path.dirname(d))
        for ids, name, eff, what in ((cpus, "cpuset.cpus", "cpuset.effective_cpus", "CPUs"),
                                     (mems, "cpuset.mems", "cpuset.effective_mems", "NUMA nodes")):
            if ids is None:
                value = (files.read_text_or_none(os.path.join(parent, name)) or "").strip()
            else:
                check_within(self.id, what, ids, os.path.join(parent, eff))
                value = values.format_id_list(ids)
            files.write(os.path.join(os.path.dirname(d), name), value)

    def _set_memory(self, limit):
        mem = _need(self, "memory", "memory.limit_in_bytes", "memory")
        memsw = _file(self, "memory", "memory.memsw.limit_in_bytes")
        if not os.path.exists(memsw):
            if files.swap_active():
                raise CgroupError(
                    f"cannot keep job {self.id} from swapping: {memsw} does not exist but swap is on",
                    "boot with swapaccount=1 (or turn swap off); starter refuses a memory limit that swap can bypass",
                )
            files.write(mem, limit)
            return
        # memsw must stay >= the memory limit: lower memory first, raise memsw first.
        try:
            files.write(mem, limit)
            files.write(memsw, limit)
        except CgroupError as e:
            if getattr(e, "errno", None) != errno.EINVAL:
                raise
            files.write(memsw, limit)
            files.write(mem, limit)

    def _resource_stats(self):
        rd = self._int
        out = {}
        mem = self.paths.get("memory")
        if mem:
            out["memory_current_bytes"] = rd(os.path.join(mem, "memory.usage_in_bytes"))
            out["memory_peak_bytes"] = rd(os.path.join(mem, "memory.max_usage_in_bytes"))
            mstat = parsers.parse_flat_keyed(self._text(os.path.join(mem, "memory.stat")))
            # total_shmem covers the job's sub-cgroups; shmem alone does not
            out["memory_shmem_bytes"] = mstat.get("total_shmem", mstat.get("shmem"))
            out["oom_kills"] = _oom_kills_v1(mem, self._text)
        pids = self.paths.get("pids")
        if pids:
            out["pids_current"] = rd(os.path.join(pids, "pids.current"))
            out["pids_peak"] = rd(os.path.join(pids, "pids.peak"))
        blk = self.paths.get("blkio")
        if blk:
            for name in ("blkio.throttle.io_service_bytes_recursive", "blkio.throttle.io_service_bytes"):
                text = self._text(os.path.join(blk, name))
                if text is not None:
                    out["io_read_bytes"], out["io_write_bytes"] = parsers.blkio_totals(text)
                    break
        return out


    def oom_kills(self):
        mem = self.paths.get("memory")
        return _oom_kills_v1(mem, self._text) if mem else None

    def end_on_oom(self):
        """v1 has no memory.oom.group: register an eventfd for
        memory.oom_control through cgroup.event_control; the supervisor
        polls it and kills the job.  The kernel signals it when the job's
        memory cgroup goes under OOM (before the OOM killer has picked a
        victim), and once more when the cgroup is removed."""
        mem = self.paths.get("memory")
        if mem is None:
            return None
        if self._oom is None:
            self._oom = OomEventfd(mem)
        return self._oom


class OomEventfd:
    """The cgroup v1 OOM notification (Documentation/admin-guide/cgroup-v1/
    memory.rst, "OOM Control").  Closing the eventfd unregisters it."""

    mask = 0x1  # POLLIN

    def __init__(self, mem):
        ctl = os.path.join(mem, "memory.oom_control")
        try:
            cfd = os.open(ctl, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise CgroupError(f"cannot open {ctl}: {os.strerror(e.errno)}", files.hint_for(e.errno)) from None
        try:
            self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            try:
                files.write(os.path.join(mem, "cgroup.event_control"), f"{self.fd} {cfd}",
                            hint="the kernel has no cgroup v1 OOM notification; "
                            "use --oom-policy continue (the report still counts OOM kills)")
            except BaseException:
                os.close(self.fd)
                raise
        finally:
            os.close(cfd)

    def drain(self):
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _oom_kills_v1(mem, read_top):
    """Sum of memory.oom_control "oom_kill" over the job's memory subtree.

    On v1 the counter is local to the cgroup whose task was killed, so a job
    with its own sub-cgroups needs the sum.  None on kernels before 4.13,
    which lack the line (memory.failcnt only counts limit hits, which page
    cache reclaim also causes, so it is not reported as OOM kills)."""
    total = None
    for d in subdirs_bottom_up(mem):
        read = read_top if d == mem else files.read_text_or_none
        n = parsers.parse_flat_keyed(read(os.path.join(d, "memory.oom_control"))).get("oom_kill")
        if n is not None:
            total = (total or 0) + n
    return total


class V1Devices:
    """The v1 devices controller (v1-only hosts: hybrid ones use the cgroup2
    side's BPF program, which needs no further v1 hierarchy)."""

    def set_devices(self, rules):
        """devices.deny "a" (nothing), then one devices.allow line per rule.
        A child cgroup starts with its parent's list: the writes only ever
        take away."""
        d = self.paths.get("devices")
        if d is None:
            raise CgroupError(f"cannot restrict the devices of job {self.id}: the v1 devices controller is "
                              "not mounted", "mount it (e.g. at /sys/fs/cgroup/devices); the starter does not "
                              "run a job that could open every device")
        files.write(os.path.join(d, "devices.deny"), "a")
        allow = os.path.join(d, "devices.allow")
        for kind, major, minor, access in rules:
            files.write(allow, f"{kind} {major}:{'*' if minor is None else minor} {access}")
        return "starter"


class V1Tracking:
    """Membership, freezing and killing on a v1-only host."""

    def is_empty(self):
        return not self.pids()

    def _freezer_state(self):
        p = _file(self, "freezer", "freezer.state")
        text = self._text(p) if p else None
        return text.strip() if text else None

    def freeze(self, timeout=5.0):
        p = _need(self, "freezer", "freezer.state", "freezing")
        files.write(p, "FROZEN")
        self._wait_state("FROZEN", timeout, "freeze", again=p)

    def thaw(self, timeout=5.0):
        p = _need(self, "freezer", "freezer.state", "freezing")
        files.write(p, "THAWED")
        self._wait_state("THAWED", timeout, "thaw")

    def frozen(self):
        return self._freezer_state() == "FROZEN"

    def _wait_state(self, want, timeout, what, again=None):
        # v1 passes through FREEZING; the kernel offers no notification.
        # again: write FROZEN to it on every round.  The v1 freezer tries
        # each task once per write: a task that was running then and went to
        # sleep without passing a freezing point (seen on 6.1: a vfork
        # parent waiting for its frozen child, wchan kernel_clone) keeps the
        # cgroup FREEZING until the next write.  runc repeats it too.
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            state = self._freezer_state()
            if state == want or state is None:
                return
            if time.monotonic() >= deadline:
                raise CgroupError(
                    f"{what} of {self.paths['freezer']} did not complete within {timeout}s (state {state})",
                    "a process may be in uninterruptible sleep (D state)",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            if again is not None:
                files.write(again, "FROZEN")

    def _thaw_tree(self, d):
        if d != self.paths.get("freezer"):
            return
        for sub in subdirs_bottom_up(d):
            p = os.path.join(sub, "freezer.state")
            try:
                if files.read_text_or_none(p) not in (None, "THAWED\n"):
                    files.write(p, "THAWED")
            except CgroupError:
                pass

    def _kill_round(self, left, deadline):
        """Freeze (so nothing forks), SIGKILL every pid in every hierarchy's
        subtree, thaw (every sub-cgroup too: a job may have frozen its own).
        v1 has no notification for "empty": kill() polls on a back-off."""
        freezer = self.paths.get("freezer")
        if not (freezer and os.path.isdir(freezer)):
            kill_pids(left)
            return
        try:
            fs = os.path.join(freezer, "freezer.state")
            files.write(fs, "FROZEN")
            self._wait_state("FROZEN", max(0.0, min(0.2, deadline - time.monotonic())), "freeze", again=fs)
        except CgroupError:
            pass  # kill anyway; the next round catches what forked
        kill_pids(self.pids())
        self._thaw_tree(freezer)

    def _tracking_stats(self):
        out = {}
        acct = self.paths.get("cpuacct")
        if acct:
            # cpuacct.usage is exact (ns, from the scheduler); the user/system
            # split (usage_user/usage_sys since 4.16 and cpuacct.stat) is
            # sampled at timer ticks, which miss or double-count time when
            # ticks are late (seen: 1.49 s and 2.4 s for 2 s of CPU in a VM).
            # Like the kernel's cputime_adjust(): the exact total, split in
            # the sampled ratio.
            total = self._int(os.path.join(acct, "cpuacct.usage"))
            u = self._int(os.path.join(acct, "cpuacct.usage_user"))
            s = self._int(os.path.join(acct, "cpuacct.usage_sys"))
            if u is None or s is None:
                st = parsers.parse_flat_keyed(self._text(os.path.join(acct, "cpuacct.stat")))
                if "user" in st:
                    hz = os.sysconf("SC_CLK_TCK")
                    u, s = st["user"] * 1e9 / hz, st.get("system", 0) * 1e9 / hz
            if total is not None and u is not None:
                user = total * u / (u + s) if u + s > 0 else total
                out["cpu_user_s"], out["cpu_system_s"] = user / 1e9, (total - user) / 1e9
            elif u is not None:
                out["cpu_user_s"], out["cpu_system_s"] = u / 1e9, s / 1e9
        out["psi"] = None
        return out


class V1Job(V1Tracking, V1Devices, V1Resources, JobCgroup):
    pass


class V1ResourcesBackend:
    """What backends whose memory and pids controllers are v1 (v1, hybrid)
    can report."""

    @property
    def supports_memory_peak(self):
        return "memory" in self.parents  # memory.max_usage_in_bytes is always there

    @property
    def supports_pids_peak(self):
        return self._probe_file("pids", "pids.peak")

    def roles(self):
        return self.fixed_roles() + ((CPUSET,) if self.cpuset else ())

    def add_cpuset(self):
        if self.cpuset:
            return self
        if CPUSET not in self.layout.v1:
            raise CgroupError("cannot bind a job to CPUs or NUMA nodes: the v1 cpuset controller is not mounted",
                              "mount it (mount -t cgroup -o cpuset cpuset /sys/fs/cgroup/cpuset), "
                              "or run the job without --cpuset/--mems")
        self.cpuset = True
        # A new dict: reclaim's copies of a cached backend share the old one.
        self.parents = dict(self.parents, **{CPUSET: self._parent_dir(CPUSET, self.parent_setting)})
        return self

    def _ensure_parents(self):
        super()._ensure_parents()
        if self.cpuset and not self.parent_is_absolute:
            self._init_cpuset_parent(self.parents[CPUSET])

    @staticmethod
    def _init_cpuset_parent(p):
        """A new v1 cpuset has no CPUs and no nodes (unless its parent has
        cgroup.clone_children): the `starter` parent gets its parent's, as
        v1 requires before a child can have any.  Checked every time, not
        only by whoever made it: a starter beside it may have made it a
        moment ago and not written them yet."""
        up = os.path.dirname(p)
        for name in ("cpuset.mems", "cpuset.cpus"):
            if not (files.read_text_or_none(os.path.join(p, name)) or "").strip():
                files.write(os.path.join(p, name), (files.read_text_or_none(os.path.join(up, name)) or "").strip())


class V1Backend(V1ResourcesBackend, Backend):
    kind = "v1"
    job_class = V1Job

    def fixed_roles(self):
        return tuple(r for r in V1_ROLES if r in self.layout.v1)
