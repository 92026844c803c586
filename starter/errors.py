"""Errors the starter raises, kept apart from job failures.

A StarterError means the starter could not do its part: the job did not start
(or was torn down), nothing is left behind, and the process exits 125.  The
job's own failures (exit code, signal, OOM, timeout) are not exceptions; they
are outcomes in the report.
"""

EXIT_STARTER_FAILED = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


class StarterError(Exception):
    """The starter failed.  `hint` says what the admin can do about it."""

    exit_code = EXIT_STARTER_FAILED

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint

    def __str__(self):
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class SpecError(StarterError):
    """A job description or command line that cannot be accepted."""

    def __init__(self, field, message, hint=None):
        field = str(field) if len(str(field)) <= 60 else str(field)[:55] + "..."  # a hostile key
        super().__init__(f"{field}: {message}", hint)
        self.field = field
        self.detail = message


class SpawnError(StarterError):
    """A step between clone() and execve() failed in the child.

    `step` names it ("mount /sys"), `errno` is what the kernel said.  Exec
    failures map to 126/127 like docker and crun do.
    """

    def __init__(self, step, errno_, hint=None, message=None):
        import os

        self.step = step
        self.errno = errno_
        name = _errno_name(errno_)
        # `message`: a step that says itself what went wrong ("...: /x is a symlink")
        super().__init__(message or f"{step} failed: {name} ({os.strerror(errno_)})", hint)
        if step.startswith("execve"):
            import errno as E

            self.exit_code = EXIT_NOT_FOUND if errno_ == E.ENOENT else EXIT_NOT_EXECUTABLE


class CgroupError(StarterError):
    """A cgroup could not be created, configured, attached or removed."""


class NetworkError(StarterError):
    """The job's network could not be set up; the job does not start."""


class StagingError(StarterError):
    """Scratch, spool or manifest verification failed; the job does not start."""


def one_line(msg):
    """A message as one printable line: a hostile id with a newline or an
    escape sequence in it is shown escaped, never interpreted."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))


_OSERROR_HINTS = {
    "EACCES": "run as root, or check the permissions on the path",
    "EPERM": "run as root",
    "EROFS": "the file system is read-only: choose a writable directory",
    "ENOSPC": "the file system is full: free space or choose another directory",
    "EDQUOT": "the disk quota is exhausted: free space or choose another directory",
    "ENOTDIR": "a component of the path is not a directory",
    "EISDIR": "the path is a directory, a file was expected",
    "ELOOP": "the path is a symbolic link, which is not followed",
    "EMFILE": "too many open files: raise the limit (ulimit -n)",
    "ENFILE": "too many open files on the node",
    "ENOMEM": "the node is out of memory",
}


def from_oserror(e, doing=None):
    """An OSError nobody handled more precisely -> a StarterError with the
    path, the errno name and what to do: "cannot open /x: ENOSPC (...)"."""
    name = _errno_name(e.errno) if e.errno else type(e).__name__
    where = " ".join(repr(f) if not isinstance(f, str) else f
                     for f in (e.filename, e.filename2) if f is not None)
    text = f"{e.strerror or e} ({name})"
    if where:
        text = f"{where}: {text}"
    if doing:
        text = f"{doing}: {text}"
    return StarterError(text, _OSERROR_HINTS.get(name))


def _errno_name(n):
    import errno

    return errno.errorcode.get(n, f"errno {n}")
