"""The event loop beside a running job.

One poll() over these, no busy loop, no /proc walking:

    pidfd             readable when the job's main process exits
    signal pipe       control signals (vacate/suspend/resume/kill), written
                      by the interpreter's wakeup fd, one byte per signal
    (timeout)         wall-clock limit, end of a vacate's grace period

The job is over when its main process has exited AND its cgroup is empty:
whatever is left when the main process exits is killed through the cgroup,
and cg.kill() returns once cgroup.events says "populated 0" (it waits on the
file with poll(POLLPRI); v1-only hosts have no such file and re-check on a
short timer).

Signals are handled with `_signal` (the C module): `import signal` builds
enums and costs ~5 ms per start.
"""

import os
import select
import time

import _signal

from starter.report import decode_status

SIGRTMIN = _signal.SIGRTMIN
# Internal signals of the `starter vacate|suspend|resume|kill JOB` commands:
# fixed, so a site's --on-signal mapping can never change what a command does.
COMMAND_SIGNALS = {SIGRTMIN + 1: "vacate", SIGRTMIN + 2: "suspend",
                   SIGRTMIN + 3: "resume", SIGRTMIN + 4: "kill"}
ACTION_SIGNALS = {v: k for k, v in COMMAND_SIGNALS.items()}
DEFAULT_ACTIONS = {
    _signal.SIGTERM: "vacate", _signal.SIGINT: "vacate", _signal.SIGHUP: "vacate",
    _signal.SIGUSR1: "suspend", _signal.SIGUSR2: "resume", _signal.SIGQUIT: "kill",
}
UNKILLABLE_AFTER = 10.0


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
        self.old = {}
        for sig in self.actions:
            self.old[sig] = _signal.signal(sig, _ignore)
        # A job that fills a pipe we hold must not kill us.
        _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)

    def read(self):
        try:
            data = os.read(self.r, 256)
        except BlockingIOError:
            return []
        return [self.actions[s] for s in data if s in self.actions]

    def close(self):
        _signal.set_wakeup_fd(-1)
        for sig, old in self.old.items():
            _signal.signal(sig, old if old is not None else _signal.SIG_DFL)
        os.close(self.r)
        os.close(self.w)


class Outcome:
    __slots__ = ("status", "reason", "unkillable", "job_status")

    def __init__(self):
        self.status = None      # raw wait status of the main process
        self.reason = None      # set by the starter's own actions (vacated, timeout, killed)
        self.unkillable = []
        self.job_status = None


class Supervisor:
    def __init__(self, child, cgroup, signals, events, state, wall_time=None, grace=10.0):
        self.child = child
        self.cg = cgroup
        self.signals = signals
        self.events = events
        self.state = state
        self.grace = grace
        self.started = time.monotonic()
        self.wall_deadline = self.started + wall_time if wall_time else None
        self.kill_deadline = None
        self.out = Outcome()

    def run(self):
        poller = select.poll()
        poller.register(self.child.pidfd, select.POLLIN)
        poller.register(self.signals.r, select.POLLIN)
        while self.out.status is None:
            ready = {fd for fd, _ in poller.poll(self._timeout_ms())}
            # Signals first: under Slurm a scancel sends SIGTERM to the job and
            # to us at once, and the job may be gone in the same wakeup; the
            # job still ended because it was vacated.
            if self.signals.r in ready:
                for action in self.signals.read():
                    self.act(action)
            if self.child.pidfd in ready:
                self.out.status = self.child.poll()
            now = time.monotonic()
            if self.wall_deadline is not None and now >= self.wall_deadline and self.out.reason is None:
                self.out.reason = "timeout"
                self.events.emit("timeout")
                self._kill()
            if self.kill_deadline is not None and now >= self.kill_deadline:
                self.kill_deadline = None
                self._kill()
        self.out.job_status = self.child.job_status()
        # The main process is gone; in its PID namespace the kernel kills the
        # rest, but anything that entered the cgroup otherwise goes this way.
        if not self.cg.is_empty():
            self.out.unkillable = self.cg.kill(timeout=UNKILLABLE_AFTER)
        return self.out

    def _timeout_ms(self):
        deadlines = [d for d in (self.wall_deadline, self.kill_deadline) if d is not None]
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    def act(self, action):
        if self.out.status is not None:
            return
        if action == "vacate" and self.out.reason is None:
            self.out.reason = "vacated"
        if action == "suspend":
            self.cg.freeze()
            self.state.update(state="suspended")
            self.events.emit("suspended")
        elif action == "resume":
            self.cg.thaw()
            self.state.update(state="running")
            self.events.emit("resumed")
        elif action == "vacate":
            if self.kill_deadline is None:
                self.state.update(state="vacating")
                self.events.emit("vacating", grace=self.grace)
                # A frozen job cannot act on SIGTERM: thaw it for its grace period.
                if self.cg.frozen():
                    self.cg.thaw()
                self.child.send_signal(_signal.SIGTERM)
                self.kill_deadline = time.monotonic() + self.grace
        elif action == "kill":
            if self.out.reason is None:
                self.out.reason = "killed"
            self._kill()

    def _kill(self):
        self.state.update(state="killing")
        self.out.unkillable = self.cg.kill(timeout=UNKILLABLE_AFTER)


def classify(outcome, oom_kills):
    """-> (reason, exit_code, signal) for the report and the starter's exit."""
    status = outcome.job_status if outcome.job_status is not None else outcome.status
    code, sig = decode_status(status)
    if outcome.reason:
        reason = outcome.reason
    elif oom_kills and sig == 9:
        reason = "oom"
    elif sig is not None:
        reason = "signaled"
    else:
        reason = "exited"
    return reason, code, sig
