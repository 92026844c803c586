"""Where the cgroup hierarchies are: /proc/self/mountinfo and /proc/<pid>/cgroup
parsed (pure; fixture-tested) into a Layout (pure v2, v1-only or hybrid, and
this process's own cgroups); Record, the small value class of these records
and of Limits."""

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


class Record:
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


class ProcCgroup(Record):
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


class Mount(Record):
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


class Layout(Record):
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
