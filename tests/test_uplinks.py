"""Several uplinks, conntrack cleanup at teardown, lowest-free allocation and
a pool that heals itself (issue 14), against test sites in namespaces made
here.  Every address of the sites is in 198.19.0.0/16 (inside the
benchmarking range 198.18.0.0/15, apart from tests/nethosts.py's /24s):

    host  stu0<tag> 198.19.T.1/30 ---- 198.19.T.2/30 up0   site 0 ns
                                         198.19.T.138/32 on lo: its server
    host  stu1<tag> 198.19.T.5/30 ---- 198.19.T.6/30 up0   site 1 ns
                                         198.19.T.154/32 on lo: its server

The host routes only 198.19.T.128/28 via site 0 and 198.19.T.144/28 via
site 1; the routes go with the uplinks.  Jobs' namespaces are
nethosts.Netns; the conntrack tool is used only to check."""

import contextlib
import os
import secrets
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import STARTER, running_netd  # noqa: E402
from starter import net  # noqa: E402
from starter.errors import NetworkError  # noqa: E402
from starter.net import conntrack, ipam, nft, nftrules  # noqa: E402

POOL = f"10.{216 + secrets.randbelow(32)}.{secrets.randbelow(256)}.0/24"

MANY_SERVER = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port)); s.listen(512)
print("ready", flush=True)
conns = []
while len(conns) < n:
    c, peer = s.accept(); conns.append(c)
print("accepted", len(conns), flush=True)
sys.stdin.readline()
for c in conns:
    c.close()
print("closed", flush=True)
"""

MANY_CLIENT = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = [socket.create_connection((host, port), timeout=10) for _ in range(n)]
print("open", len(socks), flush=True)
for s in socks:
    s.settimeout(60)
    assert s.recv(1) == b""          # the server closes: EOF
print("eof", flush=True)
"""


class Uplinks:
    def __init__(self, stack):
        t = secrets.randbelow(256)
        tag = secrets.token_hex(3)
        self.names, self.servers, self.addrs, self.cidrs, self.ns = [], [], [], [], []
        for i in (0, 1):
            name = f"stu{i}{tag}"
            host, peer = f"198.19.{t}.{4 * i + 1}", f"198.19.{t}.{4 * i + 2}"
            cidr, server = f"198.19.{t}.{128 + 16 * i}/28", f"198.19.{t}.{128 + 16 * i + 10}"
            ns = nethosts.Netns()
            stack.callback(ns.close)
            nethosts.run("ip", "link", "add", name, "type", "veth", "peer", "name", "up0", "netns", str(ns.pid))
            stack.callback(nethosts.run, "ip", "link", "del", name, check=False)
            nethosts.run("ip", "addr", "add", f"{host}/30", "dev", name)
            nethosts.run("ip", "link", "set", name, "up")
            nethosts.run("ip", "route", "add", cidr, "via", peer, "dev", name)
            stack.callback(nethosts.run, "ip", "route", "del", cidr, "via", peer, check=False)
            ns.ip("addr", "add", f"{peer}/30", "dev", "up0")
            ns.ip("link", "set", "up0", "up")
            ns.ip("link", "set", "lo", "up")
            ns.ip("addr", "add", f"{server}/32", "dev", "lo")
            self.names.append(name)
            self.addrs.append(host)
            self.cidrs.append(cidr)
            self.servers.append(server)
            self.ns.append(ns)
        self._stack = stack
        self._port = 20000 + secrets.randbelow(20000)

    def port(self):
        self._port += 1
        return self._port

    def serve(self, i, mode, n):
        srv = nethosts.Server(self.ns[i], mode, self.port(), n)
        self._stack.callback(srv.close)
        return srv

    def serve_many(self, i, n):
        port = self.port()
        proc = subprocess.Popen(self.ns[i].argv(nethosts.PY, "-c", MANY_SERVER, str(port), str(n)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        return proc, port


@pytest.fixture
def uplinks():
    with contextlib.ExitStack() as stack:
        yield Uplinks(stack)


@pytest.fixture
def cfg(tmp_path, uplinks):
    # site 0 is the "cluster network" (LAN), site 1 the public side (WAN)
    c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, lan=(uplinks.cidrs[0],),
                      uplink=tuple(uplinks.names), table="starter_t" + secrets.token_hex(3))
    yield c
    net.gc(c, set())


_setup = nethosts.net_setup


def _flows(address):
    """The host's conntrack entries with this address as source or
    destination (the conntrack tool, for checking only)."""
    out = []
    for flag in ("-s", "-d"):
        p = subprocess.run(["conntrack", "-L", flag, address], capture_output=True, text=True)
        out += [l for l in p.stdout.splitlines() if l.strip()]
    return out


def _payload(c):
    return c["bytes"] - 52 * c["packets"]


@pytest.mark.net
def test_two_uplinks_each_destination_leaves_by_its_route(uplinks, cfg):
    job = nethosts.Netns()
    try:
        _setup(job, "two", cfg)
        N, M = 1_000_000, 600_000
        wire = []   # the payload plus what the sender retransmitted
        for i, n in ((0, N), (1, M)):
            srv = uplinks.serve(i, "send", n)
            assert nethosts.client(job, "recv", uplinks.servers[i], srv.port) == (0, f"received {n}")
            out, _ = srv.result()
            # masqueraded to the address of the uplink the host's routing chose
            assert f"peer {uplinks.addrs[i]}" in out, out
            wire.append(n + nethosts.retransmitted(out))
        per_uplink = nft.read_uplink_counters(cfg.table, cfg.uplink)
        from starter.observe import metrics

        text = metrics.text(cfg.state_dir)    # the same counters, for Prometheus
        for u in uplinks.names:
            line = f'starter_uplink_network_bytes_total{{uplink="{u}",direction="in"}} {per_uplink[u]["in"]["bytes"]}'
            assert line in text.splitlines(), text
        final = net.teardown("two", cfg)
    finally:
        job.close()
    # the job's own split is by address: site 0 is LAN, site 1 WAN
    assert abs(_payload(final["lan_in"]) - wire[0]) <= 0.02 * N, final
    assert abs(_payload(final["wan_in"]) - wire[1]) <= 0.02 * M, final
    # node-wide, per uplink: what went out of and came back through each
    a, b = (per_uplink[u] for u in uplinks.names)
    assert a["in"]["bytes"] >= N and M <= b["in"]["bytes"] < N, per_uplink
    assert a["out"]["packets"] > 0 and b["out"]["packets"] > 0, per_uplink
    assert a["in"]["bytes"] == final["lan_in"]["bytes"] and b["in"]["bytes"] == final["wan_in"]["bytes"]
    assert cfg.table not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


@pytest.mark.net
def test_a_missing_uplink_among_several_is_a_clean_error(uplinks, tmp_path):
    bad = net.NetConfig(state_dir=str(tmp_path / "s"), pool=POOL, uplink=(uplinks.names[0], "nosuchif9"),
                        table="starter_t" + secrets.token_hex(3))
    job = nethosts.Netns()
    try:
        with pytest.raises(NetworkError, match="uplink: interface 'nosuchif9' does not exist"):
            _setup(job, "bad", bad)
    finally:
        job.close()
    assert not os.path.exists(os.path.join(bad.state_dir, "net"))
    with open(f"/proc/sys/net/ipv4/conf/{uplinks.names[0]}/forwarding") as f:
        assert f.read().strip() == "0"


@pytest.mark.net
def test_two_uplinks_through_the_cli(uplinks, tmp_path):
    """`--uplink` twice: each server sees the job masqueraded to its own uplink."""
    srv0, srv1 = uplinks.serve(0, "send", 100_000), uplinks.serve(1, "send", 50_000)
    (tmp_path / "client.py").write_text(nethosts.CLIENT)
    tmp_path.chmod(0o755)
    script = (f"/usr/bin/python3 /srv/client.py recv {uplinks.servers[0]} {srv0.port} 0 '' 20; "
              f"/usr/bin/python3 /srv/client.py recv {uplinks.servers[1]} {srv1.port} 0 '' 20")
    report = tmp_path / "r.json"
    p = subprocess.run([STARTER, "run", "--user", "starter-job", "--net", "nat", "--pool", POOL,
                        "--lan", uplinks.cidrs[0], "--uplink", uplinks.names[0], "--uplink", uplinks.names[1],
                        "--report", str(report), "--ro-bind", f"{tmp_path}:/srv", "--", "sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["received 100000", "received 50000"], p.stdout
    assert f"peer {uplinks.addrs[0]}" in srv0.result()[0]
    assert f"peer {uplinks.addrs[1]}" in srv1.result()[0]
    import json

    r = json.loads(report.read_text())
    assert "network" in r, (r, p.stderr)
    r = r["network"]
    assert r["lan_in"]["bytes"] >= 100_000 and 50_000 <= r["wan_in"]["bytes"] < 100_000, r


@pytest.fixture(params=["in-process", "netd"])
def netmode(request, cfg):
    """netd tears down on its worker thread: net.gc (which waits for queued
    teardowns) is the point after which the job's flows must be gone."""
    if request.param == "in-process":
        yield None
        return
    with running_netd(cfg.state_dir) as proc:
        yield proc


def _torn_down(job_id, cfg, live=()):
    net.teardown(job_id, cfg)
    net.gc(cfg, set(live))      # with netd: waits until its worker is done


@pytest.mark.net
def test_teardown_forgets_the_jobs_flows_and_the_address_is_reused(uplinks, cfg, netmode, monkeypatch):
    # A host flow with an address of the site: teardown must leave it alone.
    other = uplinks.servers[1]
    subprocess.run(["conntrack", "-I", "-s", other, "-d", uplinks.servers[0], "-p", "udp", "--sport", "9",
                    "--dport", "9", "-t", "120"], check=True, capture_output=True)
    try:
        N = 100
        srv, port = uplinks.serve_many(1, N)
        job = nethosts.Netns()
        try:
            lease = _setup(job, "many", cfg)
            cli = job.popen(nethosts.PY, "-c", MANY_CLIENT, uplinks.servers[1], str(port), str(N))
            assert cli.stdout.readline().strip() == f"open {N}", cli.stderr.read()
            assert srv.stdout.readline().strip() == f"accepted {N}"
            flows = _flows(lease.address)
            assert len(flows) >= N
            # each carries the job's mark (conntrack -L prints it in decimal)
            assert all(f"mark={nftrules.job_mark(lease.address)} " in f for f in flows), flows[:3]
            srv.stdin.write("close\n")
            srv.stdin.flush()
            assert cli.stdout.readline().strip() == "eof", cli.stderr.read()
            assert cli.wait(30) == 0
        finally:
            job.close()
        assert len(_flows(lease.address)) >= N      # TIME_WAIT: they would linger for minutes
        # One flush by the job's mark (counted in-process; netd's worker
        # flushes in its own process).
        flushed = _count_flushes(monkeypatch)
        _torn_down("many", cfg)
        assert len(flushed) == (1 if netmode is None else 0)
        assert _flows(lease.address) == []
        assert len(_flows(other)) == 1               # not the job's: untouched
        # the next job gets the same address at once, and its connections work
        job = nethosts.Netns()
        try:
            again = _setup(job, "next", cfg)
            assert again.address == lease.address
            s = uplinks.serve(1, "send", 10_000)
            assert nethosts.client(job, "recv", uplinks.servers[1], s.port) == (0, "received 10000")
            _torn_down("next", cfg)
        finally:
            job.close()
        assert _flows(lease.address) == []
    finally:
        subprocess.run(["conntrack", "-D", "-s", other, "-d", uplinks.servers[0], "-p", "udp"],
                       capture_output=True)


def _count_flushes(monkeypatch):
    """[each flush request conntrack.forget sends] (in this process)."""
    flushed, real = [], conntrack._flush
    monkeypatch.setattr(conntrack, "_flush", lambda s, req, seq: (flushed.append(req), real(s, req, seq)))
    return flushed


@pytest.mark.net
def test_a_sites_own_marks_are_kept_and_the_flows_forgotten_by_address(uplinks, cfg, monkeypatch):
    """A site's rule that marks a job's connections before the table does:
    its mark stays (the table counts it in foreign_marks), and teardown,
    no longer trusting the marks, finds the job's entries by address."""
    site = "starter_tsite" + secrets.token_hex(3)     # a table of the project's own name
    job = nethosts.Netns()
    try:
        lease = _setup(job, "marked", cfg)
        rules = (f"table inet {site} {{\n chain site_forward {{\n type filter hook forward priority -150; policy accept;\n"
                 f' iifname "{lease.host_ifname}" ct mark set 7\n }}\n}}\n')
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
        try:
            s = uplinks.serve(1, "send", 10_000)
            assert nethosts.client(job, "recv", uplinks.servers[1], s.port) == (0, "received 10000")
            flows = _flows(lease.address)
            assert flows and all(" mark=7 " in f for f in flows), flows
            assert nft.foreign_marks(cfg.table) >= 1
            flushed = _count_flushes(monkeypatch)
            _torn_down("marked", cfg)
            assert _flows(lease.address) == [] and flushed == []
        finally:
            subprocess.run(["nft", "delete", "table", "inet", site], capture_output=True)
    finally:
        job.close()


@pytest.mark.net
@pytest.mark.parametrize("walk", ["one walk", "filtered per address", "by mark"])
def test_conntrack_forget_takes_exactly_the_addresses_given(monkeypatch, walk):
    """The three ways of finding a job's entries (conntrack.py: one flush
    per job by its mark; where its marks are not trusted, one unfiltered
    walk while the table is small, else kernel-filtered dumps per address
    and direction), on entries made with the conntrack tool (no
    traffic, each job entry with the job's mark, the other's with its own):
    the given addresses' entries go, as source or as destination, in both
    families; another address's stay."""
    t = secrets.randbelow(200) + 20
    job4, job6, other = f"10.251.{t}.2", f"fd70:7639:1864::{t:x}:2", f"10.251.{t}.3"
    mark = str(nftrules.job_mark(job4))
    made = [("-s", job4, "-d", "192.0.2.1", "-p", "udp", "--sport", "9", "--dport", "9", "-m", mark),
            ("-s", "192.0.2.1", "-d", job4, "-p", "udp", "--sport", "10", "--dport", "11", "-m", mark),
            ("-s", job6, "-d", "2001:db8::1", "-p", "udp", "--sport", "9", "--dport", "9", "-m", mark),
            ("-s", other, "-d", "192.0.2.1", "-p", "udp", "--sport", "9", "--dport", "9",
             "-m", str(nftrules.job_mark(other)))]
    monkeypatch.setattr(conntrack, "SMALL_TABLE", 1 << 30 if walk == "one walk" else -1)
    marks = {int(mark): [job4, job6]} if walk == "by mark" else None
    try:
        for m in made:
            subprocess.run(["conntrack", "-I", *m, "-t", "120"], check=True, capture_output=True)
        assert len(_flows(job4)) == 2 and len(_flows(job6)) == 1
        # (a flush does not say how many it took)
        assert conntrack.forget([job4, job6], marks) == (0 if walk == "by mark" else 3)
        assert _flows(job4) == [] and _flows(job6) == []
        assert len(_flows(other)) == 1
    finally:
        for m in made:
            subprocess.run(["conntrack", "-D", *m], capture_output=True)


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _wait_gone(ifnames, timeout=30.0):
    """The kernel removes a dead namespace's veths in a worker: poll, with a
    deadline (no event reaches us)."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/sys/class/net/{n}") for n in ifnames):
        assert time.monotonic() < deadline, f"the kernel kept {ifnames} after their namespaces died"
        time.sleep(0.01)


@pytest.mark.net
def test_a_full_pool_heals_itself(uplinks, tmp_path):
    """Every slot held by a dead job's lease: the next job still starts (one
    lease reclaimed), and with every slot held by a live job it is refused."""
    from starter.net.wiring import Wiring

    c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL.replace(".0/24", ".0/29"),
                      uplink=tuple(uplinks.names), table="starter_t" + secrets.token_hex(3))
    w = Wiring()
    try:
        dead = _dead_pid()
        for job_id in ("dead1", "dead2"):          # the pool's two slots
            ns = nethosts.Netns()
            fd = ns.open_fd()
            try:
                w.setup(job_id, fd, c, dead)        # a starter that is gone
            finally:
                os.close(fd)
                ns.close()                          # its namespace died with it: so did the veth
        # The kernel destroys a dead namespace (and with it the veth) in a
        # worker, a while after its last process is gone; a veth still there
        # means "the job may still run" to the bounded reclaim, which then
        # rightly leaves that lease to `starter gc`.  Wait for the kernel.
        _wait_gone([ipam.job_key(j, c.table) for j in ("dead1", "dead2")])
        store = ipam.LeaseStore(c.state_dir)
        assert store.count() == 2
        job = nethosts.Netns()
        try:
            lease = _setup(job, "new", c)           # the facade, like a starter
            assert lease.address in (POOL.replace(".0/24", ".2"), POOL.replace(".0/24", ".6"))
            assert store.count() == 2 and {x["job_id"] for x in store.all()} & {"dead1", "dead2"} != set()
            s = uplinks.serve(1, "send", 1000)
            assert nethosts.client(job, "recv", uplinks.servers[1], s.port) == (0, "received 1000")
            # now one slot is live ("new", owned by us), one dead: fill it
            # with a live job, and a third is refused, cleanly
            job2 = nethosts.Netns()
            try:
                _setup(job2, "live2", c)
                job3 = nethosts.Netns()
                try:
                    with pytest.raises(NetworkError, match="exhausted"):
                        _setup(job3, "third", c)
                finally:
                    job3.close()
                net.teardown("live2", c)
            finally:
                job2.close()
            net.teardown("new", c)
        finally:
            job.close()
    finally:
        net.gc(c, set())
        w.close()
    assert not os.path.exists(os.path.join(c.state_dir, "net"))


@pytest.mark.net
def test_jobs_agree_on_the_set_of_uplinks_not_their_order(uplinks, cfg):
    a, b, c = nethosts.Netns(), nethosts.Netns(), nethosts.Netns()
    try:
        _setup(a, "a", cfg)
        swapped = net.NetConfig(**dict(cfg.as_dict(), uplink=tuple(reversed(cfg.uplink))))
        _setup(b, "b", swapped)                     # the same node configuration
        one = net.NetConfig(**dict(cfg.as_dict(), uplink=cfg.uplink[:1]))
        with pytest.raises(NetworkError, match="network configuration differs"):
            _setup(c, "c", one)
        net.teardown("a", cfg)
        net.teardown("b", swapped)
    finally:
        for ns in (a, b, c):
            ns.close()
