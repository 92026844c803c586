"""Test hosts for job networks: a private "site" the NAT can reach.

    host (this machine)                router ns              lan ns
    uplink <name>  10.76.T.1/30 ---- 10.76.T.2/30
                                      10.77.T.1/24 -------- 10.77.T.10/24  LAN server
                                      198.18.T.1/24 ------- 198.18.T.10/24 WAN server (wan ns)

T is random per site, so two sites (two test runs, a test and a bench) can
coexist on a node.  The LAN CIDR to configure is site.lan_cidr (10.77.T.0/24,
inside the 10.77.0.0/16 LAN range); the WAN host is in 198.18.0.0/15 (the
benchmarking range).  The host gets routes to those two /24s via the uplink,
and nothing else changes on the host: no sysctl, no other route.  Every
namespace is held by a `sleep` process we start (no /run/netns mounts) and
everything is removed on exit, also when the body raises.  Traffic goes only
to addresses inside these namespaces.

    with site() as s:
        s.uplink, s.lan_addr, s.wan_addr, s.lan_cidr, s.wan_cidr
        srv = s.serve(s.lan_addr_ns, "send", 1_000_000)   # in the LAN ns
        ...
        Job(...)  a bare job namespace for tests that do not go through starter

Site6 is test_ipv6's dual-stack site (drawn in that file's docstring).
"""

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys

PY = "/usr/bin/python3"

# The TCP server and client the tests run in namespaces: IPv4 or IPv6 by
# the address given (a ':' in it), link-local IPv6 as ADDR%IFNAME.
SERVER = r"""
import socket, sys
def retrans(sock):
    # tcp_info's tcpi_bytes_retrans (offset 208, Linux 4.19+): what the
    # sender put on the wire again, which the job's counters rightly count.
    import struct
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("=Q", info, 208)[0] if len(info) >= 216 else 0
mode, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
host = sys.argv[4] if len(sys.argv) > 4 else "0.0.0.0"
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(512)
print("ready", flush=True)
c, peer = s.accept()
print("peer", peer[0], flush=True)
if mode == "send":
    buf = b"x" * 65536
    left = n
    while left:
        left -= c.send(buf[:min(left, len(buf))])
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print("sent", n, flush=True)
    print("retrans", retrans(c), flush=True)
else:
    got = 0
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        got += len(b)
    print("received", got, flush=True)
"""

CLIENT = r"""
import socket, sys
def retrans(sock):
    # tcp_info's tcpi_bytes_retrans (offset 208, Linux 4.19+): what the
    # sender put on the wire again, which the job's counters rightly count.
    import struct
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("=Q", info, 208)[0] if len(info) >= 216 else 0
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
src = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None
timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 10.0
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(timeout)
if src:
    s.bind((src, 0))
addr = (host, port)
if "%" in host:                      # a link-local address with its interface
    host, ifname = host.split("%")
    addr = (host, port, 0, socket.if_nametoindex(ifname))
try:
    s.connect(addr)
except OSError as e:
    print("connect-failed", type(e).__name__, e.errno, flush=True); sys.exit(3)
if mode == "connect":
    print("connected", flush=True)
elif mode == "recv":
    got = 0
    while True:
        b = s.recv(1 << 16)
        if not b:
            break
        got += len(b)
    print("received", got, flush=True)
else:
    buf = b"y" * 65536
    left = n
    while left:
        left -= s.send(buf[:min(left, len(buf))])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print("sent", n, flush=True)
    sys.stderr.write(f"retrans {retrans(s)}\n")
"""


def retransmitted(text):
    """Bytes a SERVER (stdout) or CLIENT (stderr) in send mode sent twice:
    the sum of its "retrans N" lines."""
    return sum(int(l.split()[1]) for l in text.splitlines() if l.startswith("retrans "))


def net_setup(job_ns, job_id, cfg):
    """The job network for the namespace job_ns holds, through the facade
    (netd if it runs, else in-process), as a starter gets it."""
    from starter import net

    fd = job_ns.open_fd()
    try:
        return net.setup(job_id, fd, cfg)
    finally:
        os.close(fd)


def run(*argv, check=True, **kw):
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


class Netns:
    """A network namespace held by a sleeping process we started."""

    def __init__(self):
        # The holder says "ready" once it runs in the new namespace (unshare
        # has made it), then execs sleep in the same process.
        self.proc = subprocess.Popen(["unshare", "--net", "sh", "-c", "echo ready; exec sleep 3600"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        with self.proc.stdout:
            ready = self.proc.stdout.readline()
        if ready != b"ready\n":
            self.close()
            raise RuntimeError("unshare --net did not start")
        self.pid = self.proc.pid

    def open_fd(self):
        return os.open(f"/proc/{self.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def argv(self, *cmd):
        return ["nsenter", "-t", str(self.pid), "-n", *cmd]

    def ip(self, *args, check=True):
        return run(*self.argv("ip", *args), check=check)

    def popen(self, *cmd, **kw):
        return subprocess.Popen(self.argv(*cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, **kw)

    def python(self, code, *args, timeout=60):
        return run(*self.argv(PY, "-c", code, *map(str, args)), check=False, timeout=timeout)

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Server:
    def __init__(self, ns, mode, port, n, host="0.0.0.0"):
        self.proc = ns.popen(PY, "-c", SERVER, mode, str(port), str(n), host)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"test server did not start: {line!r} {self.proc.stderr.read()}")
        self.port = port

    def result(self, timeout=60):
        out, err = self.proc.communicate(timeout=timeout)
        return out, err

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Site:
    def __init__(self, stack):
        self._stack = stack
        tag = secrets.token_hex(3)
        t = secrets.randbelow(256)
        self.uplink = f"stupl{tag}"
        self.lan_cidr, self.wan_cidr = f"10.77.{t}.0/24", f"198.18.{t}.0/24"
        self.lan_addr, self.wan_addr = f"10.77.{t}.10", f"198.18.{t}.10"
        self.uplink_addr, self.uplink_peer = f"10.76.{t}.1", f"10.76.{t}.2"
        self._port = 20000 + secrets.randbelow(20000)

        self.router = self._ns()
        self.lan = self._ns()
        self.wan = self._ns()
        # host <-> router: the uplink.  The peer is born in the router's ns.
        run("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0",
            "netns", str(self.router.pid))
        stack.callback(run, "ip", "link", "del", self.uplink, check=False)
        run("ip", "addr", "add", f"{self.uplink_addr}/30", "dev", self.uplink)
        run("ip", "link", "set", self.uplink, "up")
        for cidr in (self.lan_cidr, self.wan_cidr):
            run("ip", "route", "add", cidr, "via", self.uplink_peer, "dev", self.uplink)
            stack.callback(run, "ip", "route", "del", cidr, "via", self.uplink_peer, check=False)
        r = self.router
        r.ip("addr", "add", f"{self.uplink_peer}/30", "dev", "up0")
        r.ip("link", "set", "up0", "up")
        r.ip("link", "set", "lo", "up")
        # Forwarding inside the router's own namespace only.
        run(*r.argv("sysctl", "-qw", "net.ipv4.ip_forward=1"))
        for ns, name, gw, addr in ((self.lan, "lan", f"10.77.{t}.1", self.lan_addr),
                                   (self.wan, "wan", f"198.18.{t}.1", self.wan_addr)):
            r.ip("link", "add", name, "type", "veth", "peer", "name", "eth0",
                 "netns", str(ns.pid))
            r.ip("addr", "add", f"{gw}/24", "dev", name)
            r.ip("link", "set", name, "up")
            ns.ip("addr", "add", f"{addr}/24", "dev", "eth0")
            ns.ip("link", "set", "eth0", "up")
            ns.ip("link", "set", "lo", "up")
            ns.ip("route", "add", "default", "via", gw)

    def _ns(self):
        ns = Netns()
        self._stack.callback(ns.close)
        return ns

    def port(self):
        self._port += 1
        return self._port

    def serve(self, where, mode, n):
        """A one-connection TCP server in the LAN or WAN namespace."""
        ns = {"lan": self.lan, "wan": self.wan}[where]
        srv = Server(ns, mode, self.port(), n)
        self._stack.callback(srv.close)
        return srv

    def job(self):
        """A bare job namespace (held by sleep), for tests below the starter."""
        ns = Netns()
        self._stack.callback(ns.close)
        return ns


class Site6:
    """The dual-stack site of test_ipv6 (drawn in its docstring): one namespace
    behind the uplink holding the LAN and WAN servers of both families on lo."""

    def __init__(self, stack):
        t, h = secrets.randbelow(256), secrets.randbelow(0xffff)
        self.uplink = f"st6{secrets.token_hex(3)}"
        self.addr4, self.peer4 = f"198.19.{t}.65", f"198.19.{t}.66"
        self.addr6, self.peer6 = f"2001:db8:{h:x}::1", f"2001:db8:{h:x}::2"
        self.lan4, self.wan4 = f"198.19.{t}.90", f"198.19.{t}.106"
        self.lan6, self.wan6 = f"2001:db8:{h:x}:1::10", f"2001:db8:{h:x}:2::10"
        self.lan_cidrs = (f"198.19.{t}.88/29", f"2001:db8:{h:x}:1::/64")
        self.ns = Netns()
        stack.callback(self.ns.close)
        run("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", str(self.ns.pid))
        stack.callback(run, "ip", "link", "del", self.uplink, check=False)
        with open(f"/proc/sys/net/ipv6/conf/{self.uplink}/accept_dad", "w") as f:
            f.write("0")
        run("ip", "addr", "add", f"{self.addr4}/30", "dev", self.uplink)
        run("ip", "-6", "addr", "add", f"{self.addr6}/64", "dev", self.uplink, "nodad")
        run("ip", "link", "set", self.uplink, "up")
        for cidr, via in ((f"198.19.{t}.80/28", self.peer4), (f"198.19.{t}.96/28", self.peer4), (f"2001:db8:{h:x}:1::/64", self.peer6),
                          (f"2001:db8:{h:x}:2::/64", self.peer6)):
            run("ip", "route", "add", cidr, "via", via, "dev", self.uplink)
        ns = self.ns
        run(*ns.argv("sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"))
        ns.ip("addr", "add", f"{self.peer4}/30", "dev", "up0")
        ns.ip("-6", "addr", "add", f"{self.peer6}/64", "dev", "up0", "nodad")
        ns.ip("link", "set", "up0", "up")
        ns.ip("link", "set", "lo", "up")
        for a in (self.lan4, self.wan4):
            ns.ip("addr", "add", f"{a}/32", "dev", "lo")
        for a in (self.lan6, self.wan6):
            ns.ip("-6", "addr", "add", f"{a}/128", "dev", "lo")
        self._stack = stack
        self._port = 20000 + secrets.randbelow(20000)

    def port(self):
        self._port += 1
        return self._port

    def serve(self, host, mode, n=0):
        port = self.port()
        proc = self.ns.popen(PY, "-c", SERVER, mode, str(port), str(n), host)
        self._stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read())
        proc.port = port
        return proc


def client(ns, mode, host, port, n=0, src=None, timeout=10.0, retrans=False):
    """Run the TCP client inside ns -> (returncode, stdout); with retrans,
    (returncode, stdout, bytes it retransmitted: send mode)."""
    args = [mode, host, port, n]
    if src or timeout != 10.0:
        args += [src or "", timeout]
    r = ns.python(CLIENT, *args, timeout=timeout + 30)
    if retrans:
        return r.returncode, r.stdout.strip(), retransmitted(r.stderr)
    return r.returncode, r.stdout.strip()


@contextlib.contextmanager
def site():
    """-> Site.  Removes every route, veth, namespace and process on exit."""
    if os.geteuid() != 0:
        raise RuntimeError("nethosts needs root")
    with contextlib.ExitStack() as stack:
        yield Site(stack)


def send_raw_udp(ns, ifname, dst_mac, src_ip, dst_ip, dport, payload=b"probe"):
    """Send one hand-built Ethernet/IPv4/UDP frame from inside ns (AF_PACKET):
    for what the job's own routing would never emit (127.0.0.1 via the
    gateway)."""
    code = r"""
import socket, struct, sys
ifname, dst_mac, src, dst, dport, payload = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6].encode()
# /sys here still shows the namespace that mounted it: ask the kernel in ours.
import fcntl, struct as _st
_q = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
_hw = fcntl.ioctl(_q.fileno(), 0x8927, _st.pack("256s", ifname.encode()[:15]))  # SIOCGIFHWADDR
src_mac = ":".join("%02x" % b for b in _hw[18:24])
mac = lambda m: bytes(int(x, 16) for x in m.split(":"))
udp = struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload
tot = 20 + len(udp)
hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, tot, 1, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
s = 0
for i in range(0, 20, 2):
    s += (hdr[i] << 8) + hdr[i + 1]
while s >> 16:
    s = (s & 0xffff) + (s >> 16)
hdr = hdr[:10] + struct.pack("!H", ~s & 0xffff) + hdr[12:]
frame = mac(dst_mac) + mac(src_mac) + b"\x08\x00" + hdr + udp
p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
p.bind((ifname, 0))
p.send(frame)
print("sent")
"""
    r = ns.python(code, ifname, dst_mac, src_ip, dst_ip, dport, payload.decode())
    if r.returncode:
        raise RuntimeError(r.stderr)


if __name__ == "__main__":  # manual check: build the site, print it, tear down
    with site() as s:
        print(s.uplink, s.lan_addr, s.wan_addr)
        srv = s.serve("lan", "send", 1000)
        j = s.job()
        print(run("ip", "route").stdout, file=sys.stderr)
    print(socket.gethostname(), "clean")


class Fabric:
    """Nodes of a cluster on one machine, for --net job (test_multinode):

        fabric ns: bridge br0 ---- node i ns: fab0 10.250.T.i/24   (i = 1..n)

    Each node is a network namespace of its own; a starter runs "on" node
    i when it runs in that namespace (nsenter), with a state directory of
    its own (state_dirs[i]).  Everything goes with the ExitStack."""

    def __init__(self, stack, n, state_root):
        os.makedirs(state_root, exist_ok=True)
        self._stack = stack
        t = secrets.randbelow(250) + 1
        self.fabric = self._ns()
        self.fabric.ip("link", "add", "br0", "type", "bridge")
        self.fabric.ip("link", "set", "br0", "up")
        self.nodes, self.addrs, self.state_dirs = [], [], []
        for i in range(1, n + 1):
            node = self._ns()
            run("ip", "link", "add", "fab0", "netns", str(node.pid), "type", "veth", "peer", "name", f"fab{i}",
                "netns", str(self.fabric.pid))
            self.fabric.ip("link", "set", f"fab{i}", "master", "br0", "up")
            addr = f"10.250.{t}.{i}"
            node.ip("addr", "add", f"{addr}/24", "dev", "fab0")
            node.ip("link", "set", "fab0", "up")
            node.ip("link", "set", "lo", "up")
            self.nodes.append(node)
            self.addrs.append(addr)
            self.state_dirs.append(os.path.join(state_root, f"node{i}"))
        self.cidr = f"10.250.{t}.0/24"
        self.peers = ",".join(f"n{i + 1}={a}" for i, a in enumerate(self.addrs))
        self.procs = []         # started on the nodes: killed first, on exit
        stack.callback(self._end_procs)

    def popen(self, i, *cmd):
        """cmd on node i, its output piped (text); ended with the fabric."""
        p = subprocess.Popen(self.argv(i, *cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        return p

    def _end_procs(self):
        """TERM (a starter then ends its job and tidies), KILL after 20 s."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()

    def _ns(self):
        ns = Netns()
        self._stack.callback(ns.close)
        return ns

    def argv(self, i, *cmd):
        """cmd on node i (1-based)."""
        return self.nodes[i - 1].argv(*cmd)


@contextlib.contextmanager
def fabric(n, state_root):
    """-> Fabric of n nodes.  Removes its namespaces (and with them every
    link in them) and processes on exit."""
    with contextlib.ExitStack() as stack:
        yield Fabric(stack, n, state_root)


def fabric_leftovers(fab):
    """What the nodes hold beyond the harness's own: links other than lo and
    fab0, and nft tables, per node ({} when clean)."""
    out = {}
    for i, node in enumerate(fab.nodes, 1):
        links = [l.split()[0].split("@")[0] for l in node.ip("-br", "link").stdout.splitlines() if l.strip()]
        tables = [l for l in run(*node.argv("nft", "list", "tables")).stdout.splitlines() if l.strip()]
        extra = [l for l in links if l not in ("lo", "fab0")] + tables
        if extra:
            out[f"n{i}"] = extra
    return out
