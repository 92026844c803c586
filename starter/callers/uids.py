"""Transient uids: a uid and gid of its own for every job that names no user.

Jobs of one shared account share its files, its per-uid kernel quotas
(inotify instances, POSIX message queue bytes, RLIMIT_NPROC's count, the
user keyring) and each other's processes outside the PID namespace.  So a
job without --user runs as a uid (and a gid of the same number) taken from
the range the node policy sets (defaults.job_uids, default below: the block
systemd's UIDS-GIDS.md leaves unused, above its container range), in the
spirit of systemd's DynamicUser and podman's userns=auto.

A lease is a symlink LEASES/<uid> whose target names the job and the
starter that made it, as "<state dir>/<job id>#<pid>.<start time>":
symlink() fails if the name exists, so the kernel
arbitrates between starters, in one system call (a file would take an open,
a write and a close).  The leases are the node's, not a state directory's:
uids are node-wide, and two state directories (a site's and a test's, or two
batch systems') must never lease one uid, or one job's end would kill the
other's processes as escapes.  A uid (or gid) that /etc/passwd or /etc/group names is never
leased; those files are read directly, not through NSS: the first NSS lookup
of a process costs ~5 ms here (it loads the modules nsswitch.conf names),
a quarter of a whole start.  Accounts from a directory service (LDAP, sssd)
are not seen: keep the range out of theirs (docs/admin-guide.md).  It is made before the job's state entry, which records the uid; a
lease whose job has no live entry, and whose maker no longer runs, is
gc's.  The lease goes only once the job's
processes are all gone, its escaped ones included (starter/job/strays.py) and
its scratch removed; a crashed starter's lease is reclaimed by gc.
Reuse is spread over the range: each start tries a random uid first and
walks on from there, so a uid just freed comes back, on average, only after
about as many starts as the range has uids (65,536 by default).

A uid is leased only when nothing of it lives (acquire):
  * no other lease holds it, and no passwd or group entry names it (a local
    account inside the range);
  * no task of it is alive (real uid: the kernel's per-uid count, asked by
    _clear in two clones): such a uid is skipped,
    and the next one tried.  A process that holds it only as its effective
    and saved uid (another user ran a set-user-ID file of it) is not in
    that count: it is killed before the lease (the same helper's
    kill(-1, SIGKILL); reaches the saved uid);
  * no set-id file of it reachable from a job: a transient uid's writable
    binds and scratch are nosuid in its view (mounts.nosuid_binds,
    mounts.scratch_binds), and a kept scratch loses its set-id bits
    (scratch.keep_safely).
What this cannot see: a set-id file of the uid in a host directory the job
could write (a writable bind's source, a world-writable host file system
outside the job's private mounts), run through the host's own mount, by a
process that then gives up the uid as its saved one.  Such directories
want nosuid on the host (docs/reference.md, "Who the job runs as").

What a transient uid leaves behind: files it made in places shared with the
host (a --bind of a writable directory) keep its number, and a later job
that gets the same uid owns them.  Bind only what the job may share, or
give those jobs a named --user.
"""

import errno
import os

from starter.errors import StarterError

DEFAULT_FIRST = 0x70000000          # 1879048192
DEFAULT_COUNT = 0x10000
LEASES = "/run/starter-uids"


PILOT_LEASES = None     # a pilot's, under its state directory (set by starter/rootless/pilot.py)


def where_leases():
    """The leases' directory: root's LEASES, or a pilot's (starter/rootless:
    its namespace's uids are its own)."""
    return PILOT_LEASES or LEASES
MAX_TRIES = 4096


class UidError(StarterError):
    pass


def parse_range(field, text):
    """"FIRST-LAST" -> (first, last); refused: uid 0..999 (system), past 2^31-2."""
    from starter.errors import SpecError

    a, sep, b = str(text).partition("-")
    try:
        first, last = int(a), int(b)
    except ValueError:
        raise SpecError(field, f"{text!r} must be FIRST-LAST, e.g. {DEFAULT_FIRST}-{DEFAULT_FIRST + DEFAULT_COUNT - 1}") from None
    if not sep or not 1000 <= first <= last <= 0x7FFFFFFE:
        raise SpecError(field, f"{text!r}: want 1000 <= FIRST <= LAST <= {0x7FFFFFFE}")
    return first, last


def acquire(state_dir, job_id, first=DEFAULT_FIRST, last=DEFAULT_FIRST + DEFAULT_COUNT - 1):
    """Lease a free uid of [first, last] for job_id; -> uid.  Skipped: a
    local account's or group's number, and a uid a task of which is alive
    (_clear, which also kills what holds the uid only as its saved uid)."""
    accounts = []
    alive = []

    def usable(uid):
        if not accounts:
            accounts.append(_local_ids())
        if uid in accounts[0]:
            return False
        if not _clear(uid):
            alive.append(uid)
            return False
        return True

    uid = lease(where_leases(), state_dir, job_id, first, last, usable)
    if uid is None:
        tried = min(last - first + 1, MAX_TRIES)
        if alive:
            raise UidError(f"no free transient uid in {first}-{last} ({tried} tried; {len(alive)} skipped: "
                           f"a process of the uid is alive, e.g. uid {alive[0]})",
                           f"a process outlived its job's lease (ps -o pid,user,args -U {alive[0]}); "
                           "kill it, or widen defaults.job_uids in the node policy")
        raise UidError(f"no free transient uid in {first}-{last} ({tried} tried)",
                       "too many jobs, or leases a crashed starter left: run `starter gc`; "
                       "or widen defaults.job_uids in the node policy")
    return uid


def lease(where, state_dir, job_id, first, last, usable):
    """A number of [first, last] leased for job_id in the directory `where`
    (root's alone; made if missing), one usable(n) accepts; a number it
    refuses is given back at once.  -> n, or None when none was found in
    MAX_TRIES.  Transient uids, and quota.py's project ids, are leased so."""
    try:
        os.mkdir(where, 0o700)
    except FileExistsError:
        pass
    dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(dfd).st_uid != 0 or os.fstat(dfd).st_mode & 0o077:
        os.close(dfd)
        raise UidError(f"{where} is not root's alone: nothing leased from it",
                       f"remove it (rm -r {where}); the starter makes it again")
    from starter.state.store import own_start_time

    # "#PID.START": its maker, so that gc tells a starter still between the
    # lease and its state entry from one that died there (maker_alive()).
    target = f"{os.path.join(os.path.abspath(state_dir), job_id)}#{os.getpid()}.{own_start_time()}"
    try:
        n = last - first + 1
        start = int.from_bytes(os.urandom(4), "little") % n
        for i in range(min(n, MAX_TRIES)):
            k = first + (start + i) % n
            try:
                os.symlink(target, str(k), dir_fd=dfd)
            except FileExistsError:
                continue
            try:
                if usable(k):
                    try:    # still ours after the checks (see _unlink_quiet)?
                        if os.readlink(str(k), dir_fd=dfd) == target:
                            return k
                    except FileNotFoundError:
                        pass
                    continue
            except BaseException:
                _unlink_quiet(k, dfd)
                raise
            _unlink_quiet(k, dfd)
        return None
    finally:
        os.close(dfd)


def _clear(uid):
    """False if a task of real uid `uid` is alive (zombies included: the
    uid is not to be leased); else True, once SIGKILL went to whatever holds
    it only as its saved uid (a set-user-ID file of the uid run by another
    user: the per-uid count does not see those).  native/uidkill.c's helper
    with the signal negated (starter/job/strays.py's, at a job's end): two
    clones and, when none is alive, one kill(-1)."""
    from starter._native import check, lib

    return check(lib.shim_uid_kill(uid, -9, 0), f"looking for processes of uid {uid}") == 0


def _unlink_quiet(n, dfd):
    """Give lease n back; already gone is fine (a `starter gc` of a lease
    whose job had no entry, its maker dead, may have taken it)."""
    try:
        os.unlink(str(n), dir_fd=dfd)
    except FileNotFoundError:
        pass


def _local_ids(files=("/etc/passwd", "/etc/group")):
    """The ids (third field) of /etc/passwd and /etc/group."""
    from starter.fileio import account_entries

    return {int(f[2]) for path in files for f in account_entries(path) if len(f) > 2 and f[2].isdigit()}


def holder(uid, where=None):
    """(state dir, job id) a lease names, or None (no lease)."""
    where = where or where_leases()
    try:
        return os.path.split(os.readlink(os.path.join(where, str(uid))).partition("#")[0])
    except OSError:
        return None


def maker_alive(uid, where=None):
    """Is the starter that made lease `uid` still running (its pid with the
    start time it recorded)?  False for a lease that names no maker."""
    where = where or where_leases()
    from starter.state.store import process_start_time

    try:
        maker = os.readlink(os.path.join(where, str(uid))).partition("#")[2]
        pid, _, start = maker.partition(".")
        return process_start_time(int(pid)) == int(start)
    except (OSError, ValueError):
        return False


def release(uid, state_dir, job_id, where=None):
    """Give the uid back, if that job holds it."""
    where = where or where_leases()
    if holder(uid, where) != (os.path.abspath(state_dir), job_id):
        return False
    try:
        os.unlink(os.path.join(where, str(uid)))
    except FileNotFoundError:
        return False
    return True


def leases(state_dir=None, where=None):
    """{uid: (state dir, job id)} of every lease (of state_dir's jobs only, if given)."""
    where = where or where_leases()
    try:
        names = os.listdir(where)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return {}
        raise
    want = os.path.abspath(state_dir) if state_dir is not None else None
    out = {}
    for n in names:
        h = holder(n, where) if n.isdigit() else None
        if h is not None and (want is None or h[0] == want):
            out[int(n)] = h
    return out
