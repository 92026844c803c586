"""Setup's deadline, and the control signals that arrive during setup.

Setup is everything `starter run` does before the job runs: the spec (bind
sources are opened), the state entry, the scratch and verified inputs, the
cgroup, the clone, the network, and the child's own steps up to its exec
(chdir, the command's lookup).  Any of them can wait on a path, and a path on
a hung NFS server or FUSE daemon never answers.  The kernel waits for those
in TASK_KILLABLE (a handled signal does not end the wait, SIGKILL does) or,
once a FUSE daemon has read the request, uninterruptibly (D state: not even
SIGKILL).  So neither SIGALRM nor a SIGTERM handler can get the main thread
out; another thread has to act for it.

    main thread                              watchdog thread (start())
    -----------                              ---------------
    blocks SIGTERM, SIGINT, SIGHUP, SIGQUIT  sigtimedwait(those, the region's
      and vacate/kill's SIGRTMIN+1/+4          deadline, or 1 s out of a region)
    with region("bind source /x"):           a signal, or the region's deadline:
        a call that may wait on a path         failing = "interrupted by SIGTERM
    check() between steps                        during setup" / "bind source /x:
                                                 no answer within 60 s ..."
                                               main inside a region (waiting in
                                               the kernel): take over at once
                                               else: main fails at its next
                                               check() or region

Exactly one thread unwinds (claim()): main, when it fails (its StarterError,
exit 125), or the watchdog, which then runs job.run's own end (Undo, the
state entry, the report), writes the one line and exits 125 (os._exit:
exit_group SIGKILLs the waiting main thread).  A main thread that wakes up
inside a region after the watchdog took over only closes fds on its way to
the region's end, where it waits for that exit; a region is only put around
calls that make nothing the Undo stack would have to know of.

What is guaranteed, and what is not:

  * the start ends with exit 125 and one line, and nothing it made is left
    (cgroup, state entry, scratch, network: the same Undo as any failure),
    when one wait in a region (every path the starter opens as root,
    paths.py; a verified input's copy; the child's steps up to its exec) has
    lasted $STARTER_SETUP_TIMEOUT (default 60 s) with the waiting task
    asleep and still for PROGRESS_LOOK_S more (no CPU time, page fault, read
    or change of where it waits: a runnable one is starved of CPU on a
    loaded node, and one that moves is slow, not hung; each gets another
    round), or right after a signal, when main is waiting in a
    region, or at main's next step otherwise.  The deadline is per wait, not
    for the whole setup: a start that is slow but moves (200 at once on an
    emulated 2-CPU VM) is not a hung one;
  * a wait in TASK_KILLABLE (NFS, a FUSE request no daemon has read) ends
    with the exit.  A FUSE request a daemon has read and never answers is
    D state: the starter's exit, and so its exit code, waits until the
    daemon answers or dies, or the connection is aborted
    (/sys/fs/fuse/connections/N/abort); what it made is gone already.

Once the job runs (finish()), the signals are unblocked and go to the
supervisor as before (vacate, kill ...), and one the watchdog took after
that is passed on to the same pipe.
"""

import _signal
import _thread
import os
import sys
import time

from starter.errors import StarterError, one_line

DEFAULT_TIMEOUT = 60.0
# The watchdog's wake-up while main waits on no path: to see a region start
# (and, once the job runs, to end).
IDLE_WAKE_S = 1.0
_RTMIN = _signal.SIGRTMIN
# What ends a start: the signals whose default action is vacate or kill, and
# the internal ones of `starter vacate` and `starter kill` (supervisor.py),
# and a caller's hang-up (supervisor.CALLER_GONE, caller.py).
ENDING = frozenset((_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGQUIT, _RTMIN + 1, _RTMIN + 4,
                    _RTMIN + 5))
_NAMES = {_signal.SIGTERM: "SIGTERM", _signal.SIGINT: "SIGINT", _signal.SIGHUP: "SIGHUP",
          _signal.SIGQUIT: "SIGQUIT", _RTMIN + 1: "a vacate", _RTMIN + 4: "a kill",
          _RTMIN + 5: "its caller's death"}

_guard = None


class SetupFailed(StarterError):
    """The start was interrupted or ran out of time (exit 125)."""


def start(timeout=None):
    """Start watching this process's setup (once, in `starter run`)."""
    global _guard
    if timeout is None:
        from starter.spec import values

        timeout = values.number("STARTER_SETUP_TIMEOUT",
                                os.environ.get("STARTER_SETUP_TIMEOUT") or DEFAULT_TIMEOUT, 0.1, 86400)  # noqa: the cap: a day
    _guard = _Guard(float(timeout))
    return _guard


def region(what, ran=None, task=None):
    """`with region("bind source /x"):` around a call that may wait on a
    path; a no-op outside `starter run`.  ran: a callable that says, without
    blocking, whether the job already runs (ns.Child.exec_probe): a signal
    that comes then is the job's (passed on at finish()), not a failure."""
    return _guard(what, ran, task) if _guard is not None and not _guard.running else _NOOP


def check():
    """Between steps: raise SetupFailed if the start is to fail."""
    if _guard is not None and _guard.failing is not None:
        _guard.fail()


def claim():
    """Main begins to unwind: from now on the watchdog stays out (if it is
    already unwinding, main waits here for its exit)."""
    if _guard is not None:
        _guard.claim()


def finish(pipe_w):
    """The job runs: setup is over.  Signals from now on go to the
    supervisor's pipe `pipe_w`."""
    if _guard is not None:
        _guard.finish(pipe_w)


def on_takeover(fn):
    """fn(message): how the watchdog unwinds the start (job.run's end)."""
    if _guard is not None:
        _guard.end = fn


class _NoRegion:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOOP = _NoRegion()


# A task out of time and asleep is looked at again this much later: if it
# moved meanwhile, it is slow (starved I/O, a contended lock on a loaded
# node), not hung, and gets another full round.
PROGRESS_LOOK_S = 5.0


def _runnable(tid):
    """Is task tid (a thread of ours, or a process) running or runnable?"""
    try:
        with open(f"/proc/{tid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:data.rindex(b")") + 3] == b"R"
    except (OSError, ValueError):
        return False


def _progress(tid):
    """What changes while task tid gets anywhere, asleep or not: its CPU time
    and page faults (/proc/TID/stat), the bytes and calls it has read
    (/proc/TID/io) and where it waits (wchan).  A task hung on a dead NFS
    server or an unanswered FUSE request changes none of them.  None if the
    task is gone."""
    task = f"/proc/{tid}/task/{tid}"     # the thread's own figures (/proc/PID/io sums the process's,
    try:                                 # the watchdog's own reads of these files among them)
        with open(f"{task}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        sample = [fields[7], fields[9], fields[11], fields[12]]     # minflt, majflt, utime, stime
        with open(f"{task}/io", "rb") as f:
            sample.append(f.read())
        with open(f"{task}/wchan", "rb") as f:
            sample.append(f.read())
        return tuple(sample)
    except (OSError, ValueError, IndexError):
        return None


class _Guard:
    def __init__(self, timeout):
        self.timeout = timeout
        self.region_deadline = None   # main's current wait on a path must end by then
        self.main_tid = _thread.get_native_id()
        self.task = None              # who waits in the region (main, or the child in its exec)
        self._task = None
        self.seen = None              # the task's _progress() when its time ran out
        self.lock = _thread.allocate_lock()
        self.failing = None      # the one line, once the start is to fail
        self.owner = None        # who unwinds: "main" or "watchdog"
        self.running = False     # the job runs
        self.current = None      # what main waits on, inside a region
        self.depth = 0
        self.pending = None      # the signal that set `failing`, or one for the job (ran)
        self._later = []         # more of those
        self.pipe_w = None
        self.end = None
        self._what = None
        self._ran = None
        self.ran = None          # main's region's probe: has the job exec'd?
        _signal.pthread_sigmask(_signal.SIG_BLOCK, ENDING)
        _thread.start_new_thread(self._watch, ())

    # -- main thread

    def __call__(self, what, ran=None, task=None):
        self._what, self._ran, self._task = what, ran, task
        return self

    def __enter__(self):
        what, self._what = self._what, None
        ran, self._ran = self._ran, None
        task, self._task = self._task, None
        with self.lock:
            if self.owner == "watchdog":
                self._wait_for_exit()
            if self.failing is not None and self.owner is None:
                self.owner = "main"
                raise SetupFailed(self.failing)
            self.depth += 1
            if self.depth == 1:
                self.current, self.ran = what, ran
                self.task = task or self.main_tid
                self.region_deadline = time.monotonic() + self.timeout
                self.seen = None
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.current = self.ran = self.region_deadline = None
            if self.owner == "watchdog":
                self._wait_for_exit()
            if self.failing is not None and self.owner is None and exc[0] is None:
                self.owner = "main"
                raise SetupFailed(self.failing)
        return False

    def fail(self):
        with self.lock:
            if self.owner == "watchdog":
                self._wait_for_exit()
            if self.owner is None and not self.running:
                self.owner = "main"
                raise SetupFailed(self.failing)

    def claim(self):
        with self.lock:
            if self.owner == "watchdog":
                self._wait_for_exit()
            self.owner = "main"

    def finish(self, pipe_w):
        with self.lock:
            if self.owner == "watchdog":
                self._wait_for_exit()
            self.running = True
            self.pipe_w = pipe_w
            sig, self.pending, self.failing = self.pending, None, None
            later, self._later = self._later, []
        # Too late to fail the start: the job runs.  A signal that came
        # meanwhile is a control signal like any other (a vacate).
        for s in ([sig] if sig is not None else []) + later:
            self._forward(s)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, ENDING)

    def _wait_for_exit(self):
        """Called with the lock held: the watchdog unwinds and exits."""
        self.lock.release()
        never = _thread.allocate_lock()
        never.acquire()
        never.acquire()      # never returns: the watchdog's os._exit ends the process

    # -- the watchdog thread

    def _watch(self):
        while True:
            with self.lock:
                until = self.region_deadline
            left = until - time.monotonic() if until is not None else IDLE_WAKE_S
            info = _signal.sigtimedwait(ENDING, max(left, 0)) if left > 0 else None
            with self.lock:
                if self.running:
                    if info is None:
                        return           # the job runs and nothing came: done
                    self._forward(info.si_signo)
                    continue
                if self.owner is not None:
                    return               # main unwinds (its signals stay blocked: ignored)
                if info is None and (self.region_deadline is None or time.monotonic() < self.region_deadline):
                    continue             # no wait on a path has run out: a slow setup is not a hung one
                if info is None and _runnable(self.task):
                    # Out of time but runnable: starved of CPU (a loaded node),
                    # not waiting on a path.  A hung NFS or FUSE wait sleeps.
                    self.region_deadline = time.monotonic() + self.timeout
                    continue
                if info is None:
                    # Asleep: look again a little later; one that moved meanwhile
                    # (its I/O, a lock, its faults on a loaded node) is slow, not
                    # hung, and gets another round.
                    now = _progress(self.task)
                    if self.seen is None or (now is not None and now != self.seen):
                        look = min(PROGRESS_LOOK_S, self.timeout) if self.seen is None else self.timeout
                        self.seen = now if now is not None else ()
                        self.region_deadline = time.monotonic() + look
                        continue
                if info is not None and self.ran is not None and self.ran():
                    # The job has exec'd; main is about to see it: the signal is
                    # the job's (a vacate ...), passed on at finish().
                    if self.pending is None:
                        self.pending = info.si_signo
                    else:
                        self._later.append(info.si_signo)
                    continue
                if self.failing is None:
                    if info is None:
                        self.failing = (f"{self.current}: no answer within {self.timeout:g} s (a hung NFS or "
                                        "FUSE mount?)")
                    else:
                        self.pending = info.si_signo
                        self.failing = f"interrupted by {_NAMES.get(info.si_signo, info.si_signo)} during setup"
                if self.current is None:
                    continue             # a signal: main fails at its next step
                self.owner = "watchdog"
            self._take_over()

    def _take_over(self):
        msg = self.failing
        try:
            if self.end is not None:
                self.end(msg)
            else:
                sys.stderr.write(f"starter: {one_line(msg)}\n")
                sys.stderr.flush()
        finally:
            os._exit(125)

    def _forward(self, sig):
        if self.pipe_w is not None:
            try:
                os.write(self.pipe_w, bytes((sig,)))
            except OSError:
                pass
