"""IPv6 for NAT jobs (issue 14): a ULA address per job beside its IPv4 one,
NAT66 out of the uplink, LAN/WAN accounting per family, the isolation rules
for IPv6, conntrack cleanup, `--ipv6 off`, clean errors.  Its pure logic is
in tests/unit/test_net_pure.py and test_nft_render.py; here, against a
dual-stack test site in namespaces made here (nethosts.Site6):

    host  st6<tag> 198.19.T.65/30   ---- 198.19.T.66/30   up0   site ns
                   2001:db8:H::1/64 ---- 2001:db8:H::2/64
                                         on lo: LAN server 198.19.T.90, 2001:db8:H:1::10
                                                WAN server 198.19.T.106, 2001:db8:H:2::10

The host routes only 198.19.T.80/28, .96/28 and 2001:db8:H:1::/64, 2001:db8:H:2::/64
via the site (LAN: .88/29 and :1::/64); the routes go with the uplink.  The
uplink's IPv6 forwarding is per interface (force_forwarding), never
conf.all: eth0 is not touched."""

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import SLOWDOWN, STARTER, running_netd  # noqa: E402
from starter import net  # noqa: E402
from starter.errors import NetworkError  # noqa: E402
from starter.net import ipam, nft  # noqa: E402

POOL = f"10.{216 + secrets.randbelow(32)}.{secrets.randbelow(256)}.0/24"
POOL6 = f"fd70:7639:1864:{secrets.randbelow(0xffff):x}::/64"
HDR4, HDR6 = 52, 72   # IP + TCP with timestamps, per packet

MANY_CLIENT = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = [socket.create_connection((host, port), timeout=10) for _ in range(n)]
print("open", len(socks), flush=True)
sys.stdin.readline()
"""

MANY_SERVER = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(512)
print("ready", flush=True)
conns = [s.accept()[0] for _ in range(n)]
print("accepted", len(conns), flush=True)
sys.stdin.readline()
"""


# -- the dual-stack site: nethosts.Site6 ------------------------------------------
@pytest.fixture
def site6():
    if not os.path.exists("/proc/sys/net/ipv6/conf/all/force_forwarding") and \
            open("/proc/sys/net/ipv6/conf/all/forwarding").read().strip() != "1":
        pytest.skip("needs per-interface IPv6 forwarding (force_forwarding, Linux 6.17); conf.all is not touched")
    with contextlib.ExitStack() as stack:
        yield nethosts.Site6(stack)


@pytest.fixture
def cfg(tmp_path, site6):
    c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, pool6=POOL6, lan=site6.lan_cidrs,
                      uplink=(site6.uplink,), table="starter_t" + secrets.token_hex(3))
    yield c
    net.gc(c, set())


_setup = nethosts.net_setup


def client(ns, mode, host, port, n=0, timeout=10.0, src=None, retrans=False):
    return nethosts.client(ns, mode, host, port, n, src=src, timeout=timeout, retrans=retrans)


def _payload(c, hdr):
    return c["bytes"] - hdr * c["packets"]


def _sysctl(ifname, key, family="ipv6"):
    with open(f"/proc/sys/net/{family}/conf/{ifname}/{key}") as f:
        return f.read().strip()


@pytest.mark.net
def test_dual_stack_job_reaches_lan_and_wan_counted_per_family(site6, cfg):
    assert _sysctl(site6.uplink, "force_forwarding") == "0"
    # the job's interface is named eth0 too: its sysctls are written in its namespace only
    eth0 = {k: _sysctl("eth0", k) for k in ("forwarding", "force_forwarding", "accept_ra", "accept_dad",
                                            "disable_ipv6")}
    job = nethosts.Netns()
    try:
        lease = _setup(job, "dual", cfg)
        assert lease.address6 == str(ipam.Pool6(POOL6).slot(0)[1]) and lease.address == ipam.Pool(POOL).slot(0)[1]
        assert _sysctl(site6.uplink, "force_forwarding") == "1"
        assert _sysctl(lease.host_ifname, "accept_ra") == "0"
        # inside the job: no DAD wait, no RA taken; its address usable at once
        inside = nethosts.run(*job.argv("cat", "/proc/sys/net/ipv6/conf/eth0/accept_dad",
                                        "/proc/sys/net/ipv6/conf/eth0/accept_ra")).stdout.split()
        assert inside == ["0", "0"]
        addrs = job.ip("-6", "addr", "show", "dev", "eth0").stdout
        assert f"{lease.address6}/126" in addrs and "tentative" not in addrs, addrs
        N4, N6, M4, M6, K4, K6 = 1_000_000, 1_500_000, 600_000, 800_000, 400_000, 700_000
        again = {}  # what each sender retransmitted: on the wire, so counted
        for host, n in ((site6.lan4, N4), (site6.lan6, N6), (site6.wan4, M4), (site6.wan6, M6)):
            srv = site6.serve(host, "send", n)
            assert client(job, "recv", host, srv.port) == (0, f"received {n}")
            peer = srv.stdout.readline().split()[1]
            # masqueraded (NAT66 too) to the uplink's address
            assert peer == (site6.addr6 if ":" in host else site6.addr4), peer
            again[n] = nethosts.retransmitted(srv.stdout.read())
        for host, n in ((site6.lan6, K6), (site6.wan4, K4)):
            srv = site6.serve(host, "recv")
            rc, out, again[n] = client(job, "send", host, srv.port, n, retrans=True)
            assert (rc, out) == (0, f"sent {n}")
        live = net.counters("dual", cfg)
        final = net.teardown("dual", cfg)
    finally:
        job.close()
    assert final == live
    v4, v6 = final["ipv4"], final["ipv6"]
    for got, hdr, expect in ((v4["lan_in"], HDR4, N4), (v6["lan_in"], HDR6, N6), (v4["wan_in"], HDR4, M4),
                             (v6["wan_in"], HDR6, M6), (v6["lan_out"], HDR6, K6), (v4["wan_out"], HDR4, K4)):
        assert abs(_payload(got, hdr) - expect - again[expect]) <= 0.01 * expect, (expect, final)
    # combined = the sums; the old fields keep meaning both families
    for z in ("lan_in", "lan_out", "wan_in", "wan_out"):
        assert final[z]["bytes"] == v4[z]["bytes"] + v6[z]["bytes"]
    assert abs(final["lan_in"]["bytes"] - v4["lan_in"]["packets"] * HDR4 - v6["lan_in"]["packets"] * HDR6
               - N4 - N6 - again[N4] - again[N6]) <= 0.01 * (N4 + N6)
    assert final["dropped"]["packets"] == 0, final
    # the uplink's flag is back, eth0 never changed, the table is gone
    assert _sysctl(site6.uplink, "force_forwarding") == "0"
    assert eth0 == {k: _sysctl("eth0", k) for k in eth0}
    assert cfg.table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def _dropped(job_id, cfg):
    return net.counters(job_id, cfg)["dropped"]["packets"]


def _dropped_once(job_id, cfg, want):
    """The job's dropped count once it has reached want (packets already
    sent, still on their way through the veth's backlog), or at the
    deadline.  Polled: an nft counter announces nothing.  A count above
    want is returned as it is, so extra drops fail the caller's check."""
    deadline = time.monotonic() + 5 * SLOWDOWN
    while (d := _dropped(job_id, cfg)) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return d


def _send_icmpv6(ns, src, dst, icmp_type, hoplimit=255, target=None):
    """One raw ICMPv6 message from inside ns: a router advertisement (134),
    or with target a neighbour solicitation (135) for it."""
    code = r"""
import socket, struct, sys
src, dst, t, hl, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, hl)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, hl)
s.bind((src, 0, 0, socket.if_nametoindex("eth0")))
if target:   # NS: reserved, target, source link-layer address option
    body = struct.pack("!BBHI", t, 0, 0, 0) + socket.inet_pton(socket.AF_INET6, target) + bytes([1, 1, 2, 0, 0, 0, 0, 0x99])
else:        # an RA's fixed part
    body = struct.pack("!BBHBBHII", t, 0, 0, 64, 0, 1800, 0, 0)
s.sendto(body, (dst, 0, 0, socket.if_nametoindex("eth0")))
print("sent")
"""
    r = ns.python(code, src, dst, icmp_type, hoplimit, target or "")
    assert r.returncode == 0, r.stderr


def _lladdr(ns):
    out = ns.ip("-6", "-o", "addr", "show", "dev", "eth0", "scope", "link").stdout
    return out.split("inet6 ")[1].split("/")[0]


@pytest.mark.net
def test_isolation_ipv6(site6, tmp_path):
    """Each IPv4 isolation case of test_net.test_isolation, over IPv6, with drops counted."""
    port = site6.port()
    cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, pool6=POOL6, lan=site6.lan_cidrs,
                        uplink=(site6.uplink,), table="starter_t" + secrets.token_hex(3),
                        allow_host_ports=(("tcp", port),))
    a, b = nethosts.Netns(), nethosts.Netns()
    listeners = []

    def listen(addr, p, scope=0):
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, p, 0, scope))
        s.listen(4)
        s.setblocking(False)
        listeners.append(s)
        return s

    def nothing_arrived(s):
        try:
            s.accept()
        except BlockingIOError:
            return True
        return False

    try:
        la, lb = _setup(a, "iso6-a", cfg), _setup(b, "iso6-b", cfg)
        # the allow-listed host port on the gateway is open over IPv6 too...
        proxy = listen(la.gateway6, port)
        assert client(a, "connect", la.gateway6, port, timeout=3)[0] == 0
        proxy.setblocking(True)
        proxy.settimeout(5)
        proxy.accept()[0].close()
        # ...every other host port is not, on any host address: the gateway,
        # the uplink's, and the link-local of the job's own veth
        d0 = _dropped("iso6-a", cfg)
        host_ll = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", la.host_ifname, "scope", "link"],
                                 capture_output=True, text=True).stdout.split("inet6 ")[1].split("/")[0]
        idx = socket.if_nametoindex(la.host_ifname)
        d1 = d0
        for addr, scope in ((la.gateway6, 0), (site6.addr6, 0), (host_ll, idx)):
            s = listen(addr, port + 1, scope)
            target = f"{addr}%eth0" if scope else addr
            rc, out = client(a, "connect", target, port + 1, timeout=1)
            assert rc == 3 and "connect-failed" in out, (addr, out)
            assert nothing_arrived(s)
            d = _dropped("iso6-a", cfg)
            assert d > d1, (addr, d, d1, out)
            d1 = d

        # another job: B listens on its IPv6 address, A cannot connect
        srv = nethosts.Server.__new__(nethosts.Server)
        srv.proc = b.popen(nethosts.PY, "-c", nethosts.SERVER, "recv", str(port + 2), "0", "::")
        try:
            assert srv.proc.stdout.readline().strip() == "ready"
            assert client(a, "connect", lb.address6, port + 2, timeout=1)[0] == 3
            assert srv.proc.poll() is None
        finally:
            srv.proc.kill()
            srv.proc.wait()
        d2 = _dropped("iso6-a", cfg)
        assert d2 > d1

        # cloud metadata (fd00:ec2::254) and the like
        for meta in ("fd00:ec2::254", "fd20:ce::254"):
            a.ip("-6", "route", "add", f"{meta}/128", "via", la.gateway6, check=False)
            assert client(a, "connect", meta, 80, timeout=1)[0] == 3
        d3 = _dropped("iso6-a", cfg)
        assert d3 >= d2 + 2

        # a router advertisement from the job (to all nodes and to the gateway) is dropped and counted
        ll = _lladdr(a)
        _send_icmpv6(a, ll, "ff02::1", 134)
        _send_icmpv6(a, ll, host_ll, 134)
        d4 = _dropped_once("iso6-a", cfg, d3 + 2)
        assert d4 == d3 + 2
        routes = subprocess.run(["ip", "-6", "route", "show", "dev", la.host_ifname], capture_output=True,
                                text=True).stdout
        assert "default" not in routes and "ra" not in routes.split()

        # neighbour discovery only from its own two addresses: a spoofed
        # solicitation (which would make the host add a neighbour entry:
        # a flood of them fills the host's table) is a counted drop
        assert ll == ipam.JOB_LINK_LOCAL6
        a.ip("-6", "addr", "add", "fe80::99/64", "dev", "eth0", "nodad")
        _send_icmpv6(a, "fe80::99", host_ll, 135, target=host_ll)
        d4b = _dropped_once("iso6-a", cfg, d4 + 1)
        assert d4b == d4 + 1
        neigh = subprocess.run(["ip", "-6", "neigh", "show", "dev", la.host_ifname], capture_output=True,
                               text=True).stdout
        assert "fe80::99" not in neigh, neigh
        a.ip("-6", "addr", "del", "fe80::99/64", "dev", "eth0")
        d4 = d4b

        # a spoofed source (the job is root in its namespace), including
        # another job's address
        srv = site6.serve(site6.lan6, "recv")
        for spoof in (str(ipam.Pool6(POOL6).slot(99)[1]), lb.address6):
            a.ip("-6", "addr", "add", f"{spoof}/128", "dev", "eth0", "nodad")
            assert client(a, "connect", site6.lan6, srv.port, timeout=1, src=spoof)[0] == 3
        assert srv.poll() is None
        d5 = _dropped("iso6-a", cfg)
        assert d5 > d4
        # ...while its real address works, and none of that was counted as traffic
        assert client(a, "send", site6.lan6, srv.port, 10, src=la.address6) == (0, "sent 10")
        c = net.counters("iso6-a", cfg)
        assert c["wan_out"]["packets"] == 0, c
        assert _dropped("iso6-b", cfg) == 0
    finally:
        for s in listeners:
            s.close()
        net.teardown("iso6-a", cfg)
        net.teardown("iso6-b", cfg)
        a.close()
        b.close()
    assert cfg.table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def _flows(address):
    """The host's conntrack entries from or to this IPv6 address (read-only
    dumps through starter.net.conntrack's own request builder)."""
    import ipaddress

    from starter.net import conntrack

    packed = ipaddress.ip_address(address).packed
    out = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 12) as s:
        s.settimeout(5.0)
        s.bind((0, 0))
        for direction in (0, 1):
            out += conntrack._dump(s, conntrack.dump_request(socket.AF_INET6, packed, direction, direction + 1),
                                   socket.AF_INET6, {packed})
    return out


@pytest.fixture(params=["in-process", "netd"])
def netmode(request, cfg):
    """As in test_uplinks: with netd the teardown finishes on its worker;
    net.gc waits for it."""
    if request.param == "in-process":
        yield None
        return
    with running_netd(cfg.state_dir) as proc:
        yield proc


@pytest.mark.net
def test_teardown_forgets_the_jobs_ipv6_flows(site6, cfg, netmode):
    N = 100
    port = site6.port()
    srv = subprocess.Popen(site6.ns.argv(nethosts.PY, "-c", MANY_SERVER, site6.wan6, str(port), str(N)),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        job = nethosts.Netns()
        try:
            lease = _setup(job, "many6", cfg)
            cli = subprocess.Popen(job.argv(nethosts.PY, "-c", MANY_CLIENT, site6.wan6, str(port), str(N)),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                assert cli.stdout.readline().strip() == f"open {N}", cli.stderr.read()
                assert len(_flows(lease.address6)) >= N
            finally:
                cli.kill()
                cli.wait()
        finally:
            job.close()
        net.teardown("many6", cfg)
        net.gc(cfg, set())
        assert _flows(lease.address6) == []
        # the next job gets the same addresses, and its IPv6 works
        job = nethosts.Netns()
        try:
            again = _setup(job, "next6", cfg)
            assert (again.address, again.address6) == (lease.address, lease.address6)
            s = site6.serve(site6.wan6, "send", 10_000)
            assert client(job, "recv", site6.wan6, s.port) == (0, "received 10000")
            net.teardown("next6", cfg)
            net.gc(cfg, set())
            assert _flows(lease.address6) == []
        finally:
            job.close()
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.net
def test_ipv6_off_gives_no_ipv6(site6, tmp_path):
    cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, pool6=POOL6, uplink=(site6.uplink,),
                        table="starter_t" + secrets.token_hex(3), ipv6="off")
    job = nethosts.Netns()
    try:
        lease = _setup(job, "off", cfg)
        assert lease.address6 is None
        assert job.ip("-6", "addr", "show", "dev", "eth0").stdout.strip() == ""
        assert _sysctl("eth0", "disable_ipv6") == "0"         # the host's eth0: untouched
        assert "default" not in job.ip("-6", "route").stdout
        assert client(job, "connect", site6.wan6, 80, timeout=1)[0] == 3
        assert _sysctl(site6.uplink, "force_forwarding") == "0"   # nothing turned on for IPv6
        # IPv4 still works
        srv = site6.serve(site6.wan4, "send", 1000)
        assert client(job, "recv", site6.wan4, srv.port) == (0, "received 1000")
        c = net.teardown("off", cfg)
        assert "ipv6" not in c
    finally:
        job.close()
        net.gc(cfg, set())


@pytest.mark.net
def test_clean_errors(site6, tmp_path):
    """ipv6 on with an uplink without IPv6; pool6 overlapping a host address."""
    no6 = "st6n" + secrets.token_hex(3)
    nethosts.run("ip", "link", "add", no6, "type", "veth", "peer", "name", no6 + "p")
    try:
        for kw, msg in (({"uplink": (site6.uplink, no6), "ipv6": "on"},
                         f"ipv6 on: uplink '{no6}' has no global IPv6 address"),
                        ({"uplink": (site6.uplink,), "pool6": "fd70:7639:1864:ffff::/64", "host6": True},
                         "pool6: fd70:7639:1864:ffff::/64 overlaps fd70:7639:1864:ffff::1/128 on " + no6)):
            if kw.pop("host6", False):
                nethosts.run("ip", "-6", "addr", "add", "fd70:7639:1864:ffff::1/128", "dev", no6, "nodad")
            cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL,
                                table="starter_t" + secrets.token_hex(3), **kw)
            job = nethosts.Netns()
            try:
                with pytest.raises(NetworkError, match=msg.replace("(", r"\(")):
                    _setup(job, "bad", cfg)
            finally:
                job.close()
            assert not os.path.exists(os.path.join(cfg.state_dir, "net"))
            assert _sysctl(site6.uplink, "force_forwarding") == "0"
            assert cfg.table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    finally:
        nethosts.run("ip", "link", "del", no6, check=False)


@pytest.mark.net
def test_dual_stack_through_the_cli(site6, tmp_path):
    """`starter run --net nat` with an IPv6 LAN and resolver: the report has
    both families; --ipv6 on with an uplink lacking IPv6 is exit 125, one line."""
    srv = site6.serve(site6.lan6, "send", 100_000)
    (tmp_path / "client.py").write_text(nethosts.CLIENT)
    tmp_path.chmod(0o755)
    report = tmp_path / "r.json"
    common = ["--user", "starter-job", "--net", "nat", "--pool", POOL, "--pool6", POOL6,
              "--lan", site6.lan_cidrs[0], "--lan", site6.lan_cidrs[1], "--uplink", site6.uplink]
    script = f"cat /etc/resolv.conf; /usr/bin/python3 /srv/client.py recv {site6.lan6} {srv.port} 0 '' 20"
    p = subprocess.run([STARTER, "run", *common, "--resolver", "2001:db8::53", "--ipv6", "on",
                        "--report", str(report), "--ro-bind", f"{tmp_path}:/srv", "--", "sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "nameserver 2001:db8::53" in p.stdout and "received 100000" in p.stdout, p.stdout
    r = json.loads(report.read_text())["network"]
    assert r["ipv6"]["lan_in"]["bytes"] >= 100_000 and r["lan_in"]["bytes"] >= r["ipv6"]["lan_in"]["bytes"], r
    assert r["ipv4"]["lan_in"]["bytes"] == r["lan_in"]["bytes"] - r["ipv6"]["lan_in"]["bytes"]
    p = subprocess.run([STARTER, "run", *common[:6], "--pool6", "2001:db8::/64", "--uplink", site6.uplink,
                        "--", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "pool6: 2001:db8::/64 is not a unique local network" in p.stderr


@pytest.mark.net
def test_a_full_pool_heals_itself_and_keeps_ipv6(site6, tmp_path):
    """A one-slot pool held by a dead job: the next job takes the slot and its
    IPv6 works (reclaiming the last lease must not take the table, and with
    it the uplink's IPv6 forwarding, from under the new job)."""
    from starter.net.wiring import Wiring

    c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL.replace(".0/24", ".0/30"), pool6=POOL6,
                      uplink=(site6.uplink,), table="starter_t" + secrets.token_hex(3))
    w = Wiring()
    try:
        p = subprocess.Popen(["true"])
        p.wait()
        ns = nethosts.Netns()
        fd = ns.open_fd()
        try:
            dead = w.setup("dead", fd, c, p.pid)        # a starter that is gone
        finally:
            os.close(fd)
            ns.close()
        key = ipam.job_key("dead", c.table)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/sys/class/net/{key}"):
            assert time.monotonic() < deadline, "the kernel kept the dead job's veth"
            time.sleep(0.01)
        job = nethosts.Netns()
        try:
            lease = _setup(job, "new", c)
            assert (lease.address, lease.address6) == (dead["address"], dead["address6"])
            assert _sysctl(site6.uplink, "force_forwarding") == "1"
            s = site6.serve(site6.wan6, "send", 1000)
            assert client(job, "recv", site6.wan6, s.port) == (0, "received 1000")
            net.teardown("new", c)
        finally:
            job.close()
    finally:
        net.gc(c, set())
        w.close()
    assert _sysctl(site6.uplink, "force_forwarding") == "0"
    assert not os.path.exists(os.path.join(c.state_dir, "net"))


def _nat6_args(site6):
    return ["--net", "nat", "--pool", POOL, "--pool6", POOL6, "--lan", site6.lan_cidrs[0],
            "--lan", site6.lan_cidrs[1], "--uplink", site6.uplink]


@pytest.mark.net
def test_nat_job_is_isolated_over_ipv6_through_the_cli(starter, site6):
    """test_run_nat.test_nat_job_is_isolated over IPv6: the gateway (the
    host), the metadata address, loopback; while the WAN host is reached."""
    srv = site6.serve(site6.wan6, "send", 10)
    code = ("import socket, subprocess\n"
            "gw = subprocess.run(['ip', '-6', 'route', 'show', 'default'], capture_output=True, text=True)"
            ".stdout.split()[2]\n"
            "for host in (gw, 'fd00:ec2::254', '::1'):\n"
            "    try:\n"
            "        socket.create_connection((host, 22), timeout=1).close(); print('reached', host)\n"
            "    except OSError:\n"
            "        print('blocked', host)\n"
            f"s = socket.create_connection(('{site6.wan6}', {srv.port}), timeout=10)\n"
            "print('wan', len(s.recv(100)))\n")
    p = starter("run", *_nat6_args(site6), "--ipv6", "on", "--", "/usr/bin/python3", "-c", code, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "reached" not in p.stdout, p.stdout
    assert p.stdout.count("blocked") == 3 and "wan 10" in p.stdout, p.stdout


@pytest.mark.net
def test_kill9_of_a_dual_stack_job_then_gc_leaves_the_node_as_before(starter, site6, state_dir):
    def node():
        veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        state = sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else []
        # (only our own veths: other runs on the node make and remove theirs)
        return sorted(l.split(": ")[1].split("@")[0] for l in veths.splitlines() if ": st6" in l), \
            tables, state, _sysctl(site6.uplink, "force_forwarding")

    before = node()
    srv = site6.serve(site6.wan6, "send", 1 << 30)          # a flow still open when the job dies
    proc = subprocess.Popen([STARTER, "run", "--id", "nat6crash", *_nat6_args(site6), "--", "/usr/bin/python3",
                             "-c", f"import socket, time; s = socket.create_connection(('{site6.wan6}', "
                             f"{srv.port})); s.recv(10); time.sleep(300)"])
    deadline = time.monotonic() + 30
    st = {}
    while time.monotonic() < deadline and not (st.get("state") == "running" and _flows(st["address6"])):
        try:
            with open(os.path.join(state_dir, "nat6crash.json")) as f:
                st = json.load(f)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert st.get("state") == "running" and st.get("address6"), st
    assert _flows(st["address6"])
    assert _sysctl(site6.uplink, "force_forwarding") == "1"
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{st['pid']}") and time.monotonic() < deadline:
        time.sleep(0.01)
    out = starter("gc", check=0).stdout
    assert "nat6crash" in out
    assert _flows(st["address6"]) == []
    assert node() == before, out
    assert not os.path.exists(f"/sys/class/net/{st['host_ifname']}")


@pytest.mark.net
def test_two_dual_stack_uplinks_each_destination_leaves_by_its_route(site6, tmp_path):
    """As test_uplinks' two-uplink case, over IPv6: each site's server sees
    the job masqueraded (NAT66) to that site's uplink address, and each
    uplink's node-wide counters count what went its way."""
    with contextlib.ExitStack() as stack:
        other = nethosts.Site6(stack)
        sites = (site6, other)
        c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, pool6=POOL6, lan=site6.lan_cidrs,
                          uplink=(site6.uplink, other.uplink), table="starter_t" + secrets.token_hex(3))
        job = nethosts.Netns()
        try:
            _setup(job, "two6", c)
            sizes = (300_000, 100_000)
            wire = 0    # the payload plus what the senders retransmitted
            for s, n in zip(sites, sizes):
                srv = s.serve(s.wan6, "send", n)
                assert client(job, "recv", s.wan6, srv.port) == (0, f"received {n}")
                assert srv.stdout.readline().split()[1] == s.addr6
                wire += n + nethosts.retransmitted(srv.stdout.read())
            per_uplink = nft.read_uplink_counters(c.table, c.uplink)
            final = net.teardown("two6", c)
        finally:
            job.close()
            net.gc(c, set())
        a, b = (per_uplink[s.uplink]["in"]["bytes"] for s in sites)
        assert a >= sizes[0] and sizes[1] <= b < sizes[0], per_uplink
        assert abs(_payload(final["ipv6"]["wan_in"], HDR6) - wire) <= 0.01 * sum(sizes), final
        for s in sites:
            assert _sysctl(s.uplink, "force_forwarding") == "0"


NET_STEPS = ("net-lease", "net-veth", "net-nft", "net-setup", "running", "teardown-net")


@pytest.mark.net
@pytest.mark.parametrize("how", ["kill", "fail"])
@pytest.mark.parametrize("step", NET_STEPS)
def test_a_dual_stack_job_cut_at_every_network_step_leaves_nothing(site6, state_dir, step, how):
    """test_faults for a job with IPv6: the starter killed (then gc) or the
    step failing (fail closed at once) anywhere in the network's life: no
    veth, no counters, no lease, and the uplink's IPv6 forwarding back to 0."""
    if how == "fail" and step == "running":
        pytest.skip("a failure after the job runs is the teardown tests' case (test_faults)")
    job_id = f"f6-{step}-{how}"
    env = dict(os.environ, STARTER_FAULT=step + (":fail" if how == "fail" else ""), STARTER_STATE_DIR=state_dir)
    p = subprocess.run([STARTER, "run", "--id", job_id, "--user", "nobody", *_nat6_args(site6), "--ipv6", "on",
                        "--", "true"], env=env, capture_output=True, text=True, timeout=120)
    if how == "kill":
        assert p.returncode == -9, (p.returncode, p.stderr)
    elif step == "teardown-net":   # the job ran: its code, and the step left for gc
        assert p.returncode == 0 and "teardown net failed" in p.stderr, p.stderr
    else:                          # fail closed: the job never ran
        assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    g = subprocess.run([STARTER, "gc", "--state-dir", state_dir], capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, (g.stdout, g.stderr)
    key = ipam.job_key(job_id)
    assert not os.path.exists(f"/sys/class/net/{key}")
    assert key not in subprocess.run(["nft", "list", "table", "inet", "starter"], capture_output=True,
                                     text=True).stdout
    assert not os.path.exists(os.path.join(state_dir, "net")), os.listdir(os.path.join(state_dir, "net"))
    assert _sysctl(site6.uplink, "force_forwarding") == "0"
