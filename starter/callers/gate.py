"""The caller gate: what a caller that is not root may not ask for, in one
place.  After the set-user-ID launcher, every line of the starter runs as
root on the caller's argv, job file and paths.  RULES lists each refusal,
the [callers] key of the node policy that allows or caps it (None: there is
no key, the answer is always no) and the function that enforces it.  The
checks of the [callers] table are here (apply: check, the node's defaults,
cap; spec.build calls it for such a caller); the others happen where they
must (a path is checked as it is opened) and RULES names them.  tests/unit/test_registry.py checks that every
[callers] key has a rule and that every function named exists.
"""

import os

from starter.callers.policy import (CALLER_KEYS, FLAG_KEYS, LIMIT_KEYS, PATH, ROOT_ONLY, PolicyError, has_scratch,
                                    is_under, norm_path, show_list)
from starter.errors import SpecError
from starter.spec import values as V

# (what a caller may not do, [callers] key, where it is refused): "where" is
# module:function, or native/FILE.c:function for the launcher's C side.
RULES = (
    # the launcher (C), before any Python runs as root
    ("run as root from an installation a user could write", None, "native/launcher_relay.c:check_install"),
    ("set the starter's own STARTER_* variables", None, "native/launcher_relay.c:caller_run"),
    ("hand root its environment, umask, signal dispositions or mask", None, "native/launcher_relay.c:root_half"),
    ("lower root's CPU, file-size, data, address-space, stack or process limits", None,
     "native/launcher_relay.c:set_root_limits"),
    ("signal, stop or trace the root starter (only the relay's bytes reach it)", None,
     "native/launcher_relay.c:relay"),
    # the node policy's [callers] table
    ("start a job at all", "allow", "starter.callers.gate:check"),
    ("run as another user or group", None, "starter.callers.gate:check"),
    ("set a node setting (" + ", ".join(ROOT_ONLY) + ")", None, "starter.callers.gate:check"),
    ("a network mode not allowed", "net", "starter.callers.gate:check"),
    ("a job network (--net job) under an id but its own Slurm job's", None,
     "starter.callers.slurmstep:step_of"),
    ("a job network whose nodes are not in the node's LAN", None, "starter.spec.jobspec:_peers_in_lan"),
    ("join another job's or user's part of a job network", None, "starter.job.run:_owner_namespaces"),
    ("reach a port of the node's loopback but its step's PMIx server", None, "starter.job.run:Job._bridge"),
    ("a seccomp profile not allowed", "seccomp", "starter.callers.gate:check"),
    ("an image outside the allowed directories and digests", "images", "starter.callers.gate:_check_image"),
    ("bind a source outside the allowed directories", "bind", "starter.callers.gate:_check_mount"),
    ("bind read-only a source outside the allowed directories", "ro_bind", "starter.callers.gate:_check_mount"),
    ("mount at a destination outside the allowed ones", "mount_destinations", "starter.callers.gate:_check_mount"),
    ("a scratch outside the execute directories", "execute_dirs", "starter.callers.gate:check"),
    ("raise a resource limit above the node's hard limit", None, "starter.callers.gate:_check_rlimit"),
    ("GPUs by name (--gpus slurm is the step's own)", "gpus", "starter.callers.gate:check"),
    ("a device outside the allowed globs", "devices", "starter.callers.gate:_check_device"),
    ("be uid 0 in a user namespace", "userns_root", "starter.callers.gate:check"),
    ("let the job create user namespaces", "allow_userns", "starter.callers.gate:check"),
    ("manage its own cgroup subtree", "delegate", "starter.callers.gate:check"),
    ("keep an init as PID 1", "init", "starter.callers.gate:check"),
    ("more memory than the maximum", "max_memory", "starter.callers.gate:cap"),
    ("more CPUs than the maximum", "max_cpus", "starter.callers.gate:cap"),
    ("more processes than the maximum", "max_pids", "starter.callers.gate:cap"),
    ("a longer wall time than the maximum", "max_wall_time", "starter.callers.gate:cap"),
    ("a larger --disk than the maximum", "max_disk", "starter.callers.gate:cap"),
    ("a higher bandwidth cap than the maximum", "max_net_rate", "starter.callers.gate:cap"),
    ("more jobs at once than the maximum", "max_jobs", "starter.callers.caller:Caller.job_slot"),
    # where a path or a process is at hand
    ("its job's cgroups under a parent it could write, or inside a job", None,
     "starter.cgroups.backend:Backend.check_caller_parents"),
    ("read, write or bind what it could not open itself", None, "starter.callers.caller:Caller.rights"),
    ("a report where it could not write", None, "starter.observe.report:Dest.check_writable"),
    ("a scratch in an execute directory it cannot enter", None, "starter.job.run:Job.make_scratch"),
    ("restore another user's checkpoint", None, "starter.checkpoint.directory:load"),
)


def apply(pol, raw, caller):
    """Policy.apply for a caller that is not root: refuse what it may not
    ask for, fill in the node's defaults, then cap its limits."""
    check(pol, raw, caller)
    asked_rate = raw.get("net-rate")      # the caller's own, before the node's defaults
    pol.apply(raw)
    cap(pol, raw, asked_rate)
    return raw


def _refuse(pol, what, key, hint=None):
    c = pol.callers
    raise PolicyError(f"{what}: not allowed for callers that are not root by {pol.where('callers.' + key)}",
                      hint or f"ask the node's admin, or run without it (allowed now: {show_list(c.get(key))})")

def check(pol, raw, caller):
    """Refuse what `raw` (run option -> value, the command line and the job
    file merged) asks for that the policy `pol` does not allow `caller`."""
    c = pol.callers
    if not c["allow"]:
        raise PolicyError(f"starter run is for root only on this node ({pol.where('callers.allow')})",
                          "ask the node's admin to set callers.allow = true")
    for opt in ("user", "group"):
        v = raw.get(opt)
        if v is not None and not caller.is_self(opt, v):
            raise PolicyError(f"--{opt} {V.show(str(v))}: a caller that is not root runs its jobs as itself",
                              f"leave out --{opt}: the job runs as uid {caller.uid}, gid {caller.gid}")
    for opt in ROOT_ONLY:
        if raw.get(opt) not in (None, [], ()):
            raise PolicyError(f"--{opt}: a node setting; only root sets it for a job",
                              f"the node's admin sets it in {pol.path or PATH} ([defaults])")
    for opt, key in FLAG_KEYS.items():
        if raw.get(opt) is True and not c[key]:
            _refuse(pol, f"--{opt}", key, f"ask the node's admin to set callers.{key} = true")
    if raw.get("image") is not None:
        _check_image(pol, raw["image"])
    net = raw.get("net", "none")
    if net not in c["net"]:
        _refuse(pol, f"--net {V.show(str(net))}", "net")
    seccomp = raw.get("seccomp", pol.defaults.get("seccomp", "default"))
    if seccomp not in c["seccomp"]:
        _refuse(pol, f"--seccomp {V.show(str(seccomp))}", "seccomp")
    for kind, item in raw.get("mounts") or ():
        _check_mount(pol, kind, item)
    for opt in ("execute-dir", "scratch"):
        v = raw.get(opt)
        if v is None:
            continue
        d = norm_path(str(v)) if opt == "execute-dir" else os.path.dirname(norm_path(str(v)))
        allowed = list(c["execute_dirs"]) + ([pol.defaults["execute-dir"]] if "execute-dir" in pol.defaults else [])
        if d not in allowed:
            raise PolicyError(f"--{opt} {V.show(str(v))}: {'it' if opt == 'execute-dir' else 'its parent'} "
                              f"is not an execute directory of {pol.where('callers.execute_dirs')}",
                              f"leave it out (the node's default) or use one of: {show_list(allowed)}")
    for item in raw.get("rlimit") or ():
        _check_rlimit(pol, item)
    # --gpus slurm gives only what the step already has (devices.may_open).
    if raw.get("gpus") not in (None, "", [], "slurm") and not c["gpus"]:
        _refuse(pol, "--gpus", "gpus", "ask the node's admin to set callers.gpus = true")
    for item in raw.get("device") or ():
        _check_device(pol, item)

def _check_device(pol, item):
    """--device PATH[:rwm]: PATH (normalised, no '..') must match one of
    callers.devices (fnmatch globs: /dev/nvidia*, /dev/fuse)."""
    from fnmatch import fnmatchcase

    from starter.isolate import devices as D

    try:
        path = norm_path(V.host_path("device", D.split_access("device", item)[0]))
    except SpecError:
        return          # spec says what is wrong with it
    globs = pol.callers["devices"]
    if ".." in path.split("/") or not any(fnmatchcase(path, g) for g in globs):
        _refuse(pol, f"--device {V.show(str(item))}", "devices",
                     f"pass only devices matching: {show_list(globs) or 'none on this node'}")

def _check_mount(pol, kind, item):
    from starter.isolate import mounts as M

    try:
        m = M.Mount.parse(kind, V.string(kind, item))
    except SpecError:
        return          # spec says what is wrong with it
    c = pol.callers
    if kind != "tmpfs":
        src = norm_path(m.src)
        dirs = c["bind"] + (c["ro_bind"] if kind == "ro-bind" else ())
        if not any(is_under(src, d) for d in dirs):
            key = "bind" if kind == "bind" else "ro_bind"
            _refuse(pol, f"--{kind} {V.show(m.src)}", key,
                         f"bind only what is under: {show_list(dirs) or 'nothing on this node'}")
        if norm_path(m.dst) == src:
            return
    if not any(is_under(norm_path(m.dst), d) for d in c["mount_destinations"]):
        _refuse(pol, f"--{kind} {V.show(item)}: destination {V.show(m.dst)}", "mount_destinations",
                     "bind a source at its own path, or mount under: "
                     f"{show_list(c['mount_destinations']) or 'nothing on this node'}")

def _check_image(pol, ref):
    """--image REF: a digest the policy lists, or a file under one of its
    directories (opened later with the caller's rights: job/run.py)."""
    ref = V.string("image", ref)
    allowed = pol.callers["images"]
    if ref.startswith("sha256:"):
        ok = ref in allowed
    else:
        path = norm_path(V.host_path("image", ref))
        ok = any(is_under(path, d) for d in allowed if d.startswith("/"))
    if not ok:
        _refuse(pol, f"--image {V.show(ref)}", "images",
                f"use an image under, or with a digest of: {show_list(allowed) or 'nothing on this node'}")


def _check_rlimit(pol, item):
    """A caller's --rlimit may only lower the node's hard limit: the one
    every job gets without asking, a number (the node policy's
    defaults.rlimits, else the built-in table, sigpending's threads-max
    / 2 included).  Not the starter's own getrlimit: the set-user-ID
    launcher keeps the caller's nice, rtprio, sigpending and memlock
    limits, so there it is the caller's.  "unlimited" passes only an
    unlimited node limit."""
    from starter.spec import options as O

    try:
        name, soft, hard = O.parse_rlimit("rlimit", item)
    except SpecError:
        return
    node = {n: h for n, _, h in (O.parse_rlimit("rlimit", r) for r in pol.defaults.get("rlimit", ()))}
    limit = node[name] if name in node else O.rlimit_table()[O.RLIMIT_NAMES.index(name)][2]
    if hard > limit:
        raise PolicyError(f"--rlimit {V.show(str(item))}: above the node's hard limit for {name} "
                          f"({'unlimited' if limit == O.RLIM_INFINITY else limit})",
                          "a caller that is not root may only lower resource limits")

# How a capped value and its maximum compare: by the kind of check its
# [callers] key gets (CALLER_KEYS: the capped option's own, spec/registry.py).
def _number(opt, x):
    return V.number(opt, x, 0, 1 << 62)


CAP_VALUES = {"size": V.size, "duration": lambda opt, x: V.duration(opt, x, 0.001, 1e9),
              "cpus": _number, "count": _number}


def cap(pol, raw, asked_rate=None):
    """A caller's limits never exceed the maxima; a job that asks for none
    gets the maximum (the node's default where it is lower)."""
    cap = pol.callers["max_net_rate"]
    if cap is not None and raw.get("net") == "nat":
        from starter.spec import options as O

        asked = dict(O.parse_net_rate("net-rate", asked_rate)) if asked_rate else {}
        most = dict(O.parse_net_rate("callers.max_net_rate", cap))
        for zone, bits in asked.items():
            if bits > most.get(zone, bits):
                raise PolicyError(f"--net-rate: {zone.replace('_', '-')} {O.format_rate(bits)} is above the "
                                  f"maximum {O.format_rate(most[zone])} of {pol.where('callers.max_net_rate')}",
                                  f"ask for at most {cap}")
        zones = dict(O.parse_net_rate("net-rate", raw["net-rate"])) if raw.get("net-rate") else {}
        for zone, bits in most.items():
            zones[zone] = min(zones.get(zone, bits), bits)
        raw["net-rate"] = O.format_net_rate(zones)
    for opt, key in LIMIT_KEYS.items():
        cap = pol.callers[key]
        if cap is None or opt == "net-rate":    # a rate is capped per zone, above
            continue
        v = raw.get(opt)
        if v is None:
            if opt != "disk" or has_scratch(raw):
                raw[opt] = cap
            continue
        parse = CAP_VALUES[CALLER_KEYS[key][0]]
        if parse(opt, v) > parse(opt, cap):
            raise PolicyError(f"--{opt} {V.show(str(v))}: above the maximum {cap} of {pol.where('callers.' + key)}",
                              f"ask for at most {cap}")
