"""The per-job state directory: one entry per job, born locked, removed only
under its lock.

    <state_dir>/<id>.lock         the entry's identity and its lock: flock()ed
                                  (LOCK_EX) by the starter for the job's whole
                                  life; holds the entry as first written
    <state_dir>/<id>.json         the entry as last updated (replaced by rename
                                  from <id>.json.tmp); readers prefer it
    <state_dir>/<id>.resolv.conf  the NAT job's resolv.conf
                                  (each of these may have a .tmp beside it while
                                  its one writer, the lock holder, replaces it)

The directory is root-only (0700).  An empty state directory means nothing
runs and nothing is left to reclaim.  It is never removed once made: it is
also the network lock (net/ipam.py), and a starter may be about to create an
entry in it.

The protocol
------------
Create (starter run):
    T = open(dir, O_TMPFILE); flock(T, EX); write the entry into T
    linkat(T -> <id>.lock)                        the entry and its lock appear
                                                  at once, already locked
      EEXIST: E = open(<id>.lock); flock(E, EX|NB)
              held  -> refuse: "already running" (its starter lives) or
                       "being reclaimed" (a gc holds a dead job's lock)
              taken -> if <id>.lock no longer names E's inode: retry;
                       else its starter is dead: reclaim it under E (as gc
                       does), remove it, retry; if something is still held,
                       refuse and leave it "reclaiming"
Update (the owner only): write <id>.json.tmp, rename to <id>.json.
Remove (the owner, or gc holding the lock): unlink every name of the entry,
    <id>.lock last, while holding the lock; then close it.
gc: E = open(<id>.lock); flock(E, EX|NB); held -> live, skip; taken -> check
    that <id>.lock still names E's inode (else it was removed, or replaced by
    a new job's: skip), then reclaim under E.

Invariants: a lock file has a name only while it holds an entry, and from
the first moment it has a name it is locked by its creator; only the lock
holder writes or unlinks an entry's names; whoever takes a lock checks that
the name still names that inode before acting on it.  Temp files are either
O_TMPFILE (no name until linked) or per-entry .tmp names written and removed
only by the lock holder.

Interleavings this survives (S = starter, G = gc or another starter's quick gc):
  * G lists <id>.lock while S creates it: S linked it locked, G's LOCK_NB
    fails; S is never refused and its file never unlinked (the bug of the
    open();flock() version, where G could lock and unlink a fresh file).
  * G opens <id>.lock, S ends and removes its entry, G then gets the lock:
    the name is gone (or names a new job's lock): G skips, acts on nothing.
  * S is killed anywhere: the kernel drops its lock, every name stays, and G
    reclaims from the entry.  Killed before linkat: the O_TMPFILE vanishes.
    Killed while removing: the names left are reclaimed (everything they
    recorded was already gone, and every teardown tolerates that).
  * S2 starts with the id of a dead S1 while G reclaims it: one of them gets
    the lock.  G: S2 is refused ("being reclaimed", retry).  S2: G skips;
    S2 reclaims, removes, links its own entry.
  * Two Gs: one gets the lock, the other skips.
  * A teardown step of S fails: S writes state "reclaiming" with what is
    still held, then lets go of the lock; every G retries it and removes the
    entry only once nothing is held; an S2 with that id is refused meanwhile.
  * The scratch and cgroup are recorded before they are made, so S killed
    between recording and making leaves G a record of something that may not
    exist: every reclaim step tolerates that.  G acts on a record only where
    it names what the starter would have made (admin.live.job_cgroup,
    scratch.recorded_path): a planted entry makes G delete nothing.

JSON is encoded here by dumps() and decoded with the C scanner of `_json`
rather than `import json`, which pulls in re, enum, functools and
collections: several times what `_json` alone costs, on a start that is
~20 ms of its own (docs/benchmarks.md).  A job's own start only writes
entries, so `_json` is loaded by the first loads(), not by dumps().
tests/test_start_path.py keeps both off the run path.  Admin commands that
already import json may use it.
"""

import errno
import fcntl
import os
import time

from starter.errors import StarterError
from starter.fileio import read_regular, unlink_quiet, write_all


# The bounded reclaims at the start of a job (find_dead, and the NAT
# pool's self-healing in net/wiring.py) scan for at most this long (wall
# clock) and reclaim at most one dead entry or lease.
QUICK_BUDGET_S = 0.003

# STARTER_FAULT=STEP makes the starter SIGKILL itself at STEP (no cleanup
# runs, like a crash); STEP:fail makes that step raise instead (a teardown
# that fails).  Read once; unset, fault() costs a compare.  The steps are
# listed in FAULT_STEPS; tests/test_faults.py goes through every one.
_FAULT = os.environ.get("STARTER_FAULT") or None
FAULT_STEPS = (
    "state-entry", "scratch-record", "scratch-create", "cgroup-create", "clone",
    "uid", "net-lease", "net-veth", "net-nft", "net-setup", "release", "running",
    "teardown-net", "teardown-child", "teardown-cgroup", "teardown-scratch",
    "teardown-resolv", "teardown-entry", "teardown-uid",
)
# Only a job with --disk reaches these (tests/test_disk.py goes through them).
DISK_FAULT_STEPS = (
    "disk-record", "disk-image", "disk-loop", "disk-mount",
    "teardown-disk-mount", "teardown-disk-loop", "teardown-disk-image",
)
# Only a --disk job on a file system with project quotas (tests/test_quota.py).
QUOTA_FAULT_STEPS = ("disk-project", "disk-quota", "teardown-disk-quota")


def fault(step):
    if _FAULT is not None and _FAULT.partition(":")[0] == step:
        if _FAULT.endswith(":fail"):
            raise OSError(errno.EIO, f"planted fault at {step} (STARTER_FAULT)")
        os.kill(os.getpid(), 9)


def _esc(c):
    if c == '"' or c == "\\":
        return "\\" + c
    n = ord(c)
    if 0x20 <= n < 0x7f:
        return c
    if n < 0x10000:
        return "\\u%04x" % n
    n -= 0x10000
    return "\\u%04x\\u%04x" % (0xd800 | n >> 10, 0xdc00 | n & 0x3ff)


def _enc_str(s):
    """`s` as a JSON string of ASCII only: what json.loads reads back as `s`
    (non-ASCII and control characters as \\u escapes; a lone surrogate, as
    surrogateescape makes of a non-UTF-8 argv byte, too)."""
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return '"' + s + '"'
    return '"' + "".join(map(_esc, s)) + '"'


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


class _Ctx:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo = {}

    @staticmethod
    def parse_constant(s):
        raise ValueError(f"{s} is not allowed")


_scan = None


def loads(text):
    """JSON text -> object (ValueError if it is not exactly one JSON value)."""
    global _scan
    if _scan is None:
        try:
            from _json import make_scanner
        except ImportError:  # pragma: no cover - CPython always has it
            from json.scanner import py_make_scanner as make_scanner
        _scan = make_scanner(_Ctx())
    s = text.strip()
    try:
        obj, end = _scan(s, 0)
    except (StopIteration, SystemError, ImportError):
        # SystemError: the C scanner, asked to report a cut string under
        # `python -S`, fails to import the error class it would raise.
        raise ValueError("not JSON") from None
    if end != len(s):
        raise ValueError("trailing data after JSON")
    return obj


def write_atomic(path, text, mode=0o600):
    """<path>.tmp + rename: a reader sees the old or the new file.  The caller
    must be the only writer of `path` (hold its lock): the temp name is fixed,
    so a crash leaves at most one, which the next lock holder removes."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        write_all(fd, text.encode())
    except OSError:
        os.close(fd)
        unlink_quiet(tmp)
        raise
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


_own_start = (None, None)


def own_start_time():
    """process_start_time of this process, read once (a lease and the state
    entry both record it on a job's start)."""
    global _own_start
    pid = os.getpid()
    if _own_start[0] != pid:
        _own_start = (pid, process_start_time(pid))
    return _own_start[1]


def starter_alive(entry):
    """Is the starter that wrote this entry still running?  Decided from its
    pid and start time, not by trying the job's lock: a reader (a metrics
    scrape, top) must not hold a lock, even briefly, that a starting job is
    about to take (is_live's LOCK_SH would make that start fail)."""
    pid, start = entry.get("starter_pid"), entry.get("starter_start")
    return isinstance(pid, int) and pid > 0 and start is not None and process_start_time(pid) == start


def ensure_dir(state_dir):
    try:
        os.mkdir(state_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StarterError(f"cannot create state directory {state_dir}: {e.strerror}",
                           "set --state-dir or STARTER_STATE_DIR to a writable local directory") from None


# Every name an entry may have, <id> + suffix; removed in this order (lock last).
ENTRY_SUFFIXES = (".json.tmp", ".json", ".resolv.conf.tmp", ".resolv.conf", ".hosts.tmp", ".hosts", ".lock")


def _lock_path(state_dir, job_id):
    return os.path.join(state_dir, job_id + ".lock")


def names_inode(fd, path):
    """True while `path` is the file open as `fd` (not unlinked, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def remove_entry(state_dir, job_id):
    """Unlink every name of the entry, the lock last.  Call holding its lock."""
    for suffix in ENTRY_SUFFIXES:
        unlink_quiet(os.path.join(state_dir, job_id + suffix))


def read_fd(fd):
    """The entry as first written, from its lock file."""
    data = b""
    while True:
        chunk = os.pread(fd, 65536, len(data))
        if not chunk:
            return data.decode()
        data += chunk


class JobState:
    """The live starter's handle on its job's entry."""

    def __init__(self, state_dir, job_id):
        self.dir = state_dir
        self.id = job_id
        self.lock_path = _lock_path(state_dir, job_id)
        self.path = os.path.join(state_dir, job_id + ".json")
        self.fd = None
        self.data = {}

    def create(self, reclaim=None, **fields):
        """Make the entry, locked (see the protocol above).  `reclaim(state_dir,
        id, st) -> [what is still held]` reclaims a dead predecessor's entry
        with the same id while we hold its lock."""
        ensure_dir(self.dir)
        self.data = {"id": self.id, "starter_pid": os.getpid(),
                     "starter_start": own_start_time(), **fields}
        text = dumps(self.data) + "\n"
        t_dir = None
        try:
            t_dir = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            t = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=t_dir)
        except OSError as e:
            if t_dir is not None:
                os.close(t_dir)
            if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise StarterError(f"state directory {self.dir}: its filesystem has no O_TMPFILE",
                                   "put the state directory on a local filesystem (tmpfs, ext4, xfs)") from None
            raise StarterError(f"cannot create an entry in state directory {self.dir}: {e.strerror}",
                               "set --state-dir or STARTER_STATE_DIR to a writable local directory") from None
        try:
            fcntl.flock(t, fcntl.LOCK_EX)      # nobody else can reach it yet
            write_all(t, text.encode())
            name = self.id + ".lock"
            for _ in range(100):
                try:
                    # linkat(AT_SYMLINK_FOLLOW) through /proc gives the O_TMPFILE
                    # its name (a dir_fd makes Python call linkat, not link()).
                    os.link(f"/proc/self/fd/{t}", name, dst_dir_fd=t_dir, follow_symlinks=True)
                except FileExistsError:
                    self._take_over(reclaim)
                    continue
                self.fd, t = t, None
                break
            else:
                raise StarterError(f"job {self.id!r}: its state entry keeps changing under us; giving up",
                                   "is something else creating and removing entries with this id?")
        except OSError as e:
            raise StarterError(f"cannot create the state entry {self.lock_path}: {e.strerror}",
                               "the state directory must be a writable local directory") from None
        finally:
            os.close(t_dir)
            if t is not None:
                os.close(t)
        self.save()
        return self

    def _take_over(self, reclaim):
        """<id>.lock exists: refuse if it is held; reclaim it if its starter is dead."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                st = load(self.dir, self.id, fd)
                if starter_alive(st):
                    raise StarterError(f"a job with id {self.id!r} is already running on this node",
                                       "job ids must be unique; `starter ps` lists the running ones") from None
                raise StarterError(f"job {self.id!r}: what an earlier run with this id left is being reclaimed "
                                   "right now", "retry in a moment, or pick another job id") from None
            if not names_inode(fd, self.lock_path):
                return
            st = load(self.dir, self.id, fd)
            held = reclaim(self.dir, self.id, st) if reclaim is not None else ["not reclaimed"]
            if held:
                mark_reclaiming(self.dir, self.id, st, held)
                raise StarterError(f"job {self.id!r}: an earlier run with this id left {'; '.join(held)}",
                                   "`starter gc` retries and says what is still held; or pick another job id")
            remove_entry(self.dir, self.id)
        finally:
            os.close(fd)

    def update(self, **fields):
        self.data.update(fields)
        self.save()

    def stage(self, **fields):
        """Fields written with the next update (what only a running job's
        readers need: no write of the entry of its own)."""
        self.data.update(fields)

    def save(self):
        try:
            write_atomic(self.path, dumps(self.data) + "\n")
        except OSError as e:
            raise StarterError(f"cannot write the state entry {self.path}: {e.strerror}",
                               "the state directory must be a writable local directory with free space") from None

    def remove(self):
        """Last step of a job: every name, the lock last, while we hold it."""
        fault("teardown-entry")
        remove_entry(self.dir, self.id)
        self.close()

    def keep(self, held):
        """A teardown failed: keep the entry as "reclaiming" with what is still
        held and why, for `starter gc`; then let go of the lock."""
        self.data.update(state="reclaiming", held=list(held))
        try:
            self.save()
        except StarterError:
            pass        # the entry stays as last written; gc reclaims it all the same
        finally:
            self.close()

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def mark_reclaiming(state_dir, job_id, st, held):
    """The lock holder (gc) keeps a dead job's entry with what is still held."""
    st = dict(st)
    st.update(state="reclaiming", held=list(held))
    write_atomic(os.path.join(state_dir, job_id + ".json"), dumps(st) + "\n")


MAX_ENTRY = 1 << 20     # an entry is a few hundred bytes


def read_entry(path):
    """A regular file's text, at most MAX_ENTRY (else OSError): what is in
    the state directory is read by every admin command and every start, so a
    FIFO, a link to /dev/zero or a huge file there must not hang or fill them."""
    return read_regular(path, MAX_ENTRY).decode()


def load(state_dir, job_id, lock_fd=None):
    """The entry: <id>.json, else what its lock file holds (a starter killed
    before its first update).  {} if neither can be read or holds no object."""
    for read in (lambda: read_entry(os.path.join(state_dir, job_id + ".json")),
                 lambda: read_fd(lock_fd) if lock_fd is not None else read_entry(_lock_path(state_dir, job_id))):
        try:
            st = loads(read())
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(st, dict):
            return st
    return {}


def lock_holder(state_dir, job_id):
    """The pid of the root process that holds the entry's lock, found from
    the lock itself (/proc/locks) and checked (it runs as root and has the
    lock file open), or None: how an entry that cannot be read is still
    reached (`starter kill`), and its starter's pid shown."""
    try:
        st = os.stat(_lock_path(state_dir, job_id), follow_symlinks=False)
        with open("/proc/locks", "rb") as f:
            text = f.read(1 << 22)
    except OSError:
        return None
    want = b"%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in text.splitlines():
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF" (a blocked waiter: "1: -> FLOCK ...")
        if len(f) < 6 or f[1] != b"FLOCK" or f[5] != want or not f[4].isdigit():
            continue
        pid = int(f[4])
        if _holds_open(pid, st):
            return pid
    return None


def _holds_open(pid, st):
    """Is `pid` a root process with the file `st` open?"""
    try:
        if os.stat(f"/proc/{pid}", follow_symlinks=False).st_uid != 0:
            return False
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                f = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (f.st_dev, f.st_ino) == (st.st_dev, st.st_ino):
                return True
    except OSError:
        pass
    return False


def unreadable(state_dir, job_id):
    """What is known of an entry that cannot be read (cut short, or not
    JSON): a job of unknown owner, live while its lock is held; its starter
    as lock_holder() finds it."""
    out = {"id": job_id, "state": "unknown", "unreadable": True}
    pid = lock_holder(state_dir, job_id)
    if pid is not None:
        out.update(starter_pid=pid, starter_start=process_start_time(pid))
    return out


def _listdir(state_dir):
    try:
        return os.listdir(state_dir)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StarterError(f"cannot read state directory {state_dir}: {e.strerror}",
                           "run as root, with --state-dir naming the starters' state directory") from None


def list_ids(state_dir):
    names = _listdir(state_dir)
    return sorted(n[:-5] for n in names if n.endswith(".lock") and not n.startswith("."))


def stray_names(state_dir):
    """Files of the state directory that belong to no entry (no <id>.lock):
    not made by this protocol (planted, or an older version's); left alone."""
    names = _listdir(state_dir)
    ids = {n[:-5] for n in names if n.endswith(".lock")}
    out = []
    for n in names:
        if n in ("net", "netd.sock", "parts") or n.endswith(".lock"):
            continue
        if not any(n.endswith(s) and n[:-len(s)] in ids for s in ENTRY_SUFFIXES):
            out.append(n)
    return sorted(out)


def find_dead(state_dir):
    """The scan at the start of every run (then admin.gc.reclaim_found): a dead
    starter's entry that does not wait for `starter gc`, found within
    QUICK_BUDGET_S, with its lock held -> (job_id, fd, entry), fd ours to
    close; None when there is none.  A listdir and one flock per entry;
    starts at a different entry each time, so one cannot starve the rest."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return None
    ids = [n[:-5] for n in names if n.endswith(".lock")]
    if not ids:
        return None
    deadline = time.monotonic() + QUICK_BUDGET_S
    k = os.getpid() % len(ids)
    for job_id in ids[k:] + ids[:k]:
        if time.monotonic() >= deadline:
            return None
        fd = lock_dead(state_dir, job_id)
        if fd is None:
            continue
        st = load(state_dir, job_id, fd)       # {} when unreadable: never raises
        if st.get("state") == "reclaiming":    # it waits for `starter gc`
            os.close(fd)
            continue
        return job_id, fd, st
    return None


def lock_dead(state_dir, job_id):
    """Take the lock of a job whose starter is gone: an fd (ours to close) once
    <id>.lock is locked by us and still names that file; None if a live
    starter (or another gc) holds it, or the entry is gone."""
    path = _lock_path(state_dir, job_id)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    return fd if lock_if_current(fd, path) else None


def lock_if_current(fd, path):
    """flock(fd, EX|NB), then check `path` still names fd's file.  False (and
    fd closed) if someone holds it, or the entry was removed or replaced
    between our open() and flock()."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if names_inode(fd, path):
            return True
    except OSError:
        pass
    os.close(fd)
    return False


def is_live(state_dir, job_id):
    """True while someone holds the job's lock (its starter, or a gc for a
    moment).  Only a probe: it never acts on what it locked."""
    try:
        fd = os.open(_lock_path(state_dir, job_id), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
