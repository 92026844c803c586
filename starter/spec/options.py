"""The job spec's option parsers: one option's value each (--env, --bind and
the other mounts, --on-signal, --rlimit and the limit table every job
starts with, the thread-count variables, --io-max, --allow-host-port,
--cwd, --state-dir) and the job's user (--user/--group, the default job
account, a caller that is not root).

The rules for single values live in values.py (V); here what a job spec
adds.  spec/jobspec.py assembles a JobSpec from these (and re-exports the names
other modules use as spec.X).
"""

import os

from starter.isolate import mounts as M
from starter.spec import values as V
from starter.errors import SpecError

MAX_ENV = 4096
ACTIONS = ("vacate", "suspend", "resume", "kill")


# The job's user when no --user is given: a system account of its own, with
# its own group, no home, no login shell, owning no files (scripts/setup).
JOB_ACCOUNT = "starter-job"
JOB_ACCOUNT_CMD = (f"useradd --system --user-group --no-create-home --home-dir /nonexistent "
                   f"--shell /usr/sbin/nologin {JOB_ACCOUNT}")

# /proc and /sys hold magic links (/proc/self/cwd, /proc/1/root, /proc/PID/fd/N)
# that lead to directories of other processes and namespaces without any
# path to them; /dev/fd is a link into /proc.  No job starts there.
_MAGIC_DIRS = ("/proc", "/sys", "/dev/fd")


# Bounds and choices the command line, the job file and the policy share.
MAX_CPUS = 4096
MAX_PIDS = 4194304            # pid_max limit of the kernel
MAX_WALL = 366 * 86400
MAX_DISK_INODES = (1 << 32) - 1
NET_MODES = ("none", "host", "nat", "job")
NET_TRANSPORTS = ("vxlan", "wireguard")      # --net job's (net/overlay.py, net/wireguard.py)
DEFAULT_NET_KEY = "/etc/starter/network.key"
# the modes whose job has a NAT network (job: plus the job network across its nodes)
NAT_MODES = ("nat", "job")
IPV6_MODES = ("auto", "on", "off")   # network.ipv6 / --ipv6 (see starter.net.NetConfig)


def ipv6_mode(field, value):
    """--ipv6, network.ipv6 and the policy's [defaults] ipv6: one of IPV6_MODES."""
    value = V.string(field, value)
    if value not in IPV6_MODES:
        raise SpecError(field, f"{V.show(value)} is not one of {', '.join(IPV6_MODES)}")
    return value


def seccomp_choice(value):
    """default, off, or an absolute path to a profile (read and compiled by
    starter/isolate/seccomp before the job's resources are made)."""
    value = V.string("seccomp", value)
    if value in ("default", "off"):
        return value
    if not value.startswith("/"):
        raise SpecError("seccomp", f"{V.show(value)} is not default, off or an absolute path to a profile")
    return V.path("seccomp", value)


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


GUARANTEES = ("memory", "cpu", "pids", "kill", "freeze", "accounting", "own-uid", "network")


def parse_require(field, items):
    """--require LIST (repeatable; commas): guarantees a starter without
    root must give or refuse the job (starter/rootless/pilot.py); "all"
    names every one."""
    out = []
    for item in items:
        for g in V.string(field, item).split(","):
            g = g.strip()
            if g == "all":
                out += GUARANTEES
            elif g in GUARANTEES:
                out.append(g)
            elif g:
                raise SpecError(field, f"{V.show(g)} is not one of {', '.join(GUARANTEES)}, all")
    return tuple(dict.fromkeys(out))


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
        from starter.storage import paths

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


# The resource limits every job starts with, whatever the node
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
# for a job limited to some CPUs (--cpus, --cpuset, or a batch system's
# cpuset the starter runs in), unless its --env sets them.  Without them a job that sees 64 CPUs starts 64 threads on 2 CPUs' worth
# of quota.  The list is docs/reference.md's ("Thread-count variables").
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS",
               "JULIA_NUM_THREADS", "GOMAXPROCS", "PYTHON_CPU_COUNT")


def thread_count(cpus, cpuset, affinity=None):
    """The value of THREAD_VARS: ceil(--cpus), the number of CPUs in
    --cpuset, the number the starter itself may run on where that is fewer
    than the node's (`affinity`: a batch system's cpuset, Slurm's
    ConstrainCores), the smallest of those given; None: none."""
    counts = [affinity] if affinity is not None else []
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


# --net-rate: a scope -> the zones (starter/net/shaping.py's) it caps; the
# more specific wins.
_RATE_SCOPES = {"all": ("lan_in", "lan_out", "wan_in", "wan_out"), "in": ("lan_in", "wan_in"),
                "out": ("lan_out", "wan_out"), "lan": ("lan_in", "lan_out"), "wan": ("wan_in", "wan_out"),
                "lan-in": ("lan_in",), "lan-out": ("lan_out",), "wan-in": ("wan_in",), "wan-out": ("wan_out",)}
# tc's units: bits per second, decimal (kbit = 1000 bit/s); bps = bytes/s
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}


def parse_rate(field, value):
    """100mbit, 1.5gbit, 500kbit, 10mbps (bytes) -> bits/s (int)."""
    from starter.net.shaping import MAX_RATE, MIN_RATE

    s = V.string(field, value).strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _RATE_UNITS or not num or set(num) - set("0123456789.") or num.count(".") > 1 or num == ".":
        raise SpecError(field, f"{V.show(value)} is not a rate", "e.g. 100mbit, 1gbit, 500kbit (bits/s; mbps: bytes/s)")
    n = int(float(num) * _RATE_UNITS[unit])
    if not MIN_RATE <= n <= MAX_RATE:
        raise SpecError(field, f"{V.show(value)} is out of range (8kbit .. 1tbit)")
    return n


def parse_net_rate(field, value):
    """--net-rate RATE | SCOPE=RATE[,SCOPE=RATE...] -> ((zone, bits/s), ...)
    sorted by zone, zones lan_in lan_out wan_in wan_out.  SCOPE: all, in,
    out, lan, wan, lan-in, lan-out, wan-in, wan-out; a bare RATE is all.
    A more specific scope wins over a wider one whatever the order."""
    s = V.string(field, value).strip()
    if not s:
        raise SpecError(field, "is empty", "e.g. 100mbit, or out=100mbit,lan-in=1gbit")
    got = {}
    for part in s.split(","):
        scope, eq, rate = part.strip().rpartition("=")
        scope = scope.strip().lower() if eq else "all"
        if scope not in _RATE_SCOPES:
            raise SpecError(field, f"{V.show(part)}: {V.show(scope)} is not one of {', '.join(_RATE_SCOPES)}")
        if scope in got:
            raise SpecError(field, f"{V.show(scope)} is given twice")
        got[scope] = parse_rate(field, rate)
    out = {}
    for scope in sorted(got, key=lambda sc: -len(_RATE_SCOPES[sc])):    # wide first, specific last
        out.update(dict.fromkeys(_RATE_SCOPES[scope], got[scope]))
    return tuple(sorted(out.items()))


def format_rate(bits):
    """bits/s -> the shortest exact unit parse_rate reads: 100mbit, 1500kbit, 8123bit."""
    for unit, n in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % n == 0:
            return f"{bits // n}{unit}"
    return f"{bits}bit"


def format_net_rate(zones):
    """{zone: bits/s} -> a --net-rate value parse_net_rate reads back."""
    return ",".join(f"{z.replace('_', '-')}={format_rate(bits)}" for z, bits in sorted(zones.items()))


def merge_net_rates(base, over):
    """Two --net-rate values -> one, zone by zone; `over`'s zones win."""
    zones = dict(parse_net_rate("net_rate", base))
    if over:
        zones.update(parse_net_rate("net-rate", over))
    return format_net_rate(zones)


def parse_host_port(field, value):
    proto, sep, port = V.string(field, value).partition(":")
    if not sep or proto not in ("tcp", "udp"):
        raise SpecError(field, f"{V.show(value)} must be tcp:PORT or udp:PORT")
    return (proto, V.number(field, port, 1, 65535, integer=True))


def resolve_user(user, group):
    """-> (uid, gid, groups, home, name).  Numeric ids are taken as given.
    No user: the JOB_ACCOUNT, never the starter's own uid (root)."""
    import pwd

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
        gid, groups = resolve_group(group), ()
    return uid, gid, groups, home, name


def resolve_group(group):
    """--group: a name or a number -> the gid."""
    import grp

    try:
        return V.numeric_id("group", group) if V.is_numeric_id(group) else grp.getgrnam(V.name("group", group)).gr_gid
    except KeyError:
        raise SpecError("group", f"no such group {V.show(group)}") from None


def caller_user(caller):
    """-> (uid, gid, groups, home, name) of a caller that is not root: its
    name and home from /etc/passwd read directly where it is there (the first
    NSS lookup of a process costs ~5 ms here, a quarter of a start), else
    from NSS (a directory service's user)."""
    found = _passwd_entry(caller.uid)
    if found is None:
        import pwd

        try:
            pw = pwd.getpwuid(caller.uid)
            found = (pw.pw_name, pw.pw_dir)
        except KeyError:
            found = (None, "/")
    name, home = found
    return caller.uid, caller.gid, tuple(sorted(set(caller.groups) - {caller.gid})), home, name


def _passwd_entry(uid, path="/etc/passwd"):
    """(name, home) of uid's first line in /etc/passwd, or None."""
    from starter.fileio import account_entries

    want = str(uid).encode()
    for f in account_entries(path):
        if len(f) >= 7 and f[2] == want:
            try:
                return f[0].decode(), f[5].decode()
            except UnicodeDecodeError:
                return None
    return None

def own_cpus():
    """How many CPUs the starter may run on, where that is fewer than the
    node has online (a batch system's cpuset or binding); else None."""
    try:
        n = len(os.sched_getaffinity(0))
    except OSError:
        return None
    online = os.cpu_count()
    return n if online and n < online else None
