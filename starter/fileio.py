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


def copy_hashing(src_fd, dst_fd, algorithms, limit=None):
    """Read `src_fd` to its end once, writing every byte to `dst_fd` (None:
    only hash) and hashing it with each of `algorithms` (hashlib names) on
    the way -> {algorithm: hexdigest}.  The digests are of exactly the bytes
    written: a source that changes during the copy cannot pass a check made
    on an earlier read.  `limit`: the size the source had when it was
    opened; a source still growing past it (root copying a user's file that
    never ends) raises OSError(EFBIG) instead of filling the disk."""
    import hashlib

    hs = {a: hashlib.new(a) for a in algorithms}
    left = limit
    while True:
        buf = os.read(src_fd, CHUNK if left is None else max(1, min(CHUNK, left)))
        if not buf:
            break
        if left is not None:
            left -= len(buf)
            if left < 0:
                raise OSError(errno.EFBIG, "the file grew while it was copied")
        for h in hs.values():
            h.update(buf)
        if dst_fd is not None:
            mv = memoryview(buf)
            while mv:
                mv = mv[os.write(dst_fd, mv):]
    return {a: h.hexdigest() for a, h in hs.items()}
