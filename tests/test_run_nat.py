"""`starter run --net nat` end to end through the CLI, against the private
test site of tests/nethosts.py (LAN and WAN hosts in namespaces we made),
with and without the per-node network helper (netd)."""

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import SLOWDOWN, STARTER, process_alive, running_netd  # noqa: E402

POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"

@pytest.fixture
def site():
    with nethosts.site() as s:
        yield s


@pytest.fixture(params=["in-process", "netd"])
def netmode(request, state_dir):
    if request.param == "in-process":
        yield None
        return
    with running_netd(state_dir) as proc:
        yield proc


@pytest.fixture
def netd(state_dir):
    with running_netd(state_dir) as proc:
        yield proc


def _nat_args(site):
    return ["--net", "nat", "--pool", POOL, "--lan", site.lan_cidr, "--uplink", site.uplink]


@pytest.mark.net
def test_nat_job_counts_lan_and_wan_bytes(starter, site, tmp_path, netmode):
    N, M, K_LAN, K_WAN = 2_000_000, 1_000_000, 800_000, 400_000
    servers = [site.serve("lan", "send", N), site.serve("wan", "send", M),
               site.serve("lan", "recv", 0), site.serve("wan", "recv", 0)]
    plan = [("recv", site.lan_addr, servers[0].port, N), ("recv", site.wan_addr, servers[1].port, M),
            ("send", site.lan_addr, servers[2].port, K_LAN), ("send", site.wan_addr, servers[3].port, K_WAN)]
    (tmp_path / "client.py").write_text(nethosts.CLIENT)
    tmp_path.chmod(0o755)  # readable by the job's (unprivileged) user
    script = "; ".join(f"/usr/bin/python3 /srv/client.py {m} {h} {port} {n} '' 20" for m, h, port, n in plan)
    report = tmp_path / "r.json"
    events = tmp_path / "e.jsonl"
    p = starter("run", *_nat_args(site), "--report", str(report), "--events", str(events),
                "--ro-bind", f"{tmp_path}:/srv", "--", "sh", "-c", script, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:4] == [f"received {N}", f"received {M}", f"sent {K_LAN}", f"sent {K_WAN}"], p.stdout
    outs = [s.result()[0] for s in servers]
    # What crossed the wire: the payload, plus what a sender had to send
    # again (a retransmitted 64 KiB segment is 3% of a 2 MB transfer).
    client_retrans = [int(l.split()[1]) for l in p.stderr.splitlines() if l.startswith("retrans ")]
    assert len(client_retrans) == 2 and all("retrans " in o for o in outs[:2]), (p.stderr, outs)
    r = json.loads(report.read_text())
    net = r["network"]
    for bucket, expect in (("lan_in", N + nethosts.retransmitted(outs[0])),
                           ("wan_in", M + nethosts.retransmitted(outs[1])),
                           ("lan_out", K_LAN + client_retrans[0]), ("wan_out", K_WAN + client_retrans[1])):
        payload = net[bucket]["bytes"] - 52 * net[bucket]["packets"]   # IP + TCP headers
        assert abs(payload - expect) <= 0.02 * expect, (bucket, net)
    running = [json.loads(l) for l in events.read_text().splitlines() if '"running"' in l][0]
    assert running["address"].startswith(POOL.split(".0.0/")[0] + ".")


@pytest.mark.net
def test_nat_job_is_isolated(starter, site, netmode):
    # The gateway (the host), the metadata address, and a spoofed source: all dropped.
    code = ("import socket, subprocess\n"
            "gw = subprocess.run(['ip', '-4', 'route', 'show', 'default'], capture_output=True, text=True).stdout.split()[2]\n"
            "for host in (gw, '169.254.169.254', '127.0.0.1'):\n"
            "    try:\n"
            "        socket.create_connection((host, 22), timeout=1).close(); print('reached', host)\n"
            "    except OSError:\n"
            "        print('blocked', host)\n")
    p = starter("run", *_nat_args(site), "--", "/usr/bin/python3", "-c", code, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "reached" not in p.stdout, p.stdout
    assert p.stdout.count("blocked") == 3


@pytest.mark.net
def test_nat_fails_closed_without_uplink_interface(starter, state_dir):
    p = starter("run", "--net", "nat", "--pool", POOL, "--uplink", "nosuchif0", "--", "true")
    assert p.returncode == 125, (p.stdout, p.stderr)
    assert p.stderr.startswith("starter:") and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.net
def test_kill9_of_a_nat_job_then_gc_leaves_the_node_as_before(starter, site, state_dir):
    def node():
        veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        state = sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else []
        return veths, tables, state

    before = node()
    proc = subprocess.Popen([STARTER, "run", "--id", "natcrash", *_nat_args(site), "--", "sleep", "300"])
    # The starter's "running" record is polled, with a deadline: nothing
    # announces it to another process.
    deadline = time.monotonic() + 30 * SLOWDOWN
    st = {}
    while time.monotonic() < deadline and st.get("state") != "running":
        try:
            with open(os.path.join(state_dir, "natcrash.json")) as f:
                st = json.load(f)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert st.get("state") == "running" and st.get("host_ifname")
    assert st["host_ifname"] in node()[0]
    pidfd = os.pidfd_open(st["pid"])  # polls readable when the job exits
    try:
        proc.kill()
        proc.wait(10)
        died = select.select([pidfd], [], [], 1.0 * SLOWDOWN)[0]
    finally:
        os.close(pidfd)
    assert died and not process_alive(st["pid"]), "the job outlived its starter by a second"
    out = starter("gc", check=0).stdout
    assert "natcrash" in out
    assert node() == before, out


# A job's process that reaches netd's socket (here it is bound in on purpose,
# so the check holds even where the job's view hides the state directory).
PEER = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("/mnt/netd.sock")
s.send(json.dumps({"op": "ping", "cfg": {"state_dir": sys.argv[1]}}).encode())
print(s.recv(65536).decode())
"""


@pytest.mark.net
def test_netd_refuses_a_root_job_and_still_serves_the_starter(starter, site, state_dir, tmp_path, netd):
    (tmp_path / "peer.py").write_text(PEER)
    p = starter("run", "--user", "root", "--net", "host", "--bind", f"{state_dir}:/mnt",
                "--ro-bind", f"{tmp_path}:/srv", "--", "/usr/bin/python3", "/srv/peer.py", state_dir)
    assert p.returncode == 0, p.stderr
    reply = json.loads(p.stdout)
    assert reply["ok"] is False and "netd refused this client" in reply["error"], reply
    # The starter itself still gets its NAT network through netd.
    report = tmp_path / "r.json"
    p = starter("run", "--user", "nobody", *_nat_args(site), "--report", str(report), "--",
                "sh", "-c", "ip -4 -o addr show dev eth0", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "inet " + POOL.split(".0.0/")[0] + "." in p.stdout, p.stdout
    netd.send_signal(signal.SIGTERM)
    netd.wait(30)
    assert "refused peer" in netd.stderr.read()


@pytest.mark.net
def test_caller_nat_job_counts_and_caller_death_leaves_no_veth(site, policy, home, state_dir, netd):
    """A caller that is not root runs a NAT job the node policy allows: the
    network's shape comes from the policy's defaults (a caller may not set
    it), the bytes are counted in the caller's own report; a SIGKILL of the
    caller of a running NAT job leaves no veth or entry within 10 s."""
    from conftest import caller_argv

    policy(f'[callers]\nnet = ["none", "nat"]\nro_bind = ["{home}"]\n',
           defaults=f'pool = "{POOL}"\nlan = ["{site.lan_cidr}"]\nuplink = ["{site.uplink}"]\n')
    K = 300_000
    server = site.serve("lan", "recv", 0)
    with open(f"{home}/client.py", "w") as f:
        f.write(nethosts.CLIENT)
    p = subprocess.run(caller_argv("run", "--net", "nat", "--report", f"{home}/r.json", "--ro-bind", home, "--",
                                   "/usr/bin/python3", f"{home}/client.py", "send", site.lan_addr,
                                   str(server.port), str(K), "", "20"),
                       capture_output=True, text=True, timeout=120 * SLOWDOWN, cwd=home)
    assert p.returncode == 0, p.stderr
    retrans = [int(l.split()[1]) for l in p.stderr.splitlines() if l.startswith("retrans ")]
    server.result()
    net = json.loads(open(f"{home}/r.json").read())["network"]
    payload = net["lan_out"]["bytes"] - 52 * net["lan_out"]["packets"]
    assert abs(payload - (K + sum(retrans))) <= 0.02 * K, net
    p = subprocess.run(caller_argv("run", "--net", "nat", "--uplink", "lo", "--", "true"),
                       capture_output=True, text=True, timeout=60, cwd=home)
    assert p.returncode == 125 and "only root" in p.stderr, p.stderr

    def veths():
        return {l.split(":")[1].strip().split("@")[0] for l in subprocess.run(
            ["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout.splitlines()}

    before = veths()
    proc = subprocess.Popen(caller_argv("run", "--net", "nat", "--", "sh", "-c", "echo up; exec sleep 300"),
                            stdout=subprocess.PIPE, text=True, cwd=home)
    assert proc.stdout.readline().strip() == "up"
    assert veths() - before
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10 * SLOWDOWN
    while (veths() - before or any(n.endswith(".lock") for n in os.listdir(state_dir))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not veths() - before and not any(n.endswith(".lock") for n in os.listdir(state_dir))


@pytest.mark.net
def test_netd_makes_the_policy_table_before_any_job(starter, site, policy, state_dir):
    """The node policy gives NAT jobs their network: netd makes that table
    as it starts, the jobs use it, and it goes when netd stops."""
    def tables():
        return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout

    policy(defaults=f'uplink = ["{site.uplink}"]\nlan = ["{site.lan_cidr}"]\npool = "{POOL}"\n')
    assert "table inet starter\n" not in tables()
    with running_netd(state_dir):
        assert "table inet starter\n" in tables()
        handle = subprocess.run(["nft", "-a", "list", "table", "inet", "starter"], capture_output=True,
                                text=True).stdout.split("# handle ", 1)[1].split()[0]
        p = starter("run", "--net", "nat", "--", "true")
        assert p.returncode == 0, p.stderr
        after = subprocess.run(["nft", "-a", "list", "table", "inet", "starter"], capture_output=True, text=True).stdout
        assert after.split("# handle ", 1)[1].split()[0] == handle          # the same table served the job
    assert "table inet starter\n" not in tables()
