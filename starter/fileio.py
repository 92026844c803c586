"""Small file operations that several owners share: the state directory,
the spool, the manifest stager, the lease store, the report writer, the
seccomp cache and netd's socket.

A leaf: it imports nothing of the starter and nothing heavy at import time
(hashlib only where a digest is made), so the run path may use it.
"""

import errno
import os

CHUNK = 1 << 20


def unlink_quiet(name, dir_fd=None):
    """Unlink `name` (relative to `dir_fd` if given); one that is already
    gone is fine, every other error is raised."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def unlink_best_effort(name, dir_fd=None):
    """Unlink `name` (relative to `dir_fd` if given), ignoring every error:
    for cleanup while a failure is unwound (that failure is the one to
    report) and for caches, which may keep a stale file."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def write_all(fd, data):
    """Write every byte of `data` to `fd`, or raise OSError: a short write (a
    file size limit, a full disk) never passes for a whole one."""
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        mv = mv[n:]


class NotRegular(OSError):
    """read_regular(): the name is not a regular file."""


class TooLarge(OSError):
    """read_regular(): the file holds more than the limit; copy_hashing():
    the file grew past the size it had when it was opened."""


class NoRoom(OSError):
    """sized_to_fit(): the file is larger than the room left for users."""


def read_regular(path, limit, dir_fd=None):
    """The bytes of the regular file `path`, at most `limit` of them: its
    last component is not followed (OSError ELOOP), a FIFO never blocks the
    read.  NotRegular or TooLarge else; open()'s OSError as it comes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_mode & 0o170000 != 0o100000:
            raise NotRegular(errno.EINVAL, "not a regular file")
        return read_limited(fd, limit)
    finally:
        os.close(fd)


def read_limited(fd, limit):
    """What is left to read of `fd`, at most `limit` bytes (else TooLarge)."""
    chunks, size = [], 0
    while True:
        b = os.read(fd, min(CHUNK, limit + 1 - size))
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        size += len(b)
        if size > limit:
            raise TooLarge(errno.EFBIG, f"larger than {limit} bytes")


def sized_to_fit(src_fd, dir_fd):
    """The size of the open file `src_fd`, which root is about to copy into
    the directory `dir_fd`: neither quotas nor the blocks reserved for root
    would stop that copy, so a file larger than what an ordinary user could
    still write on that file system raises NoRoom before a byte is copied (a
    sparse 100 TB file included).  Pass the size on as copy_hashing()'s
    `limit`: a file that grows past it fails there."""
    size = os.fstat(src_fd).st_size
    vfs = os.fstatvfs(dir_fd)
    room = vfs.f_bavail * vfs.f_frsize
    if size > room:
        raise NoRoom(errno.ENOSPC, f"{size} bytes, more than the {room} bytes free for users")
    return size


def copy_hashing(src_fd, dst_fd, algorithms, limit=None):
    """Read `src_fd` to its end once, writing every byte to `dst_fd` (None:
    only hash) and hashing it with each of `algorithms` (hashlib names) on
    the way -> {algorithm: hexdigest}.  The digests are of exactly the bytes
    written: a source that changes during the copy cannot pass a check made
    on an earlier read.  `limit`: the size the source had when it was
    opened; a source still growing past it (root copying a user's file that
    never ends) raises TooLarge instead of filling the disk; the copy may
    then hold one byte more, so the caller removes it.  With no algorithms
    the kernel copies (sendfile), and {} comes back."""
    import hashlib

    hs = {a: hashlib.new(a) for a in algorithms}
    left = limit
    while True:
        want = CHUNK if left is None else max(1, min(CHUNK, left))
        if dst_fd is not None and not hs:
            n = os.sendfile(dst_fd, src_fd, None, want)
            buf = None
        else:
            buf = os.read(src_fd, want)
            n = len(buf)
        if not n:
            break
        if left is not None:
            left -= n
            if left < 0:
                raise TooLarge(errno.EFBIG, "the file grew while it was copied")
        if buf is None:
            continue
        for h in hs.values():
            h.update(buf)
        if dst_fd is not None:
            write_all(dst_fd, buf)
    return {a: h.hexdigest() for a, h in hs.items()}


def account_entries(path):
    """The colon-separated lines of an account file (/etc/passwd, /etc/group)
    as lists of bytes fields, read directly, not through NSS: the first NSS
    lookup of a process costs ~5 ms here.  [] if it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(16 << 20)
    except OSError:
        return []
    return [line.split(b":") for line in data.split(b"\n") if line and not line.startswith((b"#", b"+", b"-"))]


def libc_handle():
    """(ctypes, libc) for the few system calls Python has no wrapper for
    (mount, umount2, quotactl_fd: disk.py, quota.py); ctypes is imported
    only when one is made, never on a start without --disk."""
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)
