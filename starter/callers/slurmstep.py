"""Which Slurm job a caller's start belongs to, proven by the kernel, not
by its word (for a caller's --net job: the job network's id and its PMIx
server).

A caller's $SLURM_JOB_ID is its own to set.  What it cannot set: who its
processes' ancestors are.  Slurm's slurmstepd (root) forks every task of a
step, and names itself "slurmstepd: [JOB.STEP]"; a user's process can only
descend from the slurmstepd of one of its own jobs' steps.  step_of(relay)
walks up from the caller's relay (its process that started this starter)
through its parents to the first process that is not the caller's: that
must be a slurmstepd, root's, and its title names the job.

Each hop is held by a pidfd while its parent is read: a parent read from
/proc is opened, then the child is checked to be alive with that same
parent still, so a pid reused meanwhile is never taken for the parent.

    step_of(relay_pid, uid) -> Step(job="4242", step="0", pid=<slurmstepd>)
    listener_of(step.pid, family, host, port) -> is that loopback TCP port
                                   the slurmstepd's own listening socket?
"""

import os

from starter.errors import StarterError

MAX_HOPS = 64


class Step:
    __slots__ = ("job", "step", "pid")

    def __init__(self, job, step, pid):
        self.job, self.step, self.pid = job, step, pid

    def __repr__(self):
        return f"Step(job={self.job!r}, step={self.step!r}, pid={self.pid})"


class NotInStep(StarterError):
    pass


def parse_title(cmdline):
    """A slurmstepd's /proc/PID/cmdline -> (job, step) or None (pure).
    Slurm names it "slurmstepd: [JOB.STEP]" (STEP: a number, batch,
    extern, interactive; a heterogeneous job's "JOB.STEP+COMPONENT")."""
    title = cmdline.split(b"\0", 1)[0].decode("ascii", "replace").strip()
    head, sep, rest = title.partition(" [")
    if head != "slurmstepd:" or not sep or not rest.endswith("]"):
        return None
    job, dot, step = rest[:-1].partition(".")
    if not (job.isascii() and job.isdigit()) or len(job) > 10:
        return None
    if dot and not (step and step.replace("+", "").isascii() and step.replace("+", "").isalnum()):
        return None
    return job, step or None


def _status(pid):
    """(ppid, (real, effective, saved uid)) of pid from /proc."""
    with open(f"/proc/{pid}/status", "rb") as f:
        text = f.read()
    ppid = uids = None
    for line in text.splitlines():
        if line.startswith(b"PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith(b"Uid:"):
            uids = tuple(int(x) for x in line.split()[1:4])
    if ppid is None or uids is None:
        raise OSError(f"/proc/{pid}/status has no PPid or Uid")
    return ppid, uids


def _alive(pidfd):
    import signal

    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def step_of(relay, uid):
    """The Step whose slurmstepd started the caller's process `relay` (uid
    `uid`'s, this process's parent), or NotInStep saying why not."""
    def refuse(why):
        return NotInStep(f"--net job for a caller needs its Slurm job proven: {why}",
                         "run it as a task of a Slurm step (srun, or sbatch's batch script)")

    if relay is None or os.getppid() != relay:
        raise refuse("the caller's relay is gone")
    fds = []
    try:
        cur = relay
        fds.append(os.pidfd_open(cur))
        for _ in range(MAX_HOPS):
            ppid, _ = _status(cur)
            if ppid <= 1:
                raise refuse(f"process {cur} of the caller has no slurmstepd above it")
            try:
                pfd = os.pidfd_open(ppid)
            except ProcessLookupError:
                raise refuse(f"the parent of process {cur} ended") from None
            fds.append(pfd)
            again, _ = _status(cur)
            if again != ppid or not _alive(fds[-2]):
                raise refuse(f"process {cur} of the caller moved while it was checked")
            _, ids = _status(ppid)
            if ids == (uid, uid, uid):
                cur = ppid        # still the caller's: go on up
                continue
            if ids != (0, 0, 0):
                raise refuse(f"process {ppid} above the caller is neither its own nor root's")
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                title = parse_title(f.read(4096))
            exe = os.path.basename(os.readlink(f"/proc/{ppid}/exe"))
            if not _alive(pfd):
                raise refuse(f"process {ppid} ended while it was checked")
            # (Debian's is slurmstepd-wlm, an alternative of slurmstepd)
            if title is None or not exe.startswith("slurmstepd"):
                raise refuse(f"the first process of root's above the caller ({ppid}) is not Slurm's slurmstepd")
            return Step(title[0], title[1], ppid)
        raise refuse(f"more than {MAX_HOPS} of the caller's processes above it")
    except (OSError, ValueError, IndexError) as e:
        if isinstance(e, StarterError):
            raise
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        raise refuse(f"its processes could not be read ({what})") from None
    finally:
        for fd in fds:
            os.close(fd)


def socket_inodes(pid):
    """The inodes of the sockets process pid holds open."""
    out = set()
    d = f"/proc/{pid}/fd"
    for name in os.listdir(d):
        try:
            link = os.readlink(os.path.join(d, name))
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def tcp_listeners(text, port, six=False):
    """The inodes of the listening sockets at local `port` in /proc/net/tcp
    (or tcp6) text (pure)."""
    out = set()
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != "0A":          # TCP_LISTEN
            continue
        _, _, p = f[1].rpartition(":")
        try:
            if int(p, 16) == port:
                out.add(int(f[9]))
        except ValueError:
            continue
    return out


def listener_of(pid, six, port):
    """Is the loopback TCP `port` (IPv6 if six) listened on by process pid
    (a slurmstepd: the step's PMIx server), in this network namespace?"""
    try:
        with open("/proc/net/tcp6" if six else "/proc/net/tcp") as f:
            inodes = tcp_listeners(f.read(), port)
        return bool(inodes & socket_inodes(pid))
    except OSError:
        return False
