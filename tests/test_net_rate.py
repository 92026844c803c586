"""--net-rate: a NAT job's bandwidth caps, LAN and WAN, in and out, shaped by
the kernel (starter/net/shaping.py), measured with iperf3 against the
private test site of tests/nethosts.py.  Parsing and the node policy's
keys are checked in tests/unit/test_net_pure.py."""

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import STARTER, running_netd  # noqa: E402

POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"
SECONDS = 3
# iperf3 reports what TCP delivered; the shaper counts whole frames
# (1514 bytes for 1448 of payload): the goodput at a cap is ~0.956 of it.
GOODPUT = 1448 / 1514

pytestmark = [pytest.mark.net,
              pytest.mark.skipif(not shutil.which("iperf3"), reason="iperf3 is not installed (scripts/setup --test)")]


@pytest.fixture
def site():
    with nethosts.site() as s:
        yield s


@contextlib.contextmanager
def iperf_servers(site):
    """An iperf3 server in the LAN and in the WAN namespace -> {zone: port}."""
    procs, ports = [], {}
    try:
        for zone, ns in (("lan", site.lan), ("wan", site.wan)):
            ports[zone] = site.port()
            procs.append(subprocess.Popen(ns.argv("iperf3", "-s", "-p", str(ports[zone])),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.3)
        yield ports
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _script(site, ports, runs, out):
    """sh: iperf3 runs [(name, zone, reverse)] from the job, each's JSON to out/NAME.json."""
    addr = {"lan": site.lan_addr, "wan": site.wan_addr}
    return "; ".join(f"iperf3 -c {addr[z]} -p {ports[z]} -t {SECONDS} -J {'-R' if rev else ''} > {out}/{n}.json"
                     for n, z, rev in runs)


def _mbit(path):
    return json.loads(path.read_text())["end"]["sum_received"]["bits_per_second"] / 1e6


def _until_capped(caps, payload_share, run):
    """Measure each zone of caps (Mbit/s) with run(zones, out) -> what it
    measured {zone: Mbit/s}, in a fresh job each time.  Above a cap is a
    failure at once; below it, a loaded machine (the CPU, not the shaper,
    set the pace): that zone is measured again, in a new job, up to twice.
    payload_share: TCP's payload per frame the shaper counts."""
    got, todo = {}, list(caps)
    for _ in range(3):
        got.update(run(todo))
        for zone in todo:
            assert got[zone] <= caps[zone] * (payload_share + 0.1), (zone, got, caps)
        todo = [z for z in todo if got[z] < caps[z] * (payload_share - 0.1)]
        if not todo:
            break
    assert not todo, (got, caps)


def _fresh(tmp_path):
    """A directory every job may write its iperf3 results to."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    out.mkdir()
    out.chmod(0o777)
    return out


def _nat(site):
    return ["--net", "nat", "--pool", POOL, "--lan", site.lan_cidr, "--uplink", site.uplink]


@pytest.mark.parametrize("with_netd", [False, True], ids=["in-process", "netd"])
def test_each_zone_is_capped_on_its_own(starter, site, tmp_path, state_dir, with_netd):
    # Four different caps: a packet shaped in the wrong class shows.
    caps = {"lan_out": 60, "wan_out": 40, "lan_in": 80, "wan_in": 50}
    runs = {"lan_out": ("lan", False), "wan_out": ("wan", False), "lan_in": ("lan", True), "wan_in": ("wan", True)}
    arg = ",".join(f"{z.replace('_', '-')}={c}mbit" for z, c in caps.items())
    with contextlib.ExitStack() as stack:
        if with_netd:
            stack.enter_context(running_netd(state_dir))
        ports = stack.enter_context(iperf_servers(site))

        def run(zones):
            out = _fresh(tmp_path)
            report = out / "r.json"
            p = starter("run", *_nat(site), "--net-rate", arg, "--report", str(report), "--bind", str(out), "--",
                        "sh", "-c", _script(site, ports, [(z, *runs[z]) for z in zones], out), timeout=120)
            assert p.returncode == 0, (p.stdout, p.stderr)
            shaping = json.loads(report.read_text())["network"]["shaping"]
            assert set(shaping) == set(caps), shaping
            got = {}
            for zone in zones:
                got[zone] = _mbit(out / f"{zone}.json")
                # everything of that zone went through its class, and had to wait
                s = shaping[zone]
                assert s["rate_bits"] == caps[zone] * 10**6, s
                assert s["bytes"] >= got[zone] * 10**6 / 8 * SECONDS * 0.9 and s["overlimits"] > 0, (zone, s)
            return got

        _until_capped(caps, GOODPUT, run)


def test_an_uncapped_zone_and_an_uncapped_job_are_not_shaped(starter, site, tmp_path):
    """Only WAN out capped: LAN out passes at full speed; a job without caps
    beside the capped one gets no qdisc and runs at full speed too."""
    out = _fresh(tmp_path)
    with iperf_servers(site) as ports:
        capped = subprocess.Popen(
            [STARTER, "run", *_nat(site), "--net-rate", "wan-out=30mbit", "--bind", str(out), "--", "sh", "-c",
             _script(site, ports, [("capped_wan", "wan", False), ("capped_lan", "lan", False)], out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            p = starter("run", *_nat(site), "--bind", str(out), "--", "sh", "-c",
                        f"tc qdisc show dev eth0 > {out}/qdisc", timeout=60)
            assert p.returncode == 0, p.stderr
        finally:
            o, e = capped.communicate(timeout=120)
        assert capped.returncode == 0, (o, e)
    assert "htb" not in (out / "qdisc").read_text()
    assert 30 * 0.5 <= _mbit(out / "capped_wan.json") <= 30 * (GOODPUT + 0.1)     # (precision: the test above)
    # LAN out is uncapped: far above the WAN cap (a veth moves Gbit/s)
    assert _mbit(out / "capped_lan.json") > 10 * 30, _mbit(out / "capped_lan.json")


def test_the_job_cannot_lift_its_cap(starter, site, tmp_path):
    """The job's eth0 carries the shaper; the job has no CAP_NET_ADMIN over
    its network namespace, not even as root of its own user namespace."""
    p = starter("run", *_nat(site), "--net-rate", "out=10mbit", "--userns-root", "--", "sh", "-c",
                "tc qdisc del dev eth0 root; echo rc=$?; tc qdisc show dev eth0", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "rc=2" in p.stdout and "htb 1: root" in p.stdout, (p.stdout, p.stderr)


def test_net_rate_needs_nat(starter):
    p = starter("run", "--net-rate", "10mbit", "--", "true")
    assert p.returncode == 125 and "--net nat" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr


def test_metrics_carry_a_running_jobs_caps(starter, site, tmp_path):
    out = _fresh(tmp_path)
    with iperf_servers(site) as ports:
        job = subprocess.Popen(
            [STARTER, "run", "--id", "capped-m", *_nat(site), "--net-rate", "wan-out=20mbit", "--bind", str(out), "--",
             "sh", "-c", _script(site, ports, [("w", "wan", False)], out) + "; echo sent; read x"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert job.stdout.readline() == "sent\n"
            m = starter("metrics", check=0).stdout
        finally:
            o, e = job.communicate("\n", timeout=60)
    assert job.returncode == 0, e
    rows = {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in m.splitlines()
            if 'job_id="capped-m"' in l and "starter_job_network_" in l}
    lab = 'job_id="capped-m"'
    rate = [v for k, v in rows.items() if k.startswith("starter_job_network_rate_limit_bits{") and lab in k]
    shaped = [v for k, v in rows.items() if k.startswith("starter_job_network_shaped_bytes_total{")
              and 'zone="wan",direction="out"' in k]
    assert rate == [20e6] and shaped and shaped[0] > 20e6 / 8 * SECONDS * 0.8, rows


def test_ipv6_zones_are_capped_too(starter, tmp_path):
    """The same caps over IPv6 (NAT66): the LAN prefixes of both families
    are filtered, the rest of IPv6 goes to the WAN class."""
    if not os.path.exists("/proc/sys/net/ipv6/conf/all/force_forwarding") and \
            open("/proc/sys/net/ipv6/conf/all/forwarding").read().strip() != "1":
        pytest.skip("needs per-interface IPv6 forwarding (force_forwarding, Linux 6.17); conf.all is not touched")
    caps = {"lan_out": 30, "wan_out": 20, "lan_in": 40}
    with contextlib.ExitStack() as stack:
        s6 = nethosts.Site6(stack)
        port = s6.port()
        srv = subprocess.Popen(s6.ns.argv("iperf3", "-s", "-p", str(port)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        stack.callback(lambda: (srv.kill(), srv.wait()))
        time.sleep(0.3)
        addr = {"lan": s6.lan6, "wan": s6.wan6}

        def run(zones):
            out = _fresh(tmp_path)
            script = "; ".join(f"iperf3 -c {addr[z.split('_')[0]]} -p {port} -t {SECONDS} -J "
                               f"{'-R' if z.endswith('_in') else ''} > {out}/{z}.json" for z in zones)
            p = starter("run", "--net", "nat", "--pool", POOL, "--pool6", f"fd70:7639:1864:{secrets.randbelow(0xffff):x}::/64",
                        "--lan", s6.lan_cidrs[0], "--lan", s6.lan_cidrs[1], "--uplink", s6.uplink, "--ipv6", "on",
                        "--net-rate", ",".join(f"{z.replace('_', '-')}={c}mbit" for z, c in caps.items()),
                        "--bind", str(out), "--", "sh", "-c", script, timeout=120)
            assert p.returncode == 0, (p.stdout, p.stderr)
            return {zone: _mbit(out / f"{zone}.json") for zone in zones}

        _until_capped(caps, 1428 / 1514, run)      # IPv6 + TCP headers: 1428 of 1514 bytes are payload
