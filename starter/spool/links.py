"""Whether the spool hard-links: the link state, what this module owns.

Where link() cannot work (the job's directory is on another filesystem,
EPERM, EMLINK) the job gets a private copy and a warning is logged.  After
`limit` such failures with no success ever, the spool stops trying.  The
state is ``$SPOOL/.linkstate`` ("<ever succeeded: 0|1> <failures>"), so every
process on the node sees it; delete the file to try again.  It is written to
a temp name and renamed into place, relative to the spool's directory fd,
never through a link.  The caller (spool.Spool) holds the spool's lock.
"""

import errno
import logging
import os

from starter.fileio import write_all
from starter.spool.names import LINKSTATE_NAME, TMP_PREFIX

log = logging.getLogger("starter.spool")

LINK_FAIL_LIMIT = 10


class LinkState:
    """The link state of the spool directory `dir`, open as `dfd`."""

    def __init__(self, dir, dfd, limit=LINK_FAIL_LIMIT):
        self.dir = dir
        self.dfd = dfd
        self.limit = limit
        self._disabled = False  # sticky per instance once seen
        self._ok = False  # link() has worked here once: no need to read .linkstate again

    def read(self):
        """(ever_succeeded, failures) as persisted in the spool."""
        try:
            fd = os.open(LINKSTATE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dfd)
        except FileNotFoundError:
            return False, 0
        try:
            text = os.read(fd, 64).decode("ascii", "replace").split()
        finally:
            os.close(fd)
        try:
            return text[0] == "1", int(text[1])
        except (IndexError, ValueError):
            return False, 0

    def enabled(self):
        """Whether to try link() at all."""
        if self._ok:
            return True
        if self._disabled:
            return False
        ok, fails = self.read()
        self._ok = ok
        if not ok and fails >= self.limit:
            self._disabled = True
            return False
        return True

    def note(self, success, err=None, dest=None):
        """Record a link() into `dest` that worked, or failed with OSError `err`."""
        if success and self._ok:
            return
        ok, fails = self.read()
        if success:
            if not ok:
                self._save(True, fails)
            self._ok = True
            return
        fails += 1
        self._save(ok, fails)
        log.warning(
            "spool: cannot hard-link into %s (%s); the job gets a private copy", dest, errno.errorcode.get(err.errno)
        )
        if not ok and fails >= self.limit:
            self._disabled = True
            log.warning(
                "spool: link() failed %d times and never worked in %s; copying from now on "
                "(delete %s to try links again)",
                fails,
                self.dir,
                os.path.join(self.dir, LINKSTATE_NAME),
            )

    def _save(self, ok, fails):
        tmp = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.dfd)
        try:
            write_all(fd, f"{int(ok)} {fails}\n".encode())
        except OSError:
            os.unlink(tmp, dir_fd=self.dfd)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, LINKSTATE_NAME, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
