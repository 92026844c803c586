"""Reading, writing and parsing cgroup files; finding the cgroup mounts.

Everything here is either a pure parser (unit-tested on fixture text in
tests/fixtures/cgroup/) or a thin wrapper around one open()/read()/write()
that turns an OSError into a CgroupError naming the path, the value and what
to do about it.  No backend logic lives here.
"""

import errno
import os

from ..errors import CgroupError

# Controllers a v1 mount can carry.  Anything else in a mount's super options
# (rw, xattr, name=systemd, release_agent=..., clone_children) is not one.
V1_CONTROLLERS = frozenset(
    "cpu cpuacct cpuset memory devices freezer net_cls net_prio blkio "
    "perf_event hugetlb pids rdma misc".split()
)
# v1 controllers whose presence makes a host "hybrid" rather than pure v2:
# the ones starter uses for limits and accounting.
V1_RESOURCE_CONTROLLERS = frozenset("memory pids cpu cpuacct blkio freezer".split())


# --------------------------------------------------------------------------
# reading and writing


# What a read of a cgroup file that is not there (or not readable on this
# kernel) fails with: ENOENT, ENODEV (a removed cgroup's open file, or PSI
# files with psi=0), EOPNOTSUPP, EINVAL.
_ABSENT = frozenset((errno.ENOENT, errno.ENODEV, errno.EOPNOTSUPP, errno.EINVAL))


def read_text(path):
    # os.open/os.read, not open(): a third cheaper per file, which counts
    # when `starter metrics` reads ~11 files for each of hundreds of jobs.
    # A short read of a seq_file (every cgroup file) means end of file.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_whole(fd)
    finally:
        os.close(fd)


def _read_whole(fd):
    data = os.pread(fd, 65536, 0)
    if len(data) == 65536:
        chunks, off = [data], len(data)
        while chunks[-1]:
            chunks.append(os.pread(fd, 1 << 20, off))
            off += len(chunks[-1])
        data = b"".join(chunks)
    return data.decode()


def read_text_or_none(path):
    """The file's text, or None when the file (or its cgroup) does not exist."""
    return _or_none(read_text, path)


def _or_none(read, what):
    """read(what), or None where the file is absent (_ABSENT)."""
    try:
        return read(what)
    except OSError as e:
        if e.errno in _ABSENT:
            return None
        raise


def read_int_or_none(path):
    """An integer file ("max" reads as None); None when the file is missing."""
    return int_or_none(read_text_or_none(path))


def int_or_none(text):
    """An integer file's text ("max" and None read as None)."""
    if text is None:
        return None
    text = text.strip()
    if text == "max" or text == "":
        return None
    return int(text)


class Kept:
    """Descriptors of one cgroup's own files, kept open once keep is set:
    a read is then one pread, a write one write.

    A job's last reads (its usage, "is it empty?") and its kill come after
    it ended or was told to end, where every microsecond is teardown time;
    the first open of a kernfs file makes its inode (~40 us here).  So the
    starter sets keep and reads everything once while the job runs
    (JobCgroup.keep_open), and closes them with the job's cgroup.  Until
    keep is set (a reader such as `starter metrics`, which must not hold
    descriptors of many jobs) every call is a plain read or write.  Only
    for the job's own directories, never a sub-cgroup a job could remove
    and make again under the same name."""

    def __init__(self):
        self.keep = False
        self.priming = False    # keep_open(): open what is read, read nothing
        self.fds = {}

    def open(self, path, flags=os.O_RDONLY):
        """The kept descriptor of `path` (opened now if need be), or None
        if there is no such file."""
        key = (path, flags)
        fd = self.fds.get(key, -1)
        if fd == -1:
            try:
                fd = os.open(path, flags | os.O_CLOEXEC)
            except OSError as e:
                if e.errno not in _ABSENT:
                    raise
                fd = None
            self.fds[key] = fd
        return fd

    def text(self, path):
        """As read_text_or_none(path)."""
        if not self.keep:
            return read_text_or_none(path)
        fd = self.open(path)
        if fd is None or self.priming:
            return None
        return _or_none(_read_whole, fd)

    def write(self, path, value):
        """As write(path, value); a file that is gone (or whose cgroup was
        removed since it was opened) fails with errno ENOENT."""
        if not self.keep:
            return write(path, value)
        fd = self.open(path, os.O_WRONLY)
        try:
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            os.write(fd, str(value).encode())
        except OSError as e:
            if e.errno == errno.ENODEV:
                e = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            raise _write_error(path, value, e, None) from None

    def close(self):
        fds, self.fds, self.keep, self.priming = self.fds, {}, False, False
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def swap_active():
    """Is any swap device or file on (/proc/swaps lists more than its header)?"""
    text = read_text_or_none("/proc/swaps") or ""
    return len(text.strip().splitlines()) > 1


_HINTS = {
    errno.EINVAL: "the kernel rejected the value: check its range and format",
    errno.EBUSY: "the cgroup is busy: it has processes or children "
    "(cgroup v2 allows controllers in cgroup.subtree_control only on cgroups without processes), "
    "or the new memory limit is below current usage",
    errno.ENOENT: "the file or cgroup does not exist: the controller is not mounted or not "
    "enabled for this cgroup (cgroup.subtree_control of its parent), or the cgroup was removed",
    errno.EACCES: "permission denied: starter must run as root or in a delegated cgroup",
    errno.EPERM: "operation not permitted: starter must run as root or in a delegated cgroup",
    errno.ESRCH: "the process has already exited",
    errno.ENOSPC: "cgroup.max.descendants or cgroup.max.depth of an ancestor is reached",
    errno.EOPNOTSUPP: "the kernel does not support this cgroup feature",
    errno.ENODEV: "the kernel does not support this cgroup feature",
}


def hint_for(err, default=None):
    return _HINTS.get(err, default)


def write(path, value, hint=None):
    """Write `value` to the cgroup file `path` in one write(), or raise CgroupError.

    cgroup files take one value per write() call; Python's buffered write can
    split or merge, so write unbuffered.
    """
    data = str(value).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _write_error(path, value, e, hint) from None
    try:
        os.write(fd, data)
    except OSError as e:
        raise _write_error(path, value, e, hint) from None
    finally:
        os.close(fd)


def _write_error(path, value, e, hint):
    name = errno.errorcode.get(e.errno, str(e.errno))
    err = CgroupError(
        f"writing {str(value)!r} to {path} failed: {name} ({os.strerror(e.errno)})",
        hint or hint_for(e.errno),
    )
    err.errno = e.errno
    err.path = path
    return err


def read_pids(path):
    """PIDs in one cgroup.procs file ([] when the cgroup is gone)."""
    text = read_text_or_none(path)
    if not text:
        return []
    return [int(x) for x in text.split()]


# --------------------------------------------------------------------------
# parsers (pure; fixture-tested)


def parse_flat_keyed(text):
    """`key value` lines (cpu.stat, memory.stat, memory.events, cgroup.events,
    memory.oom_control, v1 cpu.stat) -> {key: int}.  Non-integer values are
    skipped rather than guessed."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out


def parse_nested_keyed(text):
    """`name k=v k=v` lines (io.stat, pressure files) -> {name: {k: value}}.

    Values are int where they parse as int, else float (avg10=0.12)."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if not parts:
            continue
        entry = {}
        for kv in parts[1:]:
            k, sep, v = kv.partition("=")
            if not sep:
                continue
            try:
                entry[k] = int(v)
            except ValueError:
                try:
                    entry[k] = float(v)
                except ValueError:
                    continue
        out[parts[0]] = entry
    return out


def io_stat_totals(text):
    """v2 io.stat -> (read_bytes, write_bytes) summed over devices."""
    r = w = 0
    for entry in parse_nested_keyed(text).values():
        r += entry.get("rbytes", 0)
        w += entry.get("wbytes", 0)
    return r, w


def blkio_totals(text):
    """v1 blkio.*io_service_bytes -> (read_bytes, write_bytes).

    Lines are `MAJ:MIN Read N` per device and operation, then one `Total N`
    line that sums everything: sum the per-device Read and Write lines and
    ignore the grand total."""
    r = w = 0
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        _, op, n = parts
        if op == "Read":
            r += int(n)
        elif op == "Write":
            w += int(n)
    return r, w


def pressure_totals(text):
    """A PSI file (cpu.pressure ...) -> {"some": total_us, "full": total_us}.

    `total=` is cumulative stall time in microseconds.  Older kernels have no
    "full" line in cpu.pressure; it is then absent from the dict."""
    if text is None:
        return None
    out = {}
    for name, entry in parse_nested_keyed(text).items():
        if "total" in entry:
            out[name] = int(entry["total"])
    return out or None


class _Record:
    """A small value class: positional or keyword init, eq, repr.  Plain
    __slots__ instead of dataclasses, whose import costs ~13 ms of every
    job's start-up."""

    __slots__ = ()
    _defaults = {}
    _frozen = True

    def __init__(self, *args, **kw):
        vals = dict(zip(self.__slots__, args))
        vals.update(kw)
        for name in self.__slots__:
            default = self._defaults.get(name)
            object.__setattr__(self, name, vals[name] if name in vals else (default() if callable(default) else default))

    def __setattr__(self, name, value):
        if self._frozen:
            raise AttributeError(f"{type(self).__name__} is frozen")
        object.__setattr__(self, name, value)

    def __eq__(self, other):
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __hash__(self):
        return hash(tuple(getattr(self, n) for n in self.__slots__ if not isinstance(getattr(self, n), dict)))

    def replace(self, **kw):
        vals = {n: getattr(self, n) for n in self.__slots__}
        vals.update(kw)
        return type(self)(**vals)

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


class ProcCgroup(_Record):
    """One line of /proc/<pid>/cgroup: hierarchy_id, controllers (() for the
    unified line "0::/path"; ("name=systemd",) for named), path."""

    __slots__ = ("hierarchy_id", "controllers", "path")


def parse_proc_cgroup(text):
    out = []
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        hid, ctrls, path = line.split(":", 2)
        controllers = tuple(c for c in ctrls.split(",") if c)
        out.append(ProcCgroup(int(hid), controllers, path))
    return out


def unescape_mountinfo(s):
    """A mountinfo field: space, tab, newline and backslash come as \\ooo octal."""
    out = []
    i = 0
    while i < len(s):
        if s[i] == "\\" and s[i + 1 : i + 4].isdigit() and i + 3 < len(s):
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


class Mount(_Record):
    """A cgroup mount from /proc/self/mountinfo: mount_point, root (the
    cgroup path this mount shows at mount_point), fstype ("cgroup" or
    "cgroup2"), controllers (v1 controllers of this hierarchy; () for
    cgroup2), name (a v1 named hierarchy such as systemd, else None)."""

    __slots__ = ("mount_point", "root", "fstype", "controllers", "name")


def parse_mountinfo(text):
    """cgroup and cgroup2 mounts in mountinfo text, in file order."""
    mounts = []
    for line in (text or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf = left.split()
        rf = right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        fstype = rf[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        root = unescape_mountinfo(lf[3])
        mount_point = unescape_mountinfo(lf[4])
        opts = rf[2].split(",")
        controllers = ()
        name = None
        if fstype == "cgroup":
            controllers = tuple(o for o in opts if o in V1_CONTROLLERS)
            for o in opts:
                if o.startswith("name="):
                    name = o[5:]
        mounts.append(Mount(mount_point, root, fstype, controllers, name))
    return mounts


class Layout(_Record):
    """What the host has, decided once: the backend kind and where each
    hierarchy is mounted, and the starter's own cgroup in each.

    `unified` is the cgroup2 mount (or None); `v1` maps each v1 controller to
    its Mount (controllers mounted together share one Mount); `own` maps
    "unified" and each v1 controller to the starter's cgroup path relative to
    that mount's mount point ("/" = the mount point itself).
    """

    __slots__ = ("kind", "unified", "v1", "own")
    _defaults = {"v1": dict, "own": dict}
    _frozen = False


def _prefer(mounts):
    # A hierarchy can be mounted more than once (bind mounts, containers);
    # prefer the one under /sys/fs/cgroup, then the one showing the most.
    def key(m):
        return (not m.mount_point.startswith("/sys/fs/cgroup"), len(m.root))

    return sorted(mounts, key=key)[0] if mounts else None


def _relative(own_path, mount_root):
    """The starter's cgroup relative to what a mount shows, or None if the
    mount does not show it."""
    own_path = own_path or "/"
    if mount_root in ("/", ""):
        return own_path
    if own_path == mount_root:
        return "/"
    if own_path.startswith(mount_root.rstrip("/") + "/"):
        return own_path[len(mount_root.rstrip("/")) :]
    return None


def detect_layout(mountinfo_text, proc_cgroup_text):
    """Decide v2 / v1 / hybrid from mountinfo and /proc/self/cgroup text.

    - v2: a cgroup2 mount and none of the resource controllers on v1.
    - hybrid: a cgroup2 mount (used to track, freeze and kill) and the
      resource controllers on v1 hierarchies.
    - v1: no cgroup2 mount; one v1 hierarchy per controller (or group).
    Raises CgroupError when there are no usable cgroup mounts.
    """
    mounts = parse_mountinfo(mountinfo_text)
    procs = parse_proc_cgroup(proc_cgroup_text)
    unified = _prefer([m for m in mounts if m.fstype == "cgroup2"])
    by_ctrl = {}
    for m in mounts:
        for c in m.controllers:
            by_ctrl.setdefault(c, []).append(m)
    v1 = {c: _prefer(ms) for c, ms in by_ctrl.items()}

    own = {}
    for p in procs:
        if p.hierarchy_id == 0 and not p.controllers:
            if unified is not None:
                rel = _relative(p.path, unified.root)
                if rel is not None:
                    own["unified"] = rel
        else:
            for c in p.controllers:
                if c in v1:
                    rel = _relative(p.path, v1[c].root)
                    if rel is not None:
                        own[c] = rel

    resource_v1 = V1_RESOURCE_CONTROLLERS & set(v1)
    if unified is not None and not resource_v1:
        kind = "v2"
        v1 = {}
    elif unified is not None:
        kind = "hybrid"
    elif resource_v1:
        kind = "v1"
    else:
        raise CgroupError(
            "no cgroup hierarchy is mounted (no cgroup2 mount and no v1 memory/pids/cpu/freezer mount "
            "in /proc/self/mountinfo)",
            "mount cgroup2 at /sys/fs/cgroup (systemd does this on boot) or run starter where "
            "/sys/fs/cgroup is visible",
        )
    if kind in ("v2", "hybrid") and "unified" not in own:
        raise CgroupError(
            f"the starter's own cgroup2 path is not visible under the cgroup2 mount at "
            f"{unified.mount_point} (mount root {unified.root})",
            "run starter with the whole cgroup2 hierarchy mounted, or in a cgroup namespace rooted at its cgroup",
        )
    return Layout(kind=kind, unified=unified, v1=v1, own=own)


def join(mount_point, rel, *more):
    """mount_point + a cgroup path relative to it (which starts with '/')."""
    p = mount_point.rstrip("/") + (rel if rel != "/" else "")
    for m in more:
        p += "/" + m
    return p


def super_options(mountinfo_text, mount_point):
    """The super options (after " - fstype source") of the mount at
    `mount_point` in mountinfo text, as a set (the last mount there wins)."""
    opts = set()
    for line in (mountinfo_text or "").splitlines():
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if sep and len(lf) >= 5 and len(rf) >= 3 and unescape_mountinfo(lf[4]) == mount_point:
            opts = set(rf[2].split(","))
    return opts


# ---- a delegated job's sub-cgroups (job-controlled names and shapes) -------

NAME_MAX_SHOWN = 256  # characters of an escaped cgroup path in the report
_WALK_MAX_DEPTH = 32  # beyond the starter's cgroup.max.depth, in case


def show_name(raw):
    """A cgroup path the job chose (bytes) -> printable ASCII: bytes outside
    0x21..0x7e and the backslash become \\xNN; longer than NAME_MAX_SHOWN,
    cut and ended with "..."."""
    out = "".join(chr(b) if 0x21 <= b <= 0x7E and b != 0x5C else f"\\x{b:02x}" for b in raw)
    return out if len(out) <= NAME_MAX_SHOWN else out[: NAME_MAX_SHOWN - 3] + "..."


def _read_at(dir_fd, name):
    """A cgroup file's text below dir_fd (never through a link), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def cgroup_figures(dir_fd):
    """One cgroup's own usage (hierarchical: it and everything below it):
    cpu_s (cpu.stat usage_usec), memory_peak_bytes (memory.peak, left out
    where the kernel has none), memory_max_bytes (None: max), oom, oom_kill,
    oom_group_kill (memory.events), oom_local and oom_kill_local
    (memory.events.local: this cgroup's own limit was reached / processes
    of this very cgroup the OOM killer took)."""
    out = {}
    cpu = parse_flat_keyed(_read_at(dir_fd, "cpu.stat"))
    if "usage_usec" in cpu:
        out["cpu_s"] = round(cpu["usage_usec"] / 1e6, 6)
    peak = _read_at(dir_fd, "memory.peak")
    if peak is not None and peak.strip().isdigit():
        out["memory_peak_bytes"] = int(peak)
    mx = _read_at(dir_fd, "memory.max")
    if mx is not None:
        mx = mx.strip()
        out["memory_max_bytes"] = int(mx) if mx.isdigit() else None
    ev = _read_at(dir_fd, "memory.events")
    if ev is not None:
        ev = parse_flat_keyed(ev)
        for k in ("oom", "oom_kill", "oom_group_kill"):
            out[k] = ev.get(k, 0)
        local = _read_at(dir_fd, "memory.events.local")
        if local is not None:
            local = parse_flat_keyed(local)
            out["oom_local"] = local.get("oom", 0)
            out["oom_kill_local"] = local.get("oom_kill", 0)
    return out


def ran_out_of_memory(fig):
    """cgroup_figures() -> did this cgroup reach its own memory limit and
    the OOM killer kill in it?  (Not: a process in it was a victim of an
    OOM of an ancestor, such as the whole job's.)"""
    return fig.get("oom_local", fig.get("oom", 0)) > 0 and fig.get("oom_kill", 0) > 0


def subtree_figures(top, limit):
    """cgroup_figures() of every cgroup below `top`, depth first in name
    order, each with "name" (its path below `top`, show_name()), at most
    `limit` of them -> (list, number of cgroups left out).  Directories are
    opened relative to their parent's fd with O_NOFOLLOW: a job renaming or
    linking things meanwhile cannot send the walk outside `top`."""
    out, left_out = [], 0
    try:
        top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return out, 0

    def walk(fd, prefix, depth):
        nonlocal left_out
        try:
            with os.scandir(fd) as it:
                names = sorted(os.fsencode(e.name) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for name in names:
            try:
                cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            try:
                path = prefix + b"/" + name if prefix else name
                if len(out) < limit:
                    rec = {"name": show_name(path)}
                    rec.update(cgroup_figures(cfd))
                    out.append(rec)
                else:
                    left_out += 1
                if depth < _WALK_MAX_DEPTH:
                    walk(cfd, path, depth + 1)
            finally:
                os.close(cfd)

    try:
        walk(top_fd, b"", 1)
    finally:
        os.close(top_fd)
    return out, left_out
