"""Shared executables: one copy per (owner, content) in the spool, hard links as refcounts.

A node that runs hundreds of jobs with the same executable keeps one file,
``$SPOOL/exe-<EscapedOwner>-<CmdHash>``, and hard-links it into each job's
directory (the job's copy, HTCondor's "ickpt").  The inode's link count is the
reference count:

    nlink of the job copy   meaning
    1                       a private copy (no hash, links disabled, or copied)
    2                       we are the last user: release removes the hash path too
    3+                      other jobs still use it

The owner is part of the name so that one user who finds a hash collision can
only ever hurt their own jobs.  This module owns the store: add, link,
release, ls, gc under the lock, and what root reads and writes on the way.
The names (escaping, CmdHash) are spool/names.py's; whether to hard-link at all
(``$SPOOL/.linkstate``) is spool/links.py's.

Every change to the spool (store, link, release, gc) happens under an flock on
``$SPOOL/.lock`` (never deleted), so gc cannot remove a file between an add and
its first link.  Files are written to a temp name, fsynced, renamed into place
and the directory fsynced; stored executables are read-only (0555, or 0444 when
the source had no exec bit).

Where link() cannot work (the job directory is on another filesystem, EPERM,
EMLINK) the job gets a private copy; after 10 such failures with no success
ever the spool stops trying (spool/links.py).

Root reads and writes paths the job's user controls (FILE, DEST, JOBCOPY), so
none of them is followed through a link (paths.py: one component at a time,
O_PATH|O_NOFOLLOW): a link anywhere on the way is refused, and the open, link
or unlink is done relative to the directory fd that walk ended on.  A source
must be a regular file (a FIFO or device is refused from its O_PATH fstat,
never opened), and it is read only if the job's user could read it: FILE is
reopened from its O_PATH fd with the uid, gid and groups of the local account
named by `owner`; an owner with no local account gets only a file everyone may
read (o+r).  So root copies nothing into a job that its user could not have
copied there.

Root's copies are bounded like the manifest's (fileio.sized_to_fit): a file
larger than the room left for ordinary users where it would be copied (the
spool, or the job's directory for a private copy) is refused before a byte
is read, and one that grows past the size it had when it was opened fails
the copy, which is removed.
"""

import errno
import fcntl
import hmac
import os
import stat

from starter.storage import paths
from starter.spool import links as spoollinks
from starter.errors import SpecError, StagingError
from starter.fileio import NoRoom, TooLarge, copy_hashing, sized_to_fit, unlink_best_effort, unlink_quiet
# The name codec, also the spool's interface (cli/spool.py: spool.INVALID, spool.parse_name)
from starter.spool.names import HASH_ATTRS, INVALID, LOCK_NAME, NAME_MAX, PREFIX, TMP_PREFIX, check_attrs, check_cmdhash, check_owner, decode_cmdhash, encode_cmdhash, escape, hash_name, parse_name, unescape

LINK_FAIL_LIMIT = spoollinks.LINK_FAIL_LIMIT
DEFAULT_GC_MIN_AGE = 600  # seconds an unlinked file is kept: room between add and link
DEFAULT_SPOOL = "/var/lib/starter/spool"  # or $STARTER_SPOOL (cli/spool.py)
_LINK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK)


def file_digests(src, algorithms):
    """Hash a file (path or open fd) once with several algorithms -> {alg: hexdigest}.

    A path is opened without following links, but with no user's access check
    (no owner is known here): pass the path of a file the caller trusts."""
    fd = _open_src(src) if not isinstance(src, int) else src
    try:
        return copy_hashing(fd, None, algorithms)
    finally:
        if not isinstance(src, int):
            os.close(fd)


def compute_cmdhash(src, hash_attrs=("CmdHashSHA256",)):
    """The CmdHash string of a file, e.g. 'CmdHashSHA256-<hex>'; 'invalid' for no attributes."""
    attrs = check_attrs(hash_attrs)
    if not attrs:
        return INVALID
    digests = file_digests(src, {HASH_ATTRS[a] for a in attrs})
    return encode_cmdhash((a, digests[HASH_ATTRS[a]]) for a in attrs)


_SRC_HINT = "pass the file itself: no component of FILE may be a symlink"
_READ_HINT = "root copies only what the job's user could read: fix the file's owner or mode"
_DEST_HINT = "pass the job's directory as a path without symlinks"
_JOBCOPY_HINT = ("a directory on the way was replaced by a link, so nothing was removed; "
                 "removing the job's directory and `starter spool gc` reclaim the entry")


def _absolute(path):
    """A relative path (the documented `./analysis`) is taken from the cwd,
    which the kernel gives without links."""
    path = os.fspath(path)
    if not path.startswith("/"):
        path = os.getcwd() + "/" + path
    parts = [c for c in path.split("/") if c not in ("", ".")]
    return "/" + "/".join(parts) + ("/" if parts and path.endswith("/") else "")


def _open_src(path, owner=None):
    """Open the file `path` for reading, as the job's user could (module docstring).

    Walked without links (O_PATH), refused unless a regular file before any
    read open (a FIFO cannot block, a device is never opened), then reopened
    through /proc/self/fd from that very inode with the reader's credentials
    (`owner` None: no access check, for files the caller trusts)."""
    shown = os.fspath(path)
    if shown.endswith("/"):
        raise StagingError(f"spool: file {shown}: not a path to a file")
    try:
        pfd, st = paths.open_path(_absolute(shown), "spool: file")
    except paths.LinkError as e:
        raise StagingError(e.args[0], hint=_SRC_HINT) from None
    try:
        if not stat.S_ISREG(st.st_mode):
            raise StagingError(f"spool: file {shown}: is {paths.kind(st.st_mode)}, not a regular file (not opened)")
        creds = None
        if owner is not None:
            creds = _reader(owner)
            if creds is None and not st.st_mode & stat.S_IROTH:
                raise StagingError(
                    f"spool: file {shown}: owner {owner!r} is not a local account (or not one this process "
                    f"can act as), and the file (mode {stat.S_IMODE(st.st_mode):04o}) is not readable by everyone",
                    hint="run as root with --owner naming the job's local account, or make the file o+r")
        try:
            with paths.as_user(creds, "to read the job's file"):
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:
            raise StagingError(f"spool: file {shown}: {owner!r} may not read it, so it is not copied",
                               hint=_READ_HINT) from None
        except OSError as e:
            raise StagingError(f"spool: cannot open {shown}: {e.strerror}") from None
    finally:
        os.close(pfd)
    st2 = os.fstat(fd)
    if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(st2.st_mode):
        os.close(fd)  # /proc/self/fd/N is our own fd: this cannot happen unless /proc is not procfs
        raise StagingError(f"spool: file {shown}: reopened as another file", hint="is /proc mounted?")
    return fd


def _reader(owner):
    """(uid, gid, groups) to read `owner`'s files with; () when this process
    already is that account; None when there is no such local account or we
    cannot act as it (not root)."""
    import pwd

    try:
        pw = pwd.getpwnam(owner)
    except (KeyError, ValueError, UnicodeError):
        return None
    if pw.pw_uid == os.geteuid():
        return ()
    if os.geteuid() != 0:
        return None
    return pw.pw_uid, pw.pw_gid, os.getgrouplist(pw.pw_name, pw.pw_gid)


class _Target:
    """Where a job's copy goes (DEST) or is (JOBCOPY): its directory, reached
    without links and held as an fd, and the name in it."""

    def __init__(self, path, what, hint):
        self.path = os.fspath(path)
        parent, self.name = os.path.split(_absolute(self.path))
        if self.name in ("", ".", ".."):
            raise StagingError(f"spool: {what} {self.path}: not a path to a file", hint=hint)
        try:
            self.dfd = paths.open_dir(parent, f"spool: {what}", full=self.path)
        except paths.MissingError:
            raise
        except paths.LinkError as e:
            raise StagingError(e.args[0], hint=hint) from None

    def close(self):
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _dest(dest):
    try:
        return _Target(dest, "DEST", _DEST_HINT)
    except paths.MissingError as e:
        raise StagingError(e.args[0], hint="create the job's directory first") from None


def stat_dest(dest):
    """lstat() of a job's copy at `dest`, its directory reached without links."""
    with _dest(dest) as t:
        return os.stat(t.name, dir_fd=t.dfd, follow_symlinks=False)


class _Source:
    """A source given as a path (opened on first use, as `owner` could) or as
    an fd the caller owns; every use reads it from the start, and at most
    the `size` it had at the first."""

    def __init__(self, src, owner):
        self.src, self.owner = src, owner
        self.fd = src if isinstance(src, int) else None
        self.own = self.fd is None
        self.size = None

    def open(self):
        if self.fd is None:
            self.fd = _open_src(self.src, self.owner)
        else:
            os.lseek(self.fd, 0, os.SEEK_SET)
        if self.size is None:
            self.size = os.fstat(self.fd).st_size
        return self.fd

    def fit(self, dir_fd, where):
        """Open it, refused (before a byte is read) unless it fits where `dir_fd` is."""
        _fit(self.open(), dir_fd, self.src, where)
        return self.fd

    def close(self):
        if self.own and self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------- the spool


class Spool:
    """A spool directory of shared executables.  All methods return plain data."""

    def __init__(self, dir, *, link_fail_limit=LINK_FAIL_LIMIT):
        self.dir = os.path.abspath(dir)
        self._dfd = None
        self._open_dir()
        self._links = spoollinks.LinkState(self.dir, self._dfd, link_fail_limit)

    # -- setup

    def _open_dir(self):
        try:
            os.makedirs(os.path.dirname(self.dir), 0o755, exist_ok=True)
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise StagingError(f"spool: cannot create {self.dir}: {e.strerror}") from None
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise StagingError(
                f"spool: cannot open {self.dir}: {e.strerror}", hint="the spool must be a real directory, not a symlink"
            ) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise StagingError(
                f"spool: {self.dir} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; "
                "anyone who can write there can plant executables for other users",
                hint=f"chown root: {self.dir} && chmod 0700 {self.dir}",
            )
        self._dfd = fd

    def close(self):
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _lock(self):
        return _Flock(self._dfd)

    def path_of(self, owner, cmdhash):
        """Absolute hash path, or None for 'invalid'."""
        if check_cmdhash(cmdhash) == INVALID:
            check_owner(owner)
            return None
        name = hash_name(owner, cmdhash)
        if len(name.encode()) > NAME_MAX:
            raise SpecError("owner", f"spool name for {owner!r} is {len(name)} bytes, over the {NAME_MAX} limit")
        return os.path.join(self.dir, name)

    # -- the two steps of a transfer: "may I send it?" and "here it is"

    def lookup(self, owner, cmdhash):
        """The hash path if the spool has this file for this owner ("have it"), else None ("send it")."""
        path = self.path_of(owner, cmdhash)
        if path is None:
            return None
        try:
            st = os.stat(os.path.basename(path), dir_fd=self._dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return path if stat.S_ISREG(st.st_mode) else None

    def store(self, owner, cmdhash, src, *, verify=True, dest=None):
        """Copy `src` into the spool as the hash path; returns (answer, path).

        answer is "have" if the file was already there (nothing written),
        "send" if it was written now; ("send", None) for 'invalid'.  With
        `verify`, every known hash attribute in `cmdhash` is checked against
        the bytes actually copied; a mismatch raises StagingError.  With
        `dest`, the job's copy is linked in the same lock hold, so gc never
        sees the new file unused.  `src` (a path) is read as `owner` could
        (module docstring); `src` and `dest` are never followed through a link.
        """
        path = self.path_of(owner, cmdhash)
        target = _dest(dest) if dest is not None else None
        source = _Source(src, owner)
        try:
            return self._store(owner, cmdhash, path, source, verify, target)
        finally:
            source.close()
            if target is not None:
                target.close()

    def _store(self, owner, cmdhash, path, source, verify, target):
        if path is None:
            if target is not None:
                _copy_file(source.open(), target, source.src)
            return "send", None
        name = os.path.basename(path)
        if target is None and self.lookup(owner, cmdhash):
            return "have", path
        pairs = decode_cmdhash(cmdhash)
        algs = {HASH_ATTRS[k] for k, _ in pairs if k in HASH_ATTRS} if verify else set()
        for attempt in range(2):
            tmp = None
            if attempt or not self.lookup(owner, cmdhash):
                tmp = self._write_verified(source, pairs, algs)
            try:
                with self._lock():
                    if self.lookup(owner, cmdhash):
                        answer = "have"
                    elif tmp is None:
                        continue  # gc removed it since we looked: write it after all
                    else:
                        os.rename(tmp, name, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
                        tmp = None
                        os.fsync(self._dfd)
                        answer = "send"
                    if target is not None:
                        self._link_locked(name, path, target)
                    return answer, path
            finally:
                if tmp is not None:
                    unlink_quiet(tmp, self._dfd)
        raise AssertionError("unreachable")

    def _write_verified(self, source, pairs, algs):
        sfd = source.fit(self._dfd, "in the spool")
        mode = 0o555 if os.fstat(sfd).st_mode & 0o111 else 0o444
        tmp, digests = self._write_temp(source, algs, mode)
        for k, v in pairs:
            alg = HASH_ATTRS.get(k)
            if alg in digests and not hmac.compare_digest(digests[alg], v.lower()):
                unlink_quiet(tmp, self._dfd)
                raise StagingError(
                    f"spool: {source.src}: {k} mismatch (expected {v}, got {digests[alg]})",
                    hint="the file changed while it was added, or the hash given for it is wrong",
                )
        return tmp

    def _write_temp(self, source, algs, mode):
        tmp = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dfd)
        try:
            digests = _copy(source.fd, fd, algs, source.size, source.src)
            os.fchmod(fd, mode)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp, self._dfd)
            raise
        os.close(fd)
        return tmp, digests

    def add(self, owner, file, hash_attrs=("CmdHashSHA256",), *, dest=None):
        """Hash `file`, store it unless the owner already has it: (answer, hash_path).

        answer: "have" (nothing copied) or "send" (stored now).  With no hash
        attributes the hash path is 'invalid' and nothing is stored.  With
        `dest`, also give the job its copy there (see link_into).
        """
        check_owner(owner)
        attrs = check_attrs(hash_attrs)
        target = _dest(dest) if dest is not None else None
        source = _Source(file, owner)
        try:
            # Opened once: what is stored is read from the inode that was hashed (and is
            # checked again), and bounded before it is hashed: one too large to store is not read.
            cmdhash = INVALID
            if attrs:
                sfd = source.fit(self._dfd, "in the spool")
                digests = _copy(sfd, None, {HASH_ATTRS[a] for a in attrs}, source.size, source.src)
                cmdhash = encode_cmdhash((a, digests[HASH_ATTRS[a]]) for a in attrs)
            answer, path = self._store(owner, cmdhash, self.path_of(owner, cmdhash), source, True, target)
        finally:
            source.close()
            if target is not None:
                target.close()
        return answer, (path if path is not None else INVALID)

    # -- jobs

    def link_into(self, owner, cmdhash, dest, *, src=None):
        """Give a job its copy at `dest` (must not exist): a hard link to the hash path.

        'invalid' means a private copy of `src`.  If the spool lost the file
        and `src` is given, it is stored again first.  Where link() fails
        (EXDEV, EPERM, EMLINK) the job gets a private copy and a warning.
        No component of `dest` may be a link (its directory is held as an fd
        for the link or copy); `src` is read as `owner` could.
        """
        path = self.path_of(owner, cmdhash)
        if path is None and src is None:
            raise StagingError("spool: CmdHash is 'invalid' and no source file was given for a private copy")
        if src is not None:
            self.store(owner, cmdhash, src, dest=dest)
            return dest
        name = os.path.basename(path)
        with _dest(dest) as target, self._lock():
            if not self.lookup(owner, cmdhash):
                raise StagingError(
                    f"spool: no {name} in {self.dir}",
                    hint="add the executable first (`starter spool add`), or pass the source file",
                )
            self._link_locked(name, path, target)
        return dest

    def _link_locked(self, name, path, target):
        if self._links.enabled():
            try:
                os.link(name, target.name, src_dir_fd=self._dfd, dst_dir_fd=target.dfd, follow_symlinks=False)
            except OSError as e:
                if e.errno not in _LINK_ERRNOS:
                    raise StagingError(f"spool: cannot link {path} to {target.path}: {e.strerror}") from None
                self._links.note(False, e, target.path)
            else:
                self._links.note(True)
                return
        sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._dfd)
        try:
            _copy_file(sfd, target, path)
        finally:
            os.close(sfd)

    def release(self, job_copy, owner, cmdhash):
        """Drop the hash path if we are its last user, then the job copy.

        Returns True if the hash path was removed.  The job copy counts only if
        it is the very inode of the hash path (a job that replaced its copy
        cannot make us delete someone else's file).  JOBCOPY's directory is
        reached without links and the copy unlinked relative to it, so a job
        that swaps a directory on the way for a link gets an error, and
        nothing outside its directory is removed.  A JOBCOPY whose directory
        is gone is released already.
        """
        path = self.path_of(owner, cmdhash)
        try:
            target = _Target(job_copy, "JOBCOPY", _JOBCOPY_HINT)
        except paths.MissingError:
            return False
        with target:
            return self._release_locked(target, path)

    def _release_locked(self, target, path):
        removed = False
        with self._lock():
            try:
                jst = os.stat(target.name, dir_fd=target.dfd, follow_symlinks=False)
            except FileNotFoundError:
                jst = None
            if jst is not None and stat.S_ISDIR(jst.st_mode):
                raise StagingError(f"spool: JOBCOPY {target.path}: is a directory, not a job's copy")
            if path is not None and jst is not None and jst.st_nlink == 2:
                name = os.path.basename(path)
                try:
                    hst = os.stat(name, dir_fd=self._dfd, follow_symlinks=False)
                except FileNotFoundError:
                    hst = None
                if hst is not None and (hst.st_dev, hst.st_ino) == (jst.st_dev, jst.st_ino):
                    os.unlink(name, dir_fd=self._dfd)
                    os.fsync(self._dfd)
                    removed = True
            if jst is not None:
                try:
                    unlink_quiet(target.name, target.dfd)
                except OSError as e:
                    raise StagingError(f"spool: cannot remove {target.path}: {e.strerror}") from None
        return removed

    # -- admin

    def ls(self):
        """[{name, owner, cmdhash, users, size, mode}] for every exe- entry, sorted by name."""
        out = []
        for name, st in self._entries():
            try:
                owner, cmdhash = parse_name(name)
            except ValueError:
                owner, cmdhash = None, None
            out.append(
                {
                    "name": name,
                    "owner": owner,
                    "cmdhash": cmdhash,
                    "users": st.st_nlink - 1,
                    "size": st.st_size,
                    "mode": f"{stat.S_IMODE(st.st_mode):04o}",
                }
            )
        return sorted(out, key=lambda d: d["name"])

    def gc(self, min_age=DEFAULT_GC_MIN_AGE, now=None):
        """Remove exe- files no job links to (nlink 1) and unchanged for `min_age` s.

        Also removes temp files left by dead processes.  Returns the removed names.
        The age guard keeps a file that was just added and not yet linked.
        """
        import time

        now = time.time() if now is None else now
        removed = []
        with self._lock():
            for name, st in self._entries():
                if st.st_nlink == 1 and now - st.st_ctime >= min_age:
                    unlink_quiet(name, self._dfd)
                    removed.append(name)
            with os.scandir(self._dfd) as it:
                for e in it:
                    if e.name.startswith(TMP_PREFIX) and not _pid_alive(e.name):
                        unlink_quiet(e.name, self._dfd)
                        removed.append(e.name)
            if removed:
                os.fsync(self._dfd)
        return removed

    def _entries(self):
        with os.scandir(self._dfd) as it:
            names = [e.name for e in it if e.name.startswith(PREFIX)]
        for name in names:
            try:
                st = os.stat(name, dir_fd=self._dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield name, st

    def link_state(self):
        """(ever_succeeded, failures) as persisted in the spool (spool/links.py)."""
        return self._links.read()


class _Flock:
    """flock on $SPOOL/.lock; the file is never deleted (deleting it would let two holders in)."""

    def __init__(self, dfd):
        self.dfd = dfd
        self.fd = None

    def __enter__(self):
        self.fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.dfd)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the flock
        self.fd = None


def _fit(sfd, dir_fd, shown, where):
    """fileio.sized_to_fit, its refusal a StagingError naming the file -> the size."""
    try:
        return sized_to_fit(sfd, dir_fd)
    except NoRoom as e:
        raise StagingError(f"spool: {shown}: {e.strerror} {where}, so it is not copied",
                           hint="free space there, or check the file") from None


def _copy(sfd, dst_fd, algorithms, limit, shown):
    """fileio.copy_hashing, a file that grows past `limit` a StagingError."""
    try:
        return copy_hashing(sfd, dst_fd, algorithms, limit)
    except TooLarge:
        raise StagingError(f"spool: {shown}: grew past the {limit} bytes it had when it was opened, "
                           "so it is not copied", hint="add the file once it is complete") from None


def _copy_file(sfd, target, shown):
    """A private read-only copy of the open file `sfd` (`shown` in messages)
    at `target` (a _Target: created O_EXCL in its held directory, never
    through a link), bounded like every copy root makes here."""
    mode = 0o555 if os.fstat(sfd).st_mode & 0o111 else 0o444
    size = _fit(sfd, target.dfd, shown, "where DEST is")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(target.name, flags, 0o600, dir_fd=target.dfd)
    except OSError as e:
        raise StagingError(f"spool: cannot create {target.path}: {e.strerror}") from None
    try:
        _copy(sfd, fd, (), size, shown)
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_best_effort(target.name, target.dfd)
        raise
    os.close(fd)


def _pid_alive(tmpname):
    try:
        pid = int(tmpname[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

