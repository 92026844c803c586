"""Who asked for this job, when it was not root.

A caller that is not root reaches `starter run` through the set-user-ID
launcher (native/launcher_relay.c, caller_run()), which forks: the caller's half
(the relay, which keeps the caller's pid and forwards its signals) and this
process, root through and through, with an empty environment but for
$STARTER_CALLER ("UID:GID:G1,G2,...": the caller's real ids and groups, as
the kernel gave them to the launcher), $STARTER_CALLER_FD (the relay's
socket) and $STARTER_CALLER_RELAY (the relay's pid).  Only the launcher can set them for a root process a user started:
it empties the environment first.  A root caller that sets them itself only
restricts its own job.

What it means here:
  * the job runs as the caller's uid, gid and groups, never another
    (spec/jobspec.py), under the node policy's [callers] table (policy.py);
  * every path the caller names is opened with the caller's rights
    (Caller.rights(): effective ids switched around the open), never root's;
  * the relay's socket carries its signals, one byte each; a thread reads
    them and sends each to this process (relay()), so they take the same
    way as a root caller's: the setup's watchdog (job/watchdog.py) before the
    job runs, the supervisor's pipe after; the hang-up (the caller died,
    even of SIGKILL) becomes supervisor.CALLER_GONE: the start fails, or
    the job is killed, reason "caller_gone";
  * the job's cgroups nest in the caller's own, which must be root's all the
    way up (cgroups: Backend.check_trusted_parents);
  * the relay is a process of the caller's uid that started before the job:
    the escape check at a job's end (strays.find) counts it as known, so
    a caller whose uid has no other process pays no /proc walk.
"""

import os

from starter.errors import StarterError


class Caller:
    __slots__ = ("uid", "gid", "groups", "fd", "relay", "_environ", "_step")

    def __init__(self, uid, gid, groups, fd=None, relay=None):
        self.uid, self.gid, self.groups, self.fd = uid, gid, tuple(groups), fd
        self.relay = relay      # the relay's pid (our parent while it lives), a process of uid
        self._environ = self._step = None

    def __repr__(self):
        return f"Caller(uid={self.uid}, gid={self.gid}, groups={self.groups})"

    def rights(self, why="to open the caller's files"):
        """A context: effective ids of the caller inside it."""
        from starter.storage.paths import as_user

        return as_user((self.uid, self.gid, self.groups), why)

    def environ(self):
        """The caller's environment: its relay's, as the launcher was started
        with it (this process got none of it), for what --env-pass and
        --net job take from it.  The caller's word, as its argv is.  {} when
        the relay is gone (then the start ends anyway: CALLER_GONE)."""
        if self._environ is None:
            from starter.storage.paths import as_root

            env = {}
            try:
                if self.relay is not None and os.getppid() == self.relay:
                    with as_root():     # (spec.build runs with the caller's rights)
                        with open(f"/proc/{self.relay}/environ", "rb") as f:
                            data = f.read()
                    if os.getppid() == self.relay:      # still ours: the pid was not reused
                        for item in data.split(b"\0"):
                            k, eq, v = item.partition(b"=")
                            if eq and k:
                                env[os.fsdecode(k)] = os.fsdecode(v)
            except OSError:
                env = {}
            self._environ = env
        return self._environ

    def slurm_step(self):
        """The Slurm step the caller runs in, proven by its relay's
        ancestors (callers/slurmstep.py); NotInStep if it is not in one."""
        if self._step is None:
            from starter.callers import slurmstep
            from starter.storage.paths import as_root

            with as_root():     # (spec.build runs with the caller's rights)
                self._step = slurmstep.step_of(self.relay, self.uid)
        return self._step

    def job_slot(self, state_dir, policy):
        """Refuse a caller's job beyond the policy's callers.max_jobs; -> an fd
        holding a lock on the count (the state directory itself, flock()ed:
        nothing to leave behind), held until the job's entry exists."""
        import fcntl

        from starter.state import store as state

        state.ensure_dir(state_dir)
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            limit = policy.callers["max_jobs"] if policy is not None else None
            ids = state.list_ids(state_dir) if limit is not None else []
            # Fewer jobs on the node than the limit: none to read (reading every
            # entry is a file and a JSON parse each, on every caller's start).
            if limit is not None and len(ids) >= limit:
                # An entry that cannot be read is a live job of unknown
                # owner: counted as every caller's.
                running = sum(1 for i in ids
                              if state.load(state_dir, i).get("caller", self.uid) == self.uid
                              and state.is_live(state_dir, i))
                if running >= limit:
                    from starter.callers.policy import PolicyError

                    raise PolicyError(f"uid {self.uid} has {running} jobs running on this node, the most "
                                      f"{policy.where('callers.max_jobs')} allows",
                                      "wait for one to end, or ask the node's admin")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def is_self(self, what, value):
        """Does --user/--group `value` name the caller itself?"""
        value = str(value)
        if value.isascii() and value.isdigit():
            return int(value) == (self.uid if what == "user" else self.gid)
        try:
            if what == "user":
                import pwd

                return pwd.getpwnam(value).pw_uid == self.uid
            import grp

            return grp.getgrnam(value).gr_gid == self.gid
        except (KeyError, ValueError, UnicodeError):
            return False


def relay(fd):
    """Start the thread that turns the relay's bytes into signals to this
    process (a blocked thread: it never holds the GIL while it waits)."""
    import _thread

    from starter.job.watchdog import ENDING
    from starter.job.supervisor import CALLER_GONE, CHECKPOINTED

    # Imported here, not in the thread: an import there, while this thread
    # imports the start's modules, is a race for the import lock and the GIL
    # (+0.7 ms a start, measured).
    _thread.start_new_thread(_relay, (fd, ENDING, CALLER_GONE, CHECKPOINTED))


def _relay(fd, ENDING, CALLER_GONE, CHECKPOINTED):
    import _signal

    me = os.getpid()
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            os.kill(me, CALLER_GONE)
            return
        for sig in data:
            if not 0 < sig < _signal.NSIG or sig in (_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD,
                                                     CALLER_GONE, CHECKPOINTED):
                continue
            # Before the starter routes it (supervisor.Signals), a signal
            # with its default action would kill the root starter mid-setup:
            # only setup's own (deadline.ENDING, blocked, for the watchdog).
            if sig not in ENDING and _signal.getsignal(sig) in (_signal.SIG_DFL, None):
                continue
            os.kill(me, sig)


def from_environ(environ=os.environ):
    """The Caller the launcher named, or None (a root caller).  Removes the
    variables, so nothing the starter starts inherits them."""
    who = environ.pop("STARTER_CALLER", None)
    fd = environ.pop("STARTER_CALLER_FD", None)
    relay_pid = environ.pop("STARTER_CALLER_RELAY", None)
    if who is None or os.getuid() != 0:
        return None
    try:
        uid, gid, groups = who.split(":")
        uid, gid = int(uid), int(gid)
        groups = tuple(int(g) for g in groups.split(",") if g)
        fd = int(fd) if fd is not None else None
        relay_pid = int(relay_pid) if relay_pid is not None else None
    except ValueError:
        raise StarterError(f"unusable $STARTER_CALLER {who!r}",
                           "it is set by the set-user-ID `starter` launcher only") from None
    if uid == 0:
        return None
    if fd is not None:
        try:
            os.set_inheritable(fd, False)
        except OSError:
            fd = None
    return Caller(uid, gid, groups, fd, relay_pid)
