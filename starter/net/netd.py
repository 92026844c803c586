"""netd: the per-node network helper, and the client the starters use.

Why a daemon: a starter without it loads libnftables and builds its
context (~20 ms and ~16 MB per NAT start here), makes the table when no
other NAT job runs and removes it after its own job, and waits for its
veth's deletion and conntrack cleanup at the end.  netd pays the handles
once, makes the node policy's table as it starts and keeps it while it
runs (other tables: TABLE_LINGER_S after their last job), and finishes
teardowns on a worker thread after answering; a starter then needs only a
unix socket round trip per operation.

    starter (root)                          netd (root, one per node)
    --------------                          -------------------------
    clone() -> child waits
    open /proc/<child>/ns/net
    connect(<state_dir>/netd.sock)   --->   accept; the peer must be uid 0,
                                            in netd's pid namespace and in
                                            no job cgroup (SO_PEERPIDFD, else
                                            SO_PEERCRED): never a job's process
    send {"op":"setup",job_id,cfg}
         + SCM_RIGHTS [netns fd]     --->   lease, veth (peer born in the
                                            job's netns), addresses, route,
                                            counters + set elements
                                     <---   {"ok":true,"result":lease}
    release child ... job runs ... job exits
    {"op":"teardown",job_id,cfg}     --->   read counters, remove all
                                     <---   {"ok":true,"result":counters}

SOCK_SEQPACKET: one request and one reply per message, message boundaries
kept; one connection per operation.  Requests are served one at a time, so
netd needs no locking of its own beyond the state dir's network lock that it
shares with in-process fallbacks.  The lease's owner is the peer's pid (the
starter), so gc and crash reclaim work the same with or without netd.

If the socket is missing or nobody listens, call() raises Unavailable and the
facade does the work in-process.
"""

import os
import _struct as struct  # the C module: struct.py is one more module to find per NAT job

# The client side is on every NAT job's start path: it speaks through the C
# socket module and the state module's `_json` codec.  `import socket` pulls
# in enum, selectors and array, `import json` re and functools: several ms
# per NAT start (docs/benchmarks.md).  The server (a long-lived process)
# imports both in serve().
import _socket

from starter.state.store import dumps, loads  # noqa: E402

MAX_MSG = 1 << 20
TIMEOUT = 60.0
# The nft table stays this long after its last job ends (and until netd
# stops), so a node that starts jobs one after another builds it once.
TABLE_LINGER_S = 60.0
# --image: how long netd keeps an image's squashfs mounted (a detached mount
# it holds: on no path) after the last job that handed it over started, so
# that the next job finds its superblock and page cache warm.
IMAGE_LINGER_S = 60.0


class Unavailable(Exception):
    """netd is not running (no socket, or a stale one)."""


# -- client -----------------------------------------------------------------
def call(path, request, fds=()):
    """One request, one answer -> its result.  Unavailable: netd is not running."""
    return answer(ask(path, request, fds))


def ask(path, request, fds=()):
    """Send the request -> (connection, path) to read its answer from
    (answer()): the starter works on meanwhile, netd on the other CPU."""
    from starter.errors import NetworkError

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise Unavailable(path) from None
        s.settimeout(TIMEOUT)
        data = dumps(request).encode()
        try:
            if fds:
                rights = struct.pack(f"{len(fds)}i", *fds)
                s.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
            else:
                s.send(data)
        except (ConnectionResetError, BrokenPipeError):
            raise NetworkError(f"netd at {path} closed the connection without an answer",
                               "see netd's log; restart `starter netd`") from None
    except BaseException:
        s.close()
        raise
    return s, path


def answer(pending):
    """netd's answer on a connection from ask() -> its result (closes it)."""
    from starter.errors import NetworkError

    s, path = pending
    try:
        try:
            reply = s.recv(MAX_MSG)
        except TimeoutError:
            raise NetworkError(f"netd at {path} did not answer within {TIMEOUT:.0f} s",
                               "check the netd process (`starter netd`) or stop it to fall back to in-process") from None
        except (ConnectionResetError, BrokenPipeError):
            reply = b""
        if not reply:
            raise NetworkError(f"netd at {path} closed the connection without an answer",
                               "see netd's log; restart `starter netd`")
    finally:
        s.close()
    msg = loads(reply.decode())
    if not msg.get("ok"):
        raise NetworkError(msg.get("error", "netd failed"), msg.get("hint"))
    return msg.get("result")


# -- server -----------------------------------------------------------------
# SO_PEERPIDFD (Linux 6.5+): a pidfd of the peer, so a pid reused between the
# check and the reply cannot pass for it.  77 in asm-generic/socket.h (these
# architectures); Python 3.11's socket module does not name it.
SO_PEERPIDFD = getattr(_socket, "SO_PEERPIDFD", 77 if os.uname().machine in ("x86_64", "aarch64", "riscv64") else None)
JOB_CGROUP_PREFIX = "job-"  # starter.cgroups.base.JOB_PREFIX, without importing the cgroup code


def _peer(conn):
    """-> (pid, uid, pidfd or None): SO_PEERCRED, plus SO_PEERPIDFD where the
    kernel has it."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))
    pidfd = None
    if SO_PEERPIDFD is not None:
        try:
            pidfd = struct.unpack("i", conn.getsockopt(_socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
        except OSError:
            pidfd = None  # before 6.5: ENOPROTOOPT
    return pid, uid, pidfd


def _pid_of_pidfd(pidfd):
    with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
        for line in f:
            if line.startswith(b"Pid:"):
                return int(line.split()[1])
    return -1


def _why_refused(pid, uid, pidfd):
    """None if the peer may use netd, else why not.  Only the starter, which
    runs as root in netd's own PID namespace outside every job cgroup, may:
    a job's process is refused whatever its uid (a uid-0 job can open a
    root-only socket it can reach)."""
    if uid != 0:
        return "netd serves root only"
    if pidfd is not None:
        pid = _pid_of_pidfd(pidfd)  # the peer's pid now, in our namespace (-1: gone)
    if pid <= 0:
        return "the peer is not in netd's PID namespace, or is gone"
    try:
        mine = os.stat("/proc/self/ns/pid")
        theirs = os.stat(f"/proc/{pid}/ns/pid")
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            cgroups = f.read().decode(errors="replace")
    except OSError:
        return "the peer is gone"
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        return "the peer is in another PID namespace (inside a job?)"
    for line in cgroups.splitlines():
        path = line.split(":", 2)[-1]
        if any(c.startswith(JOB_CGROUP_PREFIX) for c in path.split("/")):
            return f"the peer is in a job cgroup ({path})"
    # What we read was about the peer only if it still runs now (else the pid
    # may have been reused): a pidfd says so without a race.
    if pidfd is not None:
        import select

        p = select.poll()
        p.register(pidfd, select.POLLIN)
        if p.poll(0):
            return "the peer is gone"
    return None


def _check_job_id(job_id):
    from starter.spec import values

    return values.job_id("job_id", job_id)   # a SpecError goes back to the client


class TeardownWorker:
    """The slow end of netd's teardowns, on a thread of its own.  A teardown
    answers once the job's rules and counters are gone; deleting the veth
    (15-30 ms here, nearly all of it waiting for RCU in
    unregister_netdevice, outside the RTNL lock), the conntrack entries,
    releasing the lease and removing an unused table happen here, with a
    netlink socket of its own, so neither the starter nor netd's next
    request waits for them.  The lease is released only after the veth is
    gone, so its addresses cannot be handed out twice.  finish(links, items):
    Wiring.finish, for [(cfg, key, lease)]."""

    def __init__(self, finish):
        import queue
        import threading

        self._finish = finish
        self._queue = queue.Queue()
        self.pending = set()   # keys whose teardown is yet to finish (Wiring.teardown skips them)
        self._later = []       # the work of the request being answered
        self._thread = threading.Thread(target=self._work, name="net-teardown", daemon=True)
        self._thread.start()

    def defer(self, item):
        """(cfg, key, lease): queued by start(), once the reply is sent."""
        self.pending.add(item[1])
        self._later.append(item)

    def start(self):
        """Hand the current request's deferred work to the thread.  Called
        after the reply is sent: the thread's Python (netlink, the conntrack
        walk) would otherwise hold the GIL while the reply waits."""
        for item in self._later:
            self._queue.put(item)
        self._later.clear()

    def wait_idle(self):
        self._queue.join()

    def close(self):
        """Finish what is queued, then end the thread."""
        self.start()
        self._queue.put(None)
        self._thread.join()

    def _work(self):
        import queue
        import sys

        from starter.net.veth import Links

        links = None
        stop = False
        while not stop:
            items = [self._queue.get()]
            while items[-1] is not None:      # and whatever else is queued: one conntrack walk
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if items[-1] is None:
                stop = True
                items.pop()
            try:
                if items:
                    if links is None:
                        links = Links()  # a netlink socket of its own: not shared between threads
                    self._finish(links, items)
            except Exception as e:  # noqa: BLE001 - gc reclaims whatever is left
                sys.stderr.write(f"netd: finishing the teardown of {', '.join(i[1] for i in items)} failed: {e}\n")
            finally:
                for item in items:
                    self.pending.discard(item[1])
                    self._queue.task_done()
        if links is not None:
            links.close()


class Server:
    def __init__(self, cfg, path):
        from starter.net.wiring import Wiring

        self.cfg = cfg
        self.path = path
        self.wiring = Wiring(linger=TABLE_LINGER_S)
        self.teardowns = self.wiring.deferred = TeardownWorker(self.wiring.finish)
        self.images = {}        # digest -> (a detached squashfs mount's fd, when to let go of it)
        # Pay for the netlink socket and the nft context now, not on the first job.
        _ = self.wiring.links, self.wiring.nft

    def handle(self, conn):
        import json
        import socket

        from starter.net import NetConfig

        fds = []
        try:
            conn.settimeout(5.0)
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MSG, 4)
            pid, uid, pidfd = _peer(conn)
            try:
                why = _why_refused(pid, uid, pidfd)
            finally:
                if pidfd is not None:
                    os.close(pidfd)
            if why is not None:
                import sys

                sys.stderr.write(f"netd: refused peer pid {pid} uid {uid}: {why}\n")
                return {"ok": False, "error": f"netd refused this client: {why}",
                        "hint": "only the starter, as root on the host, may use netd"}
            req = json.loads(data)
            op = req.get("op")
            cfg = NetConfig.from_dict(req.get("cfg") or {})
            if cfg.state_dir != self.cfg.state_dir:
                return {"ok": False, "error": f"netd serves state dir {self.cfg.state_dir}, not {cfg.state_dir}",
                        "hint": "use the same --state-dir for starter and netd"}
            w = self.wiring
            if op == "setup":
                if len(fds) != 1:
                    return {"ok": False, "error": "setup needs exactly one netns fd"}
                result = w.setup(_check_job_id(req.get("job_id")), fds[0], cfg, pid)
            elif op == "teardown":
                if len(fds) > 1:
                    return {"ok": False, "error": "teardown takes at most one netns fd"}
                result = w.teardown(_check_job_id(req.get("job_id")), cfg, fds[0] if fds else None)
            elif op == "counters":
                result = w.counters(_check_job_id(req.get("job_id")), cfg)
            elif op == "gc":
                self.teardowns.wait_idle()  # queued teardowns first: gc must see their final state
                result = w.gc(cfg, set(req.get("live") or ()))
            elif op == "image-hold":
                result = self._hold_image(req.get("digest"), fds)
            elif op == "ping":
                result = {"pid": os.getpid()}
            else:
                return {"ok": False, "error": f"unknown op {op!r}"}
            return {"ok": True, "result": result}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the client
            return {"ok": False, "error": str(getattr(e, "args", [e])[0]) if e.args else repr(e),
                    "hint": getattr(e, "hint", None)}
        finally:
            for fd in fds:
                os.close(fd)

    def _hold_image(self, digest, fds):
        """Keep a job's image mounted (its fd) for IMAGE_LINGER_S more."""
        import time

        if len(fds) != 1 or not isinstance(digest, str) or len(digest) != 64 or not all(
                c in "0123456789abcdef" for c in digest):
            raise ValueError("image-hold needs one mount fd and a sha256 digest")
        fd = os.dup(fds[0])
        old = self.images.pop(digest, None)
        if old is not None:
            os.close(old[0])
        self.images[digest] = (fd, time.monotonic() + IMAGE_LINGER_S)
        return {"held": len(self.images)}

    def _expire_images(self):
        """Let go of the images no job handed over for IMAGE_LINGER_S -> the
        seconds until the next one is due, or None."""
        import time

        now = time.monotonic()
        for digest, (fd, until) in list(self.images.items()):
            if until <= now:
                os.close(fd)
                del self.images[digest]
        return min((until - now for _fd, until in self.images.values()), default=None)

    def serve_forever(self, listener, stop_fd):
        import json
        import select

        while True:
            timeouts = [t for t in (self.wiring.next_expiry(), self._expire_images()) if t is not None]
            ready, _, _ = select.select([listener, stop_fd], [], [], min(timeouts) if timeouts else None)
            if stop_fd in ready:
                return
            if not ready:
                self.wiring.expire_idle()
                continue
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            with conn:
                reply = self.handle(conn)
                try:
                    conn.send(json.dumps(reply).encode())
                except OSError:
                    pass  # the starter went away; its lease is reclaimed by gc
            self.teardowns.start()


def _bind(path):
    """Bind the socket; refuse if another netd answers; drop a stale socket."""
    import socket

    from starter.fileio import unlink_quiet

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    else:
        from starter.errors import NetworkError

        raise NetworkError(f"another netd is already listening on {path}", "stop it first")
    finally:
        probe.close()
    unlink_quiet(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(128)
    s.setblocking(False)
    return s


def node_config(state_dir):
    """The NAT settings the node policy gives every job (its [defaults]),
    as a job served here would get them -> NetConfig, or None: no policy,
    no NAT defaults in it, or its jobs use another state directory."""
    from starter.callers import policy
    from starter.spec import jobspec
    from starter.net import config_of

    pol = policy.load(os.environ.get("STARTER_POLICY") or policy.PATH)
    if not any(k in pol.defaults for k in policy.NET_OPTIONS):
        return None
    raw = pol.apply({"net": "nat"})
    if jobspec.state_dir(raw.get("state-dir")) != state_dir:
        return None
    return config_of(jobspec.network_from(raw), state_dir)


def _pin_policy_table(wiring, state_dir):
    """Make the policy's table now and keep it while netd runs: no job on
    the node pays for making it (8-11 ms here).  A policy netd cannot use
    is reported and skipped: jobs then make the table as before."""
    import sys

    try:
        cfg = node_config(state_dir)
        if cfg is not None:
            wiring.pin(cfg)
    except Exception as e:  # noqa: BLE001 - netd serves on without it
        sys.stderr.write(f"netd: not making the node policy's table ahead of jobs: {e}\n")


def serve(cfg, path):
    import signal
    import sys

    from starter.fileio import unlink_quiet

    os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
    # The teardown worker runs Python for tens of ms per job (the conntrack
    # walk); a request arriving meanwhile must not wait out the default 5 ms
    # GIL switch interval, maybe several times, on the starter's start path.
    sys.setswitchinterval(0.0005)
    server = Server(cfg, path)
    _pin_policy_table(server.wiring, cfg.state_dir)
    listener = _bind(path)
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    old_wakeup = signal.set_wakeup_fd(w)
    try:
        server.serve_forever(listener, r)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, h in old.items():
            signal.signal(sig, h)
        listener.close()
        unlink_quiet(path)
        os.close(r)
        os.close(w)
        server.wiring.close()
        for fd, _until in server.images.values():
            os.close(fd)
