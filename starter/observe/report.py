"""The final usage report and the event stream.

Both go to a file or an inherited fd ("fd:N"), as JSON.  The report is one
document written when the job is over and its cgroup is empty; events are
JSON lines, one per state change.  Schemas: docs/reference.md, "The report";
docs/events.md.
"""

import os
import stat
import time

from starter.errors import StarterError
from starter.fileio import unlink_best_effort
from starter.state.store import dumps

# Version of the event schema (docs/events.md): bumped when a field changes
# meaning or goes away; new fields and events may appear without a bump.
EVENTS_VERSION = 1
REASONS = ("exited", "signaled", "oom", "timeout", "vacated", "killed", "unkillable", "starter_error")


class Report:
    """A job's final report, typed: one attribute per field of
    docs/reference.md's "The report" (FIELDS, in the document's order).  A
    field is in the document once set, None included (`signal` is null
    there); setting a name not in FIELDS is a bug and fails at once
    (AttributeError), never a key that appears in reports unannounced.
    Each phase of job/run.py sets its own fields; a teardown step that
    measures (the disk, the network, escapes) sets the field it measures."""

    FIELDS = (
        "job_id", "reason", "exit_code", "signal", "error", "teardown_error", "started_at", "ended_at",
        "wall_s", "cpu_user_s", "cpu_system_s", "memory_peak_bytes", "memory_current_bytes",
        "memory_shmem_bytes", "pids_peak", "pids_current", "io_read_bytes", "io_write_bytes", "oom_kills",
        "device_rules", "oom", "oom_policy", "psi", "cgroup", "network", "delegated", "payloads",
        "payloads_truncated", "payloads_oom", "unkillable", "kill_reason", "scratch_bytes", "disk", "uid",
        "escaped", "escaped_action", "gpu", "gpu_error", "checkpoint", "checkpoint_error", "segments", "total",
        "peer_lost", "image", "rootless", "not_enforced",
    )
    __slots__ = FIELDS

    def __init__(self, **fields):
        self.set(**fields)

    def set(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)

    def get(self, name, default=None):
        return getattr(self, name, default)

    def __contains__(self, name):
        return hasattr(self, name)

    def as_dict(self):
        """The fields set, in FIELDS' order: what the JSON document holds."""
        return {name: getattr(self, name) for name in self.FIELDS if hasattr(self, name)}


# Paths that are links by nature, taken as the starter's own fds instead.
STD_PATHS = {"/dev/stdout": 1, "/dev/stderr": 2}


class Dest:
    """Where the report or the events go, resolved once before the job runs.

    fd:N and /dev/stdout, /dev/stderr (as fd 1, 2; never opened by path) are
    written in place.  A FILE's directory is opened now, every component
    resolved without following links, and held: a job that later swaps a
    directory component for a link cannot redirect the write.  A FIFO,
    device, socket or directory at FILE itself is refused now (exit 125) and
    left alone at the end (the report is then not written); a symlink there
    is replaced by the report (rename does not follow it), and refused for
    the events (appending would follow it).
    """

    def __init__(self, dest, what):
        self.dest = dest
        self.what = what
        self.fd = None       # fd:N, /dev/stdout: the fd to write (not ours)
        self.dir_fd = None   # FILE: its directory (ours)
        self.name = None
        if dest.startswith("fd:"):
            self.fd = _passed_fd(int(dest[3:]), what, dest)
        elif dest in STD_PATHS:
            self.fd = STD_PATHS[dest]
        else:
            from starter.storage import paths

            parent, self.name = os.path.split(dest)
            if not self.name or self.name in (".", ".."):
                raise paths.LinkError(f"{what} {dest}: not a file name")
            self.dir_fd = paths.open_dir(parent, what, full=dest)
            try:
                st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as e:
                self.close()
                raise paths.LinkError(f"{what} {dest}: {e.strerror}") from None
            if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                self.close()
                raise paths.LinkError(f"{what} {dest}: is {paths.kind(st.st_mode)}, not a regular file",
                                      "use a regular file, or fd:N for a pipe")

    def open_append(self):
        """-> an fd to append to (ours to close): the events stream."""
        if self.fd is not None:
            return os.dup(self.fd)
        from starter.storage import paths

        fd, st = paths.open_beneath(self.dir_fd, self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                    self.what, self.dest)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            why = f"is {paths.kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else "has other hard links"
            raise paths.LinkError(f"{self.what} {self.dest}: {why}, not a plain regular file")
        os.set_blocking(fd, True)
        return fd

    def write_atomic(self, data):
        """The whole of `data`, at once: a temp file (O_EXCL) in the held
        directory, then renamed over the name; a reader never sees half."""
        if self.fd is not None:
            _write_all(self.fd, data)
            return
        from starter.storage import paths

        try:
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise OSError(0, f"{paths.kind(st.st_mode)} is there, not a regular file (left alone)")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(8):  # a planted or left-over temp name: pick another
            tmp = f".{self.name}.{os.urandom(4).hex()}.tmp"
            try:
                fd = os.open(tmp, flags, 0o644, dir_fd=self.dir_fd)
                break
            except FileExistsError:
                continue
        else:
            raise OSError(17, "no free temp name")
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            unlink_best_effort(tmp, self.dir_fd)
            raise

    def check_writable(self):
        """Refuse now, not after the job ran, a FILE whose directory the
        effective ids (a caller's, inside Caller.rights()) may not write."""
        if self.dir_fd is not None and not os.access(f"/proc/self/fd/{self.dir_fd}", os.W_OK | os.X_OK,
                                                     effective_ids=True):
            from starter.storage import paths

            self.close()
            raise paths.LinkError(f"{self.what} {self.dest}: its directory is not writable by the caller",
                                  "give a file in a directory you may write, or fd:N")

    def close(self):
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def _passed_fd(fd, what, dest):
    """fd:N must be a descriptor the starter was given, open for writing.
    Every descriptor the starter opens itself (its signal pipe, the
    launcher's pipe once taken) is close-on-exec, and one that came through
    exec cannot be: so fd:N naming one of the starter's own (a report
    written into its signal pipe read as signals) is refused."""
    import fcntl

    try:
        fdflags, flags = fcntl.fcntl(fd, fcntl.F_GETFD), fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise StarterError(f"{what} {dest}: no descriptor {fd} was passed to the starter") from None
    if fdflags & fcntl.FD_CLOEXEC:
        raise StarterError(f"{what} {dest}: descriptor {fd} is the starter's own, not one passed to it")
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise StarterError(f"{what} {dest}: descriptor {fd} is open for reading only")
    return fd


def _write_all(fd, data):
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]


def write_report(dest, report, fmt="json"):
    """Write the report (Report.as_dict(): JSON, or ClassAd lines with
    fmt="classad") to a Dest (or a destination string, resolved now)."""
    if dest is None:
        return
    own = not isinstance(dest, Dest)
    if own:
        dest = Dest(dest, "report")
    if fmt == "classad":
        from starter.observe.classad import render

        text = render(report).encode()
    else:
        text = (dumps(report) + "\n").encode()
    try:
        dest.write_atomic(text)
    finally:
        if own:
            dest.close()


class Events:
    """JSON lines to --events (FILE or fd:N, see Dest); a no-op without it."""

    def __init__(self, dest, job_id):
        self.fd = None
        self.job_id = job_id
        if dest:
            d = Dest(dest, "events")
            try:
                self.fd = d.open_append()
            finally:
                d.close()

    def emit(self, event, **fields):
        if self.fd is None:
            return
        line = dumps({"v": EVENTS_VERSION, "event": event, "job_id": self.job_id, "time": round(time.time(), 6),
                      **fields}) + "\n"
        try:
            os.write(self.fd, line.encode())
        except OSError:
            pass  # a reader that went away must not kill the job

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
