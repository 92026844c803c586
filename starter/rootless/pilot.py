"""What a starter without root does differently (package docstring).

begin() is `starter run`'s first step for a caller that is not root and
has no set-user-ID launcher: it enters the starter's own user namespace
(userns.py) and sets what the rest of the start reads: the state directory
(the pilot's runtime directory), the job's ids, and the pilot's policy.
From then on the start is root's, inside that namespace, but for what
needs the host's root: no netd, no NAT table (the user-mode network,
net/usermode.py, instead), no --disk loop device, no images, no node policy.

Which of the guarantees root mode gives this start cannot give, and why, is
`not_enforced()`: the report's `not_enforced`, and what `--require` refuses.
"""

import os

from starter.errors import StarterError

ACTIVE = None           # the Pilot, once begin() ran (userns.Pilot)
ACTIVE_STATE = None     # its state directory



def begin(given_state_dir=None):
    """Enter the starter's user namespace; -> the Pilot.  Its state
    directory (and beside it the leases): the one given (--state-dir), else
    $STARTER_STATE_DIR, else state_dir(); made if missing."""
    global ACTIVE, ACTIVE_STATE
    from starter.rootless import userns

    pilot = userns.who()
    userns.enter(pilot)
    os.environ.setdefault("STARTER_STATE_DIR", state_dir(pilot))
    ACTIVE_STATE = os.path.abspath(given_state_dir or os.environ["STARTER_STATE_DIR"])
    try:
        os.makedirs(ACTIVE_STATE, 0o700, exist_ok=True)
    except OSError as e:
        raise StarterError(f"the state directory {ACTIVE_STATE}: {e.strerror}",
                           "set --state-dir, $STARTER_STATE_DIR or $XDG_RUNTIME_DIR to a directory of the pilot's")
    ACTIVE = pilot
    _leases()
    return pilot


def join_job(state_dir_, job_id):
    """An admin command of the pilot's on one of its jobs (`starter enter`,
    status, vacate ...): into the user namespace of the job's starter, whose
    0 is the pilot.  The job's process names it; the namespace is checked to
    be one the pilot owns (not the host's), and the process to be the one
    the entry names (the pidfd, after the open)."""
    import fcntl

    from starter.isolate.ns import setns
    from starter.state import store as S

    global ACTIVE, ACTIVE_STATE
    NS_GET_OWNER_UID = 0xB704
    st = S.load(state_dir_, job_id)
    if not st:
        raise StarterError(f"no job {job_id!r} in {state_dir_}: this user's own jobs, started without root, are "
                           "there", "a job of root's starter needs root (`starter ps` lists this user's)")
    pid = st.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise StarterError(f"job {job_id} is not running (state {st.get('state')!r})")
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise StarterError(f"job {job_id}: its process {pid}: {e.strerror}") from None
    try:
        import array

        buf = array.array("I", [0])
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buf, True)
        host = os.stat("/proc/1/ns/user") if os.access("/proc/1/ns/user", os.R_OK) else None
        mine = os.fstat(fd)
        if buf[0] != os.getuid() or (host is not None and (host.st_dev, host.st_ino) == (mine.st_dev, mine.st_ino)):
            raise StarterError(f"job {job_id} is not one of this pilot's (its user namespace is uid {buf[0]}'s)")
        from starter.rootless import userns

        ACTIVE = userns.who()
        setns(fd, 0x10000000)
    except OSError as e:
        raise StarterError(f"job {job_id}: joining its user namespace failed: {e.strerror}") from None
    finally:
        os.close(fd)
    ACTIVE_STATE = state_dir_
    _leases()


def _leases():
    from starter.callers import uids

    # Beside the state directory, as root's /run/starter-uids is beside /run/starter.
    uids.PILOT_LEASES = os.path.join(os.path.dirname(os.path.normpath(ACTIVE_STATE)), "starter-uids")


def state_dir(pilot):
    """The pilot's jobs' state: $XDG_RUNTIME_DIR/starter, else under its home."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and run.startswith("/"):
        return os.path.join(run, "starter")
    return os.path.join(pilot.home, ".starter", "run")


def default_state_dir():
    """`starter ps` and the other commands of a pilot that is not root:
    where its `starter run` keeps its jobs' state (never /run/starter)."""
    from starter.rootless import userns

    return state_dir(userns.who())


def policy(pilot):
    """The pilot's policy: no node policy applies (it is root's, for root's
    starter); the job's ids come from the pilot's namespace."""
    from starter.callers.policy import Policy

    rng = pilot.payload_range()
    return Policy(defaults={"job-uids": f"{rng[0]}-{rng[1]}"} if rng else {"job-uids": "none", "user": "0"})


ROOT_ONLY = {   # run options that need the host's root, with why
    "disk": "a --disk file system is a loop device",
    "image": "an image is a loop device's squashfs",
    "net-id": "a --net job network is the node's",
    "user": "a pilot's job runs under its own mapped id",
    "group": "a pilot's job runs under its own mapped id",
    "restore": "CRIU restores as root",
    "on-vacate": "CRIU dumps as root",
}


def check_values(values):
    """Refuse, in one line, an option a starter without root cannot honour."""
    _check_net(values.get("net"))
    for opt, why in ROOT_ONLY.items():
        if values.get(opt) is not None:
            raise StarterError(f"--{opt} needs the host's root: {why}",
                               "run this job through a root starter, or leave the option out")


def check_spec(js):
    """The same for what the job file asked; -> the spec with the pilot's
    identity where its namespace maps only 0."""
    if js.image is not None or js.limits.disk is not None or js.on_vacate:
        raise StarterError("--image, --disk and --on-vacate need the host's root (a loop device, CRIU)",
                           "run this job through a root starter, or leave them out")
    _check_net(js.network.mode)
    if ACTIVE.mapped and js.transient is None or not ACTIVE.mapped and js.uid != 0:
        raise StarterError("--user needs the host's root: a pilot's job runs under its own mapped id",
                           "leave user out of the job file")
    if js.transient is None:
        env = dict(js.env)
        env["HOME"] = ACTIVE.home
        env["USER"] = env["LOGNAME"] = ACTIVE.name
        js = js.replace(uid=0, gid=0, groups=(), user=ACTIVE.name, home=ACTIVE.home, env=env)
    return js


def cgroup_backend(parent):
    """The pilot's cgroups: the host's backend where every directory its
    jobs' cgroups go in is the pilot's to write (delegated: made, or to be
    made, in a cgroup that is the pilot's), else none (cgroups/nocgroup.py)."""
    from starter import cgroups
    from starter.cgroups import nocgroup

    try:
        backend = cgroups.open_backend(parent)
    except StarterError:
        return nocgroup.NoBackend()
    for d in backend.distinct_parents():
        probe = d if os.path.isdir(d) else os.path.dirname(d)
        if not (os.access(probe, os.W_OK) and os.access(os.path.join(probe, "cgroup.procs"), os.W_OK)):
            if parent is not None:
                raise StarterError(f"--cgroup-parent {parent}: {probe} is not delegated to {ACTIVE.name}",
                                   "name a cgroup the pilot was given (its directory and cgroup.procs "
                                   "its own), or leave --cgroup-parent out")
            return nocgroup.NoBackend()
    return backend


def _check_net(mode):
    if mode not in (None, "none", "host", "nat"):
        raise StarterError(f"--net {mode} needs the host's root",
                           "a pilot's job has --net nat (a user-mode network), none or host")


def not_enforced(pilot, cgroup_kind, net_mode):
    """[(guarantee, why)] that this job goes without (pilot None: root's
    starter, which lacks only what the job itself gave up)."""
    out = []
    if cgroup_kind == "none":
        why = "no cgroup is delegated to the pilot"
        out += [("memory", why), ("cpu", why), ("pids", why),
                ("kill", why + ": the job is ended through its PID namespace's init"),
                ("freeze", why), ("accounting", why)]
    if pilot is not None and not pilot.mapped:
        out.append(("own-uid", f"no subordinate ids ({pilot.why_unmapped or 'none mapped'}): "
                               "the job runs as the pilot's uid"))
    if net_mode == "host":
        out.append(("network", "--net host"))
    return out


def check_required(required, missing):
    """--require: refuse the job, in one line, where a guarantee it names is
    missing (not_enforced's list)."""
    lacking = [(g, why) for g, why in missing if g in required]
    if lacking:
        raise StarterError("--require " + ", ".join(g for g, _ in lacking) + ": not enforced here ("
                           + "; ".join(f"{g}: {why}" for g, why in lacking) + ")",
                           "leave out --net host, or drop --require" if [g for g, _ in lacking] == ["network"] else
                           "run the job where a cgroup is delegated to the pilot (systemd's Delegate=yes, "
                           "the batch system's slot cgroup) and subordinate ids are set up, or drop --require")
