"""The C side of a job's spec: ChildSpec (what to run and how to isolate
it) and build(), its marshalling into a cffi `struct shim_spec` (every
buffer kept alive by the caller's list); the namespace flags and the
enter slots.  ns.py hands the result to the shim.
"""

import os

from starter.isolate import mounts as _mounts
from starter._native import cap_last_cap, ffi, lib
from starter.errors import SpecError
from starter.spec.values import MAX_NUMERIC_ID  # (uid_t)-1 means "unchanged" to setresuid

CLONE_NEWNS = lib.SHIM_NEWNS
CLONE_NEWUTS = lib.SHIM_NEWUTS
CLONE_NEWIPC = lib.SHIM_NEWIPC
CLONE_NEWPID = lib.SHIM_NEWPID
CLONE_NEWNET = lib.SHIM_NEWNET
CLONE_NEWCGROUP = lib.SHIM_NEWCGROUP
# "cgroup" is unshare()d by the child after the release byte, so that it is
# rooted at the job's cgroups in every hierarchy (see child_main in shim_clone.c).
NAMESPACES = {"pid": CLONE_NEWPID, "net": CLONE_NEWNET, "mnt": CLONE_NEWNS,
              "uts": CLONE_NEWUTS, "ipc": CLONE_NEWIPC, "cgroup": CLONE_NEWCGROUP}
DEFAULT_NAMESPACES = frozenset({"pid", "net", "mnt"})
# shim_spec.enter_ns_fds's slots
NS_SLOTS = {"ipc": lib.SHIM_NS_IPC, "uts": lib.SHIM_NS_UTS, "net": lib.SHIM_NS_NET,
             "pid": lib.SHIM_NS_PID, "cgroup": lib.SHIM_NS_CGROUP, "mnt": lib.SHIM_NS_MNT}



class ChildSpec:
    """What to run and how to isolate it.  Plain class (no dataclasses import
    on the hot path); fields as documented in the project brief."""

    __slots__ = ("argv", "env", "cwd", "uid", "gid", "groups", "namespaces", "hostname",
                 "mounts", "private_tmp", "keep_fds", "init", "cgroup_fd",
                 "die_with_parent", "drop_privileges", "stdio", "cwd_fallbacks", "seccomp",
                 "userns_root", "reset_inherited", "rlimits", "cgroupns_at_clone", "join", "image",
                 "keep_groups")

    def __init__(self, argv, env, cwd="/", uid=0, gid=0, groups=(),
                 namespaces=DEFAULT_NAMESPACES, hostname=None, mounts=(), private_tmp=True,
                 keep_fds=(), init=False, cgroup_fd=None, die_with_parent=True,
                 drop_privileges=True, stdio=(None, None, None), cwd_fallbacks=(), seccomp=None,
                 userns_root=False, reset_inherited=True, rlimits=None, cgroupns_at_clone=False, join=None,
                 image=None, keep_groups=False):
        self.argv = argv              # list[str]; argv[0] searched in env["PATH"]
        self.env = env                # dict[str, str]: exactly the job's environment
        self.cwd = cwd
        self.uid = uid
        self.gid = gid
        self.groups = groups          # supplementary groups, exactly these
        self.namespaces = namespaces  # subset of NAMESPACES
        self.hostname = hostname      # needs "uts"
        self.mounts = mounts          # tuple[Mount]; needs "mnt"
        self.private_tmp = private_tmp  # fresh tmpfs /tmp; only with "mnt"
        self.keep_fds = keep_fds      # besides 0-2, open in the job (CLOEXEC cleared)
        self.init = init              # shim stays PID 1, job is PID 2
        self.cgroup_fd = cgroup_fd    # cgroup2 dir fd: CLONE_INTO_CGROUP
        self.die_with_parent = die_with_parent
        self.drop_privileges = drop_privileges  # False: keep uid 0 and caps (ns-exec)
        self.stdio = stdio            # fds to become the job's 0, 1, 2 (None: inherit)
        self.cwd_fallbacks = cwd_fallbacks  # cwd=None: the first of these the job can chdir to
        self.seccomp = seccomp        # starter.isolate.seccomp.Filter installed before execve, or None
        self.userns_root = userns_root  # uid/gid 0 in a new user namespace mapped to uid/gid
        self.reset_inherited = reset_inherited  # oom_score_adj, nice, sched, affinity, umask...
        self.rlimits = rlimits        # ((SHIM_RLIMIT index, soft, hard, asked), ...); None: keep
        # cgroup namespace made by clone3 itself, rooted at cgroup_fd's cgroup
        # (--delegate: the starter then moves the child into a leaf below it)
        self.cgroupns_at_clone = cgroupns_at_clone
        # {"net": fd, "ipc": fd, "pid": fd}: namespaces to join, not make (a
        # --net job task joining its part on the node: starter/net/part.py)
        self.join = join or {}
        # the starter's supplementary groups stay (its user namespace denies
        # setgroups: a starter without root, without subordinate ids)
        self.keep_groups = keep_groups
        # --image: (the image's squashfs, a detached mount's fd; tmpfs size
        # or None; the directory for the job's writes, an fd, or None: a
        # tmpfs): the child makes it its root (native/shim_image.c); None:
        # the host's root
        self.image = image

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"ChildSpec({fields})"


def build(spec, keep, entering=False, src_fds=None):
    """A `struct shim_spec` for `spec`; every buffer goes to `keep`."""
    argv = spec.argv
    if not argv or not isinstance(argv, (list, tuple)):
        raise SpecError("argv", "the command is empty")
    env = spec.env
    if not isinstance(env, dict):
        raise SpecError("env", "must be a dict of str to str")
    names = spec.namespaces
    unknown = set(names) - NAMESPACES.keys()
    if unknown:
        raise SpecError("namespaces", f"unknown {', '.join(sorted(unknown))}; "
                        f"choose from {', '.join(sorted(NAMESPACES))}")
    nsflags = 0
    for n in names:
        nsflags |= NAMESPACES[n]
    if spec.hostname is not None and "uts" not in names:
        raise SpecError("hostname", "needs the uts namespace")
    if spec.mounts and "mnt" not in names:
        raise SpecError("mounts", "need the mnt namespace (they would land on the host)")
    if len(spec.mounts) > lib.SHIM_MAX_MOUNTS:
        raise SpecError("mounts", f"at most {lib.SHIM_MAX_MOUNTS}")
    for field in ("uid", "gid"):
        v = getattr(spec, field)
        if not isinstance(v, int) or not 0 <= v <= MAX_NUMERIC_ID:
            raise SpecError(field, f"{v!r} is not a valid id")
    for g in spec.groups:
        if not isinstance(g, int) or not 0 <= g <= MAX_NUMERIC_ID:
            raise SpecError("groups", f"{g!r} is not a valid group id")
    if len(spec.groups) > 65536:
        raise SpecError("groups", "more than 65536 groups")
    kfds = sorted(set(spec.keep_fds))
    if len(kfds) > lib.SHIM_MAX_KEEP:
        raise SpecError("keep_fds", f"at most {lib.SHIM_MAX_KEEP}")
    for fd in kfds:
        if not isinstance(fd, int) or fd < 3:
            raise SpecError("keep_fds", f"{fd!r}: 0-2 are always kept; give fds >= 3")
        try:
            os.fstat(fd)
        except OSError:
            raise SpecError("keep_fds", f"fd {fd} is not open") from None
    stdio = tuple(spec.stdio)
    if len(stdio) != 3:
        raise SpecError("stdio", "give three fds (or None) for stdin, stdout, stderr")
    for fd in stdio:
        if fd is not None and (not isinstance(fd, int) or fd < 0):
            raise SpecError("stdio", f"{fd!r} is not a fd")
    if spec.cgroup_fd is not None and (not isinstance(spec.cgroup_fd, int) or spec.cgroup_fd < 0):
        raise SpecError("cgroup_fd", f"{spec.cgroup_fd!r} is not a fd")
    if spec.userns_root and (entering or not spec.drop_privileges or spec.uid == 0):
        raise SpecError("userns_root", "needs a job that drops privileges to a non-root uid")
    rlimits = tuple(spec.rlimits or ())
    if rlimits and not spec.reset_inherited:
        raise SpecError("rlimits", "are set with reset_inherited")
    for r in rlimits:
        if (len(r) != 4 or not all(isinstance(v, int) for v in r)
                or not 0 <= r[0] < lib.SHIM_NRLIMITS or not 0 <= r[1] <= r[2] < 2**64):
            raise SpecError("rlimits", f"{r!r} is not (resource, soft, hard, asked), soft <= hard")

    c = ffi.new("struct shim_spec *")
    keep.append(c)
    c.argv = _strv("argv", argv, keep)
    c.envp = _strv("env", [_env_item(k, v) for k, v in env.items()], keep)
    path = env.get("PATH")
    c.path = _cstr("env", path, keep) if path is not None else ffi.NULL
    c.cwd = _cstr("cwd", spec.cwd, keep) if spec.cwd else ffi.NULL
    c.uid = spec.uid
    c.gid = spec.gid
    groups = ffi.new("unsigned int[]", list(spec.groups) or [0])
    keep.append(groups)
    c.groups = groups
    c.ngroups = len(spec.groups)
    c.nsflags = nsflags
    c.hostname = _cstr("hostname", spec.hostname, keep) if spec.hostname is not None else ffi.NULL
    if not entering and "mnt" in names:
        c.private_tmp = 1 if spec.private_tmp else 0
        c.mounts = _mounts.to_c(ffi, spec.mounts, keep, src_fds)
        c.nmounts = len(spec.mounts)
    c.stdio = [-1 if fd is None else fd for fd in stdio]
    kf = ffi.new("int[]", kfds or [0])
    keep.append(kf)
    c.keep_fds = kf
    c.nkeep = len(kfds)
    c.init = 1 if spec.init else 0
    c.cgroup_fd = -1 if spec.cgroup_fd is None else spec.cgroup_fd
    c.die_with_parent = 1 if spec.die_with_parent else 0
    c.drop_privileges = 1 if spec.drop_privileges else 0
    c.cap_last_cap = cap_last_cap()
    c.enter_ns_fds = [-1] * lib.SHIM_NNS
    if spec.join:
        if entering or set(spec.join) - {"net", "ipc", "pid"} or set(spec.join) & set(names):
            raise SpecError("join", "only the net, ipc and pid namespaces, and not made as well")
        for name, fd in spec.join.items():
            if not isinstance(fd, int) or fd < 0:
                raise SpecError("join", f"{name}: {fd!r} is not a fd")
            c.enter_ns_fds[NS_SLOTS[name]] = fd
    if not spec.cwd and spec.cwd_fallbacks:
        c.cwd_fallbacks = _strv("cwd", list(spec.cwd_fallbacks), keep)
        c.ncwd_fallbacks = len(spec.cwd_fallbacks)
    if spec.seccomp is not None:  # the job's process installs it last, before execve
        n = len(spec.seccomp.bpf)
        if not 0 < n <= lib.SHIM_SECCOMP_MAX_BYTES or n % 8:
            raise SpecError("seccomp", f"a BPF program of {n} bytes is not 1..4096 instructions")
        bpf = ffi.from_buffer(spec.seccomp.bpf)
        keep.append(bpf)
        c.seccomp_filter = bpf
        c.seccomp_len = len(spec.seccomp.bpf)
        c.seccomp_flags = spec.seccomp.flags
    c.userns_root = 1 if spec.userns_root else 0
    c.reset_inherited = 1 if spec.reset_inherited else 0
    c.cgroupns_at_clone = 1 if spec.cgroupns_at_clone else 0
    c.keep_groups = 1 if spec.keep_groups else 0
    if spec.image is not None:
        if entering or "mnt" not in names:
            raise SpecError("image", "a root of its own needs a mount namespace of the job's own")
        fd, size, upper = spec.image
        c.image, c.image_fd = (1, fd) if upper is None else (2, fd)
        c.image_upper_fd = -1 if upper is None else upper
        c.image_tmpfs_size = _cstr("image", str(size), keep) if size else ffi.NULL
    rl = ffi.new("struct shim_rlimit[]", max(len(rlimits), 1))
    keep.append(rl)
    for i, (res, soft, hard, asked) in enumerate(rlimits):
        rl[i].resource, rl[i].soft, rl[i].hard, rl[i].asked = res, soft, hard, 1 if asked else 0
    c.rlimits = rl
    c.nrlimits = len(rlimits)
    return c


def _cstr(field, s, keep):
    b = os.fsencode(s)
    if b"\0" in b:
        raise SpecError(field, f"{s!r} contains a NUL byte")
    p = ffi.new("char[]", b)
    keep.append(p)
    return p


def _env_item(k, v):
    if not isinstance(k, str) or not k or "=" in k:
        raise SpecError("env", f"bad variable name {k!r}")
    if not isinstance(v, str):
        raise SpecError("env", f"{k}: value must be a string")
    return f"{k}={v}"


def _strv(field, items, keep):
    ptrs = [_cstr(field, s, keep) for s in items]
    ptrs.append(ffi.NULL)
    arr = ffi.new("char *[]", ptrs)
    keep.append(arr)
    return arr
