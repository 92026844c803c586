"""Open a path as root without following anyone's links.

The starter runs as root and opens paths that a job may be able to change:
the report and events files (often in the job's scratch), bind sources, the
manifest and its inputs, the scratch's parent.  A symlink (or a /proc magic
link) planted at any component would make root read, write or mount
something the job chose.  So every path is walked one component at a time
from "/", each component opened with O_PATH|O_NOFOLLOW relative to the fd of
the one before, and fstat()ed: a link anywhere is refused with a message
naming it, never followed (the pattern of systemd's chase() and of
libpathrs).  Mount points are crossed; ".." never appears (values.path
refuses it).

A plain walk works on every kernel; openat2(RESOLVE_NO_SYMLINKS) would do the
same in one call but is 5.6+ and not in Python's os module.

Each open is a watchdog.region: a path on a hung NFS or FUSE mount waits in
the kernel, and setup's watchdog acts for the waiting starter.
"""

import errno
import os
import stat

from starter.job import watchdog
from starter.errors import StarterError

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkError(StarterError):
    """A component of a path is a symlink, or the path is not what was asked for."""


class MissingError(LinkError):
    """A component of the path does not exist (a caller may take "gone" as done)."""


def kind(mode):
    """'a FIFO', 'a directory', ... for messages."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _link_error(what, path, prefix):
    target = os.path.realpath(path)
    return LinkError(f"{what} {path}: {prefix} is a symlink (not followed)",
                     f"if the link is yours, give the real path (it leads to {target}); "
                     "a link a job or user made is refused on purpose"
                     if target != path else "give a path without symlinks")


def split(path):
    """'/a//b/./c' -> ['a', 'b', 'c']; relative paths and '..' are refused."""
    parts = [c for c in path.split("/") if c not in ("", ".")]
    if not path.startswith("/") or ".." in parts:
        raise LinkError(f"{path}: must be an absolute path without '..'")
    return parts


def open_dir(path, what="path", create=None, full=None, readable=False):
    """An O_PATH fd of directory `path` (`readable`: an O_RDONLY one), every
    component resolved without following links.  `create` (a mode) makes a
    missing last component.  `full`: the path to name in messages (a file in
    this directory)."""
    with watchdog.region(f"{what} {full or path}"):
        return _open_dir(path, what, create, full, readable)


def _open_dir(path, what, create, full, readable):
    parts = split(path)
    shown = full or path
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not (last and create is not None):
                    raise
                try:
                    os.mkdir(name, create, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            mode = os.fstat(fd).st_mode
            sofar = "/" + "/".join(parts[: i + 1])
            if stat.S_ISLNK(mode):
                raise _link_error(what, shown, sofar)
            if not stat.S_ISDIR(mode):
                raise LinkError(f"{what} {shown}: {sofar} is {kind(mode)}, not a directory")
        if readable:
            rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = rfd
        return fd
    except FileNotFoundError:
        os.close(fd)
        raise MissingError(f"{what} {shown}: no such directory {path}") from None
    except OSError as e:
        os.close(fd)
        raise LinkError(f"{what} {shown}: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise


def open_beneath(dir_fd, name, flags, what, path, mode=0o644):
    """open(name, flags) in `dir_fd` (one component), never through a link and
    never blocking on a FIFO; a device there is refused before it is opened
    (only root makes those, but opening one can have effects); -> (fd, stat)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise LinkError(f"{what} {path}: is {kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(what, path, path) from None
        raise
    return fd, os.fstat(fd)


def open_path(path, what="path"):
    """An O_PATH fd of `path` (any type but a link), every component resolved
    without following links; -> (fd, stat)."""
    with watchdog.region(f"{what} {path}"):
        return _open_path(path, what)


def _open_path(path, what):
    parent, name = os.path.split(path.rstrip("/") or "/")
    if not name:
        fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return fd, os.fstat(fd)
    dfd = open_dir(parent, what, full=path)
    try:
        try:
            fd = os.open(name, _PATH_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            raise MissingError(f"{what} {path}: does not exist") from None
        except OSError as e:    # EACCES: a caller's rights (Caller.rights) stop here
            raise LinkError(f"{what} {path}: {e.strerror}") from None
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            os.close(fd)
            raise _link_error(what, path, path)
        return fd, st
    finally:
        os.close(dfd)


def open_file(path, what="file"):
    """A regular file for reading (O_RDONLY, not O_PATH), resolved without
    links; a FIFO or device there is refused without blocking."""
    with watchdog.region(f"{what} {path}"):
        return _open_file(path, what)


def _open_file(path, what):
    parent, name = os.path.split(path)
    dfd = open_dir(parent, what, full=path)
    try:
        try:
            fd, st = open_beneath(dfd, name, os.O_RDONLY, what, path)
        except FileNotFoundError:
            raise MissingError(f"{what} {path}: does not exist") from None
        except OSError as e:
            raise LinkError(f"{what} {path}: {e.strerror}") from None
    finally:
        os.close(dfd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LinkError(f"{what} {path}: is {kind(st.st_mode)}, not a regular file")
    return fd


def _switch(uid, gid, groups):
    """This thread's effective ids and groups (native/threadcreds.c: the
    other threads keep theirs, and no glibc broadcast to them)."""
    from starter._native import check, ffi, lib

    groups = list(groups)
    check(lib.shim_thread_creds(uid, gid, ffi.new("unsigned int[]", groups or [0]), len(groups)),
          f"switching to uid {uid}, gid {gid}")


class as_user:
    """`with as_user((uid, gid, groups), "to read the job's file"):` act with
    those effective ids inside the block, so the kernel checks every open,
    walk and access against them (ACLs included), and root again after.
    This thread only (_switch).  Effective ids only: the real and saved uid
    stay 0, so the switch back cannot fail, and the user cannot signal or
    trace us meanwhile (a change of credentials also makes the process
    non-dumpable).  `creds` empty or None: no switch (this process already
    is that user).

    A class, not contextlib.contextmanager: contextlib costs 4.5 ms per start
    (job/run.py's Undo says why), and `starter run` for a caller that is not root
    passes through here."""

    __slots__ = ("creds", "why", "saved")

    def __init__(self, creds, why="to open the caller's files"):
        self.creds = creds
        self.why = why
        self.saved = None

    def __enter__(self):
        if not self.creds:
            return self
        uid, gid, groups = self.creds
        self.saved = (os.getegid(), os.getgroups())
        try:
            _switch(uid, gid, groups)
        except OSError as e:
            self._restore()
            raise StarterError(f"cannot take uid {uid}, gid {gid} {self.why}: {e.strerror}",
                               "the starter needs CAP_SETUID and CAP_SETGID") from None
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self._restore()

    def _restore(self):
        gid, groups = self.saved
        self.saved = None
        _switch(0, gid, groups)


class as_root:
    """`with as_root():` inside as_user, root's effective ids again for the
    block (what only root may read: another process's /proc files), then
    the user's again; outside it, nothing changes."""

    __slots__ = ("saved",)

    def __enter__(self):
        self.saved = None
        if os.geteuid() != 0:
            self.saved = (os.geteuid(), os.getegid(), os.getgroups())
            _switch(0, 0, ())
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            _switch(*self.saved)
