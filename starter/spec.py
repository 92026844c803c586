"""The job description: every field, validated once, here.

A JobSpec comes from the command line, from a job file (JSON), or both (the
command line overrides the file).  Everything that later reaches the kernel,
a file name, nft or a cgroup path has been checked in this module; other
modules trust a JobSpec.

Plain classes with __slots__ instead of dataclasses: `import dataclasses`
costs ~13 ms of interpreter time here, and every job pays it.
"""

import os

from starter import mounts as M
from starter import values as V
from starter.errors import SpecError

MAX_ARGS = 4096
MAX_ENV = 4096
MAX_MEMORY = V.MAX_SIZE
MAX_CPUS = 4096
MAX_PIDS = 4194304            # pid_max limit of the kernel
MAX_WALL = 366 * 86400
MAX_GRACE = 3600
MIN_DISK = 1 << 20             # --disk: smaller than an ext4 image's metadata is no use
MAX_DISK_INODES = (1 << 32) - 1
KILL_TIMEOUT = 10.0           # $STARTER_KILL_TIMEOUT: then the job's processes are "unkillable"

# The job's user when no --user is given: a system account of its own, with
# its own group, no home, no login shell, owning no files (scripts/setup).
JOB_ACCOUNT = "starter-job"
JOB_ACCOUNT_CMD = (f"useradd --system --user-group --no-create-home --home-dir /nonexistent "
                   f"--shell /usr/sbin/nologin {JOB_ACCOUNT}")

NET_MODES = ("none", "host", "nat")
IPV6_MODES = ("auto", "on", "off")   # network.ipv6 / --ipv6 (see starter.net.NetConfig)
REPORT_FORMATS = ("json", "classad")
ACTIONS = ("vacate", "suspend", "resume", "kill")
OOM_POLICIES = ("kill", "continue")
# The PATH a job (and `starter enter`, `ns-exec`) gets unless one is given.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"



class Spec:
    """Base for the small value classes below: slots, keyword init, repr, eq."""

    __slots__ = ()

    def __init__(self, **kw):
        for name in self.__slots__:
            object.__setattr__(self, name, kw.pop(name, self._defaults().get(name)))
        if kw:
            raise TypeError(f"unknown fields {sorted(kw)}")

    @classmethod
    def _defaults(cls):
        return cls.DEFAULTS

    def replace(self, **kw):
        vals = {n: getattr(self, n) for n in self.__slots__}
        vals.update(kw)
        return type(self)(**vals)

    def as_dict(self):
        return {n: getattr(self, n) for n in self.__slots__}

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other):
        return type(self) is type(other) and self.as_dict() == other.as_dict()

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"


class Limits(Spec):
    """Resource limits.  None means "not limited by the starter"."""

    __slots__ = ("memory", "cpus", "cpu_weight", "pids", "wall_time", "cpuset", "mems", "io_max", "disk",
                 "disk_inodes")
    DEFAULTS = {"io_max": ()}


class Network(Spec):
    """mode none: own namespace, loopback only.  host: the host's network
    (no namespace).  nat: own namespace + veth + NAT with LAN/WAN counters;
    ipv6 auto|on|off and pool6 (a ULA CIDR) add an IPv6 address beside the
    IPv4 one (starter.net.NetConfig)."""

    __slots__ = ("mode", "lan", "pool", "uplink", "allow_host_ports", "resolver", "ipv6", "pool6")
    DEFAULTS = {"mode": "none", "lan": (), "uplink": (), "allow_host_ports": (), "ipv6": "auto"}


class JobSpec(Spec):
    __slots__ = (
        "id", "argv", "user", "group", "uid", "gid", "groups", "home", "cwd",
        "env", "hostname", "init", "mounts", "limits", "network", "report",
        "report_format", "events", "grace", "on_signal", "state_dir", "cgroup_parent",
        "scratch", "execute_dir", "keep_scratch", "manifest",
        "manifest_digest", "inputs",
        "seccomp", "allow_userns", "userns_root", "rlimits",
        "oom_policy", "kill_timeout", "delegate", "transient", "escape",
        "devices", "gpus", "ptys",
    )
    DEFAULTS = {
        "grace": 10.0, "init": False, "mounts": (), "env": None, "groups": (),
        "on_signal": (), "keep_scratch": False, "report_format": "json",
        "seccomp": "default", "allow_userns": False, "userns_root": False, "rlimits": (),
        "oom_policy": "kill", "kill_timeout": KILL_TIMEOUT,
        "delegate": False, "transient": None, "escape": "report",
        "devices": (), "gpus": (), "ptys": M.PTYS_DEFAULT,
    }


# ---------------------------------------------------------------- checks
# The rules for single values live in values.py (V); here what a job spec adds.


# /proc and /sys hold magic links (/proc/self/cwd, /proc/1/root, /proc/PID/fd/N)
# that lead to directories of other processes and namespaces without any
# path to them; /dev/fd is a link into /proc.  No job starts there.
_MAGIC_DIRS = ("/proc", "/sys", "/dev/fd")


def check_cwd(field, value):
    value = V.path(field, value)
    norm = "/" + "/".join(c for c in value.split("/") if c not in ("", "."))
    for d in _MAGIC_DIRS:
        if norm == d or norm.startswith(d + "/"):
            raise SpecError(field, f"{V.show(value)} is under {d}, whose magic links lead outside the job",
                            "give a real directory, e.g. the job's scratch")
    return value


def state_dir(value=None):
    """--state-dir, else $STARTER_STATE_DIR, else /run/starter."""
    return V.host_path("state-dir", value or os.environ.get("STARTER_STATE_DIR") or "/run/starter")


def parse_env(field, items):
    env = {}
    for item in items:
        if isinstance(item, tuple):
            k, v = item
        else:
            item = V.string(field, item)
            k, sep, v = item.partition("=")
            if not sep:
                raise SpecError(field, f"{V.show(item)} must be KEY=VALUE")
        env[V.env_name(field, k)] = V.string(field, v)
    if len(env) > MAX_ENV:
        raise SpecError(field, "too many variables")
    return env


def parse_mount(field, kind, value):
    """--bind SRC[:DST]  --ro-bind SRC[:DST]  --tmpfs DST[:OPTIONS]: Mount.parse
    splits and checks the paths; here what only a job spec asks on top."""
    if kind not in M.KINDS:
        raise SpecError(field, f"unknown mount type {V.show(kind)} (one of {', '.join(M.KINDS)})")
    try:
        m = M.Mount.parse(kind, V.string(field, value))
    except SpecError as e:
        raise SpecError(field, e.detail, e.hint) from None
    if kind == "tmpfs":
        for opt in filter(None, m.options.split(",")):
            if opt.partition("=")[0] not in ("size", "mode", "nr_inodes"):
                raise SpecError(field, f"tmpfs option {V.show(opt)} not allowed (size, mode, nr_inodes)")
    else:  # the starter mounts it as root: no link of anyone's is followed
        from starter import paths

        try:
            os.close(paths.open_path(m.src, "bind source")[0])
        except paths.LinkError as e:
            raise SpecError(field, e.args[0], e.hint) from None
        except FileNotFoundError:
            raise SpecError(field, f"{V.show(m.src)} does not exist") from None
    return m


def parse_on_signal(field, items):
    """USR1=vacate -> ((10, "vacate"),)"""
    import _signal

    out = []
    for item in items:
        name, sep, action = V.string(field, item).partition("=")
        if not sep or action not in ACTIONS:
            raise SpecError(field, f"{V.show(item)} must be SIGNAL=ACTION, ACTION one of {', '.join(ACTIONS)}")
        name = name.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        # Only signal names: _signal also holds SIG_DFL, SIG_IGN and the
        # sigprocmask constants (SIG_BLOCK ...), which are not signals.
        num = getattr(_signal, name, None) if name[3:].isalnum() and name.isascii() else None
        if (not isinstance(num, int) or not 0 < num < _signal.NSIG
                or num in (_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD)):
            raise SpecError(field, f"{V.show(item)}: {V.show(name)} cannot be used")
        out.append((num, action))
    return tuple(out)


# The resource limits every job starts with (issue 10), whatever the node
# daemon that started the starter had: systemd's defaults for a service.
# Order and names as native/shim.h's SHIM_RLIMIT_*.  --rlimit changes them.
RLIMIT_NAMES = ("cpu", "fsize", "data", "stack", "core", "rss", "nproc", "nofile", "memlock",
                "as", "locks", "sigpending", "msgqueue", "nice", "rtprio", "rttime")
RLIM_INFINITY = V.RLIM_INFINITY
DEFAULT_RLIMITS = {
    "stack": (8 << 20, RLIM_INFINITY),
    "core": (0, RLIM_INFINITY),
    "nofile": (1024, 524288),       # select() needs fds < 1024; raise the soft limit at will
    "memlock": (8 << 20, 8 << 20),
    "sigpending": None,             # the kernel's own default: threads-max / 2
    "msgqueue": (819200, 819200),   # the kernel's default, bytes in POSIX message queues
    "nice": (0, 0),
    "rtprio": (0, 0),
}                                   # all others unlimited (nproc too: the pids cgroup limits)


def parse_rlimit(field, item):
    """nofile=4096 | nofile=1024:65536 | core=unlimited | stack=16M -> (name, soft, hard)."""
    name, sep, value = V.string(field, item).partition("=")
    name = name.strip().lower()
    if name.startswith("rlimit_"):
        name = name[7:]
    if not sep or name not in RLIMIT_NAMES:
        raise SpecError(field, f"{V.show(item)} must be NAME=SOFT[:HARD], NAME one of {', '.join(RLIMIT_NAMES)}")
    soft_s, colon, hard_s = value.partition(":")
    soft = V.rlimit_value(field, name, soft_s)
    hard = V.rlimit_value(field, name, hard_s) if colon else soft
    if soft > hard:
        raise SpecError(field, f"{V.show(item)}: the soft limit is above the hard limit")
    return (name, soft, hard)


def rlimit_table(overrides=()):
    """The job's full limit table: ((SHIM_RLIMIT index, soft, hard, asked), ...),
    DEFAULT_RLIMITS with the (name, soft, hard) overrides on top (asked=True:
    the shim fails rather than cap them at the starter's own hard limit)."""
    given = {name: (soft, hard) for name, soft, hard in overrides}
    table = []
    for i, name in enumerate(RLIMIT_NAMES):
        if name in given:
            table.append((i, *given[name], True))
            continue
        lim = DEFAULT_RLIMITS.get(name, (RLIM_INFINITY, RLIM_INFINITY))
        if lim is None:  # sigpending
            try:
                with open("/proc/sys/kernel/threads-max", "rb") as f:
                    n = max(int(f.read()) // 2, 1)
            except (OSError, ValueError):
                n = 63936  # threads-max / 2 of a machine with 4 GiB
            lim = (n, n)
        table.append((i, lim[0], lim[1], False))
    return tuple(table)


# What common runtimes read for their thread pools' size (OpenMP, the BLAS
# libraries, numexpr, numba, Julia, Go, Python 3.13's os.cpu_count()): set
# for a job limited to some CPUs (--cpus, --cpuset), unless its --env sets
# them.  Without them a job that sees 64 CPUs starts 64 threads on 2 CPUs' worth
# of quota.  The list is docs/reference.md's ("Thread-count variables").
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS",
               "JULIA_NUM_THREADS", "GOMAXPROCS", "PYTHON_CPU_COUNT")


def thread_count(cpus, cpuset):
    """The value of THREAD_VARS: ceil(--cpus), the number of CPUs in
    --cpuset, the smaller of the two when both are given; None: neither."""
    counts = []
    if cpus is not None:
        import math         # built in; cgroups.base has it loaded already

        counts.append(max(1, math.ceil(cpus)))
    if cpuset is not None:
        counts.append(len(cpuset))
    return min(counts) if counts else None


IO_KEYS = ("rbps", "wbps", "riops", "wiops")   # as cgroups.base.IO_KEYS (not imported: the run path)
MAX_IOPS = 1 << 40


def parse_io_max(field, item):
    """DEVICE:KEY=VALUE[,KEY=VALUE...] (KEY rbps, wbps: bytes/s, a size like
    10M; riops, wiops: operations/s) -> (path, major, minor, rbps, wbps,
    riops, wiops).  The device is a block device node, looked up by stat()
    (links followed: /dev/disk/by-id/... names are links); the path may
    hold ':' (by-path names do), the limits never do."""
    import stat

    item = V.string(field, item)
    dev, sep, rest = item.rpartition(":")
    if not sep or not dev or not rest:
        raise SpecError(field, f"{V.show(item)} must be DEVICE:KEY=VALUE[,KEY=VALUE...] "
                        f"(KEY one of {', '.join(IO_KEYS)}), e.g. /dev/sda:rbps=10M,wiops=100")
    rates = dict.fromkeys(IO_KEYS)
    for pair in rest.split(","):
        k, eq, v = pair.strip().partition("=")
        if not eq or k not in rates:
            raise SpecError(field, f"{V.show(item)}: {V.show(pair)} must be KEY=VALUE, KEY one of {', '.join(IO_KEYS)}")
        rates[k] = V.size(f"{field} {k}", v) if k.endswith("bps") else V.number(f"{field} {k}", v, 1, MAX_IOPS, integer=True)
    dev = V.path(field, dev)
    try:
        st = os.stat(dev)
    except OSError as e:
        raise SpecError(field, f"{V.show(dev)}: {e.strerror}") from None
    if not stat.S_ISBLK(st.st_mode):
        raise SpecError(field, f"{V.show(dev)} is not a block device", "name a disk's device node, e.g. /dev/sda")
    return (dev, os.major(st.st_rdev), os.minor(st.st_rdev), *rates.values())


def parse_host_port(field, value):
    proto, sep, port = V.string(field, value).partition(":")
    if not sep or proto not in ("tcp", "udp"):
        raise SpecError(field, f"{V.show(value)} must be tcp:PORT or udp:PORT")
    return (proto, V.number(field, port, 1, 65535, integer=True))


def resolve_user(user, group):
    """-> (uid, gid, groups, home, name).  Numeric ids are taken as given.
    No user: the JOB_ACCOUNT, never the starter's own uid (root)."""
    import pwd
    import grp

    if user is None:
        try:
            pw = pwd.getpwnam(JOB_ACCOUNT)
        except KeyError:
            raise SpecError("user", f"no --user given and the default job account {JOB_ACCOUNT!r} "
                            f"does not exist", f"pass --user USER, or create the account: "
                            f"scripts/setup, or {JOB_ACCOUNT_CMD}") from None
        if pw.pw_uid == 0 or pw.pw_gid == 0:
            raise SpecError("user", f"the default job account {JOB_ACCOUNT!r} has uid or gid 0",
                            "it must be an unprivileged system account; fix it, or pass --user USER")
        uid, gid, name, home = pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir
        groups = tuple(sorted(g for g in os.getgrouplist(name, gid) if g != gid))
    else:
        numeric = V.is_numeric_id(user)
        try:
            pw = pwd.getpwuid(V.numeric_id("user", user)) if numeric else pwd.getpwnam(V.name("user", user))
        except KeyError:
            if numeric:
                uid, gid, name, home, groups = int(user), int(user), None, "/", ()
                pw = None
            else:
                raise SpecError("user", f"no such user {V.show(user)}") from None
        if pw is not None:
            uid, gid, name, home = pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir
            groups = tuple(sorted(g for g in os.getgrouplist(name, gid) if g != gid))
    if group is not None:
        try:
            gid = V.numeric_id("group", group) if V.is_numeric_id(group) else grp.getgrnam(V.name("group", group)).gr_gid
        except KeyError:
            raise SpecError("group", f"no such group {V.show(group)}") from None
        groups = ()
    return uid, gid, groups, home, name


def caller_user(caller):
    """-> (uid, gid, groups, home, name) of a caller that is not root."""
    import pwd

    try:
        pw = pwd.getpwuid(caller.uid)
        home, name = pw.pw_dir, pw.pw_name
    except KeyError:
        home, name = "/", None
    return caller.uid, caller.gid, tuple(sorted(set(caller.groups) - {caller.gid})), home, name


# ---------------------------------------------------------------- building

# Option name -> (JobSpec path, parser).  The job file uses the same names.
def build(cli, job_file=None, policy=None, caller=None):
    """Merge a job file (dict, already parsed) and command-line values (dict
    of option name -> value, only those given) into a checked JobSpec, with
    the node policy's defaults where neither gives a value; for a caller
    that is not root (starter/caller.py), the policy's [callers] table
    decides what it may ask for, and the job runs as the caller."""
    raw = dict(_flatten_file(job_file)) if job_file else {}
    for k, v in cli.items():
        if k in ("env", "mounts", "lan", "uplink", "allow-host-port", "on-signal", "rlimit", "io-max",
                 "device") and k in raw:
            if not isinstance(raw[k], list):    # as the file gives it alone, checked there
                raise SpecError(k, f"must be a list in the job file, got {type(raw[k]).__name__}")
            raw[k] = raw[k] + list(v)             # repeatable: file first, then flags
        else:
            raw[k] = v
    if policy is not None:
        policy.apply(raw, caller)
    return _make(raw, caller)


_FILE_KEYS = {
    "id": "id", "command": "command", "user": "user", "group": "group",
    "cwd": "cwd", "env": "env", "hostname": "hostname", "init": "init",
    "limits": None, "network": None, "mounts": None, "report": "report",
    "report_format": "report-format",
    "events": "events", "grace": "grace", "on_signal": "on-signal",
    "state_dir": "state-dir", "cgroup_parent": "cgroup-parent",
    "scratch": "scratch", "execute_dir": "execute-dir",
    "keep_scratch": "keep-scratch", "manifest": "manifest",
    "manifest_digest": "manifest-digest", "inputs": "inputs",
    "seccomp": "seccomp", "allow_userns": "allow-userns",
    "userns_root": "userns-root", "rlimits": None,
    "oom_policy": "oom-policy", "delegate": "delegate",
    "devices": "device", "gpus": "gpus",
}
_LIMIT_KEYS = {"memory": "memory", "cpus": "cpus", "cpu_weight": "cpu-weight",
               "pids": "pids", "wall_time": "wall-time", "cpuset": "cpuset", "mems": "mems",
               "io_max": "io-max", "disk": "disk", "disk_inodes": "disk-inodes"}
_NET_KEYS = {"mode": "net", "lan": "lan", "pool": "pool", "uplink": "uplink",
             "allow_host_ports": "allow-host-port", "resolver": "resolver",
             "ipv6": "ipv6", "pool6": "pool6"}


def _flatten_file(doc):
    if not isinstance(doc, dict):
        raise SpecError("job", "the job file must hold a JSON object")
    for key, val in doc.items():
        if key not in _FILE_KEYS:
            raise SpecError(key, f"unknown key (known: {', '.join(sorted(_FILE_KEYS))})")
        if key == "env":
            if not isinstance(val, dict):
                raise SpecError("env", "must be an object of NAME: value")
            yield "env", [(k, v) for k, v in val.items()]
        elif key == "limits":
            yield from _sub(val, "limits", _LIMIT_KEYS)
        elif key == "network":
            if isinstance(val, str):
                yield "net", val
            else:
                yield from _sub(val, "network", _NET_KEYS)
        elif key == "mounts":
            if not isinstance(val, list):
                raise SpecError("mounts", "must be a list")
            mounts = []
            for i, m in enumerate(val):
                f = f"mounts[{i}]"
                if not isinstance(m, dict) or set(m) - {"type", "src", "dst", "options"} or "type" not in m:
                    raise SpecError(f, "must be {type, src, dst[, options]}")
                kind = m["type"]
                if kind not in M.KINDS:
                    raise SpecError(f + ".type", f"{V.show(kind)} is not one of {', '.join(M.KINDS)}")
                if kind == "tmpfs":
                    mounts.append((kind, V.string(f, m.get("dst", "")) + (":" + V.string(f, m["options"]) if m.get("options") else "")))
                else:
                    mounts.append((kind, V.string(f, m.get("src", "")) + ":" + V.string(f, m.get("dst", m.get("src", "")))))
            yield "mounts", mounts
        elif key == "rlimits":
            if not isinstance(val, dict):
                raise SpecError("rlimits", 'must be an object of NAME: "SOFT[:HARD]" (or a number)')
            items = []
            for k, v in val.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    v = str(v)
                items.append(f"{V.string('rlimits', k)}={V.string('rlimits.' + k, v)}")
            yield "rlimit", items
        elif key == "command":
            if not isinstance(val, list) or not all(isinstance(a, str) for a in val):
                raise SpecError("command", "must be a list of strings")
            yield "command", val
        else:
            yield _FILE_KEYS[key], val


def _sub(val, name, keys):
    if not isinstance(val, dict):
        raise SpecError(name, "must be an object")
    for k, v in val.items():
        if k not in keys:
            raise SpecError(f"{name}.{k}", f"unknown key (known: {', '.join(sorted(keys))})")
        yield keys[k], v


def _bool(field, v):
    if not isinstance(v, bool):
        raise SpecError(field, "must be true or false")
    return v


def _list(field, v):
    if isinstance(v, (str, tuple)):
        return [v]
    if not isinstance(v, list):
        raise SpecError(field, "must be a list")
    return v


def _make(raw, caller=None):
    argv = raw.get("command") or []
    if not argv:
        raise SpecError("command", "no command given (starter run [options] -- CMD ARGS)")
    if len(argv) > MAX_ARGS:
        raise SpecError("command", "too many arguments")
    argv = [V.string("command", a) for a in argv]

    job_id = raw.get("id")
    job_id = V.job_id("id", job_id) if job_id is not None else os.urandom(6).hex()

    # A job file may give them as numbers (docs/reference.md): as the digits.
    user, group = (str(v) if type(v) is int else v for v in (raw.get("user"), raw.get("group")))
    if user is not None:
        V.user_or_id("user", user)
    if group is not None:
        V.user_or_id("group", group)
    transient = None
    if caller is not None:
        # As the caller itself, with the groups the kernel gave it (a batch
        # system may have set them), never from --user or the job account.
        uid, gid, groups, home, uname = caller_user(caller)
        user = uname or str(uid)
    elif user is None and raw.get("job-uids") != "none":
        # No user named: a uid (and gid) of the job's own, leased when the
        # job starts (starter/uids.py), from the policy's range.
        from starter import uids

        transient = uids.parse_range("job_uids", raw.get("job-uids") or
                                     f"{uids.DEFAULT_FIRST}-{uids.DEFAULT_FIRST + uids.DEFAULT_COUNT - 1}")
        uid = gid = None
        groups, home, uname = (), "/", None
        if group is not None:
            gid = resolve_user("0", group)[1]
    else:
        uid, gid, groups, home, uname = resolve_user(user, group)
    if user is None:
        user = uname  # recorded in the state entry: who the job runs as

    given_env = parse_env("env", _list("env", raw.get("env", [])))
    env = {"PATH": DEFAULT_PATH, "HOME": home or "/"}
    if uname:
        env["USER"] = env["LOGNAME"] = uname

    # Devices by assignment only (starter/devices.py): each node bound at its
    # host path and allowed by the job's cgroup; GPUs with their control nodes.
    devices, gpus = [], ()
    if raw.get("device") or raw.get("gpus") not in (None, "", []):
        from starter import devices as D

        devices = [D.parse_device("device", x) for x in _list("device", raw.get("device") or [])]
        if raw.get("gpus") not in (None, "", []):
            gpus = D.parse_gpus("gpus", raw["gpus"])
            devices += D.gpu_devices("gpus", gpus)
            env.update(D.gpu_env(gpus))
        devices = list({d[0]: d for d in devices}.values())    # a path once (the last access given)
    env.update(given_env)
    ptys = V.number("ptys", raw.get("ptys", M.PTYS_DEFAULT), 1, 1 << 20, integer=True)

    mounts = [parse_mount(kind, kind, item) for kind, item in raw.get("mounts", [])]

    hostname = raw.get("hostname")
    if hostname is not None:
        hostname = V.hostname("hostname", hostname)

    limits = Limits(
        memory=V.size("memory", raw["memory"]) if raw.get("memory") is not None else None,
        cpus=V.number("cpus", raw["cpus"], 0.01, MAX_CPUS) if raw.get("cpus") is not None else None,
        cpu_weight=V.number("cpu-weight", raw["cpu-weight"], 1, 10000, integer=True) if raw.get("cpu-weight") is not None else None,
        pids=V.number("pids", raw["pids"], 1, MAX_PIDS, integer=True) if raw.get("pids") is not None else None,
        wall_time=V.duration("wall-time", raw["wall-time"], 0.001, MAX_WALL) if raw.get("wall-time") is not None else None,
        cpuset=V.id_list("cpuset", raw["cpuset"]) if raw.get("cpuset") is not None else None,
        mems=V.id_list("mems", raw["mems"], "NUMA node") if raw.get("mems") is not None else None,
        io_max=_io_max(raw.get("io-max")),
        disk=V.size("disk", raw["disk"]) if raw.get("disk") is not None else None,
        disk_inodes=V.number("disk-inodes", raw["disk-inodes"], 16, MAX_DISK_INODES, integer=True)
        if raw.get("disk-inodes") is not None else None,
    )
    _check_disk(raw, limits)
    threads = thread_count(limits.cpus, limits.cpuset)
    if threads is not None:
        env.update(dict.fromkeys(THREAD_VARS, str(threads)))
    env.update(given_env)           # the job's own word wins

    mode = V.string("net", raw.get("net", "none"))
    if mode not in NET_MODES:
        raise SpecError("net", f"{V.show(mode)} is not one of {', '.join(NET_MODES)}")
    if mode != "nat":
        for k in ("lan", "pool", "uplink", "allow-host-port", "resolver", "ipv6", "pool6"):
            if raw.get(k):
                raise SpecError(k, "only applies with --net nat")
    # Several uplinks: the host's routing picks one per destination; each is
    # masqueraded and counted.  Order does not matter; repeats are dropped.
    uplink = tuple(dict.fromkeys(V.ifname("uplink", u) for u in _list("uplink", raw.get("uplink") or [])))
    resolver = raw.get("resolver")
    if resolver is not None:
        resolver = V.ip_address("resolver", resolver)
    ipv6 = V.string("ipv6", raw.get("ipv6") or "auto")
    if ipv6 not in IPV6_MODES:
        raise SpecError("ipv6", f"{V.show(ipv6)} is not one of {', '.join(IPV6_MODES)}")
    network = Network(
        mode=mode, ipv6=ipv6,
        pool6=V.cidr("pool6", raw["pool6"]) if raw.get("pool6") else None,
        lan=tuple(V.cidr("lan", c) for c in _list("lan", raw.get("lan", []))),
        pool=V.cidr("pool", raw["pool"]) if raw.get("pool") else None,
        uplink=uplink,
        allow_host_ports=tuple(parse_host_port("allow-host-port", p) for p in _list("allow-host-port", raw.get("allow-host-port", []))),
        resolver=resolver,
    )

    def opt_path(key, must_exist=False):
        v = raw.get(key)
        if v is None:
            return None
        from starter import deadline

        with deadline.region(f"--{key} {v}"):   # a stat, maybe on a hung mount
            return V.host_path(key, v, must_exist)

    def dest(key):
        v = raw.get(key)
        if v is None:
            return None
        v = V.string(key, v)
        if v.startswith("fd:"):
            V.number(key, v[3:], 0, 1 << 20, integer=True)
            return v
        return V.host_path(key, v)

    digest = raw.get("manifest-digest")
    if digest is not None:
        digest = V.sha256_digest("manifest-digest", digest)
    if (raw.get("manifest") is None) != (digest is None):
        raise SpecError("manifest", "--manifest and --manifest-digest go together")
    if raw.get("scratch") is not None and raw.get("execute-dir") is not None:
        raise SpecError("scratch", "give --scratch or --execute-dir, not both")

    report_format = V.string("report-format", raw.get("report-format", "json"))
    if report_format not in REPORT_FORMATS:
        raise SpecError("report-format", f"{V.show(report_format)} is not one of {', '.join(REPORT_FORMATS)}")
    userns_root = _bool("userns-root", raw.get("userns-root", False))
    if userns_root and uid == 0 and transient is None:
        raise SpecError("userns-root", "maps root inside to the job's host uid, which is 0 here",
                        "give an unprivileged --user (or none: the default account)")
    rlimits = {}
    for item in _list("rlimit", raw.get("rlimit", [])):
        name, soft, hard = parse_rlimit("rlimit", item)
        rlimits[name] = (name, soft, hard)  # a later one wins
    oom_policy = V.string("oom-policy", raw.get("oom-policy", "kill"))
    if oom_policy not in OOM_POLICIES:
        raise SpecError("oom-policy", f"{V.show(oom_policy)} is not one of {', '.join(OOM_POLICIES)}")

    cwd = raw.get("cwd")
    return JobSpec(
        id=job_id,
        argv=argv,
        user=user, group=group, uid=uid, gid=gid, groups=groups, home=home,
        cwd=check_cwd("cwd", cwd) if cwd is not None else None,
        env=env,
        hostname=hostname,
        init=_bool("init", raw.get("init", False)),
        mounts=tuple(mounts),
        limits=limits,
        network=network,
        report=dest("report"),
        report_format=report_format,
        events=dest("events"),
        grace=V.duration("grace", raw.get("grace", 10.0), 0, MAX_GRACE),
        on_signal=parse_on_signal("on-signal", _list("on-signal", raw.get("on-signal", []))),
        state_dir=state_dir(raw.get("state-dir")),
        cgroup_parent=raw.get("cgroup-parent") and V.string("cgroup-parent", raw["cgroup-parent"]),
        scratch=opt_path("scratch"),
        execute_dir=opt_path("execute-dir", must_exist=True),
        keep_scratch=_bool("keep-scratch", raw.get("keep-scratch", False)),
        manifest=opt_path("manifest", must_exist=True),
        manifest_digest=digest,
        inputs=opt_path("inputs", must_exist=True),
        seccomp=_seccomp_choice(raw.get("seccomp", "default")),
        allow_userns=_bool("allow-userns", raw.get("allow-userns", False)),
        userns_root=userns_root,
        rlimits=tuple(rlimits.values()),
        oom_policy=oom_policy,
        delegate=_bool("delegate", raw.get("delegate", False)),
        transient=transient,
        # What happens to the job's processes found outside its cgroup at the
        # end (starter/escapes.py): the policy's choice, per kind of uid.
        escape=raw.get("escape-transient" if transient else "escape-named") or ("kill" if transient else "report"),
        devices=tuple(devices), gpus=gpus, ptys=ptys,
        kill_timeout=V.number("STARTER_KILL_TIMEOUT", os.environ.get("STARTER_KILL_TIMEOUT") or KILL_TIMEOUT,
                                  0.1, MAX_GRACE),
    )


def _io_max(items):
    """--io-max items (repeatable) -> ((major, minor, rbps, wbps, riops,
    wiops), ...), one per device: a later item's keys override an earlier
    one's for the same device."""
    by_dev = {}
    for item in _list("io-max", items or []):
        _, maj, mn, *rates = parse_io_max("io-max", item)
        old = by_dev.get((maj, mn), [None] * len(rates))
        by_dev[(maj, mn)] = [r if r is not None else o for r, o in zip(rates, old)]
    return tuple((maj, mn, *rates) for (maj, mn), rates in by_dev.items())


def _check_disk(raw, limits):
    """--disk limits a scratch: refused without one (one line, before anything
    is made), and with --keep-scratch (the image goes with the job)."""
    if limits.disk is None:
        if limits.disk_inodes is not None:
            raise SpecError("disk-inodes", "only applies with --disk", "add --disk SIZE")
        return
    if limits.disk < MIN_DISK:
        raise SpecError("disk", f"{V.show(raw['disk'])} is below the smallest disk image, 1M")
    if raw.get("scratch") is None and raw.get("execute-dir") is None:
        raise SpecError("disk", "limits the job's scratch directory, and this job has none",
                        "add --execute-dir DIR (or --scratch DIR), or leave out --disk")
    if raw.get("keep-scratch"):
        raise SpecError("keep-scratch", "not with --disk: the scratch is the job's disk image, removed at the end",
                        "copy what you need out of the scratch in the job, or leave out --disk")
    if limits.disk_inodes is not None and limits.disk_inodes > limits.disk // 256:
        raise SpecError("disk-inodes", f"{limits.disk_inodes} inodes do not fit in {V.show(raw['disk'])} "
                        "(at most one per 256 bytes)", "ask for fewer inodes or a larger --disk")


def _seccomp_choice(value):
    """default, off, or an absolute path to a profile (read and compiled by
    starter/seccomp before the job's resources are made)."""
    value = V.string("seccomp", value)
    if value in ("default", "off"):
        return value
    if not value.startswith("/"):
        raise SpecError("seccomp", f"{V.show(value)} is not default, off or an absolute path to a profile")
    return V.path("seccomp", value)


def load_job_file(path):
    """Parse a job file strictly: JSON (duplicate keys are an error), or TOML
    when the name ends in .toml (TOML itself forbids duplicate keys)."""
    import json

    def no_dups(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise SpecError(k, "duplicate key in job file")
            seen[k] = v
        return seen

    path = V.string("job", path)          # relative: to the caller's cwd, as open() does
    import stat

    try:
        # A regular file only, looked at before it is opened (non-blocking):
        # a FIFO or a device there must not hang the start or arm anything.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SpecError("job", f"{V.show(path)} is not a regular file")
        with open(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SpecError("job", f"{V.show(path)} is not a regular file")
            data = f.read((1 << 20) + 1)
    except OSError as e:
        raise SpecError("job", f"cannot read {V.show(path)}: {e.strerror}") from None
    if len(data) > 1 << 20:
        raise SpecError("job", "job file larger than 1 MiB")
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:
            raise SpecError("job", "TOML job files need Python 3.11 or later; use JSON") from None
        try:
            return tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise SpecError("job", "job file is not UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise SpecError("job", f"not valid TOML: {e}") from None
        except ValueError as e:         # e.g. an integer of more than 4300 digits
            raise SpecError("job", f"not usable TOML: {e}") from None
        except RecursionError:
            raise SpecError("job", "job file nested too deeply") from None
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_dups)
    except UnicodeDecodeError:
        raise SpecError("job", "job file is not UTF-8") from None
    except ValueError as e:
        raise SpecError("job", f"not valid JSON: {e}") from None
    except RecursionError:
        raise SpecError("job", "job file nested too deeply") from None
