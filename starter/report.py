"""The final usage report and the event stream.

Both go to a file or an inherited fd ("fd:N"), as JSON.  The report is one
document written when the job is over and its cgroup is empty; events are
JSON lines, one per state change.  Schema: README, "The report".
"""

import os
import time

from starter.state import dumps

REASONS = ("exited", "signaled", "oom", "timeout", "vacated", "killed", "starter_error")


def open_dest(dest, append):
    """FILE or fd:N -> writable fd (ours to close)."""
    if dest.startswith("fd:"):
        return os.dup(int(dest[3:]))
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    flags |= os.O_APPEND if append else os.O_TRUNC
    return os.open(dest, flags, 0o644)


def write_report(dest, report):
    if dest is None:
        return
    text = (dumps(report) + "\n").encode()
    import stat

    try:
        # lstat: /dev/stdout is a symlink, and renaming over it would replace it.
        special = not stat.S_ISREG(os.lstat(dest).st_mode) if not dest.startswith("fd:") else False
    except FileNotFoundError:
        special = False
    if special:  # /dev/stdout, a fifo, a link the caller chose: write through it
        fd = os.open(dest, os.O_WRONLY | os.O_CLOEXEC | os.O_APPEND)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        return
    if dest.startswith("fd:"):
        fd = open_dest(dest, append=True)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        return
    # Next to the destination, then renamed: a reader never sees half a report.
    tmp = f"{dest}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)


class Events:
    """JSON lines to --events; a no-op without it."""

    def __init__(self, dest, job_id):
        self.fd = open_dest(dest, append=True) if dest else None
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
