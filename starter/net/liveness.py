"""Whether the other nodes' parts of a job network are still there.

A job network has no controller, so nothing tells a node's part that
another node's went (its starter killed -9, the node lost): MPI would hang.
Each part's first task's starter sends a heartbeat to every other node's
part once a second, over the job network itself (UDP port PORT, bound on
every address of the part's namespace before its network exists, so no job
takes it and no heartbeat finds the part without it), and
says "bye" when its part ends as it should.  A peer that was heard and then
falls silent for LOST_AFTER seconds without a bye is lost: the starter then
vacates its job (SIGTERM, the kill after --grace), reason "peer_lost", and
the report names the node.  A peer that was never heard is not waited for:
parts start when their tasks do.

Only the job's own parts can reach that port (its segment is its own), so
a job can at worst fool its own parts.
"""

import os
import time

CLONE_NEWNET = 0x40000000
PORT = 4790
EVERY = 1.0
LOST_AFTER = 5.0
MAGIC = b"starter-part"


class Watch:
    """The part's heartbeat socket (made in its network namespace) and what
    it heard.  fd: for the supervisor's poll; deadline: the next tick."""

    def __init__(self, netns_fd, plan):
        self.plan = plan
        self.addrs = {plan.address(i): name for i, name, _a in plan.others()}
        self.heard, self.gone = {}, set()
        self.sock = _bound_in(netns_fd)
        self.fd = self.sock.fileno()
        self.deadline = time.monotonic()

    def _message(self, what):
        return b" ".join((MAGIC, str(self.plan.vni).encode(), self.plan.node.encode(), what))

    def readable(self):
        """Take what came in (never blocks)."""
        while True:
            try:
                data, (src, *_rest) = self.sock.recvfrom(512)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            name = self.addrs.get(src)
            parts = data.split()
            if name is None or len(parts) != 4 or parts[0] != MAGIC or parts[1] != str(self.plan.vni).encode():
                continue
            if parts[3] == b"bye":
                self.gone.add(name)
            else:
                self.heard[name] = time.monotonic()

    def tick(self, now=None):
        """Send the heartbeats -> the name of a peer lost, or None."""
        now = time.monotonic() if now is None else now
        self.deadline = now + EVERY
        msg = self._message(b"alive")
        for addr, name in self.addrs.items():
            if name not in self.gone:
                self._send(msg, addr)
        for name, t in sorted(self.heard.items()):
            if name not in self.gone and now - t > LOST_AFTER:
                return name
        return None

    def keep_up(self):
        """While the part outlives its first task's job (its other tasks
        run): take what came, send when due; a peer lost is no longer news."""
        self.readable()
        if time.monotonic() >= self.deadline:
            self.tick()

    def bye(self):
        """The part ends as it should: no peer is to take its silence for a
        loss.  Not to a peer that said bye itself (taken in first): its part
        may be gone but for its device, whose kernel would answer with an
        ICMP error, counted as the job's bytes."""
        if self.sock is not None:
            self.readable()
            msg = self._message(b"bye")
            for addr, name in self.addrs.items():
                if name not in self.gone:
                    self._send(msg, addr)

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _send(self, msg, addr):
        try:
            self.sock.sendto(msg, (addr, PORT))
        except OSError:
            pass        # (no route yet, a full queue: the next tick)


def _bound_in(netns_fd):
    """The heartbeat socket, made in the part's network namespace by this
    thread, which goes there for the socket() and bind() alone (no thread
    of its own: the start path has no threading module); a thread that
    cannot come back must not live on."""
    import _socket  # not `socket`: it builds enums at import (~5 ms on the start path)

    from starter.isolate.ns import setns

    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(netns_fd, CLONE_NEWNET)
        try:
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC)
            try:
                s.bind(("0.0.0.0", PORT))  # (before vx0 has its address: every address, so no job takes the port)
            except OSError:
                s.close()
                raise
        finally:
            try:
                setns(home, CLONE_NEWNET)
            except OSError:  # pragma: no cover - cannot happen with a valid fd
                os._exit(125)
    finally:
        os.close(home)
    return s
