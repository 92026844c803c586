"""The mount plan handed to the shim: what the job sees besides the host's /.

Applied in the child in this order, after / was made a slave mount (so
nothing propagates back to the host): fresh /proc (pid ns), fresh /sys (net
ns), a private /tmp, then these mounts in the order given.  A mount point must
exist, except inside a tmpfs this plan mounted (the private /tmp or an earlier
tmpfs entry), where the shim creates it.  The shim walks each destination
once, in the job's view, without following links: a link anywhere on it, the
last component included, fails the job (a job's user may own a directory on
the way).  So the plan's own entries give their destinations with the host's
links resolved (a site's /var/run/starter is /run/starter).

A job's plan (job/run.py) is, in order:

    cgroup_view()     the job's own cgroup tree at /sys/fs/cgroup, read-only
    dev()             a fresh /dev: copies of a few host nodes, links,
                      its own devpts
    private_dirs()    /run (with the policy's passthrough), /dev/shm
                      (size-limited), /var/tmp, /run/lock, /run/user/UID,
                      /dev/mqueue: fresh, the job's own
    device_binds()    the devices it was given, at their host paths
    the spec's binds and tmpfs (a site sharing /var/tmp binds it here)
    seal_dev()        /dev read-only
    hide()            empty read-only mounts over the state directory
                      (and with it netd's socket): last, so nothing covers them

Besides the user's kinds (bind, ro-bind, tmpfs) there are three internal
ones the starter uses for the entries above, which a job file cannot ask
for: "fs", mount(2) with an explicit file system type, flags and data;
"link", a symlink, and "node", a device node, both made only inside a
tmpfs of the plan (the job's /dev).

A plain class rather than a dataclass: `import dataclasses` costs every job
~13 ms of start-up.
"""

import os
import stat

from starter.errors import SpecError
from starter.spec.values import host_path as _host_path, path as _check_path, show as _show

KINDS = ("bind", "ro-bind", "tmpfs")
_KIND_CODE = {"bind": 1, "ro-bind": 2, "tmpfs": 3, "fs": 4, "link": 5, "node": 6}  # SHIM_MOUNT_* in shim.h
# SHIM_MS_* in shim.h (the kernel's MS_* values)
FLAGS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "bind": 4096}
_SAFE = ("nosuid", "nodev", "noexec")


class Mount:
    """One mount.  kind: "bind" | "ro-bind" | "tmpfs"; dst: absolute path in the
    job's view; src: the source of a bind (absolute, in the starter's view);
    options: tmpfs options such as "size=64m,mode=1777"."""

    __slots__ = ("kind", "dst", "src", "options", "fstype", "flags", "optional")

    def __init__(self, kind, dst, src=None, options="", fstype=None, flags=(), optional=False):
        for name, value in (("kind", kind), ("dst", dst), ("src", src), ("options", options),
                            ("fstype", fstype), ("flags", tuple(flags)), ("optional", optional)):
            object.__setattr__(self, name, value)
        self._validate()

    @classmethod
    def fs(cls, fstype, dst, options="", flags=_SAFE, optional=False):
        """Internal: mount(fstype, dst, fstype, flags, options); fstype None
        with "remount" in flags changes the flags of what is at dst.
        optional: skipped when dst does not exist in the job's view."""
        return cls("fs", dst, None, options, fstype, flags, optional)

    @classmethod
    def link(cls, target, dst):
        """Internal: a symlink dst -> target, made inside a tmpfs of the plan
        (the job's /dev); the shim refuses one anywhere else."""
        return cls("link", dst, target)

    @classmethod
    def node(cls, dst, mode, rdev):
        """Internal: a device node at dst (type and permission bits `mode`,
        device number `rdev`, copied from a host node), made by the shim
        while root, inside a tmpfs of the plan (the job's /dev) only."""
        return cls("node", dst, None, f"{int(mode)}:{int(rdev)}")

    def _validate(self):
        if self.kind == "node":
            _check_path("mount.dst", self.dst)
            mode, _, rdev = str(self.options).partition(":")
            if self.src is not None or not (mode.isdigit() and rdev.isdigit()):
                raise SpecError("mount.options", f"bad device node for {_show(self.dst)}")
            return
        if self.kind == "link":
            _check_path("mount.dst", self.dst)
            if not isinstance(self.src, str) or not self.src or "\0" in self.src or self.options:
                raise SpecError("mount.src", f"bad link target for {_show(self.dst)}")
            return
        if self.kind == "fs":
            _check_path("mount.dst", self.dst)
            unknown = set(self.flags) - FLAGS.keys()
            if unknown or (self.fstype is None) != ("remount" in self.flags):
                raise SpecError("mount.flags", f"bad flags {self.flags!r} for {self.dst}")
            return
        if self.fstype is not None or self.optional or (
                self.flags and (self.kind != "bind" or set(self.flags) - {"nosuid"})):
            raise SpecError("mount.kind", f"a {self.kind} mount takes no fstype or flags")
        if self.kind not in KINDS:
            raise SpecError("mount.kind", f"{_show(self.kind)} is not one of {', '.join(KINDS)}")
        _check_path("mount.dst", self.dst)
        if self.kind == "tmpfs":
            if self.src is not None:
                raise SpecError("mount.src", f"a tmpfs on {_show(self.dst)} takes no source")
            if not isinstance(self.options, str) or "\0" in self.options:
                raise SpecError("mount.options", f"bad tmpfs options for {_show(self.dst)}")
        else:
            if self.src is None:
                raise SpecError("mount.src", f"a {self.kind} on {_show(self.dst)} needs a source")
            _check_path("mount.src", self.src)
            if self.options:
                raise SpecError("mount.options", f"{self.kind} takes no options (got {_show(self.options)})")

    @classmethod
    def parse(cls, kind, text):
        """From the command line: "SRC:DST" (or "PATH" for SRC=DST) for binds,
        "DST[:OPTIONS]" for tmpfs.  A relative SRC is resolved against the
        caller's working directory (and is then also the DST if none is given)."""
        if kind == "tmpfs":
            dst, _, opts = text.partition(":")
            return cls("tmpfs", dst, None, opts)
        src, sep, dst = text.partition(":")
        src = _host_path("mount.src", src) if src and kind in KINDS else src
        return cls(kind, dst if sep else src, src)

    def __setattr__(self, name, value):
        raise AttributeError("Mount is frozen")

    def __eq__(self, other):
        return type(other) is Mount and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return (self.kind, self.dst, self.src, self.options, self.fstype, self.flags, self.optional)

    def __repr__(self):
        extra = f", fstype={self.fstype!r}, flags={self.flags!r}" if self.kind == "fs" else (
            f", flags={self.flags!r}" if self.flags else "")
        return (f"Mount(kind={self.kind!r}, dst={self.dst!r}, src={self.src!r}, "
                f"options={self.options!r}{extra})")


def to_c(ffi, mounts, keep, fds=None):
    """A `struct shim_mount[]` for the shim.  Every buffer it points to is
    appended to `keep`, which must outlive the clone.  With `fds` (a list),
    each bind source is opened (O_PATH) here, resolved without following
    links (paths.open_path; a link is refused), and the fd, which the caller
    closes after the clone, goes to the shim as src_fd."""
    arr = ffi.new("struct shim_mount[]", max(len(mounts), 1))
    for i, m in enumerate(mounts):
        if not isinstance(m, Mount):
            raise SpecError("mounts", f"{m!r} is not a Mount")
        c = arr[i]
        c.kind = _KIND_CODE[m.kind]
        c.src_fd = -1
        dst = ffi.new("char[]", os.fsencode(os.path.normpath(m.dst)))
        keep.append(dst)
        c.dst = dst
        if m.src is not None:
            src = ffi.new("char[]", os.fsencode(m.src))
            keep.append(src)
            c.src = src
            if fds is not None and m.kind != "link":
                from starter.storage.paths import open_path

                fd, _st = open_path(m.src, "bind source")
                fds.append(fd)
                c.src_fd = fd
        if m.kind == "node":
            mode, _, rdev = m.options.partition(":")
            c.mode, c.rdev = int(mode), int(rdev)
        elif m.options:
            data = ffi.new("char[]", m.options.encode())
            keep.append(data)
            c.data = data
        if m.kind == "fs":
            if m.fstype is not None:
                fstype = ffi.new("char[]", m.fstype.encode())
                keep.append(fstype)
                c.fstype = fstype
            c.optional = 1 if m.optional else 0
        if m.flags:         # "fs": the mount's flags; "bind": nosuid on top of the source's
            c.flags = sum(FLAGS[f] for f in set(m.flags))
    keep.append(arr)
    return arr


# ---- the plan's own entries (job/run.py puts them around the spec's mounts) -----

CGROUP_ROOT = "/sys/fs/cgroup"
DEFAULT_STATE_DIR = "/run/starter"  # hidden too: another netd may listen there


def cgroup_view(view, writable=False):
    """Fresh cgroup mounts at /sys/fs/cgroup for the job's cgroup namespace,
    from the backend's view() [(fstype, path under /sys/fs/cgroup, options)].
    Mounted inside the namespace, each shows only the job's own subtree.
    Read-only unless `writable` (a delegated pilot job manages its subtree)."""
    flags = _SAFE if writable else _SAFE + ("ro",)
    out = []
    for fstype, rel, options in view:
        dst = CGROUP_ROOT + ("/" + rel if rel else "")
        if fstype == "tmpfs":  # holds the mount points; read-only once they are made
            out.append(Mount.fs("tmpfs", dst, options or "mode=755,size=64k", _SAFE))
        else:
            out.append(Mount.fs(fstype, dst, options, flags))
    if out and out[0].fstype == "tmpfs":
        out.append(Mount.fs(None, out[0].dst, "", ("remount", "bind", "ro") + _SAFE))
    elif out and out[0].dst == CGROUP_ROOT:
        # v2: one cgroup2 mount at /sys/fs/cgroup.  Where the job shares the
        # host's /sys (--net host) that is the host's cgroup2 mount, and the
        # same file system on its own root is refused (EBUSY): stack it on a
        # small tmpfs instead.
        out.insert(0, Mount.fs("tmpfs", CGROUP_ROOT, "mode=755,size=4k", _SAFE))
    return out


# No --memory: the kernel's tmpfs default (half of RAM, as on the host's
# /dev/shm); every page is charged to the job's memory cgroup either way.
SHM_SIZE_DEFAULT = None


# World-writable directories a job gets empty, private copies of.  Besides
# temp files, these are where same-uid daemons keep their sockets (tmux in
# /tmp, screen in /run/screen, systemd --user and D-Bus in /run/user/UID): a
# job that reached a host daemon of its own uid could have it start
# processes outside the job's cgroup.
PRIVATE_TMP_DIRS = ("/var/tmp", "/run/lock", "/run/screen")

# The job's own /run (private_run): the host's holds the sockets of daemons
# a job could ask to start processes outside its cgroup (an agent's, a
# session bus's, a same-uid helper's in a directory of its own), the
# system bus, root's 0600 sockets (which a uid-0 job may open), a resolver
# a --net none job could send names through, and the node's own leases.
RUN = "/run"
RUN_PASSTHROUGH = ("/run/munge",)   # the node policy's built-in defaults.run_passthrough


def private_run(through=RUN_PASSTHROUGH):
    """An empty tmpfs over /run (0755, nosuid, nodev), then each path of
    `through` (the node policy's defaults.run_passthrough) the host has,
    bound read-only at its own path: a socket needs no write access to be
    connected to.  A path with a link anywhere in it is left out (not
    followed).  RUN itself in `through`: the host's /run as it is, nothing
    mounted.  The mount points below it are made in the tmpfs by the
    shim (any later entry's too: /run/lock, /run/user/UID, a --bind)."""
    if RUN in through or not os.path.isdir(RUN):
        return []
    out = [Mount.fs("tmpfs", os.path.realpath(RUN), "mode=755", ("nosuid", "nodev"))]
    for p in through:
        if os.path.realpath(p) == p and os.path.lexists(p):
            out.append(Mount("ro-bind", p, p))
    return out


def is_under(path, d):
    return path == d or path.startswith(d.rstrip("/") + "/")


def scratch_binds(path, nosuid=False, private_run=True, always=False):
    """The scratch at its own path in the job's view: bound where the job's
    own /tmp (or /run) covers it, always in an image, and everywhere for a
    transient uid, whose scratch is nosuid in its view (a set-id file it
    makes there is honoured by no exec inside any job)."""
    covered = always or is_under(path, "/tmp") or (private_run and is_under(path, RUN))
    if not (covered or nosuid):
        return []
    return [Mount("bind", path, path, flags=("nosuid",) if nosuid else ())]


def nosuid_binds(mounts):
    """`mounts` with every writable bind nosuid (a transient uid's job)."""
    return [Mount("bind", m.dst, m.src, flags=("nosuid",)) if m.kind == "bind" else m for m in mounts]


RESOLV_CONF = "/etc/resolv.conf"


def resolv_conf(own=None, private_run=True, path=RESOLV_CONF):
    """What makes the job's /etc/resolv.conf.  own: a NAT job's own file,
    bound read-only at `path`, or, where the host's `path` is a link into
    /run (a systemd-resolved host: ../run/systemd/resolve/stub-resolv.conf),
    at the link's end inside the job's own /run, since the shim follows no
    link on a destination.  Without one (--net host): the host's file at
    that link's end, bound read-only into the job's /run; nothing where
    `path` is no such link."""
    target = os.path.realpath(path) if private_run and os.path.islink(path) else path
    inside = target != path and is_under(target, RUN)
    if own is not None:
        return [Mount("ro-bind", target if inside else path, own)]
    if inside and os.path.isfile(target):
        return [Mount("ro-bind", target, target)]
    return []


def private_dirs(uid, gid, shm_bytes=None, run_through=RUN_PASSTHROUGH):
    """The job's own /run (private_run(run_through)), /dev/shm (at most
    shm_bytes, else SHM_SIZE_DEFAULT), PRIVATE_TMP_DIRS and /run/user/UID,
    each only where the host has the directory, and a fresh mqueue at
    /dev/mqueue where the host mounts one (it shows the job's IPC
    namespace).  All tmpfs, nosuid and nodev; their pages are charged to
    the job's memory cgroup (the job faults them in) and go away with the
    job's mount namespace."""
    size = shm_bytes if shm_bytes is not None else SHM_SIZE_DEFAULT
    real = os.path.realpath  # the host's own links (an old /dev/shm -> /run/shm)
    out = private_run(run_through)
    if os.path.isdir("/dev/shm"):
        out.append(Mount.fs("tmpfs", real("/dev/shm"), "mode=1777" + (f",size={size}" if size else ""),
                            ("nosuid", "nodev")))
    for d in PRIVATE_TMP_DIRS:
        if os.path.isdir(d):
            out.append(Mount.fs("tmpfs", real(d), "mode=1777", ("nosuid", "nodev")))
    run_user = f"/run/user/{uid}"
    if os.path.isdir(run_user):
        out.append(Mount.fs("tmpfs", real(run_user), f"mode=700,uid={uid},gid={gid}", ("nosuid", "nodev")))
    if os.path.ismount("/dev/mqueue"):
        out.append(Mount.fs("mqueue", "/dev/mqueue", "", _SAFE))
    return out


# The job's /dev: a fresh tmpfs with only what every program
# expects, never the host's whole /dev (fuse, kvm, net/tun, loop, kmsg, every
# tty).  Its nodes are copies of the host's (type, mode, number), made by the
# shim while it is still root (the job never has CAP_MKNOD): six binds cost
# ~0.4 ms of every start (open_tree clones), six mknods next to nothing.  The
# nodes of --device/--gpus are bound (they may live anywhere).  The cgroup's
# device rules (DEV_RULES, dev_rules()) are what the kernel enforces,
# whatever path a node is reached by.
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"))
# What the kernel lets every job open (its cgroup's device rules, by any
# path): (type, major, minor or None for any, access of "rwm").  The nodes
# above and the ptys of the job's own devpts: null, zero, full, random,
# urandom, tty, ptmx, pts/N.
DEV_RULES = (
    ("c", 1, 3, "rwm"), ("c", 1, 5, "rwm"), ("c", 1, 7, "rwm"), ("c", 1, 8, "rwm"),
    ("c", 1, 9, "rwm"), ("c", 5, 0, "rwm"), ("c", 5, 2, "rwm"), ("c", 136, None, "rwm"),
)
DEV_TMPFS = "mode=755,size=64k,nr_inodes=4096"
_DEV_FLAGS = ("nosuid", "noexec")
PTYS_DEFAULT = 1024     # the node policy's defaults.ptys


def dev(ptys=PTYS_DEFAULT, bind_nodes=False):
    """The job's /dev: a tmpfs (0755, nosuid, noexec), copies of the
    DEV_NODES the host has (character devices only), the DEV_LINKS, a devpts instance
    of its own (newinstance: its ptys are counted apart from the host's,
    at most `ptys`).  private_dirs() then mounts /dev/shm and
    /dev/mqueue on it; seal_dev() makes it read-only once the spec's binds
    (an admin's --bind /dev/xyz) have their mount points.  bind_nodes:
    the host's nodes bound instead of copied (a starter without root: a
    user namespace may not mknod)."""
    out = [Mount.fs("tmpfs", "/dev", DEV_TMPFS, _DEV_FLAGS)]
    for name in DEV_NODES:
        p = "/dev/" + name
        try:
            st = os.stat(p, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append(Mount("bind", p, p) if bind_nodes else
                       Mount.node(p, stat.S_IFCHR | stat.S_IMODE(st.st_mode), st.st_rdev))
    out += [Mount.link(target, "/dev/" + name) for name, target in DEV_LINKS]
    out.append(Mount.fs("devpts", "/dev/pts", f"newinstance,ptmxmode=0666,mode=0620,max={int(ptys)}",
                        ("nosuid", "noexec")))
    return out


def device_binds(nodes):
    """The nodes of --device and --gpus (host paths), each bound at its own
    path: after private_dirs(), so that one under /var/tmp lands in the
    job's own /var/tmp, not under it."""
    return [Mount("bind", p, p) for p in dict.fromkeys(nodes)]


def dev_rules(devices=()):
    """The job's device allow list for JobCgroup.set_devices: DEV_RULES,
    then one rule per device given ((path, type, major, minor, access),
    starter/isolate/devices.py), in order, each once."""
    out = list(DEV_RULES)
    for _path, kind, major, minor, access in devices:
        rule = (kind, major, minor, access)
        if rule not in out:
            out.append(rule)
    return out


def seal_dev():
    """The job's /dev tmpfs read-only (its mounts, /dev/shm and /dev/pts
    among them, keep their own flags): a uid-0 job cannot add files there.
    Not nodev: where an admin's --bind /dev covered it, this remounts that
    bind, whose nodes (the cgroup still decides which) must stay usable."""
    return [Mount.fs(None, "/dev", "", ("remount", "bind", "ro") + _DEV_FLAGS)]


# Keys are not namespaced: /proc/keys lists every key the reader may view,
# including those of other jobs of the same uid (a user's own keys grant it
# "view").  The job sees an empty file there, like docker's masked paths.
MASKED_FILES = ("/proc/keys",)


def hide(paths, files=MASKED_FILES):
    """An empty, read-only, mode-0 tmpfs over each existing directory in
    `paths`: the job can neither list nor reach what is below (state
    entries, locks, netd's socket), whatever its uid.  Skipped where the
    job's view has no such path (a state directory under the private /tmp).
    /dev/null, read-only, over each of `files`."""
    out = [Mount("ro-bind", f, "/dev/null") for f in files if os.path.exists(f)]
    # The host's links resolved (a state directory given as /var/run/starter):
    # the shim follows none on a destination.
    for p in dict.fromkeys(os.path.realpath(p) for p in paths if p):
        if os.path.isdir(p):
            out.append(Mount.fs("tmpfs", p, "mode=000,size=4k,nr_inodes=2", _SAFE + ("ro",),
                                optional=True))
    return out
