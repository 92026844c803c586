"""The PMIx server, reached from a --net job job's own network namespace.

Slurm's slurmstepd runs a PMIx server per step and node, and tells each task
where it listens: PMIX_SERVER_URI* = "pmix-server.PID;tcp4://127.0.0.1:PORT"
(PMIx 4 speaks TCP on the loopback only).  A job in a network namespace of
its own has a loopback of its own, so an MPI rank's MPI_Init could not reach
it.  The starter listens at that same address and port in the job's
namespace (the socket made by a thread that is there: veth.in_netns) and
relays each connection to the server in its own namespace, byte for byte,
until either side closes.  Nothing else of the host's loopback is reachable;
the server sees a local client, as any process of the node would be.

One bridge per part of a job network on a node: the first task that asks for
a port gets it (the owner, whose starter outlives the others' jobs); a task
whose endpoint is bridged already uses that bridge.
"""

import os

from starter.errors import NetworkError

URI_VARS = ("PMIX_SERVER_URI",)     # PMIX_SERVER_URI, ..2, ..3, ..4, ..21, ..41: one endpoint


def endpoints(environ):
    """{(family, host, port)} of the loopback TCP endpoints the PMIx URIs in
    environ name (pure)."""
    import _socket

    out = set()
    for k, v in environ.items():
        if not k.startswith(URI_VARS):
            continue
        for part in v.split(";"):
            for scheme, fam in (("tcp4://", _socket.AF_INET), ("tcp6://", _socket.AF_INET6)):
                if not part.startswith(scheme):
                    continue
                host, _, port = part[len(scheme):].rpartition(":")
                host = host.strip("[]")
                if port.isdigit() and 0 < int(port) < 65536 and host in ("127.0.0.1", "::1"):
                    out.add((fam, host, int(port)))
    return out


class Bridge:
    """Listening sockets in the job's namespace, and the threads that relay."""

    def __init__(self, netns_fd, eps):
        import threading

        from starter.net import veth

        self.listeners = []
        self._stop = False
        for fam, host, port in sorted(eps):
            sock = veth.in_netns(netns_fd, lambda f=fam, h=host, p=port: _listen(f, h, p))
            if sock is None:
                continue        # another task's bridge has it
            self.listeners.append((sock, fam, host, port))
        for sock, fam, host, port in self.listeners:
            threading.Thread(target=self._accept, args=(sock, fam, host, port), name=f"pmix-bridge-{port}",
                             daemon=True).start()

    def _accept(self, lsock, fam, host, port):
        import socket
        import threading

        while not self._stop:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            try:
                up = socket.socket(fam, socket.SOCK_STREAM)
                up.connect((host, port))
            except OSError:
                conn.close()
                continue
            pair = _Pair(conn, up)

            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b, pair), name="pmix-relay", daemon=True).start()

    def close(self):
        self._stop = True
        for sock, *_ in self.listeners:
            try:
                sock.shutdown(2)
            except OSError:
                pass
            sock.close()
        self.listeners = []


def _listen(fam, host, port):
    import errno
    import socket

    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise NetworkError(f"the PMIx bridge cannot listen at {host}:{port} in the job's network: "
                           f"{os.strerror(e.errno)}") from None
    return s


class _Pair:
    """One relayed connection: the last of its two pumps closes both sockets."""

    def __init__(self, a, b):
        import threading

        self.socks, self.left, self.lock = (a, b), 2, threading.Lock()

    def done(self):
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            for s in self.socks:
                s.close()


def _pump(src, dst, pair):
    """Copy src to dst until src ends; then end dst's writing side."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(1)     # SHUT_WR
        except OSError:
            pass
        pair.done()
