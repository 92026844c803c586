"""A job's resource limits (Limits) and their conversions between cgroup
versions: CPU bandwidth to a quota, cpu.weight to v1 cpu.shares, io.max keys
to v1 blkio files, and the check that CPUs/NUMA nodes are the parent's to
give.  Pure but for check_within (one read).
"""

import math

from ..spec import values
from ..errors import CgroupError, SpecError
from . import files, hierarchy

CPU_PERIOD_US = 100_000
CPU_WEIGHT_MIN, CPU_WEIGHT_MAX = 1, 10_000
CPU_SHARES_MIN, CPU_SHARES_MAX = 2, 262_144
# pids.max accepts up to PID_MAX_LIMIT (2^22); larger values are the kernel's to refuse.
PIDS_MAX_SANE = 2**31 - 1


class Limits(hierarchy.Record):
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
