"""The job description: JobSpec (and its parts Limits and Network), every
field validated once, and build(): a job file's values and the command
line's (the command line wins) merged, the node policy applied, and one
checked JobSpec made.  Everything that later reaches the kernel, a file
name, nft or a cgroup path has been checked here or in the parsers this
module calls (spec/options.py: one option each; jobfile.py: the job file);
other modules trust a JobSpec.

Plain classes with __slots__ instead of dataclasses: `import dataclasses`
costs ~13 ms of interpreter time here, and every job pays it.
"""

import os

from starter.isolate import mounts as M
from starter.spec import values as V
from starter.errors import SpecError
# The option parsers; policy, admin, job, cli and tests name some as spec.X.
from starter.spec.options import IPV6_MODES, MAX_CPUS, MAX_DISK_INODES, MAX_PIDS, MAX_WALL, NAT_MODES, NET_MODES  # noqa: F401
from starter.spec.options import DEFAULT_NET_KEY, NET_TRANSPORTS
from starter.spec.options import ipv6_mode, seccomp_choice
from starter.spec.options import DEFAULT_RLIMITS, RLIM_INFINITY, THREAD_VARS, caller_user, check_cwd, parse_env, parse_host_port, parse_io_max, parse_net_rate, parse_mount, parse_on_signal, parse_require, parse_rlimit, resolve_group, resolve_user, rlimit_table, own_cpus, state_dir, thread_count

MAX_ARGS = 4096
MAX_MEMORY = V.MAX_SIZE
MAX_GRACE = 3600
MIN_DISK = 1 << 20             # --disk: smaller than an ext4 image's metadata is no use
KILL_TIMEOUT = 10.0           # $STARTER_KILL_TIMEOUT: then the job's processes are "unkillable"

REPORT_FORMATS = ("json", "classad")
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
    IPv4 one (starter.net.NetConfig); rate: ((zone, bits/s), ...) bandwidth
    caps (--net-rate, starter/net/shaping.py), None: uncapped."""

    __slots__ = ("mode", "lan", "pool", "uplink", "allow_host_ports", "resolver", "ipv6", "pool6", "rate",
                 "overlay")
    DEFAULTS = {"mode": "none", "lan": (), "uplink": (), "allow_host_ports": (), "ipv6": "auto", "rate": None,
                "overlay": None}


class Overlay(Spec):
    """mode job: the job's network across its nodes (starter/net/overlay.py).
    net_id: the same on every node; vni: its VXLAN id; node: this node's
    name; peers: ((name, fabric address), ...) in the order every node
    expands them (this node among them); transport: vxlan or wireguard;
    key: wireguard's node network key (a path)."""

    __slots__ = ("net_id", "vni", "node", "peers", "transport", "key")
    DEFAULTS = {}


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
        "asked", "restore", "on_vacate", "checkpoint_every", "image", "image_cache", "image_digest",
        "require",
    )
    DEFAULTS = {
        "grace": 10.0, "init": False, "mounts": (), "env": None, "groups": (),
        "on_signal": (), "keep_scratch": False, "report_format": "json",
        "seccomp": "default", "allow_userns": False, "userns_root": False, "rlimits": (),
        "oom_policy": "kill", "kill_timeout": KILL_TIMEOUT,
        "delegate": False, "transient": None, "escape": "report",
        "devices": (), "gpus": (), "ptys": M.PTYS_DEFAULT, "image": None, "image_cache": None, "image_digest": None,
        "require": (),
    }


# ---------------------------------------------------------------- building

# Option name -> (JobSpec path, parser).  The job file uses the same names.
def build(cli, job_file=None, policy=None, caller=None):
    """Merge a job file (dict, already parsed) and command-line values (dict
    of option name -> value, only those given) into a checked JobSpec, with
    the node policy's defaults where neither gives a value; for a caller
    that is not root (starter/callers/caller.py), the policy's [callers] table
    decides what it may ask for, and the job runs as the caller."""
    if job_file:
        from starter.spec import jobfile

        raw = dict(jobfile.flatten(job_file))
    else:
        raw = {}
    for k, v in cli.items():
        if k in ("env", "env-pass", "mounts", "lan", "uplink", "allow-host-port", "on-signal", "rlimit", "io-max",
                 "device") and k in raw:
            if not isinstance(raw[k], list):    # as the file gives it alone, checked there
                raise SpecError(k, f"must be a list in the job file, got {type(raw[k]).__name__}")
            raw[k] = raw[k] + list(v)             # repeatable: file first, then flags
        else:
            raw[k] = v
    # What the job asked for, before the node's policy: kept in its state
    # entry, so a checkpoint can be restored under the restoring node's policy.
    asked = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in raw.items()}
    if policy is not None and caller is not None:
        from starter.callers import gate     # only for a caller that is not root

        gate.apply(policy, raw, caller)
    elif policy is not None:
        policy.apply(raw)
    return _make(raw, caller, asked)


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


# What a task of a multi-node job needs of its launcher to find its peers
# (Slurm's step, PMIx's and PMI-2's wire-up): passed to every --net job job.
JOB_ENV_PASS = ("SLURM_*", "PMIX_*", "PMI_*")


def passed_env(patterns, environ):
    """--env-pass: the variables of `environ` whose name is one of `patterns`
    (NAME, or PREFIX* for every name that starts with PREFIX), never the
    starter's own STARTER_*."""
    if not patterns:
        return {}       # (every job: no walk of the environment)
    names, prefixes = set(), []
    for p in patterns:
        p = V.string("env-pass", p)
        bare = p[:-1] if p.endswith("*") else p
        if not bare or not (bare.replace("_", "").isalnum() and bare.isascii()) or bare[0].isdigit():
            raise SpecError("env-pass", f"{V.show(p)} is not NAME or PREFIX* (letters, digits and _)")
        if p.endswith("*"):
            prefixes.append(bare)
        else:
            names.add(bare)
    prefixes = tuple(prefixes)
    return {k: v for k, v in environ.items()
            if not k.startswith("STARTER_") and (k in names or (prefixes and k.startswith(prefixes)))}


def network_from(raw, environ=os.environ, caller=None):
    """The job's Network from the run options in `raw` (also how netd reads
    the node policy's NAT defaults: net/netd.py, node_config); environ: the
    starter's (a caller's: Caller.environ()), where --net job finds what
    Slurm gives it."""
    mode = V.string("net", raw.get("net", "none"))
    if mode not in NET_MODES:
        raise SpecError("net", f"{V.show(mode)} is not one of {', '.join(NET_MODES)}")
    if mode not in NAT_MODES:
        for k in ("lan", "pool", "uplink", "allow-host-port", "resolver", "ipv6", "pool6", "net-rate"):
            if raw.get(k):
                raise SpecError(k, "only applies with --net nat or job")
    if mode != "job":
        for k in ("peers", "net-id", "node", "net-transport", "net-key"):
            if raw.get(k):
                raise SpecError(k, "only applies with --net job")
    # Several uplinks: the host's routing picks one per destination; each is
    # masqueraded and counted.  Order does not matter; repeats are dropped.
    uplink = tuple(dict.fromkeys(V.ifname("uplink", u) for u in _list("uplink", raw.get("uplink") or [])))
    lan = tuple(V.cidr("lan", c) for c in _list("lan", raw.get("lan", [])))
    resolver = raw.get("resolver")
    if resolver is not None:
        resolver = V.ip_address("resolver", resolver)
    return Network(
        mode=mode, ipv6=ipv6_mode("ipv6", raw.get("ipv6") or "auto"),
        pool6=V.cidr("pool6", raw["pool6"]) if raw.get("pool6") else None,
        lan=lan,
        pool=V.cidr("pool", raw["pool"]) if raw.get("pool") else None,
        uplink=uplink,
        allow_host_ports=tuple(parse_host_port("allow-host-port", p) for p in _list("allow-host-port", raw.get("allow-host-port", []))),
        resolver=resolver,
        rate=parse_net_rate("net-rate", raw["net-rate"]) if raw.get("net-rate") else None,
        overlay=overlay_from(raw, environ, caller, lan) if mode == "job" else None,
    )


def overlay_from(raw, environ, caller=None, lan=()):
    """--net job's Overlay from --peers, --net-id and --node, each by default
    what Slurm gives the job's processes (SLURM_JOB_NODELIST, SLURM_JOB_ID,
    SLURMD_NODENAME; the host's name for the node).  For a caller that is
    not root (its environment its own word): the id is its Slurm job's,
    proven by its slurmstepd (callers/slurmstep.py), and every peer must be
    in the node's LAN (--lan, the node policy's): its part's VXLAN frames,
    sent by the host, go nowhere else."""
    from starter.spec import peers as P

    def given(opt, var, what):
        v = raw.get(opt) or environ.get(var)
        if not v:
            raise SpecError(opt, f"--net job needs {what}", f"give --{opt}, or run it under Slurm (${var})")
        return v

    if caller is not None:
        net_id = caller.slurm_step().job
    else:
        net_id = V.string("net-id", given("net-id", "SLURM_JOB_ID", "the job network's id"))
    vni = P.vni_of("net-id", net_id)
    peers = P.parse("peers", given("peers", "SLURM_JOB_NODELIST", "the job's nodes"), P.resolve)
    if caller is not None:
        _peers_in_lan(peers, lan)
    node = raw.get("node") or environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    node = V.hostname("node", node)
    if node not in dict(peers):
        raise SpecError("node", f"this node, {node}, is not one of the job's nodes in --peers",
                        "give this node's name there with --node")
    transport = V.string("net-transport", raw.get("net-transport") or "vxlan")
    if transport not in NET_TRANSPORTS:
        raise SpecError("net-transport", f"{V.show(transport)} is not one of {', '.join(NET_TRANSPORTS)}")
    if raw.get("net-key") and transport != "wireguard":
        raise SpecError("net-key", "only applies with --net-transport wireguard")
    key = V.host_path("net-key", raw.get("net-key") or DEFAULT_NET_KEY) if transport == "wireguard" else ""
    if key and not key.startswith("/"):
        raise SpecError("net-key", f"{V.show(key)} must be an absolute path")
    return Overlay(net_id=net_id, vni=vni, node=node, peers=peers, transport=transport, key=key)


def image_cache(value=None):
    """--image-cache, else $STARTER_IMAGE_CACHE (root's: a caller's
    environment is emptied), else /var/lib/starter/images."""
    value = value or os.environ.get("STARTER_IMAGE_CACHE")
    if value is None:
        from starter.image.cache import DEFAULT_CACHE

        value = DEFAULT_CACHE
    return V.host_path("image-cache", value)


def image_pin(raw):
    """--image-digest: the digest the image must have (a job file pins its
    image so); only with --image."""
    pin = raw.get("image-digest")
    if pin is None:
        return None
    if raw.get("image") is None:
        raise SpecError("image-digest", "only applies with --image")
    pin = image_ref("image-digest", pin)
    if not pin.startswith("sha256:"):
        raise SpecError("image-digest", f"{V.show(pin)} is not sha256:HEX")
    return pin


def image_ref(field, value):
    """--image: "sha256:<hex>" (an image in the node's cache) or a file's
    path (a squashfs or SIF file, imported into the cache first)."""
    value = V.string(field, value)
    if value.startswith("sha256:"):
        from starter.image.cache import CacheError, check_digest

        try:
            return "sha256:" + check_digest(value)
        except CacheError as e:
            raise SpecError(field, e.args[0], e.hint) from None
    return V.host_path(field, value)


def _peers_in_lan(peers, lan):
    """A caller's peers (its word: $SLURM_JOB_NODELIST) must be nodes of the
    node's LAN."""
    import ipaddress

    if not lan:
        raise SpecError("net", "--net job for a caller needs the node's LAN (its fabric) to check the job's nodes against",
                        "the node's admin sets [defaults] lan in the node policy")
    nets = [ipaddress.ip_network(c, strict=False) for c in lan]
    for name, addr in peers:
        a = ipaddress.ip_address(addr)
        if not any(a.version == n.version and a in n for n in nets):
            raise SpecError("net", f"node {name} of the job ({addr}) is not in the node's LAN ({', '.join(lan)})",
                            "a caller's job network reaches the nodes of the LAN only")


def _make(raw, caller=None, asked=None):
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
        # job starts (starter/callers/uids.py), from the policy's range.
        from starter.callers import uids

        transient = uids.parse_range("job_uids", raw.get("job-uids") or
                                     f"{uids.DEFAULT_FIRST}-{uids.DEFAULT_FIRST + uids.DEFAULT_COUNT - 1}")
        uid = gid = None
        groups, home, uname = (), "/", None
        if group is not None:
            gid = resolve_group(group)     # a transient uid in a named group
    else:
        uid, gid, groups, home, uname = resolve_user(user, group)
    if user is None:
        user = uname  # recorded in the state entry: who the job runs as

    given_env = parse_env("env", _list("env", raw.get("env", [])))
    env = {"PATH": DEFAULT_PATH, "HOME": home or "/"}
    if uname:
        env["USER"] = env["LOGNAME"] = uname
    # Passed from the caller's own environment (its word, as --env is; read
    # only for a job that takes something of it).
    passed = _list("env-pass", raw.get("env-pass", [])) + (list(JOB_ENV_PASS) if raw.get("net") == "job" else [])
    environ = os.environ if caller is None else caller.environ() if passed else {}
    env.update(passed_env(passed, environ))

    # Devices by assignment only (starter/isolate/devices.py): each node bound at its
    # host path and allowed by the job's cgroup; GPUs with their control nodes.
    devices, gpus = [], ()
    if raw.get("device") or raw.get("gpus") not in (None, "", []):
        from starter.isolate import devices as D

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
    threads = thread_count(limits.cpus, limits.cpuset, own_cpus())
    if threads is not None:
        env.update(dict.fromkeys(THREAD_VARS, str(threads)))
    env.update(given_env)           # the job's own word wins

    network = network_from(raw, environ, caller)

    def opt_path(key, must_exist=False):
        v = raw.get(key)
        if v is None:
            return None
        from starter.job import watchdog

        with watchdog.region(f"--{key} {v}"):   # a stat, maybe on a hung mount
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

    on_vacate = raw.get("on-vacate")
    if on_vacate is not None:
        on_vacate = V.string("on-vacate", on_vacate)
        if not on_vacate.startswith("checkpoint:") or len(on_vacate) == 11:
            raise SpecError("on-vacate", f"{V.show(on_vacate)} is not checkpoint:DIR")
        on_vacate = V.host_path("on-vacate", on_vacate[11:])
    every = raw.get("checkpoint-every")
    if every is not None:
        every = V.duration("checkpoint-every", every, 1, MAX_WALL)
        if on_vacate is None:
            raise SpecError("checkpoint-every", "needs --on-vacate checkpoint:DIR (where the images are kept)")

    cwd = raw.get("cwd")
    return JobSpec(
        image=image_ref("image", raw["image"]) if raw.get("image") is not None else None,
        image_cache=image_cache(raw.get("image-cache"))
        if raw.get("image") is not None or raw.get("image-cache") is not None else None,
        image_digest=image_pin(raw),
        on_vacate=on_vacate, checkpoint_every=every,
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
        seccomp=seccomp_choice(raw.get("seccomp", "default")),
        allow_userns=_bool("allow-userns", raw.get("allow-userns", False)),
        userns_root=userns_root,
        rlimits=tuple(rlimits.values()),
        oom_policy=oom_policy,
        delegate=_bool("delegate", raw.get("delegate", False)),
        transient=transient,
        # What happens to the job's processes found outside its cgroup at the
        # end (starter/job/strays.py): the policy's choice, per kind of uid.
        escape=raw.get("escape-transient" if transient else "escape-named") or ("kill" if transient else "report"),
        devices=tuple(devices), gpus=gpus, ptys=ptys, asked=asked,
        require=parse_require("require", _list("require", raw.get("require", []))),
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


def load_job_file(path):
    """jobfile.load_job_file: the job file read and parsed (loaded only then)."""
    from starter.spec import jobfile

    return jobfile.load_job_file(path)
