"""Reading and writing cgroup files: each a thin wrapper around one
open()/read()/write() that turns an OSError into a CgroupError naming the
path, the value and what to do about it.  The parsers of what is read are
parsers.py's; where the hierarchies are, layout.py's."""

import errno
import os

from ..errors import CgroupError

# --------------------------------------------------------------------------
# reading and writing


# What a read of a cgroup file that is not there (or not readable on this
# kernel) fails with: ENOENT, ENODEV (a removed cgroup's open file, or PSI
# files with psi=0), EOPNOTSUPP, EINVAL.
_ABSENT = frozenset((errno.ENOENT, errno.ENODEV, errno.EOPNOTSUPP, errno.EINVAL))


def read_text(path):
    # os.open/os.read, not open(): a third cheaper per file, which counts
    # when `starter metrics` reads ~11 files for each of hundreds of jobs.
    # A short read of a seq_file (every cgroup file) means end of file.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_whole(fd)
    finally:
        os.close(fd)


def _read_whole(fd):
    data = os.pread(fd, 65536, 0)
    if len(data) == 65536:
        chunks, off = [data], len(data)
        while chunks[-1]:
            chunks.append(os.pread(fd, 1 << 20, off))
            off += len(chunks[-1])
        data = b"".join(chunks)
    return data.decode()


def read_text_or_none(path):
    """The file's text, or None when the file (or its cgroup) does not exist."""
    return _or_none(read_text, path)


def _or_none(read, what):
    """read(what), or None where the file is absent (_ABSENT)."""
    try:
        return read(what)
    except OSError as e:
        if e.errno in _ABSENT:
            return None
        raise


def read_int_or_none(path):
    """An integer file ("max" reads as None); None when the file is missing."""
    return int_or_none(read_text_or_none(path))


def int_or_none(text):
    """An integer file's text ("max" and None read as None)."""
    if text is None:
        return None
    text = text.strip()
    if text == "max" or text == "":
        return None
    return int(text)


class Kept:
    """Descriptors of one cgroup's own files, kept open once keep is set:
    a read is then one pread, a write one write.

    A job's last reads (its usage, "is it empty?") and its kill come after
    it ended or was told to end, where every microsecond is teardown time;
    the first open of a kernfs file makes its inode (~40 us here).  So the
    starter sets keep and reads everything once while the job runs
    (JobCgroup.keep_open), and closes them with the job's cgroup.  Until
    keep is set (a reader such as `starter metrics`, which must not hold
    descriptors of many jobs) every call is a plain read or write.  Only
    for the job's own directories, never a sub-cgroup a job could remove
    and make again under the same name."""

    def __init__(self):
        self.keep = False
        self.priming = False    # keep_open(): open what is read, read nothing
        self.fds = {}

    def open(self, path, flags=os.O_RDONLY):
        """The kept descriptor of `path` (opened now if need be), or None
        if there is no such file."""
        key = (path, flags)
        fd = self.fds.get(key, -1)
        if fd == -1:
            try:
                fd = os.open(path, flags | os.O_CLOEXEC)
            except OSError as e:
                if e.errno not in _ABSENT:
                    raise
                fd = None
            self.fds[key] = fd
        return fd

    def text(self, path):
        """As read_text_or_none(path)."""
        if not self.keep:
            return read_text_or_none(path)
        fd = self.open(path)
        if fd is None or self.priming:
            return None
        return _or_none(_read_whole, fd)

    def write(self, path, value):
        """As write(path, value); a file that is gone (or whose cgroup was
        removed since it was opened) fails with errno ENOENT."""
        if not self.keep:
            return write(path, value)
        fd = self.open(path, os.O_WRONLY)
        try:
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            os.write(fd, str(value).encode())
        except OSError as e:
            if e.errno == errno.ENODEV:
                e = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            raise _write_error(path, value, e, None) from None

    def close(self):
        fds, self.fds, self.keep, self.priming = self.fds, {}, False, False
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def swap_active():
    """Is any swap device or file on (/proc/swaps lists more than its header)?"""
    text = read_text_or_none("/proc/swaps") or ""
    return len(text.strip().splitlines()) > 1


_HINTS = {
    errno.EINVAL: "the kernel rejected the value: check its range and format",
    errno.EBUSY: "the cgroup is busy: it has processes or children "
    "(cgroup v2 allows controllers in cgroup.subtree_control only on cgroups without processes), "
    "or the new memory limit is below current usage",
    errno.ENOENT: "the file or cgroup does not exist: the controller is not mounted or not "
    "enabled for this cgroup (cgroup.subtree_control of its parent), or the cgroup was removed",
    errno.EACCES: "permission denied: starter must run as root or in a delegated cgroup",
    errno.EPERM: "operation not permitted: starter must run as root or in a delegated cgroup",
    errno.ESRCH: "the process has already exited",
    errno.ENOSPC: "cgroup.max.descendants or cgroup.max.depth of an ancestor is reached",
    errno.EOPNOTSUPP: "the kernel does not support this cgroup feature",
    errno.ENODEV: "the kernel does not support this cgroup feature",
}


def hint_for(err, default=None):
    return _HINTS.get(err, default)


def write(path, value, hint=None):
    """Write `value` to the cgroup file `path` in one write(), or raise CgroupError.

    cgroup files take one value per write() call; Python's buffered write can
    split or merge, so write unbuffered.
    """
    data = str(value).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _write_error(path, value, e, hint) from None
    try:
        os.write(fd, data)
    except OSError as e:
        raise _write_error(path, value, e, hint) from None
    finally:
        os.close(fd)


def _write_error(path, value, e, hint):
    name = errno.errorcode.get(e.errno, str(e.errno))
    err = CgroupError(
        f"writing {str(value)!r} to {path} failed: {name} ({os.strerror(e.errno)})",
        hint or hint_for(e.errno),
    )
    err.errno = e.errno
    err.path = path
    return err


def read_pids(path):
    """PIDs in one cgroup.procs file ([] when the cgroup is gone)."""
    text = read_text_or_none(path)
    if not text:
        return []
    return [int(x) for x in text.split()]
