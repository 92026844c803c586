"""The job description: every field, validated once, here.

A JobSpec comes from the command line, from a job file (JSON), or both (the
command line overrides the file).  Everything that later reaches the kernel,
a file name, nft or a cgroup path has been checked in this module; other
modules trust a JobSpec.

Plain classes with __slots__ instead of dataclasses: `import dataclasses`
costs ~13 ms of interpreter time here, and every job pays it.
"""

import os

from starter.errors import SpecError

MAX_ID = 64
MAX_NAME = 32
MAX_ARGS = 4096
MAX_ENV = 4096
MAX_PATH = 4096
MAX_MEMORY = 1 << 50          # 1 PiB: anything above is a typo
MAX_CPUS = 4096
MAX_PIDS = 4194304            # pid_max limit of the kernel
MAX_WALL = 366 * 86400
MAX_GRACE = 3600
KILL_TIMEOUT = 10.0           # $STARTER_KILL_TIMEOUT: then the job's processes are "unkillable"

NET_MODES = ("none", "host", "nat")
ACTIONS = ("vacate", "suspend", "resume", "kill")
MOUNT_KINDS = ("bind", "ro-bind", "tmpfs")
OOM_POLICIES = ("kill", "continue")

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_ENV_FIRST = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_ENV_CHARS = _ENV_FIRST | frozenset("0123456789")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


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

    __slots__ = ("memory", "cpus", "cpu_weight", "pids", "wall_time")
    DEFAULTS = {}


class Network(Spec):
    """mode none: own namespace, loopback only.  host: the host's network
    (no namespace).  nat: own namespace + veth + NAT with LAN/WAN counters."""

    __slots__ = ("mode", "lan", "pool", "uplink", "allow_host_ports", "resolver")
    DEFAULTS = {"mode": "none", "lan": (), "allow_host_ports": ()}


class JobSpec(Spec):
    __slots__ = (
        "id", "argv", "user", "group", "uid", "gid", "groups", "home", "cwd",
        "env", "hostname", "init", "mounts", "limits", "network", "report",
        "events", "grace", "on_signal", "state_dir", "cgroup_parent",
        "scratch", "execute_dir", "keep_scratch", "manifest",
        "manifest_digest", "inputs", "oom_policy", "kill_timeout",
    )
    DEFAULTS = {
        "grace": 10.0, "init": False, "mounts": (), "env": None, "groups": (),
        "on_signal": (), "keep_scratch": False, "oom_policy": "kill", "kill_timeout": KILL_TIMEOUT,
    }


# ---------------------------------------------------------------- checks

def check_id(field, value):
    """Job ids become file, cgroup and nft names: a strict alphabet."""
    value = _str(field, value)
    if not value or len(value) > MAX_ID:
        raise SpecError(field, f"must be 1..{MAX_ID} characters, got {len(value)}")
    bad = set(value) - _ID_CHARS
    if bad:
        raise SpecError(field, f"{value!r} has characters outside [A-Za-z0-9_.-]: {''.join(sorted(bad))!r}")
    if value[0] in "-." or ".." in value:
        raise SpecError(field, f"{value!r} may not start with '-' or '.' or contain '..'")
    return value


def check_name(field, value):
    """A user or group name as the system databases allow them."""
    value = _str(field, value)
    if not value or len(value) > MAX_NAME:
        raise SpecError(field, f"must be 1..{MAX_NAME} characters")
    bad = set(value) - _NAME_CHARS
    if bad or value[0] in "-." or ".." in value:
        raise SpecError(field, f"{value!r} is not a valid user or group name")
    return value


def check_path(field, value, must_exist=False):
    value = _str(field, value)
    if not value.startswith("/"):
        raise SpecError(field, f"{value!r} must be an absolute path")
    if len(value) > MAX_PATH:
        raise SpecError(field, "path too long")
    if "/../" in value + "/" or value.endswith("/.."):
        raise SpecError(field, f"{value!r} may not contain '..'")
    if must_exist and not os.path.exists(value):
        raise SpecError(field, f"{value!r} does not exist")
    return value


def state_dir(value=None):
    """--state-dir, else $STARTER_STATE_DIR, else /run/starter."""
    return check_path("state-dir", value or os.environ.get("STARTER_STATE_DIR") or "/run/starter")


def parse_size(field, value):
    """512M, 2G, 1048576 -> bytes."""
    if isinstance(value, bool):
        raise SpecError(field, "must be a size like 512M, not a boolean")
    if isinstance(value, int):
        n = value
    else:
        s = _str(field, value).strip().lower()
        if s.endswith("ib"):
            s = s[:-2]
        elif s.endswith("b") and len(s) > 1 and not s[-2].isdigit():
            s = s[:-1]
        unit = s[-1:] if s[-1:] in _SIZE_UNITS and not s[-1:].isdigit() else ""
        num = s[: len(s) - len(unit)]
        try:
            n = int(float(num) * _SIZE_UNITS[unit]) if num else -1
        except ValueError:
            raise SpecError(field, f"{value!r} is not a size (e.g. 512M, 2G)") from None
    if n <= 0 or n > MAX_MEMORY:
        raise SpecError(field, f"{value!r} is out of range (1 byte .. 1 PiB)")
    return n


def parse_number(field, value, lo, hi, integer=False):
    if isinstance(value, bool):
        raise SpecError(field, "must be a number, not a boolean")
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise SpecError(field, f"{value!r} is not a{'n integer' if integer else ' number'}") from None
    if integer and not isinstance(value, int):
        raise SpecError(field, f"{value!r} must be an integer")
    if not isinstance(value, (int, float)) or value != value:
        raise SpecError(field, f"{value!r} is not a number")
    if not lo <= value <= hi:
        raise SpecError(field, f"{value!r} is out of range ({lo} .. {hi})")
    return value


def parse_env(field, items):
    env = {}
    for item in items:
        if isinstance(item, tuple):
            k, v = item
        else:
            item = _str(field, item)
            k, sep, v = item.partition("=")
            if not sep:
                raise SpecError(field, f"{item!r} must be KEY=VALUE")
        k, v = _str(field, k), _str(field, v)
        if not k or k[0] not in _ENV_FIRST or set(k) - _ENV_CHARS:
            raise SpecError(field, f"{k!r} is not a valid variable name")
        env[k] = v
    if len(env) > MAX_ENV:
        raise SpecError(field, "too many variables")
    return env


def parse_mount(field, kind, value):
    """--bind SRC[:DST]  --ro-bind SRC[:DST]  --tmpfs DST[:OPTIONS]: Mount.parse
    splits and checks the paths; here what only a job spec asks on top."""
    from starter.mounts import Mount

    if kind not in MOUNT_KINDS:
        raise SpecError(field, f"unknown mount type {kind!r} (one of {', '.join(MOUNT_KINDS)})")
    try:
        m = Mount.parse(kind, _str(field, value))
    except SpecError as e:
        raise SpecError(field, e.detail, e.hint) from None
    if kind == "tmpfs":
        for opt in filter(None, m.options.split(",")):
            if opt.partition("=")[0] not in ("size", "mode", "nr_inodes"):
                raise SpecError(field, f"tmpfs option {opt!r} not allowed (size, mode, nr_inodes)")
    elif not os.path.exists(m.src):
        raise SpecError(field, f"{m.src!r} does not exist")
    return m


def parse_on_signal(field, items):
    """USR1=vacate -> ((10, "vacate"),)"""
    import _signal

    out = []
    for item in items:
        name, sep, action = _str(field, item).partition("=")
        if not sep or action not in ACTIONS:
            raise SpecError(field, f"{item!r} must be SIGNAL=ACTION, ACTION one of {', '.join(ACTIONS)}")
        name = name.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        num = getattr(_signal, name, None)
        if not isinstance(num, int) or name in ("SIGKILL", "SIGSTOP", "SIGCHLD"):
            raise SpecError(field, f"{item!r}: {name} cannot be used")
        out.append((num, action))
    return tuple(out)


def parse_host_port(field, value):
    proto, sep, port = _str(field, value).partition(":")
    if not sep or proto not in ("tcp", "udp"):
        raise SpecError(field, f"{value!r} must be tcp:PORT or udp:PORT")
    return (proto, parse_number(field, port, 1, 65535, integer=True))


def parse_cidr(field, value):
    import ipaddress

    try:
        return str(ipaddress.ip_network(_str(field, value), strict=True))
    except ValueError as e:
        raise SpecError(field, str(e)) from None


def resolve_user(user, group):
    """-> (uid, gid, groups, home, name).  Numeric ids are taken as given."""
    import pwd
    import grp

    if user is None:
        uid, gid, name, home = os.getuid(), os.getgid(), None, "/root"
        try:
            pw = pwd.getpwuid(uid)
            name, home = pw.pw_name, pw.pw_dir
        except KeyError:
            pass
        groups = tuple(sorted(set(os.getgroups()) - {gid}))
    else:
        try:
            pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(check_name("user", user))
        except (KeyError, ValueError):
            if user.isdigit():
                uid, gid, name, home, groups = int(user), int(user), None, "/", ()
                pw = None
            else:
                raise SpecError("user", f"no such user {user!r}") from None
        if pw is not None:
            uid, gid, name, home = pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir
            groups = tuple(sorted(g for g in os.getgrouplist(name, gid) if g != gid))
    if group is not None:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(check_name("group", group)).gr_gid
        except KeyError:
            raise SpecError("group", f"no such group {group!r}") from None
        groups = ()
    return uid, gid, groups, home, name


def _str(field, value):
    if not isinstance(value, str):
        raise SpecError(field, f"must be a string, got {type(value).__name__}")
    if "\0" in value:
        raise SpecError(field, "contains a NUL byte")
    return value


# ---------------------------------------------------------------- building

# Option name -> (JobSpec path, parser).  The job file uses the same names.
def build(cli, job_file=None):
    """Merge a job file (dict, already parsed) and command-line values (dict
    of option name -> value, only those given) into a checked JobSpec."""
    raw = dict(_flatten_file(job_file)) if job_file else {}
    for k, v in cli.items():
        if k in ("env", "mounts", "lan", "allow-host-port", "on-signal") and k in raw:
            raw[k] = list(raw[k]) + list(v)       # repeatable: file first, then flags
        else:
            raw[k] = v
    return _make(raw)


_FILE_KEYS = {
    "id": "id", "command": "command", "user": "user", "group": "group",
    "cwd": "cwd", "env": "env", "hostname": "hostname", "init": "init",
    "limits": None, "network": None, "mounts": None, "report": "report",
    "events": "events", "grace": "grace", "on_signal": "on-signal",
    "state_dir": "state-dir", "cgroup_parent": "cgroup-parent",
    "scratch": "scratch", "execute_dir": "execute-dir",
    "keep_scratch": "keep-scratch", "manifest": "manifest",
    "manifest_digest": "manifest-digest", "inputs": "inputs", "oom_policy": "oom-policy",
}
_LIMIT_KEYS = {"memory": "memory", "cpus": "cpus", "cpu_weight": "cpu-weight",
               "pids": "pids", "wall_time": "wall-time"}
_NET_KEYS = {"mode": "net", "lan": "lan", "pool": "pool", "uplink": "uplink",
             "allow_host_ports": "allow-host-port", "resolver": "resolver"}


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
                if kind not in MOUNT_KINDS:
                    raise SpecError(f + ".type", f"{kind!r} is not one of {', '.join(MOUNT_KINDS)}")
                if kind == "tmpfs":
                    mounts.append((kind, _str(f, m.get("dst", "")) + (":" + _str(f, m["options"]) if m.get("options") else "")))
                else:
                    mounts.append((kind, _str(f, m.get("src", "")) + ":" + _str(f, m.get("dst", m.get("src", "")))))
            yield "mounts", mounts
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


def _make(raw):
    argv = raw.get("command") or []
    if not argv:
        raise SpecError("command", "no command given (starter run [options] -- CMD ARGS)")
    if len(argv) > MAX_ARGS:
        raise SpecError("command", "too many arguments")
    argv = [_str("command", a) for a in argv]

    job_id = raw.get("id")
    job_id = check_id("id", job_id) if job_id is not None else os.urandom(6).hex()

    user = raw.get("user")
    group = raw.get("group")
    if user is not None:
        user = _str("user", user)
        if not user.isdigit():
            check_name("user", user)
    if group is not None:
        group = _str("group", group)
        if not group.isdigit():
            check_name("group", group)
    uid, gid, groups, home, uname = resolve_user(user, group)

    given_env = parse_env("env", _list("env", raw.get("env", [])))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", "HOME": home or "/"}
    if uname:
        env["USER"] = env["LOGNAME"] = uname
    env.update(given_env)

    mounts = [parse_mount(kind, kind, item) for kind, item in raw.get("mounts", [])]

    hostname = raw.get("hostname")
    if hostname is not None:
        hostname = _str("hostname", hostname)
        if not 1 <= len(hostname) <= 64 or set(hostname) - _ID_CHARS or hostname[0] in "-.":
            raise SpecError("hostname", f"{hostname!r} is not a valid host name")

    limits = Limits(
        memory=parse_size("memory", raw["memory"]) if raw.get("memory") is not None else None,
        cpus=parse_number("cpus", raw["cpus"], 0.01, MAX_CPUS) if raw.get("cpus") is not None else None,
        cpu_weight=parse_number("cpu-weight", raw["cpu-weight"], 1, 10000, integer=True) if raw.get("cpu-weight") is not None else None,
        pids=parse_number("pids", raw["pids"], 1, MAX_PIDS, integer=True) if raw.get("pids") is not None else None,
        wall_time=parse_number("wall-time", raw["wall-time"], 0.001, MAX_WALL) if raw.get("wall-time") is not None else None,
    )

    mode = _str("net", raw.get("net", "none"))
    if mode not in NET_MODES:
        raise SpecError("net", f"{mode!r} is not one of {', '.join(NET_MODES)}")
    if mode != "nat":
        for k in ("lan", "pool", "uplink", "allow-host-port", "resolver"):
            if raw.get(k):
                raise SpecError(k, "only applies with --net nat")
    uplink = raw.get("uplink")
    if uplink is not None:
        uplink = _str("uplink", uplink)
        if not 1 <= len(uplink) <= 15 or set(uplink) - _ID_CHARS or uplink[0] in "-.":
            raise SpecError("uplink", f"{uplink!r} is not an interface name")
    resolver = raw.get("resolver")
    if resolver is not None:
        import ipaddress

        try:
            resolver = str(ipaddress.ip_address(_str("resolver", resolver)))
        except ValueError as e:
            raise SpecError("resolver", str(e)) from None
    network = Network(
        mode=mode,
        lan=tuple(parse_cidr("lan", c) for c in _list("lan", raw.get("lan", []))),
        pool=parse_cidr("pool", raw["pool"]) if raw.get("pool") else None,
        uplink=uplink,
        allow_host_ports=tuple(parse_host_port("allow-host-port", p) for p in _list("allow-host-port", raw.get("allow-host-port", []))),
        resolver=resolver,
    )

    def opt_path(key, must_exist=False):
        v = raw.get(key)
        return check_path(key, v, must_exist) if v is not None else None

    def dest(key):
        v = raw.get(key)
        if v is None:
            return None
        v = _str(key, v)
        if v.startswith("fd:"):
            parse_number(key, v[3:], 0, 1 << 20, integer=True)
            return v
        return check_path(key, v)

    digest = raw.get("manifest-digest")
    if digest is not None:
        digest = _str("manifest-digest", digest).lower()
        if len(digest) != 64 or set(digest) - set("0123456789abcdef"):
            raise SpecError("manifest-digest", "must be 64 hex digits (SHA-256)")
    if (raw.get("manifest") is None) != (digest is None):
        raise SpecError("manifest", "--manifest and --manifest-digest go together")
    if raw.get("scratch") is not None and raw.get("execute-dir") is not None:
        raise SpecError("scratch", "give --scratch or --execute-dir, not both")

    oom_policy = _str("oom-policy", raw.get("oom-policy", "kill"))
    if oom_policy not in OOM_POLICIES:
        raise SpecError("oom-policy", f"{oom_policy!r} is not one of {', '.join(OOM_POLICIES)}")

    cwd = raw.get("cwd")
    return JobSpec(
        id=job_id,
        argv=argv,
        user=user, group=group, uid=uid, gid=gid, groups=groups, home=home,
        cwd=check_path("cwd", cwd) if cwd is not None else None,
        env=env,
        hostname=hostname,
        init=_bool("init", raw.get("init", False)),
        mounts=tuple(mounts),
        limits=limits,
        network=network,
        report=dest("report"),
        events=dest("events"),
        grace=parse_number("grace", raw.get("grace", 10.0), 0, MAX_GRACE),
        on_signal=parse_on_signal("on-signal", _list("on-signal", raw.get("on-signal", []))),
        state_dir=state_dir(raw.get("state-dir")),
        cgroup_parent=raw.get("cgroup-parent") and _str("cgroup-parent", raw["cgroup-parent"]),
        scratch=opt_path("scratch"),
        execute_dir=opt_path("execute-dir", must_exist=True),
        keep_scratch=_bool("keep-scratch", raw.get("keep-scratch", False)),
        manifest=opt_path("manifest", must_exist=True),
        manifest_digest=digest,
        inputs=opt_path("inputs", must_exist=True),
        oom_policy=oom_policy,
        kill_timeout=parse_number("STARTER_KILL_TIMEOUT", os.environ.get("STARTER_KILL_TIMEOUT") or KILL_TIMEOUT,
                                  0.1, MAX_GRACE),
    )


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

    try:
        with open(path, "rb") as f:
            data = f.read((1 << 20) + 1)
    except OSError as e:
        raise SpecError("job", f"cannot read {path}: {e.strerror}") from None
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
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_dups)
    except UnicodeDecodeError:
        raise SpecError("job", "job file is not UTF-8") from None
    except ValueError as e:
        raise SpecError("job", f"not valid JSON: {e}") from None
