"""Processes of a job's uid that live outside its cgroup: escapes.

The cgroup holds every process the job makes itself.  A process of the
job's uid outside it was made by something else on its behalf: a host
daemon of that uid (a tmux server whose socket lay in a shared directory,
`systemd-run --user`, at) started it for the job.  The seed's third
requirement is to notice when tracking failed; this is where.

    transient uid   the uid is the job's alone: every process of it outside
                    the cgroup has escaped; default action kill
    named user      the user's other sessions and jobs are legitimate:
                    escaped = started during the job (start time at or after
                    the job's) and not inside any starter job's cgroup;
                    default action report

Found without walking /proc on the common path: a helper that is the uid
(native/uidkill.c) asks the kernel's per-uid task count (RLIMIT_NPROC's)
whether any other task of the uid exists.  Only then is /proc read: a stat
of each /proc/PID directory gives its owner (the task's effective uid,
whatever its dumpable flag), and only those of the uid are read further.  A
process that took another effective uid (a set-user-ID program) still
counts: then every process's status is read.  Zombies count until reaped and
are never reported.  The kill is the same helper's kill(-1, SIGKILL), which
reaches exactly the processes of the uid: no pid is ever signalled by
number, so a pid reused meanwhile is never hit; /proc is read after it to
see that none is left.

Before a transient uid is leased, starter/callers/uids.py asks the same helper
whether a task of it is alive (the uid is skipped then) and has it kill
what holds the uid only as its saved uid: another user's run of a
set-user-ID file of it, which the per-uid count does not see.
"""

import os
import sys

from starter.errors import StarterError

# /proc/PID/stat: the fields after "(comm) ", 0-based: starttime is the 20th.
_START_FIELD = 19


def _as_uid(uid, sig, known=0):
    """The helper of native/uidkill.c; -> True if a process of uid is alive
    (beyond `known` live ones)."""
    from starter._native import check, lib

    return check(lib.shim_uid_kill(uid, sig, known), f"looking for processes of uid {uid}") == 1


def any_process(uid, relay=None):
    """Is any task of real uid `uid` alive on the host (zombies included)?
    relay: the pid of a caller's relay (starter/callers/caller.py), our parent, a
    task of `uid` that is none of the answer's business: asked for as one
    known task, and trusted only if it is still our parent after the probe
    (then it was alive, and counted, all through it; a relay that died
    reparents us at once)."""
    if relay is not None and os.getppid() == relay:
        if _as_uid(uid, 0, 1):
            return True
        if os.getppid() == relay:
            return False
    return _as_uid(uid, 0)


def kill_all(uid):
    """SIGKILL every process of uid `uid`; -> [{"pid", "comm", "start"}] of
    those (not zombies) still there after it (a process in D state)."""
    if not _as_uid(uid, 9):
        return []
    import time

    deadline = time.monotonic() + 1.0
    while True:
        left = find(uid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)


def _stat_fields(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    close = data.rindex(b")")
    comm = data[data.index(b"(") + 1:close].decode("utf-8", "replace")
    return comm, data[close + 2:].split()


def _in_a_job(pid):
    """Is pid in some starter job's cgroup (another job of the same user)?"""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)[-1].split("/")
                if any(a.startswith("starter") and b.startswith("job-") for a, b in zip(parts, parts[1:])):
                    return True
    except OSError:
        pass
    return False


def _real_uid(pid):
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                ids = [int(x) for x in line.split()[1:]]
                return ids[0], ids[2]        # real, saved
    return None, None


def find(uid, since=None, skip_jobs=False, relay=None):
    """[{"pid", "comm", "start"}] of the processes of `uid` (effective; or real/saved
    when the cheap way finds none though the probe said some), started at or
    after `since` (clock ticks since boot, /proc/PID/stat's starttime) when
    given, and outside every starter job's cgroup when skip_jobs.  relay:
    see any_process (it started before the job: never in the answer)."""
    if not any_process(uid, relay):
        return []
    me = os.getpid()
    found, seen = [], False
    for full in (False, True):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            try:
                if not full:
                    if os.stat(f"/proc/{name}").st_uid != uid:
                        continue
                else:
                    ruid, suid = _real_uid(pid)
                    if uid not in (ruid, suid) or os.stat(f"/proc/{name}").st_uid == uid:
                        continue        # the first pass had those
                comm, fields = _stat_fields(pid)
                if fields[0] == b"Z":
                    continue
                seen = True
                if since is not None and int(fields[_START_FIELD]) < since:
                    continue
                if skip_jobs and _in_a_job(pid):
                    continue
            except (OSError, ValueError, IndexError):
                continue            # gone meanwhile
            found.append({"pid": pid, "comm": comm, "start": int(fields[_START_FIELD])})
        if seen:
            break
    return found


def kill_found(found):
    """SIGKILL the processes find() returned, each through a pidfd taken
    while it is still the process found (same start time): a pid reused
    meanwhile is never signalled."""
    import signal

    for p in found:
        try:
            fd = os.pidfd_open(p["pid"])
        except OSError:
            continue            # gone
        try:
            if int(_stat_fields(p["pid"])[1][_START_FIELD]) == p["start"]:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
        finally:
            os.close(fd)


# ---------------------------------------------------------------- at a job's end (starter/job/run.py)

def end_transient(state_dir, uid, job_id, action, report):
    """The job's own uid, at its end: every process of it left (outside the
    emptied cgroup) has escaped; killed (the default) or reported; the uid
    is given back only once none is left."""
    from starter.callers import uids

    found = find(uid)
    report.escaped = found
    if found:
        _say(job_id, found, action)
        report.escaped_action = "killed" if action == "kill" else "reported"
        if action != "kill":
            return          # the lease stays until they are gone (`starter gc`)
        if kill_all(uid):
            raise StarterError(f"processes of the job's uid {uid} outlived the kill; the uid stays leased",
                               "`starter gc` gives it back once they are gone")
    uids.release(uid, state_dir, job_id)


def end_named(uid, since, action, report, relay=None):
    """A named user's processes started during the job, outside every job's
    cgroup: escaped (a same-uid host daemon started them for the job)."""
    if since is None:
        return              # the job never ran
    found = find(uid, since=since, skip_jobs=True, relay=relay)
    report.escaped = found
    if found:
        _say(report.get("job_id"), found, action)
        report.escaped_action = "killed" if action == "kill" else "reported"
        if action == "kill":
            kill_found(found)


def _say(job_id, found, action):
    """One line on stderr where the starter acted (killed them); escapes it
    only reports are in the report alone: a named user's other sessions
    started meanwhile are found too, and the job's stderr is not for them."""
    if action != "kill":
        return
    shown = ", ".join(f"{p['pid']} ({p['comm']})" for p in found[:10]) + (" ..." if len(found) > 10 else "")
    sys.stderr.write(f"starter: job {job_id}: {len(found)} process(es) of its uid outside its cgroup "
                     f"(escaped): {shown}; {'killed' if action == 'kill' else 'reported'}\n")
