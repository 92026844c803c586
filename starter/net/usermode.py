"""A pilot's job network (`--net nat` from a starter without root): a
user-mode stack, pasta (Debian's passt package), and the job's LAN/WAN
counters in the job's own network namespace.

    job netns (owned by the starter's user namespace)     the pilot, on the host
    eth0 10.0.2.100/24, default via 10.0.2.2  ==tap==  pasta: each flow a socket
    table inet starter_usermode: lan_in/out, wan_in/out    of the pilot's own

pasta terminates the job's TCP and UDP flows and opens the same flows from
the host as the pilot: the job reaches what the pilot reaches, and nothing
of the host's own loopback (--no-map-gw), and nothing reaches the job (no
port is forwarded in).  The counters are nftables rules on eth0 in the
job's namespace, which the starter, root of the namespace's owner, loads
before the job runs; the job has no capability there and cannot change them.
They count what crosses eth0 (IP headers included), LAN by --lan, the rest
WAN, as root mode's do on the host's veth.

pasta gets the namespace as an fd (/proc/self/fd/3): it drops its
capabilities before it opens the namespace, and /proc/PID/ns of the job's
still privileged process would then be refused to it.  It needs
/dev/net/tun (0666, as udev makes it).  It runs as a child of the
starter's, killed at the job's end, after the counters are read.
"""

import errno
import os
import time

from starter.errors import NetworkError

PASTA = "/usr/bin/pasta"
SETPRIV = "/usr/bin/setpriv"
IFNAME = "eth0"
ADDRESS, PREFIX, GATEWAY = "10.0.2.100", 24, "10.0.2.2"
READY_WAIT = 10.0       # seconds for pasta to configure the job's device
DRAIN_WAIT = 2.0        # seconds the job's last bytes may take to leave through pasta


class UserNet:
    """One job's user-mode network: start() before the job runs, read()
    its counters, stop() at its end (idempotent)."""

    def __init__(self, job_id, netns_fd, lan, state_dir, uplink=()):
        self.job_id, self.lan = job_id, tuple(lan)
        self.uplink = tuple(uplink)[:1]     # pasta's template interface (default: the default route's)
        self.netns_fd = os.dup(netns_fd)      # kept: the counters are read after the job is gone
        self.pidfile = os.path.join(state_dir, job_id + ".pasta.pid")
        self.pid = None
        self.sock = None        # a netfilter socket in the job's namespace (the counters' reads)

    def start(self):
        """The counters first (nothing crosses eth0 uncounted), then pasta;
        returns once pasta has made and configured eth0."""
        from starter.net import nft, nftrules, nftwire

        if not (os.access(PASTA, os.X_OK) and os.access(SETPRIV, os.X_OK)):
            raise NetworkError("--net nat without root needs pasta, and it is not installed",
                               "install Debian's passt package, or run the job with --net none")
        if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
            raise NetworkError("--net nat without root needs /dev/net/tun, and the pilot may not open it",
                               "the site makes it mode 0666 (udev does by default), or run with --net none")
        cmds = nftrules.usermode_table(IFNAME, self.lan)
        nft._load()     # (imported and loaded before the fork)
        # The table made, and a netfilter socket opened, in the job's
        # namespace: the counters are read on it, with no helper, at the end.
        self.sock = _in_job(self.netns_fd, lambda: nft.Nft().run(cmds, "the job's network counters") and None,
                            socket_proto=nftwire.NETLINK_NETFILTER)
        try:
            os.unlink(self.pidfile)
        except FileNotFoundError:
            pass
        err_r, err_w = os.pipe()
        # setpriv (util-linux): pasta dies with the starter, however it ends
        # (a starter killed by -9 leaves no pasta holding the namespace).
        argv = [SETPRIV, "--pdeathsig", "KILL", "--", PASTA, "--foreground", "--quiet", "--runas", "0:0", "--config-net",
                "--netns", "/proc/self/fd/3", "--ns-ifname", IFNAME,
                "--address", ADDRESS, "--netmask", str(PREFIX), "--gateway", GATEWAY, "--no-map-gw",
                "-t", "none", "-u", "none", "-T", "none", "-U", "none", "--pid", self.pidfile,
                *(("--interface", self.uplink[0]) if self.uplink else ())]
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            self.pid = os.posix_spawn(SETPRIV, argv, {"PATH": "/usr/bin:/bin"}, file_actions=[
                (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2), (os.POSIX_SPAWN_DUP2, self.netns_fd, 3)], setsid=True,
                # Default dispositions, nothing blocked: pasta refuses to start
                # where SIGPIPE is already ignored (Python ignores it).
                setsigdef=[n for n in range(1, 32) if n not in (9, 19)], setsigmask=[])
        finally:
            os.close(null)
            os.close(err_w)
        try:
            self._wait_ready(err_r)
        finally:
            os.close(err_r)

    def _wait_ready(self, err_r):
        deadline = time.monotonic() + READY_WAIT
        while True:
            try:
                if os.path.getsize(self.pidfile) > 0:
                    return
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = None
                os.set_blocking(err_r, False)
                try:
                    text = os.read(err_r, 4096).decode("utf-8", "replace")
                except OSError:
                    text = ""
                lines = [ln for ln in text.splitlines() if ln.strip() and "syslog" not in ln]
                why = lines[-1] if lines else "exit status " + str(status >> 8)
                raise NetworkError(f"pasta (the job's user-mode network) failed: {why}",
                                   "name the host's interface to the network with --uplink IFNAME (this "
                                   "host has no default route)" if "External interface" in why else
                                   "check that pasta runs for this user: pasta --config-net true")
            if time.monotonic() > deadline:
                raise NetworkError(f"pasta did not configure the job's network in {READY_WAIT:g}s")
            time.sleep(0.002)

    def read(self):
        """{"lan_in"|...: {"bytes", "packets"}}, or None where the table is gone."""
        from starter.net import netlink, nftrules, nftwire

        names = nftrules.ZONES
        if self.sock is None:
            return None
        try:
            self.sock.settimeout(5.0)
            self.sock.send(b"".join(nftwire.getobj_request(nftrules.USERMODE_TABLE, n, 1 + k)
                                    for k, n in enumerate(names)))
            answers = netlink.collect(self.sock, 1, len(names), ack=False)
        except OSError:
            return None
        out = {}
        for n, (replies, err) in zip(names, answers):
            c = nftwire.counter_of(replies[0][1]) if not err and replies else {}
            out[n] = {"bytes": int(c.get("bytes", 0)), "packets": int(c.get("packets", 0))}
        return out

    def report(self):
        """The report's `network`: the counters, and how the job was connected.
        Read once they stand still (at most DRAIN_WAIT): what the job's
        sockets still held when it ended goes on out through pasta, which
        lives until after this read."""
        counters = self.read() or {}
        deadline = time.monotonic() + DRAIN_WAIT
        while counters and time.monotonic() < deadline:
            time.sleep(0.005)
            again = self.read() or {}
            if again == counters:
                break
            counters = again
        return {"usermode": {"stack": "pasta", "address": ADDRESS, "gateway": GATEWAY}, **counters}

    def stop(self):
        """-> pasta's pid where it was killed here and is still to be reaped
        (Job.end does so after the report), else None."""
        left = None
        if self.pid is not None:
            # Nothing of pasta's is left to flush once the counters stood
            # still: the job's flows are done.  Not waited for here: its tap
            # device's removal takes the kernel ~25 ms: reaped after the report.
            pid, self.pid = self.pid, None
            try:
                os.kill(pid, 9)
                left = pid
            except ProcessLookupError:
                pass
        try:
            os.unlink(self.pidfile)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        if self.netns_fd is not None:
            os.close(self.netns_fd)
            self.netns_fd = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        return left


def _in_job(netns_fd, work, socket_proto=None):
    """work() run by a forked process in the job's network namespace, and
    with socket_proto a netlink socket of that protocol opened there; ->
    the socket (a socket.socket, the starter's from now on).  A starter
    without root cannot setns() a thread of its own there and back
    (net/veth.in_netns): the host's namespace is not its user namespace's.
    The child only makes system calls and what work() brings, imported
    before the fork; it never returns into the starter."""
    import _socket
    import socket

    from starter.isolate.ns import setns

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            parent.close()
            fds = []
            try:
                setns(netns_fd, 0x40000000)
                work()
                if socket_proto is not None:
                    fds.append(_socket.socket(_socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC,
                                              socket_proto).detach())
                msg = b"ok"
            except Exception as e:  # noqa: BLE001 - carried to the starter
                msg = ("error " + (str(e) or type(e).__name__)).encode()[:4000]
            socket.send_fds(child, [msg], fds)
            code = 0
        finally:
            os._exit(code)
    child.close()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(parent, 4096, 1)
    finally:
        parent.close()
        os.waitpid(pid, 0)
    if msg != b"ok":
        for fd in fds:
            os.close(fd)
        raise NetworkError("the job's network namespace: " + (msg.decode("utf-8", "replace")[6:] or "its helper gave no answer"))
    if socket_proto is None:
        return None
    return socket.socket(_socket.AF_NETLINK, _socket.SOCK_RAW, socket_proto, fileno=fds[0])
