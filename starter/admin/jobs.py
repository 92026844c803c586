"""What an admin does with jobs: ps, status, top, vacate/suspend/resume/kill,
enter.  All of it starts from the state directory (starter/state/store.py): a job
whose lock is held has a live starter.  Reclaiming what a dead starter left
(gc) is admin/gc.py's.
"""

import os
import time

from starter.state import store as S
from starter.spec.options import NAT_MODES
from starter.errors import StarterError
from starter.admin.live import entry, job_cgroup


# ---------------------------------------------------------------- ps / status

def _live_entries(state_dir):
    for job_id in S.list_ids(state_dir):
        st = S.load(state_dir, job_id)
        if not st:         # never skipped: a job of unknown owner while its lock is held
            if not os.path.exists(os.path.join(state_dir, job_id + ".lock")):
                continue   # ended since the listing
            st = S.unreadable(state_dir, job_id)
        st["id"] = job_id
        st["live"] = S.is_live(state_dir, job_id)
        yield st


def _usage(state_dir, st):
    """Live cpu/memory from the job's cgroup, network bytes from its counters."""
    out = {}
    try:
        cg = job_cgroup(st, st["id"])
        stats = cg.stats()
        out["cpu_s"] = round((stats.get("cpu_user_s") or 0) + (stats.get("cpu_system_s") or 0), 3)
        out["memory_bytes"] = stats.get("memory_current_bytes")
        out["stats"] = stats
        if st.get("delegate"):   # the same per-sub-cgroup figures as the report
            out["payloads"], out["payloads_truncated"] = cg.payload_stats()
    except (StarterError, OSError):
        pass
    if st.get("net") in NAT_MODES:
        try:
            from starter import net

            out["network"] = net.counters(st["id"], net.NetConfig(state_dir=state_dir))
            if out["network"] is not None and st.get("overlay"):
                from starter.net import overlay

                out["network"]["overlay"] = overlay.read_live(st)     # per peer node
        except (StarterError, OSError, TypeError, ValueError):
            pass
    return out


def ps(state_dir, as_json):
    rows = []
    for st in _live_entries(state_dir):
        u = _usage(state_dir, st)
        netb = None
        if u.get("network"):
            netb = sum(c.get("bytes", 0) for c in u["network"].values() if isinstance(c, dict))
        rows.append({
            "id": st["id"], "user": "?" if st.get("unreadable") else st.get("user") or st.get("uid"),
            "state": st.get("state") if st["live"] or st.get("state") == "reclaiming" else "dead",
            "pid": st.get("pid"),
            "held": st.get("held"),
            "address": st.get("address"), "cpu_s": u.get("cpu_s"),
            "memory_bytes": u.get("memory_bytes"), "net_bytes": netb,
        })
    if as_json:
        print(S.dumps(rows))
        return 0
    cols = ("id", "user", "state", "pid", "address", "cpu_s", "memory_bytes", "net_bytes")
    heads = ("ID", "USER", "STATE", "PID", "ADDRESS", "CPU_S", "MEMORY", "NET_BYTES")
    table = [heads] + [tuple("-" if r[c] is None else str(r[c]) for c in cols) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    for r in rows:
        held = r["held"]
        for h in held if isinstance(held, list) else ([held] if held else ()):
            print(f"{r['id']}: still held: {h}")
    return 0


def status(state_dir, job_id, as_json, processes=False):
    st = entry(state_dir, job_id)
    u = _usage(state_dir, st)
    doc = dict(st)
    doc.update(live=S.is_live(state_dir, job_id), **{k: v for k, v in u.items() if k != "cpu_s"})
    doc["escaped"] = _escaped(st, job_id) if doc["live"] else None
    procs = None
    if processes:
        from starter.observe import top

        procs = top.sample(job_cgroup(st, job_id), job_id, top.DEFAULT_ONCE_WINDOW)
    if as_json:
        if procs is not None:
            doc["processes"] = procs
        print(S.dumps(doc))
    else:
        for k, v in doc.items():
            print(f"{k}: {S.dumps(v) if isinstance(v, (dict, list)) else v}")
        if procs is not None:
            print("processes:")
            print(top.table(procs))
    return 0


def _escaped(st, job_id):
    """Processes of a live job's uid outside its cgroup (job/strays.py): for a
    transient uid every one, for a named user those started since the job;
    none for root's jobs.  The job's own (its cgroup's) never."""
    uid = st.get("uid")
    if not isinstance(uid, int) or uid <= 0:
        return None
    from starter.job import strays

    since = None
    if not st.get("transient"):
        since = S.process_start_time(st["pid"]) if isinstance(st.get("pid"), int) else None
        if since is None:
            return None
    try:
        own = set(job_cgroup(st, job_id).pids())
    except (StarterError, OSError):
        own = set()
    return [p for p in strays.find(uid, since=since, skip_jobs=True) if p["pid"] not in own]


def top(state_dir, job_id, interval=None, once=False, as_json=False):
    """`starter top JOB`: the job's processes (top.py), from its cgroup."""
    from starter.observe import top

    try:
        st = entry(state_dir, job_id)
        if not S.starter_alive(st):
            raise StarterError(f"job {job_id!r} has no live starter", "run `starter gc` to clean it up")
        return top.main(st, job_cgroup(st, job_id), job_id, interval, once, as_json)
    except PermissionError as e:
        raise StarterError(f"cannot read {e.filename}: {e.strerror}", "run it as root") from None


# ---------------------------------------------------------------- control

def control(state_dir, job_id, action):
    """Signal the job's starter with the fixed command signal for `action`,
    then wait for the state to show it (suspend/resume) or the job to end."""
    from starter.job.supervisor import ACTION_SIGNALS

    st = entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id):
        raise StarterError(f"job {job_id!r} has no live starter", "run `starter gc` to clean it up")
    pid = st.get("starter_pid")
    if not isinstance(pid, int) or S.process_start_time(pid) != st.get("starter_start"):
        raise StarterError(f"the starter of job {job_id!r} (pid {pid}) is gone")
    failed = st.get("control_failed")      # an earlier one
    os.kill(pid, ACTION_SIGNALS[action])
    want = {"suspend": "suspended", "resume": "running"}.get(action)
    deadline = time.monotonic() + 10
    while want and time.monotonic() < deadline:
        try:
            now = S.load(state_dir, job_id)
        except (OSError, ValueError):
            now = {}
        if now.get("control_failed") not in (None, failed):
            f = now["control_failed"]
            raise StarterError(f"{f.get('action')} of job {job_id!r} failed: {f.get('error')}")
        if now.get("state") == want:
            print(f"{job_id}: {want}")
            return 0
        time.sleep(0.02)
    if want:
        raise StarterError(f"job {job_id!r} did not report {want} within 10 s")
    print(f"{job_id}: {action} sent")
    return 0


# ---------------------------------------------------------------- enter

def enter(state_dir, job_id, argv, user=None):
    """Join a running job's namespaces and cgroup and run argv there, as the
    job's user by default: what condor_ssh_to_job gives, for an admin.

    Only the namespaces the starter made for the job, as it recorded them
    at clone time (job/run.py): a job that made its PID 1 a namespace of its own
    (unshare in a user namespace of its own, --userns-root or --allow-userns)
    is refused, not joined.  The job's user namespace is never joined: the
    entering process has host credentials (the job's host uid by default)."""
    from starter.isolate import ns, nsidentity
    from starter.spec.jobspec import DEFAULT_PATH, resolve_user, rlimit_table

    st = entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id) or not st.get("pid"):
        raise StarterError(f"job {job_id!r} is not running")
    recorded = st.get("namespaces")
    if not isinstance(recorded, dict) or "mnt" not in recorded:
        raise StarterError(f"job {job_id!r} has no record of the namespaces the starter made for it",
                           "it was started by an older starter: enter it once it is restarted")
    if user is not None:
        uid, gid, groups, home, name = resolve_user(user, None)
    else:
        uid, gid = st.get("uid"), st.get("gid")
        if not isinstance(uid, int) or not isinstance(gid, int):
            raise StarterError(f"job {job_id!r}: its entry records no uid/gid", "name one with --user")
        groups = tuple(st.get("groups") or ())
        home, name = "/", st.get("user")
    # The job's own filter: an unfiltered process in the job could be
    # ptraced by the job and used to make the calls the filter denies.
    from starter.isolate import seccomp

    sc_filter = seccomp.load(st.get("seccomp", "default"), bool(st.get("allow_userns")), state_dir,
                             no_setid=bool(st.get("transient")))
    pid = st["pid"]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise StarterError(f"job {job_id!r}: its PID 1 (pid {pid}) is gone") from None
    leaf = leaf_fd = None
    nsfds = {}
    try:
        cg = job_cgroup(st, job_id)
        # The pid is the job's (not a reused one, while its starter tears
        # down): in its cgroup now, and still alive after open_namespaces
        # opened its namespaces (which it checks).
        if not cg.holds(pid):
            raise StarterError(f"job {job_id!r}: pid {pid} is not in the job's cgroup",
                               "its PID 1 is gone; `starter ps` shows its state")
        try:
            nsfds = nsidentity.open_namespaces(pidfd, recorded)
        except nsidentity.NamespacesChanged as e:
            raise StarterError(f"job {job_id!r} changed its namespaces ({', '.join(sorted(e.changed))}) "
                               "since it started: `starter enter` joins only the namespaces the starter "
                               "made for it") from None
        cgroup_fd = cg.clone_fd()
        if st.get("delegate"):
            # Not in the job's own cgroup (it has children: no internal
            # processes) nor in one the job made: a root-owned leaf of its own.
            from starter.cgroups.base import ENTER_PREFIX

            leaf = f"{ENTER_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"   # not a name the job can guess
            cgroup_fd = leaf_fd = cg.open_leaf(leaf)
        env = {"PATH": DEFAULT_PATH, "HOME": home or "/",
               "TERM": os.environ.get("TERM", "dumb")}
        if name:
            env["USER"] = name
        child = ns.enter(nsfds, list(argv), env, cwd="/", uid=uid, gid=gid,
                         groups=groups, cgroup_fd=cgroup_fd, released=False, seccomp=sc_filter,
                         rlimits=rlimit_table())
        nsidentity.close_namespaces(nsfds)
        nsfds = {}
        try:
            cg.add_pid(child.pid, cloned=True)   # v1 hierarchies, before it runs anything
            child.release()
            child.wait_started()
            return ns.decode_status(child.wait())[0]
        finally:
            child.close()
    finally:
        nsidentity.close_namespaces(nsfds)
        if leaf_fd is not None:
            os.close(leaf_fd)
            cg.remove_leaf(leaf)
        os.close(pidfd)


def ns_exec(argv, namespaces):
    """ns_exec: CMD in fresh namespaces, root, caps kept; for admins."""
    from starter.isolate import ns

    child = ns.spawn(ns.ChildSpec(
        argv=list(argv), env=_admin_env(), cwd=os.getcwd(), uid=0, gid=0,
        namespaces=namespaces | ({"mnt"} if "pid" in namespaces else set()),
        private_tmp=False, drop_privileges=False, keep_fds=(), reset_inherited=False))
    try:
        child.release()
        child.wait_started()
        return ns.decode_status(child.wait())[0]
    finally:
        child.close()


def _admin_env():
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TERM", "USER", "LANG", "LC_ALL")}
    from starter.spec.jobspec import DEFAULT_PATH

    env.setdefault("PATH", DEFAULT_PATH)
    return env
