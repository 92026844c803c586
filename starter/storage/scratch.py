"""The job's private working directory: made fresh, owned by the job, removed safely.

Creation: mkdir(0700) under a parent the job cannot write, open it by fd with
O_NOFOLLOW, fchown that fd to the job's uid/gid.  Nothing else is ever chowned.

Removal happens after the job ran, so everything inside is hostile: symlinks to
/etc, hard links to host files, symlink loops, deep trees, bind mounts.  The
walk therefore
  * holds directories only as fds opened with O_DIRECTORY|O_NOFOLLOW relative to
    their parent's fd, and checks (st_dev, st_ino) of what it opened against the
    lstat it decided on: a symlink is unlinked, never followed;
  * unlinks names (a hard link to a host file loses one name, the file stays);
  * never descends into another mount: st_dev and the fd's mnt_id (from
    /proc/self/fdinfo, which also catches a bind mount of the same filesystem)
    must match the scratch root; mounts are skipped and reported;
  * keeps one fd open at a time and climbs back with "..", verified against the
    identity recorded on the way down, so depth costs neither fds nor stack.

The parent must not be writable by the job: otherwise the job could rename its
scratch away and put a symlink in its place before cleanup.  remove() also
re-opens the scratch by name with O_NOFOLLOW and refuses if its (st_dev,
st_ino) is not the directory that was created.
"""

import errno
import logging
import os
import stat

from starter.errors import SpecError, StagingError

log = logging.getLogger("starter.scratch")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Scratch:
    """A created scratch directory.  `fd` stays open until remove()/close()."""

    def __init__(self, path, parent_fd, fd, st, uid, gid, keep=False):
        self.path = path
        self.name = os.path.basename(path)
        self.parent_fd = parent_fd
        self.fd = fd
        self.dev, self.ino = st.st_dev, st.st_ino
        self.uid, self.gid = uid, gid
        self.keep = keep

    def __repr__(self):
        return f"Scratch({self.path!r}, uid={self.uid}, gid={self.gid})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self):
        """End of job: remove the scratch unless it is to be kept; a kept one
        loses the set-id bits of its files first (keep_safely)."""
        if self.keep:
            log.info("scratch: keeping %s", self.path)
            try:
                if self.fd is not None:
                    keep_safely(self.fd, self.path)
            finally:
                self.close()
            return None
        return self.remove()

    def remove(self):
        """Remove the scratch and everything in it; returns a RemoveReport.

        Raises StagingError (after removing all it safely could) if something
        was left: a mount point inside, a name that would not go, or a scratch
        that is no longer the directory we created.
        """
        if self.parent_fd is None:
            return None
        try:
            report = remove_tree(self.parent_fd, self.name, expect=(self.dev, self.ino), path=self.path)
        finally:
            self.close()
        return report

    def close(self):
        for attr in ("fd", "parent_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)


# Set on every scratch as it is made, value the job id: only a process with
# CAP_SYS_ADMIN on the host can set or remove a trusted.* attribute, so gc
# knows a directory it is asked to remove after a crash is one the starter
# made for that job, whatever a state entry says.
MARK = "trusted.starter.job"


def create(path, uid, gid, *, keep=False, mark=None, groups=()):
    """Make `path` (must not exist) as the job's scratch: mode 0700, owned uid:gid.
    `groups`: the job's supplementary groups (for the parent's check).

    It is born mode 0000 and root-owned, then gets the MARK (`mark`, the job
    id), and only then its owner and mode: a directory of a starter killed in
    between is recognisable (see remove_recorded).  What is opened after the
    mkdir must still be that fresh directory (root's, mode 0000, empty)
    before it is marked or given away."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise SpecError("scratch", f"{path!r} is not a usable directory name")
    pfd = _open_dir(parent, "scratch: parent directory")
    try:
        _check_parent(pfd, parent, uid, gid, groups)
        try:
            os.mkdir(name, 0, dir_fd=pfd)
        except FileExistsError:
            raise StagingError(
                f"scratch: {path} already exists",
                hint="a scratch is always made fresh: remove the old one or use --execute-dir",
            ) from None
        except OSError as e:
            raise StagingError(f"scratch: cannot create {path}: {e.strerror}") from None
        replaced = False
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
            try:
                replaced = not _is_fresh(fd)
                if replaced:
                    raise StagingError(f"scratch: {path} was replaced between its creation and its use; "
                                       "left alone", hint="something else writes the scratch's parent "
                                       "directory: give scratches a root-owned parent only root writes")
                if mark is not None:
                    _set_mark(fd, mark)
                os.fchown(fd, uid, gid)
                os.fchmod(fd, 0o700)
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            if not replaced:        # a replacement is not ours to remove
                try:
                    os.rmdir(name, dir_fd=pfd)
                except OSError:
                    pass
            raise
    except BaseException:
        os.close(pfd)
        raise
    return Scratch(path, pfd, fd, st, uid, gid, keep=keep)


def create_in(execute_dir, job_id, uid, gid, *, keep=False, groups=()):
    """Make `<execute_dir>/job-<job_id>`; `execute_dir` is created (0755) if missing."""
    from starter.spec import values

    values.job_id("job_id", job_id)
    execute_dir = os.path.abspath(execute_dir)
    os.close(_open_dir(execute_dir, "scratch: execute dir", create=0o755))
    return create(os.path.join(execute_dir, f"job-{job_id}"), uid, gid, keep=keep, mark=job_id, groups=groups)


def _is_fresh(fd):
    """Is `fd` the directory just made, not one put in its place between the
    mkdir and the open (a parent someone else writes: another user's
    directory renamed there would be marked and given to this job)?  Root's,
    no permission bits (a setgid parent adds S_ISGID), empty."""
    st = os.fstat(fd)
    return st.st_uid == 0 and not st.st_mode & 0o777 and not os.listdir(fd)


def _set_mark(fd, job_id):
    try:
        os.setxattr(fd, MARK, job_id.encode())
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # No trusted xattrs here (some network filesystems): the job runs; a
        # scratch its crashed starter left is reported by gc, not removed.


def _get_mark(fd):
    try:
        return os.getxattr(fd, MARK).decode(errors="replace")
    except OSError:
        return None


def recorded_path(st, job_id):
    """The scratch a state entry records, if it is one the starter would have
    made for `job_id`: <execute_dir>/job-<id> for --execute-dir, the --scratch
    path otherwise, with a root-owned parent nobody else may write.  Raises
    StagingError ("not ours") for anything else: planted entries name /etc."""
    path, parent, kind = st.get("scratch"), st.get("scratch_parent"), st.get("scratch_kind")
    if not (isinstance(path, str) and isinstance(parent, str) and path.startswith("/")):
        raise StagingError(f"scratch {path!r}: no parent recorded: not a scratch the starter made; left alone")
    name = os.path.basename(path)
    if (os.path.normpath(path) != path or os.path.dirname(path) != parent or name in ("", ".", "..")
            or kind not in ("execute-dir", "scratch") or (kind == "execute-dir" and name != f"job-{job_id}")):
        raise StagingError(f"scratch {path!r} is not what the starter makes for job {job_id!r} "
                           f"({kind} under {parent!r}); left alone")
    return path


def _recorded_parent(st, job_id):
    """The scratch an entry records: (its path, its name, an fd of its parent
    opened without following a link), the fd None when the parent is gone."""
    path = recorded_path(st, job_id)
    parent, name = os.path.split(path)
    try:
        return path, name, _open_dir(parent, "scratch: parent directory")
    except FileNotFoundError:
        return path, name, None
    except OSError as e:
        raise StagingError(f"scratch: cannot open {parent}: {e.strerror}") from None


def remove_recorded(st, job_id):
    """gc after a crashed starter: remove the scratch its entry records, only
    if it is one the starter made for this job (recorded_path, and the MARK on
    the directory itself, and its recorded (st_dev, st_ino) if it got that
    far).  A directory still mode 0000, root-owned and empty is one whose
    starter died before marking it: rmdir.  -> True if something was removed."""
    path, name, pfd = _recorded_parent(st, job_id)
    if pfd is None:
        return False
    try:
        pst = os.fstat(pfd)
        if pst.st_uid != 0 or pst.st_mode & 0o002:
            raise StagingError(f"scratch {path}: its parent is not root-owned or is world-writable; "
                               "not a place the starter makes scratches; left alone")
        try:
            lst = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(lst.st_mode):
            raise StagingError(f"scratch {path} is not a directory; left alone")
        fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        try:
            mark = _get_mark(fd)
            empty = not os.listdir(fd)
        finally:
            os.close(fd)
        if mark == job_id:
            expect = tuple(st["scratch_id"]) if st.get("scratch_id") else None
            remove_tree(pfd, name, expect=expect, path=path)
            return True
        if mark is None and stat.S_IMODE(lst.st_mode) == 0 and lst.st_uid == 0 and empty:
            os.rmdir(name, dir_fd=pfd)
            return True
        raise StagingError(f"scratch {path} does not carry the starter's mark for job {job_id!r}; "
                           "left alone", hint="if it is a leftover, remove it by hand")
    finally:
        os.close(pfd)


def keep_recorded(st, job_id):
    """gc after a crashed starter whose job kept its scratch (--keep-scratch):
    what keep_safely does at a job's end, on the scratch the entry records,
    only if it is one the starter made for this job (as remove_recorded
    checks: recorded_path, the MARK, the recorded identity).  -> True if it
    was walked."""
    path, name, pfd = _recorded_parent(st, job_id)
    if pfd is None:
        return False
    try:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StagingError(f"scratch {path}: cannot open it: {e.strerror}; left alone") from None
        try:
            fst = os.fstat(fd)
            if _get_mark(fd) != job_id or (st.get("scratch_id") and
                                           (fst.st_dev, fst.st_ino) != tuple(st["scratch_id"])):
                raise StagingError(f"scratch {path} is not the one the starter made for job {job_id!r}; "
                                   "left alone")
            keep_safely(fd, path)
            return True
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def _open_dir(path, what, create=None):
    """A directory fd of `path`, no component a link (paths.open_dir): root
    makes a job-owned directory here, which a link must not put elsewhere."""
    from starter.storage import paths

    try:
        return paths.open_dir(path, what, create=create, readable=True)
    except paths.LinkError as e:
        raise StagingError(e.args[0], e.hint) from None


def _check_parent(pfd, parent, uid, gid, groups=()):
    st = os.fstat(pfd)
    mode = stat.S_IMODE(st.st_mode)
    job_writable = (
        (st.st_uid == uid and uid != 0)
        or (mode & 0o002)
        or (mode & 0o020 and st.st_gid != 0 and (st.st_gid == gid or st.st_gid in groups))
        or _has_acl(pfd)
    )
    if job_writable:
        raise StagingError(
            f"scratch: parent directory {parent} (uid {st.st_uid}, gid {st.st_gid}, mode {mode:04o}) "
            "is writable by the job; it could swap its scratch for a symlink before cleanup",
            hint="put scratches under a root-owned directory with mode 0755, e.g. --execute-dir /var/lib/starter/execute",
        )


def _has_acl(fd):
    """An access ACL can give anyone write: such a parent counts as the job's."""
    try:
        return len(os.getxattr(fd, "system.posix_acl_access")) > 0
    except OSError:
        return False        # none (ENODATA), or no ACLs on this filesystem


_SETID = stat.S_ISUID | stat.S_ISGID


def keep_safely(fd, path):
    """A scratch that stays after its job: no file of its owner in it keeps
    a set-user-ID or set-group-ID bit (strip_setid), or anyone who can reach
    it would run that file as the job's uid, which a later job may have
    again (a transient uid).  What the walk could not finish makes the
    scratch root's, mode 0700: kept for the admin, reachable by no one
    else; said in one line."""
    try:
        problems = strip_setid(fd, path)
    except OSError as e:
        problems = [(path, e.strerror or str(e))]
    if not problems:
        return
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o700)
        done = "made root's, mode 0700"
    except OSError as e:
        done = f"and it could not be made root's: {e.strerror}"
    p, why = problems[0]
    import sys

    sys.stderr.write(f"starter: kept scratch {path}: set-id bits not cleared everywhere ({p}: {why}"
                     f"{f'; {len(problems) - 1} more' if len(problems) > 1 else ''}); {done}\n")


def strip_setid(fd, path):
    """Clear S_ISUID and S_ISGID on every regular file of the tree at the
    directory `fd` that belongs to the tree's owner (what that uid could
    clear itself), without following a link or leaving the tree's mount.
    Walked as remove_tree walks: directories opened O_NOFOLLOW relative to
    their parent's fd and checked to be what was looked at, one fd held at a
    time, climbing back by "..", verified; each file chmod-ed through an
    O_PATH fd of it (/proc/self/fd/N), checked to be the inode looked at.
    -> [(path, why)] of what could not be done (empty: all done)."""
    root = os.fstat(fd)
    root_dev, root_mnt, owner = root.st_dev, _mnt_id(fd), root.st_uid
    cur = os.open(".", _DIR_FLAGS, dir_fd=fd)
    problems = []
    try:
        stack = [((root.st_dev, root.st_ino), path, os.listdir(cur))]
        while stack:
            ident, dpath, pending = stack[-1]
            if pending:
                name = pending.pop()
                cpath = f"{dpath}/{name}"
                try:
                    st = os.stat(name, dir_fd=cur, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_mode & _SETID and st.st_uid == owner:
                    why = _clear_setid(cur, name, st)
                    if why:
                        problems.append((cpath, why))
                elif stat.S_ISDIR(st.st_mode) and st.st_dev == root_dev:
                    try:
                        cfd = os.open(name, _DIR_FLAGS, dir_fd=cur)
                    except OSError as e:
                        problems.append((cpath, e.strerror))
                        continue
                    cst = os.fstat(cfd)
                    if (cst.st_dev, cst.st_ino) != (st.st_dev, st.st_ino) or _mnt_id(cfd) != root_mnt:
                        os.close(cfd)
                        problems.append((cpath, "changed, or another mount: not entered"))
                        continue
                    try:
                        names = os.listdir(cfd)
                    except OSError as e:
                        os.close(cfd)
                        problems.append((cpath, e.strerror))
                        continue
                    os.close(cur)
                    cur = cfd
                    stack.append(((cst.st_dev, cst.st_ino), cpath, names))
                continue
            stack.pop()
            if not stack:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=cur)
            ust = os.fstat(up)
            os.close(cur)
            cur = up
            if (ust.st_dev, ust.st_ino) != stack[-1][0]:
                problems.append((dpath, "moved during the walk; stopped"))
                break
    finally:
        os.close(cur)
    return problems


def _clear_setid(dfd, name, st):
    """Clear the set-id bits of `name` in dfd, the regular file `st` said it
    is; -> None, or why not."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            return "changed while being looked at"
        if now.st_mode & _SETID:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(now.st_mode) & ~_SETID)
        return None
    except OSError as e:
        return e.strerror
    finally:
        os.close(fd)


class RemoveReport:
    """What remove_tree did: counts, and what it left and why."""

    def __init__(self, path):
        self.path = path
        self.files = 0
        self.dirs = 0
        self.bytes = 0     # disk space freed (st_blocks), each inode once: the job's disk usage
        self._linked = set()
        self.mounts = []  # paths of mount points found inside (not entered)
        self.errors = []  # (path, message) for names that would not go

    @property
    def complete(self):
        return not self.mounts and not self.errors

    def as_dict(self):
        return {
            "path": self.path,
            "files": self.files,
            "dirs": self.dirs,
            "bytes": self.bytes,
            "mounts": list(self.mounts),
            "errors": [f"{p}: {m}" for p, m in self.errors],
        }


def _mnt_id(fd):
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def remove_tree(parent_fd, name, *, expect=None, path=None, check=True):
    """Remove directory `name` under `parent_fd` and its contents, never leaving its mount.

    `expect` is the (st_dev, st_ino) the directory must have (else nothing is
    touched).  Returns a RemoveReport; with `check`, raises StagingError if
    anything was left behind, after removing everything that safely could be.

    Only directories of the scratch's owner (the job's uid) are entered: a
    process of that uid still running elsewhere could rename another user's
    directory into the tree while root removes it, and root would delete
    what that uid itself could not.
    """
    path = path or name
    report = RemoveReport(path)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return report
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StagingError(
                f"scratch: {path} is no longer a directory (it was replaced, maybe by a symlink); not removing it",
                hint="its parent directory must not be writable by the job",
            ) from None
        raise StagingError(f"scratch: cannot open {path}: {e.strerror}") from None
    root = os.fstat(fd)
    if expect is not None and (root.st_dev, root.st_ino) != tuple(expect):
        os.close(fd)
        raise StagingError(
            f"scratch: {path} is not the directory that was created (it was replaced); not removing it",
            hint="its parent directory must not be writable by the job",
        )
    root_dev, root_mnt, owner = root.st_dev, _mnt_id(fd), root.st_uid
    report.bytes += root.st_blocks * 512
    pst = os.fstat(parent_fd)
    if root_dev != pst.st_dev or (root_mnt is not None and root_mnt != _mnt_id(parent_fd)):
        os.close(fd)
        report.mounts.append(path)
        _finish(report, check)
        return report

    # One frame per directory on the way down: (identity, name, path, pending names).
    with os.scandir(fd) as it:
        pending = [e.name for e in it]
    stack = [((root.st_dev, root.st_ino), None, path, pending)]
    skip = set()  # identities that must not be entered again (mounts, non-empty dirs)
    try:
        while stack:
            ident, dname, dpath, pending = stack[-1]
            if pending:
                child = pending.pop()
                cpath = f"{dpath}/{child}"
                cfd = _step(fd, child, cpath, root_dev, root_mnt, owner, skip, report)
                if cfd is not None:
                    cst = os.fstat(cfd)
                    try:
                        with os.scandir(cfd) as it:
                            cpending = [e.name for e in it]
                    except OSError as e:
                        os.close(cfd)
                        report.errors.append((cpath, e.strerror))
                        continue
                    os.close(fd)
                    fd = cfd
                    stack.append(((cst.st_dev, cst.st_ino), child, cpath, cpending))
                continue
            # Directory done: climb to the parent by "..", verified, then rmdir the child.
            stack.pop()
            if not stack:
                break
            pfd = os.open("..", _DIR_FLAGS, dir_fd=fd)
            pst = os.fstat(pfd)
            if (pst.st_dev, pst.st_ino) != stack[-1][0]:
                os.close(pfd)
                raise StagingError(f"scratch: {dpath} moved during removal; stopping", hint="is the job still running?")
            os.close(fd)
            fd = pfd
            try:
                os.rmdir(dname, dir_fd=fd)
                report.dirs += 1
            except OSError as e:
                skip.add(ident)
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # non-empty: its content was reported
                    report.errors.append((dpath, e.strerror))
    finally:
        os.close(fd)
    if report.complete:
        try:
            os.rmdir(name, dir_fd=parent_fd)
            report.dirs += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            report.errors.append((path, e.strerror))
    _finish(report, check)
    return report


def _step(dfd, child, cpath, root_dev, root_mnt, owner, skip, report):
    """Handle one name in the open directory `dfd`: unlink it, or return an fd to descend into."""
    try:
        st = os.stat(child, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        report.errors.append((cpath, e.strerror))
        return None
    ident = (st.st_dev, st.st_ino)
    if ident in skip:
        return None
    if not stat.S_ISDIR(st.st_mode):
        if st.st_dev != root_dev:  # a file bind-mounted over a name
            report.mounts.append(cpath)
            return None
        try:
            os.unlink(child, dir_fd=dfd)
            report.files += 1
            if ident not in report._linked:
                report.bytes += st.st_blocks * 512
                if st.st_nlink > 1:
                    report._linked.add(ident)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.EBUSY:  # a file mount point
                report.mounts.append(cpath)
            else:
                report.errors.append((cpath, e.strerror))
        return None
    if st.st_dev != root_dev:
        report.mounts.append(cpath)
        skip.add(ident)
        return None
    try:
        cfd = os.open(child, _DIR_FLAGS, dir_fd=dfd)
    except OSError as e:
        report.errors.append((cpath, e.strerror))
        return None
    cst = os.fstat(cfd)
    cmnt = _mnt_id(cfd)
    if cst.st_dev != root_dev or (root_mnt is not None and cmnt != root_mnt):
        report.mounts.append(cpath)  # e.g. a bind mount from the same filesystem
    elif (cst.st_dev, cst.st_ino) != ident:
        report.errors.append((cpath, "changed while being removed"))
    elif cst.st_uid != owner:
        report.errors.append((cpath, f"a directory of uid {cst.st_uid}, not of the job's uid {owner}: not entered"))
    else:
        report.bytes += cst.st_blocks * 512
        return cfd
    os.close(cfd)
    skip.add(ident)
    return None


def _finish(report, check):
    if report.mounts:
        log.warning("scratch: %s: not entering mount point(s) %s", report.path, ", ".join(report.mounts))
    for p, m in report.errors:
        log.warning("scratch: %s: %s", p, m)
    if check and not report.complete:
        what = []
        if report.mounts:
            what.append("mount point(s) inside: " + ", ".join(report.mounts))
        if report.errors:
            what.append("; ".join(f"{p}: {m}" for p, m in report.errors))
        raise StagingError(
            f"scratch: {report.path} not fully removed ({'; '.join(what)})",
            hint="unmount what is mounted there, then remove the directory (`starter gc` retries)",
        )
