"""The event loop beside a running job.

One poll() over these, no busy loop, no /proc walking:

    pidfd             readable when the job's main process exits
    signal pipe       control signals (vacate/suspend/resume/kill), written
                      by the interpreter's wakeup fd, one byte per signal
                      (a caller that is not root: its relay's signals come
                      as bytes on a socket, which a thread turns into the
                      same signals to this process, its hang-up into
                      CALLER_GONE: the job is killed, reason "caller_gone";
                      starter/callers/caller.py)
    OOM watch         --oom-policy kill where the kernel cannot end the job
                      by itself (cgroup v1 memory: an eventfd); see below
    (timeout)         wall-clock limit, end of a vacate's grace period,
                      re-check of an OOM notification
    peers             --net job, a part's first task: the other nodes'
                      parts' heartbeats (starter/net/liveness.py); one gone
                      silent vacates the job, reason "peer_lost"

The job is over when its main process has exited AND its cgroup is empty:
whatever is left when the main process exits is killed through the cgroup,
and cg.kill() returns once cgroup.events says "populated 0" (it waits on the
file with poll(POLLPRI); v1-only hosts have no such file and re-check on a
timer that backs off to 1 s).

OOM policy "kill" (the default): an OOM kill of any process ends the job
with reason "oom", as Slurm's OUT_OF_MEMORY and HTCondor's hold do.  cgroup
v2 does it in the kernel (memory.oom.group); elsewhere cg.end_on_oom() gives
a watch, and when it fires the loop checks the OOM kill counter (v1 notifies
before the victim is picked, so an uncounted notification is re-checked a few
times) and kills the job.  "continue": only the victim dies; the report
still says oom: true.

Processes that do not die (D state: a hung NFS server, a stuck device):
after the kill timeout ($STARTER_KILL_TIMEOUT, default 10 s) the loop stops
waiting for them, reason "unkillable", with their pids, state and wchan;
job/run.py then leaves the cgroup, address and entry for `starter gc`.

Signals are handled with `_signal` (the C module): `import signal` builds
enums and costs ~5 ms per start.
"""

import os
import select
import sys
import time

import _signal

from starter.errors import EXIT_STARTER_FAILED, StarterError, one_line
from starter.isolate.ns import decode_status
from starter.state.store import fault

SIGRTMIN = _signal.SIGRTMIN
# Internal signals of the `starter vacate|suspend|resume|kill JOB` commands:
# fixed, so a site's --on-signal mapping can never change what a command does.
COMMAND_SIGNALS = {SIGRTMIN + 1: "vacate", SIGRTMIN + 2: "suspend",
                   SIGRTMIN + 3: "resume", SIGRTMIN + 4: "kill", SIGRTMIN + 5: "caller_gone",
                   SIGRTMIN + 6: "checkpointed"}
CALLER_GONE = SIGRTMIN + 5     # a caller's relay hung up (caller.py's reader thread)
# `starter checkpoint` dumped the job, which CRIU left stopped: end it (root's
# only: a caller's relay never passes it on, caller.py).
CHECKPOINTED = SIGRTMIN + 6
ACTION_SIGNALS = {v: k for k, v in COMMAND_SIGNALS.items()}
DEFAULT_ACTIONS = {
    _signal.SIGTERM: "vacate", _signal.SIGINT: "vacate", _signal.SIGHUP: "vacate",
    _signal.SIGUSR1: "suspend", _signal.SIGUSR2: "resume", _signal.SIGQUIT: "kill",
}
UNKILLABLE_AFTER = 10.0
MOVED_OUT_EVERY = 1.0
PERIODIC_DUMP_FLOOR = 60.0     # a periodic dump's time limit, at least (seconds)
# v1 OOM notifications come before the kill is counted: re-check after
# 10, 20, 40, ... ms, then give up (the OOM was resolved without a kill).
OOM_RECHECKS = 7


def _ignore(signum, frame):
    pass


class Signals:
    """Route control signals into a pipe the loop polls."""

    def __init__(self, on_signal=()):
        self.actions = dict(DEFAULT_ACTIONS)
        self.actions.update(on_signal)
        self.actions.update(COMMAND_SIGNALS)
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        _signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)
        for sig in self.actions:
            _signal.signal(sig, _ignore)
        # A job that fills a pipe we hold must not kill us.
        _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)

    def read(self):
        try:
            data = os.read(self.r, 256)
        except BlockingIOError:
            return []
        return [self.actions[s] for s in data if s in self.actions]

    def close(self):
        """Stop routing.  The handlers stay, ignoring: the starter exits
        right after its report, and a signal (the batch system repeating
        its SIGTERM) must not kill it unreported nor change its exit code."""
        _signal.set_wakeup_fd(-1)
        os.close(self.r)
        os.close(self.w)


class Outcome:
    __slots__ = ("status", "reason", "unkillable", "job_status", "checkpoint_error", "peer_lost")

    def __init__(self):
        self.status = None      # raw wait status of the main process (None: never seen)
        self.reason = None      # set by the starter's own actions (vacated, timeout, killed, oom)
        self.unkillable = []    # [{"pid", "state", "wchan"}] of processes that outlived the kill
        self.job_status = None
        self.checkpoint_error = None    # why --on-vacate's dump did not happen (then: the plain vacate)
        self.peer_lost = None   # --net job: the node whose part went silent (then: the vacate)


class Supervisor:
    def __init__(self, child, cgroup, signals, events, state, wall_time=None, grace=10.0,
                 oom_watch=None, kill_timeout=UNKILLABLE_AFTER, checkpoint=None, checkpoint_every=None,
                 watch_roles=(), peers=None):
        self.child = child
        self.cg = cgroup
        self.signals = signals
        self.events = events
        self.state = state
        self.grace = grace
        self.oom = oom_watch
        self.kill_timeout = kill_timeout
        self.started = time.monotonic()
        self.wall_deadline = self.started + wall_time if wall_time else None
        self.kill_deadline = None
        self.oom_recheck = None
        self.oom_tries = 0
        self.killed = False
        self.out = Outcome()
        # --on-vacate checkpoint:DIR: checkpoint(leave_running, timeout) dumps
        # the job there (starter/checkpoint/criu.py); --checkpoint-every: also
        # this often while it runs.
        self.checkpoint = checkpoint
        self.every = checkpoint_every
        self.next_checkpoint = self.started + checkpoint_every if checkpoint_every else None
        # v1 hierarchies whose cgroups the job's user may move processes
        # between (Backend.watch_roles): checked every MOVED_OUT_EVERY.
        self.watch_roles = tuple(watch_roles)
        self.next_watch = self.started + MOVED_OUT_EVERY if self.watch_roles else None
        # --net job: the other nodes' parts (starter/net/liveness.py Watch)
        self.peers = peers

    def run(self):
        poller = select.poll()
        poller.register(self.child.pidfd, select.POLLIN)
        poller.register(self.signals.r, select.POLLIN)
        oom_fd = self.oom.fd if self.oom is not None else None
        if oom_fd is not None:
            poller.register(oom_fd, self.oom.mask)
        if self.peers is not None:
            poller.register(self.peers.fd, select.POLLIN)
        while self.out.status is None and not self.out.unkillable:
            ready = {fd for fd, _ in poller.poll(self._timeout_ms())}
            # Signals first: under Slurm a scancel sends SIGTERM to the job and
            # to us at once, and the job may be gone in the same wakeup; the
            # job still ended because it was vacated.
            if self.signals.r in ready:
                for action in self.signals.read():
                    self.act(action)
            if self.child.pidfd in ready:
                self.out.status = self.child.poll()
            if oom_fd is not None and oom_fd in ready and self.out.status is None:
                self.oom.drain()
                self._check_oom()
            now = time.monotonic()
            if self.wall_deadline is not None and now >= self.wall_deadline:
                self.wall_deadline = None
                if self.out.reason is None:
                    self.out.reason = "timeout"
                    self.events.emit("timeout")
                self._kill()
            if self.kill_deadline is not None and now >= self.kill_deadline:
                self.kill_deadline = None
                self._kill()
            if self.oom_recheck is not None and now >= self.oom_recheck and self.out.status is None:
                self._check_oom()
            if self.next_checkpoint is not None and now >= self.next_checkpoint and self.out.status is None:
                self._periodic_checkpoint()
            if self.next_watch is not None and now >= self.next_watch and self.out.status is None:
                self._check_moved_out()
            if self.peers is not None:
                self._check_peers(ready, now)
        if self.out.status is None:
            # Gave up on unkillable processes; the main one may be among them.
            self.out.status = self.child.poll()
        if self.out.status is not None:
            self.out.job_status = self.child.job_status()
        # The main process is gone; in its PID namespace the kernel kills the
        # rest, but anything that entered the cgroup otherwise goes this way.
        if not self.out.unkillable and not self.cg.is_empty():
            self.out.unkillable = self.cg.kill(timeout=self.kill_timeout)
        if self.out.unkillable:
            self.out.unkillable = describe(self.out.unkillable)
        return self.out

    def _timeout_ms(self):
        deadlines = [d for d in (self.wall_deadline, self.kill_deadline, self.oom_recheck, self.next_checkpoint,
                                 self.next_watch, self.peers and self.peers.deadline) if d]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def _check_peers(self, ready, now):
        """--net job: heartbeats in and out; a node's part gone silent ends
        the job (vacate, reason "peer_lost")."""
        if self.peers.fd in ready:
            self.peers.readable()
        if now >= self.peers.deadline:
            lost = self.peers.tick(now)
            if lost is not None and self.out.status is None and self.out.peer_lost is None:
                self.out.peer_lost = lost
                if self.out.reason is None:
                    self.out.reason = "peer_lost"
                self.events.emit("peer_lost", node=lost)
                self.act("vacate")

    def _check_moved_out(self):
        """A job process moved out of the job's cgroup in a watched v1
        hierarchy (past the job's limits there, by its user from outside):
        the job is killed, reason "escaped", with the pids."""
        self.next_watch = time.monotonic() + MOVED_OUT_EVERY
        try:
            moved = self.cg.moved_out(self.watch_roles)
        except (OSError, StarterError):
            return
        if moved and not self.killed:
            self.next_watch = None
            if self.out.reason is None:
                self.out.reason = "escaped"
            self.events.emit("escaped", pids=moved, hierarchies=list(self.watch_roles))
            self._kill()

    def _check_oom(self):
        """The OOM watch fired (or a re-check is due): end the job if the
        OOM killer has killed one of its processes."""
        if self.cg.oom_kills():
            self.oom_recheck = None
            if self.out.reason is None:
                self.out.reason = "oom"
            if not self.killed:
                self._kill()
            return
        if self.oom_tries < OOM_RECHECKS:
            self.oom_recheck = time.monotonic() + 0.01 * (2 ** self.oom_tries)
            self.oom_tries += 1
        else:
            self.oom_recheck = None
            self.oom_tries = 0

    def act(self, action):
        if self.out.status is not None:
            return
        if action == "vacate" and self.out.reason is None:
            self.out.reason = "vacated"
        if action == "suspend":
            if self._control("suspend", self.cg.freeze):
                self._note(state="suspended")
                self.events.emit("suspended")
        elif action == "resume":
            if self._control("resume", self.cg.thaw):
                self._note(state="running")
                self.events.emit("resumed")
        elif action == "vacate":
            if self.kill_deadline is None and self.checkpoint is not None and self._vacate_checkpoint():
                return
            if self.kill_deadline is None:
                self._note(state="vacating")
                self.events.emit("vacating", grace=self.grace)
                # A frozen job cannot act on SIGTERM: thaw it for its grace period.
                if self.cg.frozen():
                    self._control("resume", self.cg.thaw)
                self.child.send_signal(_signal.SIGTERM)
                self.kill_deadline = time.monotonic() + self.grace
        elif action in ("kill", "caller_gone", "checkpointed"):
            if self.out.reason is None or action == "checkpointed":
                self.out.reason = {"kill": "killed"}.get(action, action)
                if action == "caller_gone":
                    self.events.emit("caller_gone")
            self._kill()

    def _vacate_checkpoint(self):
        """The vacate's dump, bounded by the grace period; -> done (the job
        is then ended, reason "checkpointed").  Once only: a failure falls
        back to the ordinary vacate, and the report says why."""
        dump, self.checkpoint, self.next_checkpoint = self.checkpoint, None, None
        self._note(state="checkpointing")
        try:
            to = dump(False, self.grace)
        except (StarterError, OSError) as e:
            self.out.checkpoint_error = one_line(e)
            sys.stderr.write(f"starter: {self.out.checkpoint_error}; vacating without a checkpoint\n")
            self.events.emit("checkpoint_failed", error=self.out.checkpoint_error)
            return False
        self.out.reason = "checkpointed"
        self.events.emit("checkpointed", to=to)
        self._kill()
        return True

    def _periodic_checkpoint(self):
        """--checkpoint-every: a dump of the running job; a failure is said
        and the job runs on (the last good image stays).  A dump may take up
        to the interval, or a minute where the interval is shorter (CRIU
        needs seconds on a slow node); the next is due an interval after it
        ended, so dumps never run back to back."""
        try:
            to = self.checkpoint(True, max(self.every, PERIODIC_DUMP_FLOOR))
        except (StarterError, OSError) as e:
            err = one_line(e)
            sys.stderr.write(f"starter: periodic {err}\n")
            self.events.emit("checkpoint_failed", error=err)
            return
        finally:
            self.next_checkpoint = time.monotonic() + self.every
        self.events.emit("checkpointed", to=to, running=True)

    def _control(self, action, step):
        """Freeze or thaw; -> done.  A failure (a process that stays in D
        state past the 5 s wait, no freezer) is the job's or the node's
        trouble, not a reason to end it: said on stderr and as a
        control_failed event, and supervision goes on.  A suspend that did
        not complete is taken back, so the job is never half frozen."""
        try:
            fault(action)
            step()
            return True
        except (StarterError, OSError) as e:
            err = one_line(e)
        sys.stderr.write(f"starter: {action} failed: {err}\n")
        self.events.emit("control_failed", action=action, error=err)
        if action == "suspend":
            try:
                self.cg.thaw(timeout=1.0)
            except (StarterError, OSError) as e:
                sys.stderr.write(f"starter: taking the suspend back failed: {one_line(e)}\n")
        # For `starter suspend`/`resume`, which wait on the entry.
        self._note(control_failed={"action": action, "error": err, "time": round(time.time(), 6)})
        return False

    def _note(self, **fields):
        """Update the entry; a failed write (a full disk) leaves `starter ps`
        behind, not the job unsupervised."""
        try:
            self.state.update(**fields)
        except (StarterError, OSError) as e:
            sys.stderr.write(f"starter: {one_line(e)}\n")

    def _kill(self):
        self.killed = True
        # Blocks until the cgroup is empty or the kill timeout has passed,
        # waiting on cgroup.events (or a back-off timer on v1), not spinning.
        # The entry says "killing" only once the kill is found to take a
        # while (see kill()): a write before or during it delayed it.
        self.out.unkillable = self.cg.kill(timeout=self.kill_timeout,
                                           then=lambda: self._note(state="killing"))


def describe(pids):
    """[{"pid", "state", "wchan"}] of processes that would not die: what an
    admin needs to find the stuck mount or device (wchan "0": running)."""
    out = []
    for pid in pids:
        st = wchan = None
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            st = data[data.rindex(b")") + 2:].split()[0].decode()
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip() or None
        except (OSError, ValueError):
            pass
        out.append({"pid": pid, "state": st, "wchan": wchan})
    return out


def classify(outcome, oom_kills, oom_policy="kill"):
    """-> (reason, exit_code, signal) for the report and the starter's exit.

    oom: the main process was OOM-killed, or (policy kill) any process was,
    even if the main process then exited on its own.  unkillable: the job
    could not be ended; the starter exits 125 (the node needs attention)."""
    if outcome.unkillable:
        return "unkillable", EXIT_STARTER_FAILED, None
    status = outcome.job_status if outcome.job_status is not None else outcome.status
    code, sig = decode_status(status)
    if outcome.reason:
        reason = outcome.reason
    elif oom_kills and (sig == 9 or oom_policy == "kill"):
        reason = "oom"
    elif sig is not None:
        reason = "signaled"
    else:
        reason = "exited"
    return reason, code, sig
