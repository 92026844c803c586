"""Cgroup directories as files: mkdir that says whether it made one, the
walk below a cgroup (deepest first), depth-first rmdir with EBUSY retries,
and EventsWatch, the poll() wakeup on a changed cgroup2 file.  Shared by
the interface (base.py), the backends and kill.py.
"""

import errno
import os
import time

from ..errors import CgroupError
from . import files


def mkdir(path):
    """mkdir that reports (made_it: bool); EEXIST is fine."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        err = CgroupError(
            f"cannot create cgroup {path}: {errno.errorcode.get(e.errno, e.errno)} ({os.strerror(e.errno)})",
            files.hint_for(e.errno),
        )
        err.errno = e.errno
        raise err from None


def subdirs_bottom_up(top):
    """Every cgroup below `top`, deepest first, then `top` itself.

    Tolerates directories vanishing while walking (ENOENT) and modes the job
    set on its own sub-cgroups (root reads them anyway)."""
    out = []

    def walk(d):
        try:
            it = os.scandir(d)
        except FileNotFoundError:
            return
        with it:
            children = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        for c in children:
            walk(c)
        out.append(d)

    walk(top)
    return out


def _busy_after_rmdir(d):
    """rmdir one cgroup -> True if it is busy (EBUSY: children, or a task
    still leaving); gone already is fine; anything else raises."""
    try:
        os.rmdir(d)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise CgroupError(f"cannot remove cgroup {d}: {errno.errorcode.get(e.errno, e.errno)}",
                              files.hint_for(e.errno)) from None
        return True
    return False


def rmdir_tree(top, attempts=50):
    """rmdir every cgroup under `top` depth-first, then `top`.  ENOENT is
    fine; EBUSY (a task still leaving) is retried briefly, then raised."""
    # A job's cgroup usually has no sub-cgroups (only a delegated job can
    # make them): one rmdir, no walk.
    if not _busy_after_rmdir(top):
        return
    delay = 0.001
    for i in range(attempts):
        busy = [d for d in subdirs_bottom_up(top) if _busy_after_rmdir(d)]
        if not busy:
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    raise CgroupError(
        f"cannot remove cgroup {busy[-1]}: EBUSY (it still has processes or children)",
        "kill the processes listed in its cgroup.procs (starter gc does this)",
    )


def rmdir_quiet(d):
    """rmdir_tree with few retries, errors ignored: undoing a half-made job."""
    try:
        rmdir_tree(d, attempts=5)
    except CgroupError:
        pass


class EventsWatch:
    """Wakes when a cgroup2 file such as cgroup.events changes.

    kernfs reports POLLPRI|POLLERR on an open cgroup file once its content
    has changed since it was last read, so one read arms it and poll() waits.
    Not inotify: closing an inotify instance waits for an SRCU grace period
    (measured 15 ms of every job here), and reaching it from Python needs
    ctypes (~2 ms to import)."""

    # What to poll() it for: kernfs files always poll readable (POLLIN).
    mask = 0x2 | 0x8  # POLLPRI | POLLERR; `import select` only where we wait

    def __init__(self, path, kept=None):
        """kept: a files.Kept that keeps its files (keep_open()) owns the
        descriptor, which stays open after close(); else this watch opens
        and owns one."""
        self.kept = kept if kept is not None and kept.keep else None
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if self.kept is None else self.kept.open(path)
        except OSError as e:
            raise CgroupError(f"cannot open {path}: {os.strerror(e.errno)}", files.hint_for(e.errno)) from None
        if self.fd is None:
            raise CgroupError(f"cannot open {path}: it does not exist", files.hint_for(errno.ENOENT))
        self.drain()

    def drain(self):
        """Read the file again: re-arms the next wakeup."""
        try:
            os.pread(self.fd, 4096, 0)
        except OSError:
            pass

    def wait(self, timeout):
        import select

        if timeout <= 0:
            return False
        p = select.poll()
        p.register(self.fd, select.POLLPRI | select.POLLERR)
        ready = p.poll(int(timeout * 1000) + 1)
        if ready:
            self.drain()
        return bool(ready)

    def close(self):
        if self.fd is not None and self.kept is None:
            os.close(self.fd)
        self.fd = None
