"""Job networks against the real kernel (veths, nftables, namespaces) and a
private test site (tests/nethosts.py).  Their pure logic is in
tests/unit/test_net_pure.py and test_nft_render.py."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import SLOWDOWN  # noqa: E402
from starter import net  # noqa: E402
from starter.errors import NetworkError  # noqa: E402
from starter.net import ipam, nft, wiring  # noqa: E402

PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bin", "python")
# A pool of its own per test run: two runs on one node must not collide.
POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"


# ============================================================ real kernel

@pytest.fixture
def site():
    with nethosts.site() as s:
        yield s


@pytest.fixture
def cfg(tmp_path, site):
    c = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, lan=(site.lan_cidr,),
                      uplink=site.uplink, table="starter_t" + secrets.token_hex(3))
    yield c
    # whatever the test did: nothing of ours may survive it
    net.gc(c, set())


def _tables():
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout


def _our_veths():
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    return [l.split(": ")[1].split("@")[0] for l in out.splitlines() if ": stj" in l]


_setup = nethosts.net_setup


def _payload(c):
    """Bytes counted minus IP+TCP headers (20 + 32 with timestamps) per packet."""
    return c["bytes"] - 52 * c["packets"]


@pytest.mark.net
def test_lan_wan_accounting(site, cfg):
    job = site.job()
    lease = _setup(job, "acct", cfg)
    assert lease.host_ifname == ipam.job_key("acct", cfg.table) and lease.prefixlen == 30
    N, M, K_LAN, K_WAN = 3_000_000, 2_000_000, 1_500_000, 700_000
    # What crosses the wire: the payload plus what the sender retransmitted.
    srv = site.serve("lan", "send", N)
    assert nethosts.client(job, "recv", site.lan_addr, srv.port) == (0, f"received {N}")
    out, _ = srv.result()
    assert f"peer {site.uplink_addr}" in out  # masqueraded to the uplink's address
    wire = {"lan_in": N + nethosts.retransmitted(out)}
    srv = site.serve("wan", "send", M)
    assert nethosts.client(job, "recv", site.wan_addr, srv.port) == (0, f"received {M}")
    wire["wan_in"] = M + nethosts.retransmitted(srv.result()[0])
    srv = site.serve("lan", "recv", 0)
    rc, out, again = nethosts.client(job, "send", site.lan_addr, srv.port, K_LAN, retrans=True)
    assert (rc, out) == (0, f"sent {K_LAN}")
    wire["lan_out"] = K_LAN + again
    assert f"received {K_LAN}" in srv.result()[0]
    srv = site.serve("wan", "recv", 0)
    rc, out, again = nethosts.client(job, "send", site.wan_addr, srv.port, K_WAN, retrans=True)
    assert (rc, out) == (0, f"sent {K_WAN}")
    wire["wan_out"] = K_WAN + again

    live = net.counters("acct", cfg)
    final = net.teardown("acct", cfg)
    assert final == live  # the job is idle: the final read equals the live one
    for bucket, expect in wire.items():
        got = _payload(final[bucket])
        assert abs(got - expect) <= 0.02 * expect, (bucket, final)
        assert final[bucket]["bytes"] >= expect
    assert final["dropped"]["packets"] == 0
    # gone: rules, counters, lease, veth, and (last job) the table
    assert net.teardown("acct", cfg) is None
    assert net.counters("acct", cfg) is None
    assert lease.host_ifname not in _our_veths()
    assert cfg.table not in _tables()
    assert ipam.LeaseStore(cfg.state_dir).count() == 0
    assert os.listdir(cfg.state_dir) == []  # net/ goes with the last job
    # the uplink's forwarding flag is back to what it was
    with open(f"/proc/sys/net/ipv4/conf/{site.uplink}/forwarding") as f:
        assert f.read().strip() == "0"


def _dropped(job_id, cfg):
    return net.counters(job_id, cfg)["dropped"]["packets"]


@pytest.mark.net
def test_isolation(site, tmp_path):
    port = site.port()
    cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, lan=(site.lan_cidr,),
                        uplink=site.uplink, table="starter_t" + secrets.token_hex(3),
                        allow_host_ports=(("tcp", port),))
    a, b = site.job(), site.job()
    try:
        la = _setup(a, "iso-a", cfg)
        lb = _setup(b, "iso-b", cfg)
        listeners = []

        def listen(addr, p, kind=socket.SOCK_STREAM):
            s = socket.socket(socket.AF_INET, kind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, p))
            if kind == socket.SOCK_STREAM:
                s.listen(4)
            s.setblocking(False)
            listeners.append(s)
            return s

        def nothing_arrived(s):
            try:
                s.accept() if s.type == socket.SOCK_STREAM else s.recv(100)
            except BlockingIOError:
                return True
            return False

        # The allow-listed host port on the gateway is open (the site proxy case)...
        proxy = listen(la.gateway, port)
        rc, out = nethosts.client(a, "connect", la.gateway, port, timeout=3)
        assert rc == 0, out
        proxy.setblocking(True)
        proxy.settimeout(5)
        proxy.accept()[0].close()
        # ...every other host port is not, on any host address.
        d0 = _dropped("iso-a", cfg)
        for addr in (la.gateway, site.uplink_addr):
            s = listen(addr, port + 1)
            rc, out = nethosts.client(a, "connect", addr, port + 1, timeout=1)
            assert rc == 3 and "connect-failed" in out
            assert nothing_arrived(s)
        d1 = _dropped("iso-a", cfg)
        assert d1 > d0

        # Another job: B listens, A cannot connect.
        srv = nethosts.Server(b, "recv", port + 2, 0)
        try:
            rc, out = nethosts.client(a, "connect", lb.address, port + 2, timeout=1)
            assert rc == 3
            assert srv.proc.poll() is None  # still waiting: never got a connection
        finally:
            srv.close()
        d2 = _dropped("iso-a", cfg)
        assert d2 > d1

        # Link-local / cloud metadata.
        rc, out = nethosts.client(a, "connect", "169.254.169.254", 80, timeout=1)
        assert rc == 3
        d3 = _dropped("iso-a", cfg)
        assert d3 > d2

        # 127.0.0.1 via the gateway, even where the host would route it
        # (route_localnet on the job's veth; a per-interface flag that dies
        # with the veth).
        with open(f"/proc/sys/net/ipv4/conf/{la.host_ifname}/route_localnet", "w") as f:
            f.write("1")
        lo = listen("127.0.0.1", port + 3, socket.SOCK_DGRAM)
        with open(f"/sys/class/net/{la.host_ifname}/address") as f:
            gw_mac = f.read().strip()
        nethosts.send_raw_udp(a, "eth0", gw_mac, la.address, "127.0.0.1", port + 3)
        # The drop is counted when the packet meets the rule: once it is, the
        # packet is gone and cannot arrive later.  The counter is polled, with
        # a deadline (the kernel announces no counter change).
        deadline = time.monotonic() + 10 * SLOWDOWN
        while _dropped("iso-a", cfg) == d3 and time.monotonic() < deadline:
            time.sleep(0.01)
        d4 = _dropped("iso-a", cfg)
        assert d4 == d3 + 1
        assert nothing_arrived(lo)

        # A spoofed source address (the job is root in its namespace).
        spoof = POOL.replace(".0.0/16", ".99.99")
        a.ip("addr", "add", f"{spoof}/32", "dev", "eth0")
        srv = site.serve("lan", "recv", 0)
        rc, out = nethosts.client(a, "connect", site.lan_addr, srv.port, src=spoof, timeout=1)
        assert rc == 3
        assert srv.proc.poll() is None
        d5 = _dropped("iso-a", cfg)
        assert d5 > d4
        # ...while its real address still works, and none of this was counted as traffic
        rc, out = nethosts.client(a, "send", site.lan_addr, srv.port, 10)
        assert rc == 0, out
        c = net.counters("iso-a", cfg)
        assert c["wan_out"]["packets"] == 0
        # B saw none of A's drops
        assert _dropped("iso-b", cfg) == 0
        for s in listeners:
            s.close()
    finally:
        net.teardown("iso-a", cfg)
        net.teardown("iso-b", cfg)
    assert cfg.table not in _tables()


@pytest.mark.net
@pytest.mark.slow
def test_fifty_jobs(site, cfg):
    jobs = [site.job() for _ in range(50)]
    leases = [_setup(j, f"many-{i}", cfg) for i, j in enumerate(jobs)]
    assert len({l.address for l in leases}) == 50
    assert len({l.host_ifname for l in leases}) == 50
    assert len({l.gateway for l in leases}) == 50
    assert set(_our_veths()) >= {l.host_ifname for l in leases}
    out = subprocess.run(["nft", "-j", "list", "set", "inet", cfg.table, "job_ifs"],
                         capture_output=True, text=True, check=True).stdout
    assert len(json.loads(out)["nftables"][1]["set"]["elem"]) == 50
    # one of them really works
    srv = site.serve("wan", "send", 1000)
    assert nethosts.client(jobs[37], "recv", site.wan_addr, srv.port) == (0, "received 1000")
    for i in range(50):
        assert net.teardown(f"many-{i}", cfg) is not None
    assert not set(_our_veths()) & {l.host_ifname for l in leases}
    assert cfg.table not in _tables()
    assert os.listdir(cfg.state_dir) == []


_UDP_COUNT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
s.settimeout(3)
n = 0
try:
    while True:
        s.recv(64)
        n += 1
except socket.timeout:
    pass
print(n, flush=True)
"""

_UDP_FLOWS = """
import socket, sys
for i in range(int(sys.argv[3])):      # each from a port of its own: a flow each
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2])))
    s.close()
"""


@pytest.mark.net
def test_a_job_cannot_hold_more_than_its_share_of_the_conntrack_table(site, cfg, monkeypatch):
    monkeypatch.setenv("STARTER_NET_MAX_FLOWS", "4")      # read when the table is made
    job = site.job()
    _setup(job, "flows", cfg)
    job_key = ipam.job_key("flows", cfg.table)
    other = site.job()                 # keeps the table after "flows" is gone
    _setup(other, "flows-other", cfg)
    port = site.port()
    rx = site.wan.popen(nethosts.PY, "-c", _UDP_COUNT, str(port))
    try:
        assert rx.stdout.readline().strip() == "ready"
        before = _dropped("flows", cfg)
        r = job.python(_UDP_FLOWS, site.wan_addr, port, 10)
        assert r.returncode == 0, r.stderr
        received = int(rx.stdout.readline())
    finally:
        rx.kill()
        rx.wait()
        rx.stdout.close()
        rx.stderr.close()
    assert received == 4, received
    assert _dropped("flows", cfg) - before >= 6
    listed = subprocess.run(["nft", "list", "set", "inet", cfg.table, "job_flows"], capture_output=True,
                            text=True, check=True).stdout
    assert job_key in listed, listed
    net.teardown("flows", cfg)
    listed = subprocess.run(["nft", "list", "set", "inet", cfg.table, "job_flows"], capture_output=True,
                            text=True).stdout
    assert listed and job_key not in listed, listed      # removed with the job
    net.teardown("flows-other", cfg)


@pytest.mark.net
def test_a_quiet_jobs_teardown_refuses_no_transaction(site, cfg, monkeypatch):
    """A job that made no connection has no element in job_flows: its
    teardown must not try to delete one.  A refused (aborted) nf_tables
    transaction waits for an RCU grace period, ~10 ms here, and this one
    cost every NAT job's end that much for two days."""
    refused = []
    apply = nft.Nft.apply

    def watched(self, table, verb, changes, what="transaction"):
        try:
            return apply(self, table, verb, changes, what)
        except nft.NftError as e:
            refused.append((what, str(e)))
            raise

    monkeypatch.setattr(nft.Nft, "apply", watched)
    keep, quiet = site.job(), site.job()
    _setup(keep, "quiet-keep", cfg)             # the table stays: only the job's own objects go
    _setup(quiet, "quiet", cfg)
    quiet.close()
    assert net.teardown("quiet", cfg) is not None
    assert not refused, refused
    net.teardown("quiet-keep", cfg)
    assert not refused, refused


@pytest.mark.net
def test_a_veth_that_outlives_its_job_is_down_before_its_rules_go(site, cfg, monkeypatch):
    # The job's namespace is kept alive (here by the site's holder process;
    # in an attack by a socket of it passed to another process): its veth
    # stays until deleted, and must pass nothing once its rules are removed.
    job = site.job()
    lease = _setup(job, "outlive", cfg)
    flags = f"/sys/class/net/{lease.host_ifname}/flags"
    with open(flags) as f:
        assert int(f.read(), 16) & 1, "the veth should be up while the job runs"
    seen = []
    w = net._local()                # what net.teardown uses without netd
    real_apply = w.nft.apply

    def apply(table, verb, changes, what="transaction"):
        if verb == "delete":
            with open(flags) as f:
                seen.append(int(f.read(), 16) & 1)
        return real_apply(table, verb, changes, what)

    monkeypatch.setattr(w.nft, "apply", apply)
    assert net.teardown("outlive", cfg) is not None
    assert seen and not any(seen), "the job's rules were removed while its veth was still up"
    assert lease.host_ifname not in _our_veths()


@pytest.mark.net
def test_setup_failure_leaves_nothing(site, cfg, tmp_path):
    # Not a network namespace: the veth cannot be created there.
    bogus = os.open(str(tmp_path), os.O_RDONLY)
    try:
        with pytest.raises(NetworkError) as ei:
            net.setup("bad", bogus, cfg)
    finally:
        os.close(bogus)
    assert "veth" in str(ei.value)
    assert not _our_veths()
    assert cfg.table not in _tables()
    assert ipam.LeaseStore(cfg.state_dir).count() == 0


@pytest.mark.net
def test_without_libnftables_setup_fails_cleanly(site, cfg):
    """libnftables cannot be loaded (its module import fails, as it does when
    the shared library is missing): NetworkError, and no veth/lease/table."""
    job = site.job()
    code = f"""
import os, sys
sys.modules["starter._nft"] = None          # import of the binding now fails
from starter import net
from starter.errors import NetworkError
cfg = net.NetConfig.from_dict({cfg.as_dict()!r})
fd = os.open("/proc/{job.pid}/ns/net", os.O_RDONLY)
try:
    net.setup("nonft", fd, cfg)
except NetworkError as e:
    print("NetworkError:", e)
    sys.exit(0)
sys.exit(1)
"""
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "libnftables could not be loaded" in r.stdout and "apt install" in r.stdout
    assert not _our_veths()
    assert cfg.table not in _tables()
    assert ipam.LeaseStore(cfg.state_dir).count() == 0
    # the job namespace got no interface either
    assert "eth0" not in job.ip("-o", "link").stdout


@pytest.mark.net
def test_pool_overlapping_a_host_address_is_refused(site, tmp_path):
    job = site.job()
    bad = net.NetConfig(state_dir=str(tmp_path / "state"), pool="10.76.0.0/16", uplink=site.uplink,
                        table="starter_t" + secrets.token_hex(3))
    with pytest.raises(NetworkError, match=f"pool: 10.76.0.0/16 overlaps {site.uplink_addr}/30 on {site.uplink}"):
        _setup(job, "overlap", bad)
    assert bad.table not in _tables() and not _our_veths()
    assert os.listdir(bad.state_dir) == []


@pytest.mark.net
def test_config_mismatch_is_refused(site, cfg):
    a, b = site.job(), site.job()
    _setup(a, "cfg-a", cfg)
    other = net.NetConfig(**dict(cfg.as_dict(), lan=("10.78.0.0/16",)))
    with pytest.raises(NetworkError, match="differs"):
        _setup(b, "cfg-b", other)
    assert ipam.LeaseStore(cfg.state_dir).count() == 1
    net.teardown("cfg-a", cfg)


@pytest.mark.net
def test_gc_reclaims_dead_jobs(site, cfg):
    jobs = [site.job() for _ in range(3)]
    leases = [_setup(j, f"gc-{i}", cfg) for i, j in enumerate(jobs)]
    jobs[0].close()  # its namespace dies, and the veth with it
    # The kernel removes the veth in a worker, after the namespace's last
    # process: poll for it, with a deadline (no event reaches us).
    deadline = time.monotonic() + 30 * SLOWDOWN
    while os.path.exists(f"/sys/class/net/{leases[0].host_ifname}"):
        assert time.monotonic() < deadline, "the kernel kept the dead job's veth"
        time.sleep(0.01)
    removed = net.gc(cfg, {"gc-1"})
    assert len([r for r in removed if r.startswith("job ")]) == 2
    assert net.counters("gc-1", cfg) is not None
    assert net.counters("gc-0", cfg) is None and net.counters("gc-2", cfg) is None
    assert set(_our_veths()) & {l.host_ifname for l in leases} == {leases[1].host_ifname}
    removed = net.gc(cfg, set())
    assert f"table inet {cfg.table}" in removed
    assert not _our_veths() and cfg.table not in _tables()
    assert net.gc(cfg, set()) == []


def _table_handle(table):
    out = subprocess.run(["nft", "-a", "list", "table", "inet", table], capture_output=True, text=True).stdout
    return out.split("# handle ", 1)[1].split()[0] if "# handle " in out else None


def _wired(w, job, job_id, cfg):
    fd = job.open_fd()
    try:
        return w.setup(job_id, fd, cfg, os.getpid())
    finally:
        os.close(fd)


@pytest.mark.net
def test_a_lingering_table_serves_the_next_job_then_expires(site, cfg):
    """netd's Wiring keeps the table after the last job (the next job does not
    pay for building it), rebuilds it for other settings, and removes it, with
    the uplink's forwarding flag, when it has been idle long enough."""
    fwd = f"/proc/sys/net/ipv4/conf/{site.uplink}/forwarding"
    before = open(fwd).read()
    w = wiring.Wiring(linger=60)
    try:
        job = site.job()
        _wired(w, job, "linger-0", cfg)
        handle = _table_handle(cfg.table)
        job.close()
        assert w.teardown("linger-0", cfg) is not None
        assert _table_handle(cfg.table) == handle and w.next_expiry() > 50     # kept, idle
        job = site.job()
        _wired(w, job, "linger-1", cfg)
        assert _table_handle(cfg.table) == handle and w.next_expiry() is None  # the same table serves it
        srv = site.serve("lan", "send", 10_000)
        assert nethosts.client(job, "recv", site.lan_addr, srv.port) == (0, "received 10000")
        job.close()
        w.teardown("linger-1", cfg)
        # Other settings while it idles: built anew, not refused.
        other = net.NetConfig(**{**cfg.as_dict(), "lan": ("192.0.2.0/24",)})
        job = site.job()
        _wired(w, job, "linger-2", other)
        assert _table_handle(cfg.table) not in (None, handle)
        job.close()
        w.teardown("linger-2", other)
        w.expire_idle(time.monotonic() + 30)
        assert cfg.table in _tables()                       # not yet
        w.expire_idle(time.monotonic() + 61)
        assert cfg.table not in _tables() and w.next_expiry() is None
        assert open(fwd).read() == before                   # the guard went back with it
    finally:
        w.close()


@pytest.mark.net
def test_a_pinned_table_is_made_ahead_and_kept(site, cfg):
    """netd pins the node policy's table (Wiring.pin): made before any job,
    kept however long the node idles, put back after a job with other
    settings, removed with the uplink's flag when netd stops."""
    fwd = f"/proc/sys/net/ipv4/conf/{site.uplink}/forwarding"
    before = open(fwd).read()
    w = wiring.Wiring(linger=60)
    try:
        w.pin(cfg)
        handle = _table_handle(cfg.table)
        assert handle is not None and w.next_expiry() is None          # made, and never expires
        job = site.job()
        _wired(w, job, "pin-0", cfg)
        assert _table_handle(cfg.table) == handle                       # the job used it
        job.close()
        w.teardown("pin-0", cfg)
        w.expire_idle(time.monotonic() + 10**6)
        assert _table_handle(cfg.table) == handle
        other = net.NetConfig(**{**cfg.as_dict(), "lan": ("192.0.2.0/24",)})
        job = site.job()
        _wired(w, job, "pin-1", other)                                  # other settings: rebuilt for them
        job.close()
        w.teardown("pin-1", other)
        w.expire_idle(time.monotonic() + 61)                            # that one expires as any other
        assert cfg.table not in _tables()
        job = site.job()
        _wired(w, job, "pin-2", cfg)                                    # the node's again: pinned again
        job.close()
        w.teardown("pin-2", cfg)
        w.expire_idle(time.monotonic() + 10**6)
        assert cfg.table in _tables()
    finally:
        w.close()
    assert cfg.table not in _tables() and open(fwd).read() == before


@pytest.mark.net
def test_netd_roundtrip(site, cfg, monkeypatch):
    sock = net.socket_path(cfg)
    code = f"from starter import net; net.serve(net.NetConfig(state_dir={cfg.state_dir!r}))"
    netd = subprocess.Popen([PY, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        # netd announces nothing: poll for its socket, with a deadline.
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.02)
        assert os.stat(sock).st_mode & 0o777 == 0o600
        # Everything must go through netd now, never the in-process path.
        monkeypatch.setattr(net, "_local", lambda: pytest.fail("in-process path used"))
        job = site.job()
        lease = _setup(job, "via-netd", cfg)
        rec = ipam.LeaseStore(cfg.state_dir).get_by_key(lease.host_ifname)
        assert rec["owner_pid"] == os.getpid()  # the starter owns the lease, not netd
        srv = site.serve("lan", "send", 100_000)
        assert nethosts.client(job, "recv", site.lan_addr, srv.port) == (0, "received 100000")
        assert net.counters("via-netd", cfg)["lan_in"]["bytes"] >= 100_000
        with pytest.raises(NetworkError, match="already holds"):
            _setup(job, "via-netd", cfg)  # errors travel back with their hint
        final = net.teardown("via-netd", cfg)
        assert final["lan_in"]["bytes"] >= 100_000
        assert net.teardown("via-netd", cfg) is None
        assert net.gc(cfg, set()) == []
        assert cfg.table in _tables()     # netd keeps it for the next job (not a leftover for gc)
    finally:
        netd.send_signal(signal.SIGTERM)
        netd.wait(timeout=10)
    assert netd.returncode == 0, netd.stderr.read()
    assert not os.path.exists(sock)
    assert cfg.table not in _tables()


def test_netd_refuses_a_peer_in_a_job_cgroup():
    """A process in netd's PID namespace but inside a job's cgroup (a job
    escaped into the host's namespace somehow) is still refused."""
    from starter import cgroups
    from starter.net import netd

    backend = cgroups.open_backend()
    cg = backend.create(f"netdpeer-{secrets.token_hex(3)}")
    proc = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        assert netd._why_refused(proc.pid, 0, pidfd) is None  # a plain host process may
        cg.add_pid(proc.pid)
        why = netd._why_refused(proc.pid, 0, pidfd)
        assert why is not None and "job cgroup" in why, why
        assert netd._why_refused(proc.pid, 1000, pidfd) == "netd serves root only"
        proc.kill()
        proc.wait()
        assert netd._why_refused(proc.pid, 0, pidfd) is not None  # gone: never "fine"
    finally:
        os.close(pidfd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cg.destroy()
