"""The one kill loop, for every backend: JobCgroup.kill() is this.  Each
backend says how to kill (the _kill_round hook, and _kill_tree where one
write ends the whole tree) and whether it can be told when the job is empty
(_exit_watch); kill_pids is SIGKILL by pid, for the rounds that list them.
"""

import os
import time


def kill_pids(pids, sig=9):  # SIGKILL; `import signal` builds enums (~3 ms)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_until_empty(job, timeout, then):
    """JobCgroup.kill(): SIGKILL until `job` is empty -> the pids left
    after `timeout` ([] = empty); then() once, when the first look after a
    kill still finds processes.  Most kills are over within milliseconds,
    and what the caller records about one (the entry's "killing": a file
    write, 0.35 ms of a 200-process kill here) would only compete with them.

    Rounds repeat at growing gaps up to 1 s for stragglers (processes
    attached after a round); between them, a watch if there is one, else
    polling on a back-off up to 1 s: a task stuck in D state costs no CPU."""
    deadline = time.monotonic() + timeout
    watch = job._exit_watch()
    poll, gap, next_round = 0.001, 0.2, 0.0
    try:
        # Where one write kills the whole tree, it comes first: listing
        # the pids of every hierarchy before it (each directory walked,
        # each cgroup.procs read) only delays the kill.  Then the first
        # look is after the tree says it is empty.
        killed = job._kill_tree()
        if killed and watch is not None:
            watch.wait(min(gap, deadline - time.monotonic()))
        while True:
            # is_empty(): one cgroup.events read where the tree says so
            # (every process of a job is in its cgroup2 cgroup, and leaves
            # its v1 ones in the same exit); a listing of every hierarchy
            # only while something is left.
            left = [] if job.is_empty() else job.pids()
            if not left:
                return []
            if killed and then is not None:
                then()
                then = None
            if time.monotonic() >= next_round:
                job._kill_round(left, deadline)
                killed = True
                next_round = time.monotonic() + gap
                gap = min(gap * 2, 1.0)
            now = time.monotonic()
            if now >= deadline:
                return job.pids()
            until = min(next_round, deadline)
            if watch is not None and not job.is_empty():
                watch.wait(until - now)
            else:   # killed tasks leave their cgroups as they exit
                time.sleep(max(0.0, min(poll, until - now)))
                poll = min(poll * 2, 1.0)
    finally:
        if watch is not None:
            watch.close()
