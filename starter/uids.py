"""Transient uids: a uid and gid of its own for every job that names no user.

Jobs of one shared account share its files, its per-uid kernel quotas
(inotify instances, POSIX message queue bytes, RLIMIT_NPROC's count, the
user keyring) and each other's processes outside the PID namespace.  So a
job without --user runs as a uid (and a gid of the same number) taken from
the range the node policy sets (defaults.job_uids, default below: the block
systemd's UIDS-GIDS.md leaves unused, above its container range), in the
spirit of systemd's DynamicUser and podman's userns=auto.

A lease is a symlink <state dir>/uids/<uid> whose target is the job id:
symlink() fails if the name exists, so the kernel arbitrates between
starters, in one system call (a file would take an open, a write and a
close).  A uid (or gid) that /etc/passwd or /etc/group names is never
leased; those files are read directly, not through NSS: the first NSS lookup
of a process costs ~5 ms here (it loads the modules nsswitch.conf names),
a quarter of a whole start.  Accounts from a directory service (LDAP, sssd)
are not seen: keep the range out of theirs (docs/admin-guide.md).  It is made before the job's state entry, which records the uid; a
lease whose job has no live entry is gc's.  A uid is leased only while no
other lease holds it, and never one with a passwd or group entry (an LDAP
or local account inside the range).  The lease goes only once the job's
processes are all gone, its escaped ones included (starter/escapes.py) and
its scratch removed; a crashed starter's lease is reclaimed by gc.
Reuse is spread over the range: each start tries a random uid first and
walks on from there, so a uid just freed comes back, on average, only after
about as many starts as the range has uids (65,536 by default).

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
DIR = "uids"
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


def lease_dir(state_dir):
    return os.path.join(state_dir, DIR)


def acquire(state_dir, job_id, first=DEFAULT_FIRST, last=DEFAULT_FIRST + DEFAULT_COUNT - 1):
    """Lease a free uid of [first, last] for job_id; -> uid."""
    from starter.state import ensure_dir

    ensure_dir(state_dir)
    d = lease_dir(state_dir)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        n = last - first + 1
        accounts = None
        start = int.from_bytes(os.urandom(4), "little") % n
        for i in range(min(n, MAX_TRIES)):
            uid = first + (start + i) % n
            try:
                os.symlink(job_id, str(uid), dir_fd=dfd)
            except FileExistsError:
                continue
            if accounts is None:
                accounts = _local_ids()
            if uid not in accounts:     # never a local account's or group's number
                return uid
            os.unlink(str(uid), dir_fd=dfd)
        raise UidError(f"no free transient uid in {first}-{last} ({min(n, MAX_TRIES)} tried)",
                       "too many jobs, or leases a crashed starter left: run `starter gc`; "
                       "or widen defaults.job_uids in the node policy")
    finally:
        os.close(dfd)


def _local_ids(files=("/etc/passwd", "/etc/group")):
    """The ids (third field) of /etc/passwd and /etc/group."""
    out = set()
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(16 << 20)
        except OSError:
            continue
        for line in data.split(b"\n"):
            parts = line.split(b":", 3)
            if len(parts) > 2 and parts[2].isdigit():
                out.add(int(parts[2]))
    return out


def holder(state_dir, uid):
    """The job id a lease names, or None (no lease, or not one of ours)."""
    try:
        return os.readlink(os.path.join(lease_dir(state_dir), str(uid)))
    except OSError:
        return None


def release(state_dir, uid, job_id):
    """Give the uid back, if job_id holds it."""
    if holder(state_dir, uid) != job_id:
        return False
    try:
        os.unlink(os.path.join(lease_dir(state_dir), str(uid)))
    except FileNotFoundError:
        return False
    return True


def leases(state_dir):
    """{uid: job id} of every lease."""
    try:
        names = os.listdir(lease_dir(state_dir))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return {}
        raise
    out = {}
    for n in names:
        if n.isdigit():
            out[int(n)] = holder(state_dir, n)
    return out
