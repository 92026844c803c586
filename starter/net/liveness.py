"""Whether the other nodes' parts of a job network are still there.

A job network has no controller, so nothing tells a node's part that
another node's went (its starter killed -9, the node lost): MPI would hang.
Each part's first task's starter sends a heartbeat to every other node's
part once a second, over the job network itself (UDP port PORT on vx0's
address, bound by the starter before the job runs, so no job takes it), and
says "bye" when its part ends as it should.  A peer that was heard and then
falls silent for LOST_AFTER seconds without a bye is lost: the starter then
vacates its job (SIGTERM, the kill after --grace), reason "peer_lost", and
the report names the node.  A peer that was never heard is not waited for:
parts start when their tasks do.

Only the job's own parts can reach that port (its segment is its own), so
a job can at worst fool its own parts.
"""

import time

PORT = 4790
EVERY = 1.0
LOST_AFTER = 5.0
MAGIC = b"starter-part"


class Watch:
    """The part's heartbeat socket (made in its network namespace) and what
    it heard.  fd: for the supervisor's poll; deadline: the next tick."""

    def __init__(self, netns_fd, plan):
        from starter.net import veth

        self.plan = plan
        self.addrs = {plan.address(i): name for i, name, _a in plan.others()}
        self.heard, self.gone = {}, set()
        self.sock = veth.in_netns(netns_fd, lambda: _bind(plan.address(plan.index)))
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

    def close(self, bye=True):
        if self.sock is None:
            return
        if bye:
            msg = self._message(b"bye")
            for addr in self.addrs:
                self._send(msg, addr)
        self.sock.close()
        self.sock = None

    def _send(self, msg, addr):
        try:
            self.sock.sendto(msg, (addr, PORT))
        except OSError:
            pass        # (no route yet, a full queue: the next tick)


def _bind(address):
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        s.bind((address, PORT))
    except OSError:
        s.close()
        raise
    return s
