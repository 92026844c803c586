"""What an admin does with jobs that are running or were left behind:
ps, status, vacate/suspend/resume/kill, enter, gc.

All of it starts from the state directory (starter/state.py): a job whose
lock is held has a live starter; a job whose lock can be taken has none, and
gc reclaims what it left (cgroups, network lease/rules/veth, scratch, entry).
An entry is removed only once everything it records is gone; until then it
stays "reclaiming" with what is still held and why.  gc acts only on what
the starter recorded and would have made (job_cgroup, scratch.recorded_path).
"""

import os
import time

from starter import state as S
from starter.errors import StarterError


# ---------------------------------------------------------------- gc

# gc at the start of every run is bounded by S.QUICK_BUDGET_S and reclaims
# at most one dead entry, and only what is cheap: slow reclaims (a cgroup
# still emptying, a scratch tree, the network) are left to `starter gc`.


def gc_quick(state_dir):
    """At the start of every run: reclaim one dead starter's entry, if the
    scan finds one within a small time budget.  Cheap when there is nothing
    to do (a listdir, one flock per entry).  Starts at a different entry each
    time, so one entry cannot starve the rest.  What it costs at most: the
    scan plus one empty cgroup's rmdir (about 1 ms on an idle node)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return
    ids = [n[:-5] for n in names if n.endswith(".lock")]
    if not ids:
        return
    deadline = time.monotonic() + S.QUICK_BUDGET_S
    k = os.getpid() % len(ids)
    for job_id in ids[k:] + ids[:k]:
        if time.monotonic() >= deadline:
            break
        fd = S.lock_dead(state_dir, job_id)
        if fd is None:
            continue
        try:
            st = S.load(state_dir, job_id, fd)
            if st.get("state") == "reclaiming":    # it waits for `starter gc`
                continue
            _reclaim_locked(state_dir, job_id, st, quick=True)
        finally:
            os.close(fd)
        return


def gc(state_dir, cgroup_parent=None):
    """`starter gc`: dead starters' entries, network leftovers, the empty
    cgroup parents.  Safe while other jobs run.  -> (lines, ok): ok is False
    while anything is still held or was left alone."""
    lines, ok = [], True
    for job_id in S.list_ids(state_dir):
        fd = S.lock_dead(state_dir, job_id)
        if fd is None:
            continue
        try:
            st = S.load(state_dir, job_id, fd)
            done, held = _reclaim_locked(state_dir, job_id, st)
        finally:
            os.close(fd)
        lines += [f"job {job_id}: {d}" for d in done]
        if held:
            ok = False
            lines += [f"job {job_id}: still held: {h}" for h in held]
    for name in S.stray_names(state_dir):
        ok = False
        lines.append(f"{os.path.join(state_dir, name)}: not an entry of this state directory; left alone")
    # A job's cgroup exists only while its state entry does (recorded before
    # it is made, removed after), so reclaiming dead entries reclaims every
    # cgroup a crashed starter left.  A job cgroup with no entry here belongs
    # to another state directory (or to something else): not ours to touch.
    if _net_state_exists(state_dir):
        from starter import net

        try:
            cfg = net.NetConfig(state_dir=state_dir)
            live_now = {j for j in S.list_ids(state_dir) if S.is_live(state_dir, j)}
            lines += [f"network: {x}" for x in net.gc(cfg, live_now)]
        except StarterError as e:
            ok = False
            lines.append(f"network: still held: {e}")
    try:
        from starter import cgroups

        if not any(S.is_live(state_dir, j) for j in S.list_ids(state_dir)):
            cgroups.open_backend(cgroup_parent).prune()
    except StarterError as e:
        lines.append(f"cgroups: parents not pruned ({e})")
    return lines, ok


def reclaim_for_start(state_dir, job_id, st):
    """JobState.create found a dead entry with its own id: reclaim it fully."""
    return _reclaim_locked(state_dir, job_id, st)[1]


def _reclaim_locked(state_dir, job_id, st, quick=False):
    """Reclaim what a dead job's entry records, holding its lock.  Removes the
    entry when nothing is left; else keeps it as "reclaiming" with what is
    still held and why.  -> (done, held)."""
    done, held = [], []
    if not st or st.get("id") != job_id:
        held.append("its entry cannot be read (or names another job): left alone")
        S.mark_reclaiming(state_dir, job_id, st or {"id": job_id}, held)
        return done, held
    # cgroup: only where the starter recorded it, and only under its parent.
    if st.get("cgroup"):
        try:
            cg = job_cgroup(st, job_id)
            if quick and cg.exists() and not cg.is_empty():
                cg.kill(timeout=0)     # never wait here
                held.append("cgroup: processes still exiting (`starter gc` finishes it)")
            elif cg.exists():
                cg.destroy()
                done.append("cgroup removed")
        except (StarterError, OSError) as e:
            held.append(f"cgroup: {e}")
    if st.get("net") == "nat":
        if quick:
            held.append("network: left for `starter gc`")
        else:
            from starter import net

            try:
                net.teardown(job_id, net.NetConfig(state_dir=state_dir))
                done.append("network removed")
            except (StarterError, OSError) as e:
                held.append(f"network: {e}")
    if st.get("scratch") and not st.get("keep_scratch"):
        if quick:
            held.append(f"scratch {st['scratch']}: left for `starter gc`")
        else:
            from starter import scratch

            try:
                if scratch.remove_recorded(st, job_id):
                    done.append(f"scratch {st['scratch']} removed")
            except StarterError as e:
                held.append(str(e))         # scratch.py's errors name the scratch
            except OSError as e:
                held.append(f"scratch: {e}")
    if held:
        S.mark_reclaiming(state_dir, job_id, st, held)
    else:
        S.remove_entry(state_dir, job_id)
        done.append("state entry removed")
    return done, held


def job_cgroup(st, job_id, backends=None):
    """The job's cgroup where its starter recorded it: each path must be
    <parent>/job-<id>, the parent where the starter puts jobs (the recorded
    --cgroup-parent, inside the hierarchy this host mounts for that role).
    Anything else is not ours: StarterError, and nothing is touched.
    backends: a dict to reuse probed backends in (metrics reads many jobs)."""
    from starter import cgroups
    from starter.cgroups.base import JOB_PREFIX, check_parent

    paths, parents, setting = st.get("cgroup"), st.get("cgroup_parents"), st.get("cgroup_parent")

    def refuse(why):
        return StarterError(f"state entry of job {job_id!r}: {why}: not a cgroup this starter made; left alone")

    if not isinstance(paths, dict) or not isinstance(parents, dict) or set(paths) != set(parents):
        raise refuse("no cgroup parents recorded")
    try:
        check_parent("starter" if setting is None else setting)
        backend = backends.get(setting) if backends is not None else None
        if backend is None:
            backend = cgroups.open_backend(setting)
            if backends is not None:
                backends[setting] = backend
        import copy

        backend = copy.copy(backend)       # its parents become this job's below
    except StarterError as e:
        raise refuse(str(e)) from None
    if set(paths) != set(backend.roles()):
        raise refuse(f"roles {sorted(paths)} are not this host's {sorted(backend.roles())}")
    for role, p in paths.items():
        parent = parents[role]
        mount = backend.mount_for(role).mount_point
        if not (isinstance(p, str) and isinstance(parent, str)) or p != parent + "/" + JOB_PREFIX + job_id \
                or os.path.normpath(parent) != parent or not parent.startswith(mount.rstrip("/") + "/"):
            raise refuse(f"{role} cgroup {p!r} is not <parent>/job-{job_id} under {mount}")
        want = (setting or "starter").strip("/")
        rel = parent[len(mount.rstrip("/")) + 1:]
        absolute = (setting or "").startswith("/")
        if not (rel == want or (not absolute and rel.endswith("/" + want))):
            raise refuse(f"{role} parent {parent!r} is not where --cgroup-parent {setting or 'starter'} puts jobs")
        if os.path.islink(parent) or os.path.islink(p):
            raise refuse(f"{p!r} is a symlink")
    backend.parents = dict(parents)        # prune what the job's starter used
    return backend.job_class(backend, job_id, dict(paths))


def _net_state_exists(state_dir):
    return os.path.isdir(os.path.join(state_dir, "net"))


# ---------------------------------------------------------------- ps / status

def _live_entries(state_dir):
    for job_id in S.list_ids(state_dir):
        st = S.load(state_dir, job_id)
        if not st:
            continue
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
            "state": st.get("state") if st["live"] or st.get("state") == "reclaiming" else "dead",
            "pid": st.get("pid"), "held": st.get("held"),
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
        for h in r["held"] or ():
            print(f"{r['id']}: still held: {h}")
    return 0


def status(state_dir, job_id, as_json, processes=False):
    st = _entry(state_dir, job_id)
    u = _usage(state_dir, st)
    doc = dict(st)
    doc.update(live=S.is_live(state_dir, job_id), **{k: v for k, v in u.items() if k != "cpu_s"})
    procs = None
    if processes:
        from starter import top

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


def top(state_dir, job_id, interval=None, once=False, as_json=False):
    """`starter top JOB`: the job's processes (top.py), from its cgroup."""
    from starter import top

    try:
        st = _entry(state_dir, job_id)
        if not S.starter_alive(st):
            raise StarterError(f"job {job_id!r} has no live starter", "run `starter gc` to clean it up")
        return top.main(st, job_cgroup(st, job_id), job_id, interval, once, as_json)
    except PermissionError as e:
        raise StarterError(f"cannot read {e.filename}: {e.strerror}", "run it as root") from None


def _entry(state_dir, job_id):
    from starter import values

    values.job_id("job", job_id)
    st = S.load(state_dir, job_id) if os.path.exists(os.path.join(state_dir, job_id + ".lock")) else {}
    if not st:
        raise StarterError(f"no job {job_id!r} on this node", "`starter ps` lists the jobs")
    return st


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
    from starter import ns
    from starter.spec import DEFAULT_PATH, resolve_user, rlimit_table

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
    leaf = leaf_fd = None
    try:
        cg = job_cgroup(st, job_id)
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
        # Every namespace the job has (pid, mnt, ipc, cgroup, net and uts
        # where it has its own), read from its PID 1, not from its options.
        namespaces = ns.namespaces_of(pid)
        if "mnt" not in namespaces:
            raise StarterError(f"job {job_id!r} (pid {pid}) shares the host's mount namespace",
                               "its PID 1 is gone or was replaced; `starter ps` shows its state")
        child = ns.enter(pidfd, namespaces, list(argv), env, cwd="/", uid=uid, gid=gid,
                         groups=groups, cgroup_fd=cgroup_fd, released=False, seccomp=sc_filter,
                         rlimits=rlimit_table())
        try:
            cg.add_pid(child.pid, cloned=True)   # v1 hierarchies, before it runs anything
            child.release()
            child.wait_started()
            return ns.decode_status(child.wait())[0]
        finally:
            child.close()
    finally:
        if leaf_fd is not None:
            os.close(leaf_fd)
            cg.remove_leaf(leaf)
        os.close(pidfd)
