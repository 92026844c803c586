"""The node policy: /etc/starter/starter.toml, root's word on every job.

Two tables, both optional:

    [defaults]   node settings every job gets unless its command line or job
                 file says otherwise, root's jobs too: the NAT uplinks, LAN
                 ranges, resolver and address pools, the execute directory,
                 limits, rlimits, the syscall profile, the grace period, the
                 state directory (also the admin commands' default).
    [callers]    what a caller that is not root may ask for (the set-user-ID
                 entry point, native/launcher.c).  Deny by default: what the
                 file does not allow is refused with exit 125 and one line
                 naming the key that would allow it.

The file is trusted only if it and every directory above it are root's and
writable by no one else (as sshd's StrictModes and sudo do); it is read
without following links.  No file: the built-in policy (no defaults; callers
may run plain `--net none` jobs under the default profile, as themselves,
without binds or extra privileges).  Every error names the file, the line
and the key.  Format and keys: docs/reference.md, "The node policy".
"""

import os
import stat

from starter.spec import registry, values as V
from starter.spec.options import NAT_MODES
from starter.errors import SpecError, StarterError

PATH = "/etc/starter/starter.toml"
MAX_SIZE = 1 << 20
DEFAULT_MAX_JOBS = 64

# [defaults] key -> (run option it stands for, kind); kind says how it is
# checked (_check).  The run options' are the option registry's; these few
# have no run option: the node's alone.
DEFAULT_KEYS = registry.policy_defaults()
DEFAULT_KEYS.update({
    "job_uids": ("job-uids", "uids"),
    "escape_transient": ("escape-transient", "escape"),
    "escape_named": ("escape-named", "escape"),
    "ptys": ("ptys", "count"),      # the most ptys of a job's own devpts
    "run_passthrough": ("run-passthrough", "run_dirs"),     # the node's (run_passthrough())
})
# Options whose defaults only make sense for a NAT job (spec refuses them otherwise).
NET_OPTIONS = registry.nat_only()
NAT_DEFAULTS = NET_OPTIONS + ("net-rate",)
JOB_DEFAULTS = registry.job_only()

# [callers] key -> (kind, built-in value).
CALLER_KEYS = {
    "allow": ("bool", True),
    "net": ("modes", ("none",)),
    "bind": ("dirs", ()),
    "ro_bind": ("dirs", ()),
    "mount_destinations": ("dirs", ()),
    "execute_dirs": ("dirs", ()),
    "images": ("images", ()),       # --image: directories of image files, or sha256: digests
    "seccomp": ("profiles", ("default",)),
    "userns_root": ("bool", False), "allow_userns": ("bool", False),
    "delegate": ("bool", False), "init": ("bool", False),
    "max_jobs": ("count", DEFAULT_MAX_JOBS),
    "devices": ("globs", ()), "gpus": ("bool", False),
    # the maxima: max_memory, max_cpus, ..., checked as the option's value is
    **{key: (kind, None) for key, kind in registry.cap_kinds().items()},
}
# Options that only root sets (where jobs' state and cgroups live, the
# network's shape, a checkpoint's directory: written as root), a caller's
# flag -> the [callers] key that allows it, and a caller's value -> its cap.
ROOT_ONLY = registry.root_only()
FLAG_KEYS = registry.caller_flags()
LIMIT_KEYS = registry.caller_caps()
# --disk limits a scratch: its defaults (and a caller's max_disk) go only to jobs with one.
DISK_OPTIONS = ("disk", "disk-inodes")


class PolicyError(StarterError):
    """The policy file is unusable, or a caller asked for what it does not allow."""


class Policy:
    __slots__ = ("path", "defaults", "callers", "lines")

    def __init__(self, path=None, defaults=None, callers=None, lines=None):
        self.path = path                # None: the built-in policy
        self.defaults = defaults or {}  # run option -> value (as a job file gives it)
        self.callers = {k: v for k, (_, v) in CALLER_KEYS.items()}
        self.callers.update(callers or {})
        self.lines = lines or {}

    def where(self, key):
        """'the node policy /etc/starter/starter.toml line 12, key callers.net' for messages."""
        if self.path is None:
            return f"the built-in node policy (no {PATH}), key {key}"
        line = self.lines.get(key)
        return f"the node policy {self.path}" + (f" line {line}" if line else "") + f", key {key}"

    # ------------------------------------------------------------ applying
    def apply(self, raw):
        """Fill the node defaults into `raw` (run option -> value, merged from
        the command line and the job file).  For a caller that is not root,
        gate.apply() checks first and caps after."""
        for opt, value in self.defaults.items():
            if opt in NAT_DEFAULTS and raw.get("net") not in NAT_MODES:
                continue
            if opt in JOB_DEFAULTS and raw.get("net") != "job":
                continue
            if opt == "net-rate":               # per zone: the job's own win
                from starter.spec import options as O

                raw[opt] = O.merge_net_rates(value, raw.get(opt))
                continue
            if opt == "state-dir" and os.environ.get("STARTER_STATE_DIR"):
                continue        # a root caller's environment comes first (spec.state_dir)
            if opt == "execute-dir" and (raw.get("scratch") is not None or raw.get("execute-dir") is not None):
                continue
            if opt in DISK_OPTIONS:
                continue                        # below, once the scratch is known
            if opt == "run-passthrough":
                continue                        # the node's, not the job's: run_passthrough()
            if opt == "rlimit":                 # per name: the job's own win
                given = {str(r).partition("=")[0].strip().lower() for r in raw.get("rlimit") or ()}
                raw["rlimit"] = [r for r in value if r.partition("=")[0] not in given] + list(raw.get("rlimit") or ())
                continue
            if raw.get(opt) is None:
                raw[opt] = value
        if has_scratch(raw):
            for opt in DISK_OPTIONS:
                if raw.get(opt) is None and opt in self.defaults and (opt == "disk" or raw.get("disk") is not None):
                    raw[opt] = self.defaults[opt]
        return raw

    def run_passthrough(self):
        """What of the host's /run every job sees (defaults.run_passthrough;
        built in: mounts.RUN_PASSTHROUGH, munge's socket directory): the
        rest of /run is a tmpfs of the job's own (mounts.private_run)."""
        from starter.isolate.mounts import RUN_PASSTHROUGH

        return tuple(self.defaults.get("run-passthrough", RUN_PASSTHROUGH))

    # ------------------------------------------------------------ showing
    def render(self):
        """The effective policy as TOML (`starter config show`)."""
        out = [f"# effective node policy: {self.path or 'built in (no ' + PATH + ')'}", "[defaults]"]
        for key, (opt, _) in DEFAULT_KEYS.items():
            if opt in self.defaults:
                out.append(f"{key} = {_toml(self.defaults[opt] if key != 'rlimits' else dict(r.split('=', 1) for r in self.defaults[opt]))}")
        out += ["", "[callers]"]
        for key in CALLER_KEYS:
            v = self.callers[key]
            out.append(f"{key} = {_toml(v)}" if v is not None else f"# {key}: no maximum")
        return "\n".join(out) + "\n"


def has_scratch(raw):
    return raw.get("scratch") is not None or raw.get("execute-dir") is not None


def _toml(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    from starter.state.store import dumps

    return dumps(str(v))        # a basic TOML string is a JSON string


def show_list(v):
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return str(v)


def norm_path(path):
    return "/" + "/".join(c for c in path.split("/") if c not in ("", "."))


def is_under(path, d):
    """Is `path` (normalised) `d` or below it?  A '..' anywhere: never."""
    if ".." in path.split("/"):
        return False
    return path == d or path.startswith(d.rstrip("/") + "/")


# ---------------------------------------------------------------- loading

# The parsed policy of the last file read, keyed by its identity: every
# start reads the policy, and tomllib costs ~12 ms to import here (it pulls
# in `re`), as much as the rest of a `starter run`.  marshal is built in and
# loads the cache in microseconds.  Root's alone, in root's /run.
CACHE = "/run/starter.policy-cache"


def load(path=PATH, cached=True):
    """The policy in `path`; the built-in one if there is no such file.
    cached=False: parse the file even if the cache has it (config check)."""
    from starter.storage import paths

    try:
        fd = paths.open_file(path, "node policy")
    except paths.MissingError:
        return Policy()
    except paths.LinkError as e:
        raise PolicyError(e.args[0], e.hint) from None
    try:
        _check_trusted(fd, path)
        st = os.fstat(fd)
        key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        pol = _cache_get(key) if cached else None
        if pol is not None:
            return pol
        from starter.fileio import read_limited

        data = read_limited(fd, MAX_SIZE)
    except OSError as e:
        raise PolicyError(f"node policy {path}: cannot read it: {e.strerror}") from None
    finally:
        os.close(fd)
    pol = parse(data, path)
    _cache_put(key, pol)
    return pol


def _cache_get(key):
    import marshal

    try:
        fd = os.open(CACHE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SIZE:
            return None
        got = marshal.loads(os.read(fd, MAX_SIZE))
        if not isinstance(got, tuple) or len(got) != 4 or got[0] != key:
            return None
        return Policy(key[0], got[1], got[2], got[3])
    except (OSError, ValueError, EOFError, TypeError):
        return None
    finally:
        os.close(fd)


def _cache_put(key, pol):
    """Best effort: a node where /run is not writable parses every time."""
    import marshal

    tmp = f"{CACHE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, marshal.dumps((key, pol.defaults, pol.callers, pol.lines)))
        finally:
            os.close(fd)
        os.replace(tmp, CACHE)
    except (OSError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _check_trusted(fd, path):
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise PolicyError(f"node policy {path}: must be owned by root and writable by no one else "
                          f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
                          f"chown root: {path} && chmod go-w {path}")
    d = os.path.dirname(path)
    while True:
        st = os.stat(d, follow_symlinks=False)
        if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise PolicyError(f"node policy {path}: its directory {d} must be owned by root and writable "
                              f"by no one else (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
                              f"chown root: {d} && chmod go-w {d}")
        if d == "/":
            return
        d = os.path.dirname(d)


def parse(data, path="<policy>"):
    """TOML text (bytes) -> Policy; every error one line naming file, line and key."""
    import tomllib

    try:
        text = data.decode("utf-8")
        doc = tomllib.loads(text)
    except UnicodeDecodeError:
        raise PolicyError(f"node policy {path}: not UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"node policy {path}: not valid TOML: {e}") from None
    except (ValueError, RecursionError) as e:
        raise PolicyError(f"node policy {path}: not usable TOML: {e}") from None
    lines = _key_lines(text)
    pol = Policy(path, lines=lines)

    def fail(key, detail, hint=None):
        line = lines.get(key)
        raise PolicyError(f"node policy {path}" + (f" line {line}" if line else "") + f", key {key}: {detail}",
                          hint)

    for top, val in doc.items():
        if top not in ("defaults", "callers"):
            fail(top, "unknown table (known: callers, defaults)")
        if not isinstance(val, dict):
            fail(top, "must be a table")
    for key, val in doc.get("defaults", {}).items():
        full = "defaults." + key
        if key not in DEFAULT_KEYS:
            fail(full, f"unknown key (known: {', '.join(sorted(DEFAULT_KEYS))})")
        opt, kind = DEFAULT_KEYS[key]
        try:
            pol.defaults[opt] = _check(kind, full, val)
        except SpecError as e:
            fail(full, e.detail, e.hint)
    for key, val in doc.get("callers", {}).items():
        full = "callers." + key
        if key not in CALLER_KEYS:
            fail(full, f"unknown key (known: {', '.join(sorted(CALLER_KEYS))})")
        try:
            pol.callers[key] = _check(CALLER_KEYS[key][0], full, val)
        except SpecError as e:
            fail(full, e.detail, e.hint)
    return pol


def _check(kind, key, val):
    """Validate one value; -> what apply() puts into a job's options."""
    from starter.spec import options as O

    def strings(v):
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise SpecError(key, "must be a list of strings")
        return v

    if kind == "user":
        val = str(val) if type(val) is int else V.string(key, val)
        V.user_or_id(key, val)
        return val
    if kind == "uids":
        if val == "none":
            return val
        from starter.callers import uids

        uids.parse_range(key, V.string(key, val))
        return val
    if kind == "gpus":
        if val != "slurm":
            raise SpecError(key, 'must be "slurm" (the GPUs the batch system gave the step)')
        return val
    if kind == "escape":
        if val not in ("kill", "report"):
            raise SpecError(key, "must be kill or report")
        return val
    if kind == "bool":
        if not isinstance(val, bool):
            raise SpecError(key, "must be true or false")
        return val
    if kind == "ifnames":
        return [V.ifname(key, x) for x in strings(val)]
    if kind == "cidrs":
        return [V.cidr(key, x) for x in strings(val)]
    if kind == "cidr":
        return V.cidr(key, V.string(key, val))
    if kind == "ip":
        return V.ip_address(key, V.string(key, val))
    if kind == "ipv6":
        return O.ipv6_mode(key, val)
    if kind == "ports":
        for p in strings(val):
            O.parse_host_port(key, p)
        return val
    if kind == "globs":
        out = []
        for g in strings(val):
            if not g.startswith("/") or "\0" in g or ".." in g.split("/"):
                raise SpecError(key, f"{V.show(g)} must be an absolute path or glob without '..'")
            out.append(g)
        return tuple(out)
    if kind == "transport":
        if val not in O.NET_TRANSPORTS:
            raise SpecError(key, f"{V.show(str(val))} is not one of {', '.join(O.NET_TRANSPORTS)}")
        return val
    if kind == "images":
        out = []
        for item in strings(val):
            if V.string(key, item).startswith("sha256:"):
                from starter.image.cache import CacheError, check_digest

                try:
                    out.append("sha256:" + check_digest(item))
                except CacheError as e:
                    raise SpecError(key, e.args[0]) from None
            elif item.startswith("/"):
                out.append(norm_path(V.host_path(key, item)))
            else:
                raise SpecError(key, f"{V.show(item)} is neither an absolute directory nor a sha256: digest")
        return tuple(out)
    if kind in ("dir", "dirs", "file"):
        items = strings(val) if kind == "dirs" else [val]
        out = []
        for d in items:
            # Absolute before anything else: a relative one would be
            # resolved against whoever's directory the policy is read in,
            # a caller's among them.
            if not V.string(key, d).startswith("/"):
                raise SpecError(key, f"{V.show(d)} must be an absolute path")
            out.append(norm_path(V.host_path(key, d)))
        return tuple(out) if kind == "dirs" else out[0]
    if kind == "run_dirs":
        out = []
        for d in strings(val):
            if not d.startswith("/") or "\0" in d or ".." in d.split("/") or not is_under(norm_path(d), "/run"):
                raise SpecError(key, f"{V.show(d)} must be /run or a path under it, without '..'")
            out.append(norm_path(d))
        return tuple(out)
    if kind == "modes":
        for m in strings(val):
            if m not in O.NET_MODES:
                raise SpecError(key, f"{V.show(m)} is not one of {', '.join(O.NET_MODES)}")
        return tuple(val)
    if kind in ("profile", "profiles"):
        items = [val] if kind == "profile" else strings(val)
        for p in items:
            O.seccomp_choice(V.string(key, p))
        return items[0] if kind == "profile" else tuple(items)
    if kind == "netrate":
        O.parse_net_rate(key, val)
        return val
    if kind == "rlimits":
        if not isinstance(val, dict):
            raise SpecError(key, 'must be a table of NAME = "SOFT[:HARD]"')
        items = []
        for k, v in val.items():
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise SpecError(f"{key}.{k}", 'must be "SOFT[:HARD]" or a number')
            item = f"{V.string(key, k)}={v}"
            O.parse_rlimit(key + "." + k, item)
            items.append(item)
        return items
    if isinstance(val, bool) or not isinstance(val, (int, float, str)):
        raise SpecError(key, "must be a number or a string")
    if kind == "size":
        V.size(key, val)
    elif kind == "cpus":
        V.number(key, val, 0.01, O.MAX_CPUS)
    elif kind == "weight":
        V.number(key, val, 1, 10000, integer=True)
    elif kind == "inodes":
        V.number(key, val, 16, O.MAX_DISK_INODES, integer=True)
    elif kind == "count":
        V.number(key, val, 0 if key == "callers.max_jobs" else 1, O.MAX_PIDS, integer=True)
    elif kind == "duration":
        V.duration(key, val, 0, O.MAX_WALL)
    return val


def _key_lines(text):
    """'table.key' -> the line it is set on (tomllib gives no positions):
    good enough for the two flat tables of this file."""
    lines, table = {}, ""
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("[") and not s.startswith("[["):
            table = s.strip("[] \t").split("#")[0].strip().strip("[]").strip()
            lines.setdefault(table, n)
            continue
        key, eq, _ = s.partition("=")
        key = key.strip().strip('"')
        if eq and key and not s.startswith("#"):
            lines.setdefault(f"{table}.{key}" if table else key, n)
    return lines
