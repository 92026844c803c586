"""The per-job state directory: one entry per job, written atomically, locked
by the live starter.

    <state_dir>/<id>.lock   flock()ed (LOCK_EX) by the starter for the job's
                            whole life; whoever can take it knows the starter
                            is gone (gc)
    <state_dir>/<id>.json   what ps/status/enter/gc need: pids, cgroup paths,
                            network lease, user; replaced atomically

The directory is root-only (0700).  When a job ends its two files go; an empty
state directory means nothing runs.

JSON is encoded here with a few lines over the C helpers in `_json` rather
than `import json` (~6 ms of interpreter start per job).
"""

import errno
import fcntl
import os

from starter.errors import StarterError

try:
    from _json import encode_basestring_ascii as _enc_str
except ImportError:  # pragma: no cover - CPython always has it
    from json.encoder import py_encode_basestring_ascii as _enc_str


def dumps(obj):
    """Compact JSON for dict/list/tuple/str/int/float/bool/None."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return _enc_str(obj)
    if isinstance(obj, int):
        return str(int(obj))
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            return "null"
        return repr(obj)
    if isinstance(obj, dict):
        return "{" + ", ".join(_enc_str(str(k)) + ": " + dumps(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(dumps(v) for v in obj) + "]"
    raise TypeError(f"cannot encode {type(obj).__name__}")


class _ScanContext:
    """What `_json.make_scanner` asks of json.JSONDecoder, without it."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name):
        return float(name.replace("Infinity", "inf"))


_scan = None


def loads(text):
    """JSON text -> object with the C scanner of `_json`: `import json`
    pulls in `re` and `enum` (~10-25 ms), which `starter metrics` would pay
    once per scrape."""
    global _scan
    if _scan is None:
        from _json import make_scanner

        _scan = make_scanner(_ScanContext)
    text = text.strip()
    try:
        obj, end = _scan(text, 0)
    except StopIteration as e:
        raise ValueError(f"not JSON (at offset {e.value})") from None
    if end != len(text):
        raise ValueError(f"not JSON (trailing data at offset {end})")
    return obj


def write_atomic(path, text, mode=0o600):
    """temp file + fsync-free rename: a reader sees the old or the new file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def process_start_time(pid):
    """Field 22 of /proc/PID/stat: with the pid, identifies a process uniquely."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[19])


def ensure_dir(state_dir):
    try:
        os.mkdir(state_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StarterError(f"cannot create state directory {state_dir}: {e.strerror}",
                           "set --state-dir or STARTER_STATE_DIR to a writable local directory") from None


class JobState:
    """The live starter's handle on its job's entry."""

    def __init__(self, state_dir, job_id):
        self.dir = state_dir
        self.id = job_id
        self.lock_path = os.path.join(state_dir, job_id + ".lock")
        self.path = os.path.join(state_dir, job_id + ".json")
        self.fd = None
        self.data = {}

    def create(self, **fields):
        ensure_dir(self.dir)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StarterError(f"a job with id {self.id!r} is already running on this node",
                                   "job ids must be unique; `starter ps` lists the running ones") from None
            raise
        self.fd = fd
        self.data = {"id": self.id, "starter_pid": os.getpid(),
                     "starter_start": process_start_time(os.getpid()), **fields}
        self.save()
        return self

    def update(self, **fields):
        self.data.update(fields)
        self.save()

    def save(self):
        write_atomic(self.path, dumps(self.data) + "\n")

    def remove(self):
        """Last step of a job: entry first, then the lock we still hold."""
        for p in (self.path, self.lock_path):
            unlink_quiet(p)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def load(state_dir, job_id):
    import json

    with open(os.path.join(state_dir, job_id + ".json")) as f:
        return json.load(f)


def list_ids(state_dir):
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".lock"))


def _lock_nb(state_dir, job_id, op):
    """The job's lock file, flock()ed with `op` without waiting: an fd (ours
    to close), None if a live starter holds it, -1 if there is none."""
    try:
        fd = os.open(os.path.join(state_dir, job_id + ".lock"), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def is_live(state_dir, job_id):
    """True while a starter holds the job's lock."""
    fd = _lock_nb(state_dir, job_id, fcntl.LOCK_SH)
    if fd is not None and fd >= 0:
        os.close(fd)
    return fd is None


def claim_dead(state_dir, job_id):
    """Take the lock of a job whose starter is gone; None if it is alive (or
    has no entry).  The caller removes the entry and closes the fd."""
    fd = _lock_nb(state_dir, job_id, fcntl.LOCK_EX)
    return None if fd is None or fd < 0 else fd


def unlink_quiet(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
