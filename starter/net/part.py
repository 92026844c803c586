"""A --net job job's part on one node, shared by the job's tasks there.

srun starts one starter per task.  The first one on a node for a job
network (its VNI), the owner, makes the node's part: an init (job/run.py)
whose PID, network (the NAT network and vx0) and IPC namespaces are the
part's, and the part's /dev/shm, a tmpfs.  Every task's job, the owner's
included, joins those namespaces and binds that tmpfs at /dev/shm, with a
mount namespace, cgroup, limits and report of its own: MPI's shared-memory
transport works between the ranks of a node.

On the node, in <state_dir>/parts/ (root's, 0700):

    <vni>.lock      the part's mutex: who owns, who joins (flock, held briefly)
    <vni>.owner     the owner's job id: there while the owner takes new tasks
    <vni>.members   every task holds a shared flock on it for its life
    <vni>.shm/      the part's /dev/shm (a tmpfs mounted there, private)

The owner holds the mutex from its decision until its job runs (so a task
that comes meanwhile waits, then joins), and at its job's end removes the
owner file, waits until it holds the members' lock alone (every joiner's job
has ended), and only then tears down the network, ends the init and unmounts
the tmpfs.  A task that finds a part ending waits for its end, then makes it
anew.  The
owner's report counts the whole part's traffic; a joiner's names its owner.
`starter gc` unmounts and removes what a part whose tasks all died left.
"""

import errno
import fcntl
import os
import time

from starter.errors import NetworkError

DIR = "parts"
LOCK_WAIT = 60.0


def part_dir(state_dir):
    return os.path.join(state_dir, DIR)


class Part:
    """One task's hold on its part: Part(state_dir, vni).begin(open_owner)
    -> the owner's namespaces (joined), or None (be it: the mutex stays held
    until register)."""

    def __init__(self, state_dir, vni):
        self.dir = part_dir(state_dir)
        self.base = os.path.join(self.dir, str(int(vni)))
        self.shm = self.base + ".shm"
        self.mutex = self.members = None
        self.owner = None           # the owner's job id, for a joiner
        self.mounted = False

    def begin(self, open_owner):
        """Join the part, or be its owner.  open_owner(job id) -> what the
        joiner needs of the owner's job (its namespaces), raising Gone when
        that job has ended.  -> that, joined (the members' lock held, the
        mutex let go); or None: this task owns the part (the mutex and the
        members' lock held alone, until register()).  A part that is ending
        (its owner's job gone, or its last tasks still running) is waited
        for, then made anew."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)
        if not os.path.isdir(self.dir) or os.path.islink(self.dir) or st.st_uid != 0:
            raise NetworkError(f"{self.dir} is not root's own directory", "remove it; the starter makes it")
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            self.mutex = _mutex(self.base + ".lock")
            owner = _read(self.base + ".owner")
            if owner is not None and _live(os.path.dirname(self.dir), owner):
                try:
                    got = open_owner(owner)
                except Gone:
                    got = None
                if got is not None:
                    self.owner = owner
                    self.join()
                    return got
            else:
                self.members = _open(self.base + ".members")
                try:
                    fcntl.flock(self.members, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    _unlink(self.base + ".owner")       # (a crashed owner's)
                    return None
                except BlockingIOError:
                    os.close(self.members)              # its tasks still run
                    self.members = None
            self._release_mutex()
            if time.monotonic() > deadline:
                raise NetworkError(f"the job network's part on this node ({self.base}) stayed in use "
                                   f"for {LOCK_WAIT:.0f}s after its first task ended",
                                   "its other tasks still run: start the task again once they end")
            time.sleep(0.02)

    def join(self):
        """Hold the members' lock (shared) for the task's life; let go of the mutex."""
        self.members = _open(self.base + ".members")
        _flock(self.members, fcntl.LOCK_SH, self.base + ".members")
        self._release_mutex()

    def make_shm(self, size):
        """The owner: the part's /dev/shm, a private tmpfs (1777, nosuid,
        nodev, at most size bytes: the owner's --memory, else tmpfs's
        default), its pages charged to the task that writes them."""
        from starter._native import lib

        os.makedirs(self.shm, mode=0o700, exist_ok=True)
        opts = ("mode=1777" + (f",size={int(size)}" if size else "")).encode()
        r = lib.shim_mount_tmpfs_private(self.shm.encode(), opts)
        if r < 0:
            raise NetworkError(f"mounting the job's shared /dev/shm at {self.shm} failed: {os.strerror(-r)}")
        self.mounted = True

    def register(self, job_id):
        """The owner, once its job runs: take new tasks from now on."""
        tmp = self.base + ".owner.tmp"
        with open(tmp, "w") as f:
            f.write(job_id)
        os.replace(tmp, self.base + ".owner")
        fcntl.flock(self.members, fcntl.LOCK_SH)        # (from its own LOCK_EX)
        self._release_mutex()

    def wait_members(self, meanwhile=None):
        """The owner, its job ended: take no more tasks, then wait until
        every joiner's job has ended (their starters let go of the members'
        lock at their end: a joiner ends with its job, or is killed with it;
        no bound: each joiner's job has one).  meanwhile(): called about
        every 0.2 s while they run (the part's heartbeats)."""
        if self.members is None or self.owner is not None or self.mutex is not None:
            return      # a joiner's, or an owner's that never registered
        lock = _mutex(self.base + ".lock")
        try:
            _unlink(self.base + ".owner")
        finally:
            os.close(lock)
        while True:
            try:
                fcntl.flock(self.members, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if meanwhile is not None:
                    meanwhile()
                time.sleep(0.2)

    def close(self):
        """The end, for owner and joiner: let go of the locks; the owner
        (who waits for the others first) unmounts the part's /dev/shm and,
        alone now, removes its files under its mutex (a task waiting on the
        old mutex finds it unlinked and starts over)."""
        if self.owner is None and (self.mutex is not None or self.members is not None):
            if self.members is not None:
                self.wait_members()     # (where its end came another way than measure())
            if self.mounted:
                unmount(self.shm)
                self.mounted = False
            lock, self.mutex = (self.mutex if self.mutex is not None else _mutex(self.base + ".lock")), None
            _remove_files(self.base)
            try:
                os.rmdir(self.dir)      # (the last part of the node)
            except OSError:
                pass
            os.close(lock)
        self._release_mutex()
        if self.members is not None:
            os.close(self.members)
            self.members = None

    def _release_mutex(self):
        if self.mutex is not None:
            os.close(self.mutex)
            self.mutex = None


def unmount(path):
    from starter._native import lib

    r = lib.shim_umount_lazy(path.encode())
    if r < 0 and -r not in (errno.EINVAL, errno.ENOENT):
        raise NetworkError(f"unmounting the job's shared /dev/shm at {path} failed: {os.strerror(-r)}",
                           "`starter gc` retries")
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def gc(state_dir):
    """Parts whose tasks are all gone: unmount their /dev/shm, remove their
    files.  A part whose members' lock someone holds is live.  -> removed."""
    d = part_dir(state_dir)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    removed = []
    for vni in sorted({n.split(".")[0] for n in names if n.split(".")[0].isdigit()}):
        base = os.path.join(d, vni)
        lock = _try_alone(base + ".lock")            # (a task deciding right now: later)
        if lock is None:
            continue
        try:
            members = _try_alone(base + ".members")  # (tasks run: live)
            if members is None:
                continue
            try:
                if os.path.isdir(base + ".shm"):
                    unmount(base + ".shm")
                _remove_files(base)
                removed.append(f"job network part {vni}: /dev/shm and locks")
            finally:
                os.close(members)
        finally:
            os.close(lock)
    return removed


def _try_alone(path):
    """path opened and flocked exclusively, or None where another holds it
    (or it is gone, or was unlinked meanwhile)."""
    try:
        fd = _open(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink:
            return fd
    except BlockingIOError:
        pass
    os.close(fd)
    return None


def _remove_files(base):
    for suffix in (".owner", ".owner.tmp", ".members", ".lock"):
        _unlink(base + suffix)


class Gone(Exception):
    """The owner's job ended while a task was about to join it."""


def _read(path):
    try:
        with open(path) as f:
            return f.read(200).strip() or None
    except (OSError, ValueError):
        return None


def _open(path):
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _mutex(path):
    """The part's mutex, held: the lock file opened and flocked, again where
    the one flocked was unlinked meanwhile (its owner's end), and the
    directory made again where the last owner removed it."""
    while True:
        try:
            fd = _open(path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            continue
        _flock(fd, fcntl.LOCK_EX, path)
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)


def _flock(fd, how, what):
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise NetworkError(f"{what} stayed locked for {LOCK_WAIT:.0f}s: another task's starter is stuck",
                                   "end the starter holding it (`fuser -v` shows it), then start the task again") from None
            time.sleep(0.01)


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _live(state_dir, job_id):
    from starter.state.store import is_live, load

    try:
        return is_live(state_dir, job_id) and load(state_dir, job_id).get("state") == "running"
    except (OSError, ValueError):
        return False
