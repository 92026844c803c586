"""What an admin does with jobs that are running or were left behind:
ps, status, vacate/suspend/resume/kill, enter, gc.

All of it starts from the state directory (starter/state.py): a job whose
lock is held has a live starter; a job whose lock can be taken has none, and
gc reclaims what it left (cgroups, network lease/rules/veth, scratch, entry).
"""

import os
import time

from starter import state as S
from starter.errors import StarterError


# ---------------------------------------------------------------- gc

def gc_quick(state_dir):
    """At the start of every run: reclaim dead starters' jobs.  Cheap when
    there is nothing to do (a listdir and one flock per entry)."""
    for job_id in S.list_ids(state_dir):
        if not S.is_live(state_dir, job_id):
            _reclaim(state_dir, job_id)


def gc(state_dir, cgroup_parent=None):
    """`starter gc`: dead starters' jobs, cgroups with no live job, network
    leftovers, then the empty parents.  Safe while other jobs run."""
    done = []
    live = set()
    for job_id in S.list_ids(state_dir):
        if S.is_live(state_dir, job_id):
            live.add(job_id)
        else:
            done += _reclaim(state_dir, job_id)
    # A job's cgroup exists only while its state entry does (the entry is
    # made first and removed last), so reclaiming dead entries reclaims every
    # cgroup a crashed starter left.  A job cgroup with no entry here belongs
    # to another state directory (or to something else): not ours to touch.
    from starter import cgroups

    try:
        backend = cgroups.open_backend(cgroup_parent)
    except StarterError as e:
        done.append(f"cgroups: skipped ({e})")
        backend = None
    if _net_state_exists(state_dir):
        from starter import net

        cfg = net.NetConfig(state_dir=state_dir)
        live_now = {j for j in S.list_ids(state_dir) if S.is_live(state_dir, j)}
        done += [f"network: {x}" for x in net.gc(cfg, live_now)]
    if backend is not None and not any(S.is_live(state_dir, j) for j in S.list_ids(state_dir)):
        backend.prune()
    _prune_state_dir(state_dir)
    return done


def _reclaim(state_dir, job_id):
    fd = S.claim_dead(state_dir, job_id)
    if fd is None:
        return []
    done = []
    try:
        try:
            st = S.load(state_dir, job_id)
        except (OSError, ValueError):
            st = {}
        try:
            cg = job_cgroup(st, job_id)
            cg.destroy()
            done.append(f"job {job_id}: cgroup removed")
        except StarterError as e:
            done.append(f"job {job_id}: cgroup: {e}")
        if st.get("net") == "nat":
            from starter import net

            net.teardown(job_id, net.NetConfig(state_dir=state_dir))
            done.append(f"job {job_id}: network removed")
        if st.get("scratch") and not st.get("keep_scratch"):
            from starter import scratch

            try:
                scratch.remove_path(st["scratch"], expect=tuple(st["scratch_id"]) if st.get("scratch_id") else None)
                done.append(f"job {job_id}: scratch {st['scratch']} removed")
            except StarterError as e:
                done.append(f"job {job_id}: scratch: {e}")
        for suffix in (".json", ".resolv.conf", ".lock"):
            S.unlink_quiet(os.path.join(state_dir, job_id + suffix))
        done.append(f"job {job_id}: state entry removed")
    finally:
        os.close(fd)
    return done


def job_cgroup(st, job_id, backends=None):
    """The job's cgroup where its starter made it (recorded in the state
    entry): the default parent depends on the cgroup of whoever runs gc.
    backends: a dict to reuse backends in (metrics reads many jobs)."""
    from starter import cgroups

    parent = st.get("cgroup_parent")
    backend = backends.get(parent) if backends is not None else None
    if backend is None:
        backend = cgroups.open_backend(parent)
        if backends is not None:
            backends[parent] = backend
    paths = st.get("cgroup")
    if not paths:
        return backend.open_job(job_id)
    suffix = "/job-" + job_id
    for p in paths.values():
        if not (p.startswith("/sys/fs/cgroup/") and p.endswith(suffix) and "/../" not in p):
            raise StarterError(f"state entry of job {job_id!r} names an unexpected cgroup {p!r}")
    return backend.job_class(backend, job_id, dict(paths))


def _net_state_exists(state_dir):
    return os.path.isdir(os.path.join(state_dir, "net"))


def _prune_state_dir(state_dir):
    try:
        os.rmdir(state_dir)       # only succeeds when empty
    except OSError:
        pass


# ---------------------------------------------------------------- ps / status

def _live_entries(state_dir):
    for job_id in S.list_ids(state_dir):
        try:
            st = S.load(state_dir, job_id)
        except (OSError, ValueError):
            continue
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
    except (StarterError, OSError):
        pass
    if st.get("net") == "nat":
        try:
            from starter import net

            out["network"] = net.counters(st["id"], net.NetConfig(state_dir=state_dir))
        except (StarterError, OSError):
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
            "id": st["id"], "user": st.get("user") or st.get("uid"),
            "state": st.get("state") if st["live"] else "dead", "pid": st.get("pid"),
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
    return 0


def status(state_dir, job_id, as_json, processes=False):
    st = _entry(state_dir, job_id)
    u = _usage(state_dir, st)
    doc = dict(st)
    doc.update(live=S.is_live(state_dir, job_id), **{k: v for k, v in u.items() if k != "cpu_s"})
    procs = None
    if processes:
        from starter import top

        procs = top.sample(st, job_id, top.DEFAULT_ONCE_WINDOW)
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


def _entry(state_dir, job_id):
    from starter.spec import check_id

    check_id("job", job_id)
    try:
        return S.load(state_dir, job_id)
    except FileNotFoundError:
        raise StarterError(f"no job {job_id!r} on this node", "`starter ps` lists the jobs") from None


# ---------------------------------------------------------------- control

def control(state_dir, job_id, action):
    """Signal the job's starter with the fixed command signal for `action`,
    then wait for the state to show it (suspend/resume) or the job to end."""
    from starter.supervisor import ACTION_SIGNALS

    st = _entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id):
        raise StarterError(f"job {job_id!r} has no live starter", "run `starter gc` to clean it up")
    pid = st["starter_pid"]
    if S.process_start_time(pid) != st.get("starter_start"):
        raise StarterError(f"the starter of job {job_id!r} (pid {pid}) is gone")
    os.kill(pid, ACTION_SIGNALS[action])
    want = {"suspend": "suspended", "resume": "running"}.get(action)
    deadline = time.monotonic() + 10
    while want and time.monotonic() < deadline:
        try:
            if S.load(state_dir, job_id).get("state") == want:
                print(f"{job_id}: {want}")
                return 0
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    if want:
        raise StarterError(f"job {job_id!r} did not report {want} within 10 s")
    print(f"{job_id}: {action} sent")
    return 0


# ---------------------------------------------------------------- enter

def enter(state_dir, job_id, argv, user=None):
    """Join a running job's namespaces and cgroup and run argv there, as the
    job's user by default: what condor_ssh_to_job gives, for an admin."""
    from starter import cgroups, ns
    from starter.report import decode_status
    from starter.spec import resolve_user, rlimit_table

    st = _entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id) or not st.get("pid"):
        raise StarterError(f"job {job_id!r} is not running")
    if user is not None:
        uid, gid, groups, home, name = resolve_user(user, None)
    else:
        uid, gid, groups = st.get("uid", 0), st.get("gid", 0), tuple(st.get("groups") or ())
        home, name = "/", st.get("user")
    # The job's own filter: an unfiltered process in the job could be
    # ptraced by the job and used to make the calls the filter denies.
    from starter import seccomp

    sc_filter = seccomp.load(st.get("seccomp", "default"), bool(st.get("allow_userns")), state_dir)
    pid = st["pid"]
    pidfd = os.pidfd_open(pid)
    try:
        cg = job_cgroup(st, job_id)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", "HOME": home or "/",
               "TERM": os.environ.get("TERM", "dumb")}
        if name:
            env["USER"] = name
        # Every namespace the job has (pid, mnt, ipc, cgroup, net and uts
        # where it has its own), read from its PID 1, not from its options.
        namespaces = ns.namespaces_of(pid)
        if "mnt" not in namespaces:
            raise StarterError(f"job {job_id!r} (pid {pid}) shares the host's mount namespace",
                               "its PID 1 is gone or was replaced; `starter ps` shows its state")
        child = ns.enter(pidfd, namespaces, list(argv), env, cwd="/", uid=uid, gid=gid,
                         groups=groups, cgroup_fd=cg.clone_fd(), released=False, seccomp=sc_filter,
                         rlimits=rlimit_table())
        try:
            cg.add_pid(child.pid, cloned=True)   # v1 hierarchies, before it runs anything
            child.release()
            child.wait_started()
            return decode_status(child.wait())[0]
        finally:
            child.close()
    finally:
        os.close(pidfd)
