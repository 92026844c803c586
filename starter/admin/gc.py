"""What a dead starter left behind, reclaimed: gc.

All of it starts from the state directory (starter/state/store.py): a job whose
lock is held has a live starter; a job whose lock can be taken has none, and
gc reclaims what it left (cgroups, network lease/rules/veth, scratch, entry).
An entry is removed only once everything it records is gone; until then it
stays "reclaiming" with what is still held and why.  gc acts only on what
the starter recorded and would have made (live.job_cgroup, scratch.recorded_path).

A `starter run` loads this module only when its scan (state.find_dead) or
its own entry finds something to reclaim; the admin commands (ps, status,
kill, enter) are in admin/jobs.py.
"""

import os

from starter.fileio import unlink_quiet

from starter.admin.live import job_cgroup
from starter.state import store as S
from starter.spec.options import NAT_MODES
from starter.errors import StarterError


# gc at the start of every run is bounded by S.QUICK_BUDGET_S and reclaims
# at most one dead entry, and only what is cheap: slow reclaims (a cgroup
# still emptying, a scratch tree, the network) are left to `starter gc`.


def reclaim_found(state_dir, found):
    """At the start of every run, what state.find_dead found (one dead
    starter's entry), reclaimed the quick way (nothing that waits: about one
    empty cgroup's rmdir), and its lock let go."""
    job_id, fd, st = found
    try:
        _reclaim_locked(state_dir, job_id, st, quick=True)
    finally:
        os.close(fd)


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
    more, held = _reclaim_uids(state_dir)
    lines += more
    ok = ok and not held
    from starter.rootless import pilot

    if pilot.ACTIVE is None:        # (--disk's project quotas are root's alone)
        lines += _reclaim_project_leases()
    from starter.isolate import seccomp

    lines += [f"seccomp cache: removed {n} (not a whole cache file)" for n in seccomp.check_cache(state_dir)]
    for name in S.stray_names(state_dir):
        ok = False
        lines.append(f"{os.path.join(state_dir, name)}: not an entry of this state directory; left alone")
    # A job's cgroup exists only while its state entry does (recorded before
    # it is made, removed after), so reclaiming dead entries reclaims every
    # cgroup a crashed starter left.  A job cgroup with no entry here belongs
    # to another state directory (or to something else): not ours to touch.
    if os.path.isdir(os.path.join(state_dir, "parts")):
        from starter.net import part

        try:
            lines += [f"network: {x}" for x in part.gc(state_dir)]
        except StarterError as e:
            ok = False
            lines.append(f"network: still held: {e}")
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
            from starter.rootless import pilot

            # A pilot's parents are where its own cgroup is delegated to it, or none.
            (cgroups.open_backend(cgroup_parent) if pilot.ACTIVE is None else
             pilot.cgroup_backend(cgroup_parent)).prune()
    except StarterError as e:
        lines.append(f"cgroups: parents not pruned ({e})")
    return lines, ok


def _reclaim_uids(state_dir):
    """Transient uids whose job is over (its starter dead, or it ended with
    processes of the uid left), whatever state directory leased them (the
    leases are the node's): killed what is left of the uid (unless the
    job's entry says its escapes are only reported), then the lease given
    back.  -> (lines, held)."""
    from starter.job import strays
    from starter.callers import uids

    lines, held = [], False
    for uid, (sd, job_id) in sorted(uids.leases().items()):
        if S.is_live(sd, job_id) or _entry_to_come(uids.where_leases(), uid, sd, job_id):
            continue
        if S.load(sd, job_id).get("state") == "reclaiming":
            held = held or sd == os.path.abspath(state_dir)
            lines.append(f"uid {uid} (job {job_id}): its job's entry still holds something; still held")
            continue
        try:
            if strays.any_process(uid):
                if S.load(sd, job_id).get("escape") == "report":
                    held = held or sd == os.path.abspath(state_dir)
                    lines.append(f"uid {uid} (job {job_id}): processes of it still run (escapes are only "
                                 "reported on this node); still held")
                    continue
                if strays.kill_all(uid):
                    held = True
                    lines.append(f"uid {uid} (job {job_id}): processes of it survived the kill; still held")
                    continue
                lines.append(f"uid {uid} (job {job_id}): processes of it killed")
        except OSError as e:
            held = True
            lines.append(f"uid {uid} (job {job_id}): {e}; still held")
            continue
        if uids.release(uid, sd, job_id):
            lines.append(f"uid {uid} (job {job_id}): lease given back")
    return lines, held


def _entry_to_come(where, n, state_dir, job_id):
    """A lease is made before its job's state entry: one whose job has no
    entry yet (not even a dead one) while the starter that made it still
    runs is a start in progress, not a dead starter's.  Giving it back would
    let a second job lease the uid of a starting one."""
    from starter.callers import uids

    return not os.path.lexists(os.path.join(state_dir, job_id + ".lock")) and uids.maker_alive(n, where)


def _reclaim_project_leases():
    """Project ids (quota.py) leased by a starter that died before its entry
    recorded them: no limit was set yet (that comes after the record), so the
    lease alone goes.  A recorded one is its entry's (_reclaim_locked)."""
    from starter.storage import quota
    from starter.callers import uids

    lines = []
    for qid, (sd, job_id) in sorted(uids.leases(None, quota.PROJECTS).items()):
        if S.is_live(sd, job_id) or _entry_to_come(quota.PROJECTS, qid, sd, job_id):
            continue
        if S.load(sd, job_id).get("disk_project") == qid:
            continue
        if uids.release(qid, sd, job_id, quota.PROJECTS):
            lines.append(f"disk project {qid} (job {job_id}): lease given back")
    return lines


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
    if st.get("pasta_pidfile"):
        # A pilot's user-mode network (net/usermode.py): pasta died with its
        # starter (its parent-death signal); its pid file is what is left.
        pidfile = st["pasta_pidfile"]
        if os.path.dirname(pidfile) == os.path.abspath(state_dir) and pidfile.endswith(".pasta.pid"):
            unlink_quiet(pidfile)
        done.append("user-mode network removed")
    elif st.get("net") in NAT_MODES:
        if quick:
            held.append("network: left for `starter gc`")
        else:
            from starter import net

            try:
                net.teardown(job_id, net.NetConfig(state_dir=state_dir))
                done.append("network removed")
            except (StarterError, OSError) as e:
                held.append(f"network: {e}")
    disk_held = False
    if st.get("disk_image"):
        # Before the scratch: the image is mounted on it.
        if quick:
            held.append(f"disk image {st['disk_image']}: left for `starter gc`")
            disk_held = True
        else:
            from starter.storage import disk

            try:
                done += disk.reclaim_recorded(st, job_id)
            except (StarterError, OSError) as e:
                held.append(f"disk image: {e}")
                disk_held = True
    if st.get("disk_project") is not None:
        if quick:
            held.append(f"disk project {st['disk_project']}: left for `starter gc`")
        else:
            from starter.storage import quota

            try:
                done += quota.reclaim_recorded(st, job_id, state_dir)
            except (StarterError, OSError) as e:
                held.append(f"disk project: {e}")
    # The scratch goes; a kept one of a transient uid loses its set-id bits
    # before the uid can be leased again (the lease goes only with the entry).
    keep = st.get("keep_scratch")
    if st.get("scratch") and (not keep or st.get("transient")) and not disk_held:
        what = f"kept scratch {st['scratch']}: set-id bits" if keep else f"scratch {st['scratch']}"
        if quick:
            held.append(f"{what}: left for `starter gc`")
        else:
            from starter.storage import scratch

            try:
                if (scratch.keep_recorded if keep else scratch.remove_recorded)(st, job_id):
                    done.append(f"{what} {'cleared' if keep else 'removed'}")
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


def _net_state_exists(state_dir):
    return os.path.isdir(os.path.join(state_dir, "net"))
