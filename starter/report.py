"""The final usage report and the event stream.

Both go to a file or an inherited fd ("fd:N"), as JSON.  The report is one
document written when the job is over and its cgroup is empty; events are
JSON lines, one per state change.  Schema: README, "The report".
"""

import os
import time

from starter.state import dumps

REASONS = ("exited", "signaled", "oom", "timeout", "vacated", "killed", "unkillable", "starter_error")


def open_dest(dest):
    """FILE or fd:N -> an fd to append to (ours to close)."""
    if dest.startswith("fd:"):
        return os.dup(int(dest[3:]))
    if dest.startswith("/dev/") or dest.startswith("/proc/"):  # /dev/stdout is a link
        return os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    # No link followed, never truncated.
    return os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


def write_report(dest, report):
    """The report goes where the node daemon said, written as root, often
    into a directory the job can write (its scratch, say).  So: never write
    through a link the job could have planted, never truncate a file we did
    not create.

    - fd:N, and /dev/... or /proc/... paths (/dev/stdout): written in place;
    - a fifo or character device at the path itself: written in place, no
      link followed;
    - otherwise a fresh temp file (O_EXCL) renamed over the path: a reader
      never sees half a report, and a symlink there is replaced, not followed.
    """
    if dest is None:
        return
    text = (dumps(report) + "\n").encode()
    if dest.startswith("fd:") or dest.startswith("/dev/") or dest.startswith("/proc/"):
        fd = open_dest(dest)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        return
    import stat

    try:
        mode = os.lstat(dest).st_mode
    except FileNotFoundError:
        mode = 0
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        fd = os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        return
    tmp = f"{dest}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:  # left by a crash, or planted: drop the name, make our own
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o644)
    try:
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)


class Events:
    """JSON lines to --events; a no-op without it."""

    def __init__(self, dest, job_id):
        self.fd = open_dest(dest) if dest else None
        self.job_id = job_id

    def emit(self, event, **fields):
        if self.fd is None:
            return
        line = dumps({"event": event, "job_id": self.job_id, "time": round(time.time(), 6), **fields}) + "\n"
        try:
            os.write(self.fd, line.encode())
        except OSError:
            pass  # a reader that went away must not kill the job

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def decode_status(status):
    """Raw wait status -> (exit_code for the starter, signal or None)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None
