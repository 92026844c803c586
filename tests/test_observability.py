"""Observability: `starter metrics` (checked by promtool, served through a
real node_exporter and over HTTP), the ClassAd report (parsed by HTCondor's
own `classad` module), `starter top`, and the versioned event stream.

Jobs run with an explicit `--user nobody`.  The NAT job talks only to the
private test site of tests/nethosts.py.  Rendering and escaping on their
own: tests/unit/test_observe_render.py."""

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import SLOWDOWN, STARTER, process_alive, starter_in_python, wait_running  # noqa: E402

POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
PROMTOOL = "/usr/bin/promtool"


# ---------------------------------------------------------------- helpers

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _promtool(text):
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, (p.stdout, p.stderr, text)
    return p


def _sample(text, name, **labels):
    """The value of one series in exposition text (None if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            lab, val = "", line[len(name) + 1:]
        elif line.startswith(name + "{"):
            lab, _, val = line[len(name) + 1:].rpartition("} ")
        else:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', lab))
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(val)
    return None


def _client_dir(d):
    """The test site's client where the job (uid nobody) can read it: the
    directory is bind-mounted at /srv, so only its own mode matters."""
    (d / "client.py").write_text(nethosts.CLIENT)
    os.chmod(d / "client.py", 0o644)
    os.chmod(d, 0o755)


def _parse_classad(text):
    """HTCondor's parser: `classad` (bindings v1, htcondor < 25), else
    `classad2` (htcondor >= 25 ships only the v2 bindings, same parseOne)."""
    os.environ.setdefault("CONDOR_CONFIG", "/dev/null")
    try:
        import classad
    except ImportError:
        import classad2 as classad
    return dict(classad.parseOne(text))


# ---------------------------------------------------------------- three jobs, one NAT with traffic

N_LAN, N_WAN = 300_000, 200_000


@pytest.fixture(scope="module")
def msite():
    """One test site for the module: NAT jobs on a node share one table, so
    jobs alive at the same time must agree on the uplink and the LAN."""
    with nethosts.site() as s:
        yield s


def _nat_args(site):
    return ["--net", "nat", "--pool", POOL, "--lan", site.lan_cidr, "--uplink", site.uplink]


@pytest.fixture(scope="module")
def node(state_root, tmp_path_factory, msite):
    """Three jobs: two sleepers (--net none) and a NAT job that has moved
    N_LAN bytes from the LAN host and N_WAN to the WAN host and then sleeps."""
    tmp = tmp_path_factory.mktemp("obs")
    _client_dir(tmp)
    tag = secrets.token_hex(3)
    ids = {"a": f"obs-a-{tag}", "b": f"obs-b-{tag}", "nat": f"obs-nat-{tag}"}
    procs = []
    site = msite
    try:
        for key in ("a", "b"):
            procs.append(subprocess.Popen([STARTER, "run", "--id", ids[key], "--user", "nobody",
                                           "--", "sleep", "600"], stdin=subprocess.DEVNULL))
        lan = site.serve("lan", "send", N_LAN)
        wan = site.serve("wan", "recv", 0)
        script = (f"/usr/bin/python3 /srv/client.py recv {site.lan_addr} {lan.port} {N_LAN} '' 20 && "
                  f"/usr/bin/python3 /srv/client.py send {site.wan_addr} {wan.port} {N_WAN} '' 20 && "
                  "echo done && exec sleep 600")
        nat = subprocess.Popen(
            [STARTER, "run", "--id", ids["nat"], "--user", "nobody", *_nat_args(site), "--ro-bind", f"{tmp}:/srv",
             "--", "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        procs.append(nat)
        lines = []
        while "done" not in lines:
            line = nat.stdout.readline()
            assert line, f"the NAT job ended early: {lines} {nat.stderr.read()}"
            lines.append(line.strip())
        lan.result()
        wan.result()
        for job_id in ids.values():
            wait_running(state_root, job_id)
        yield ids
    finally:
        for job_id in ids.values():
            subprocess.run([STARTER, "kill", job_id], capture_output=True, timeout=60)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()


@pytest.mark.net
def test_metrics_pass_promtool_with_three_jobs_one_nat(node, state_root):
    p = subprocess.run([STARTER, "metrics"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    _promtool(text)
    for key, job_id in node.items():
        assert _sample(text, "starter_job_state", job_id=job_id, state="running", user="nobody") == 1
        assert _sample(text, "starter_job_memory_bytes", job_id=job_id) > 0
        assert _sample(text, "starter_job_start_time_seconds", job_id=job_id) > 1.6e9
    assert _sample(text, "starter_jobs", state="running") == 3
    nat = node["nat"]
    lan_in = _sample(text, "starter_job_network_bytes_total", job_id=nat, zone="lan", direction="in")
    wan_out = _sample(text, "starter_job_network_bytes_total", job_id=nat, zone="wan", direction="out")
    assert N_LAN <= lan_in <= N_LAN * 1.2, lan_in
    assert N_WAN <= wan_out <= N_WAN * 1.2, wan_out
    assert _sample(text, "starter_job_network_bytes_total", job_id=node["a"]) is None   # --net none
    assert _sample(text, "starter_metrics_read_errors") == 0


@pytest.mark.net
def test_node_exporter_serves_the_textfile(node, tmp_path):
    d = tmp_path / "textfile"
    d.mkdir()
    subprocess.run([STARTER, "metrics", "--textfile", str(d)], check=True, timeout=60)
    assert sorted(os.listdir(d)) == ["starter.prom"]          # no temp file left
    assert (d / "starter.prom").stat().st_mode & 0o777 == 0o644
    port = _free_port()
    ne = subprocess.Popen([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}",
                           "--collector.disable-defaults", "--collector.textfile",
                           f"--collector.textfile.directory={d}"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # node_exporter announces nothing we can wait on: poll its port.
        deadline = time.monotonic() + 20 * SLOWDOWN
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert ne.poll() is None, ne.stderr.read()
                assert time.monotonic() < deadline, "node_exporter did not come up"
                time.sleep(0.05)
    finally:
        ne.terminate()
        ne.wait(10)
        ne.stderr.close()
    assert _sample(text, "node_textfile_scrape_error") == 0, text
    for job_id in node.values():
        assert _sample(text, "starter_job_state", job_id=job_id, state="running") == 1
    assert _sample(text, "starter_job_network_bytes_total", job_id=node["nat"], zone="lan", direction="in") >= N_LAN


@pytest.mark.net
def test_http_endpoint_answers_a_scrape(node):
    srv = subprocess.Popen([STARTER, "metrics", "--listen", "127.0.0.1:0"], stdin=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stderr.readline()
        m = re.search(r"serving (http://127\.0\.0\.1:\d+)/metrics", line)
        assert m, line
        # A client that connects and stalls does not hold the endpoint.
        port = int(m.group(1).rsplit(":", 1)[1])
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for s in stalled:
            s.sendall(b"GET /metr")
        with urllib.request.urlopen(m.group(1) + "/metrics", timeout=5) as r:
            ctype = r.headers["Content-Type"]
            text = r.read().decode()
        for s in stalled:
            s.close()
        assert ctype.startswith("text/plain; version=0.0.4")
        _promtool(text)
        assert _sample(text, "starter_job_state", job_id=node["b"], state="running") == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(m.group(1) + "/nothing", timeout=10)
        assert e.value.code == 404
    finally:
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(10) == 0
        srv.stderr.close()


# ---------------------------------------------------------------- ClassAd report

def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_classad(r):
    """The mapping table of docs/reference.md, written out independently of starter/observe/classad.py."""
    kib, mib = 1024, 1 << 20
    want = {
        "StarterJobId": r["job_id"], "StarterReason": r["reason"], "StarterExitCode": r["exit_code"],
        "StarterOomKilled": r["reason"] == "oom", "ExitBySignal": r["signal"] is not None,
        "JobCurrentStartDate": int(r["started_at"]), "CompletionDate": int(r["ended_at"]),
        "StarterStartedAt": r["started_at"], "StarterEndedAt": r["ended_at"],
        "RemoteWallClockTime": r["wall_s"], "RemoteUserCpu": r["cpu_user_s"], "RemoteSysCpu": r["cpu_system_s"],
        "MemoryUsage": -(-r["memory_peak_bytes"] // mib), "ResidentSetSize": -(-r["memory_peak_bytes"] // kib),
        "StarterMemoryPeakBytes": r["memory_peak_bytes"],
        "BlockReadKbytes": r["io_read_bytes"] // kib, "BlockWriteKbytes": r["io_write_bytes"] // kib,
        "StarterOomKills": r["oom_kills"], "StarterCgroup": r["cgroup"],
    }
    if r["signal"] is None:
        want["ExitCode"] = r["exit_code"]
    else:
        want["ExitSignal"] = r["signal"]
    if r.get("pids_peak") is not None:
        want["StarterPidsPeak"] = r["pids_peak"]
    for key, prefix in (("lan_in", "NetworkLanInput"), ("lan_out", "NetworkLanOutput"),
                        ("wan_in", "NetworkWanInput"), ("wan_out", "NetworkWanOutput"),
                        ("dropped", "NetworkDropped")):
        if "network" in r:
            want[prefix + "Bytes"] = r["network"][key]["bytes"]
            want[prefix + "Packets"] = r["network"][key]["packets"]
    return want


@pytest.mark.net
def test_classad_report_parses_and_matches_the_json_report(tmp_path, state_dir, msite):
    _client_dir(tmp_path)
    ad_path, events = tmp_path / "report.ad", tmp_path / "events.jsonl"
    site = msite
    srv = site.serve("lan", "send", 100_000)
    script = (f"/usr/bin/python3 /srv/client.py recv {site.lan_addr} {srv.port} 100000 '' 20; "
              "head -c 3000000 /dev/zero > /dev/null; exit 3")
    p = subprocess.run([STARTER, "run", "--user", "nobody", *_nat_args(site), "--ro-bind", f"{tmp_path}:/srv",
                        "--report", str(ad_path), "--report-format", "classad", "--events", str(events),
                        "--", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    srv.result()
    assert p.returncode == 3, p.stderr
    assert p.stdout.startswith("received 100000"), (p.stdout, p.stderr)
    text = ad_path.read_text()
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9]* = .+", line) for line in text.splitlines()), text
    ad = _parse_classad(text)
    report = [e for e in _events(events) if e["event"] == "exited"][0]["report"]
    want = _expected_classad(report)
    for name, value in want.items():
        assert name in ad, (name, text)
        got = ad[name]
        assert (got == pytest.approx(value) if isinstance(value, float) else got == value), (name, got, value)
    assert ad["ExitCode"] == 3 and ad["ExitBySignal"] is False
    assert ad["NetworkLanInputBytes"] >= 100_000


def test_classad_report_of_a_signaled_job_and_from_a_job_file(tmp_path, state_dir):
    ad_path = tmp_path / "r.ad"
    job = tmp_path / "job.json"
    # --init: the job is not PID 1 then, so its own SIGTERM is not ignored
    job.write_text(json.dumps({"command": ["sh", "-c", "kill -TERM $$"], "user": "nobody", "init": True,
                               "report": str(ad_path), "report_format": "classad"}))
    p = subprocess.run([STARTER, "run", "--job", str(job)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    ad = _parse_classad(ad_path.read_text())
    assert ad["ExitBySignal"] is True and ad["ExitSignal"] == signal.SIGTERM and "ExitCode" not in ad
    assert ad["StarterReason"] == "signaled" and ad["StarterExitCode"] == 128 + signal.SIGTERM


def test_classad_disk_usage_is_what_the_job_left_in_its_scratch(tmp_path, state_dir):
    execute = tmp_path / "execute"
    execute.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)   # the job (nobody) walks to its scratch below
    ad_path, ev = tmp_path / "r.ad", tmp_path / "e.jsonl"
    p = subprocess.run([STARTER, "run", "--user", "nobody", "--execute-dir", str(execute), "--report", str(ad_path),
                        "--report-format", "classad", "--events", str(ev), "--",
                        "sh", "-c", "head -c 3000000 /dev/urandom > out && mkdir d && ln out d/again"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert os.listdir(execute) == []
    ad = _parse_classad(ad_path.read_text())
    report = [e for e in _events(ev) if e["event"] == "exited"][0]["report"]
    # the hard link is counted once: about 3 MB of data, plus a few directory blocks
    assert 3_000_000 <= report["scratch_bytes"] < 3_100_000, report
    assert ad["StarterScratchBytes"] == report["scratch_bytes"]
    assert ad["DiskUsage"] == -(-report["scratch_bytes"] // 1024)


def test_unknown_report_format_is_refused(tmp_path, state_dir):
    p = subprocess.run([STARTER, "run", "--user", "nobody", "--report-format", "xml", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 125 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "report-format" in p.stderr


# ---------------------------------------------------------------- events

EVENT_FIELDS = {  # docs/events.md: the fields every event of that name has
    "starting": {"argv", "user"},
    "running": {"pid", "cgroup", "address"},
    "exited": {"report"},
}


def test_every_event_has_the_schema_version(tmp_path, state_dir):
    ev = tmp_path / "e.jsonl"
    p = subprocess.run([STARTER, "run", "--user", "nobody", "--events", str(ev), "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    events = _events(ev)
    assert [e["event"] for e in events] == ["starting", "running", "exited"]
    for e in events:
        assert e["v"] == 1 and isinstance(e["time"], float) and isinstance(e["job_id"], str)
        assert EVENT_FIELDS[e["event"]] <= set(e), e


# ---------------------------------------------------------------- top

def test_top_lists_exactly_the_jobs_processes(tmp_path, state_dir):
    job_id = "obs-top-" + secrets.token_hex(3)
    script = "for i in 1 2 3 4 5; do sleep 600 & done; echo ready; wait"
    proc = subprocess.Popen([STARTER, "run", "--id", job_id, "--user", "nobody", "--", "sh", "-c", script],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        st = wait_running(state_dir, job_id)
        p = subprocess.run([STARTER, "top", job_id, "--once", "--json", "--interval", "0.2"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        rows = json.loads(p.stdout)
        with open(f"{st['cgroup'][next(iter(st['cgroup']))]}/cgroup.procs") as f:
            in_cgroup = {int(x) for x in f.read().split()}
        assert {r["pid"] for r in rows} == in_cgroup
        assert sorted(r["command"] for r in rows) == sorted([f"sh -c {script}"] + ["sleep 600"] * 5)
        assert sorted(r["nspid"] for r in rows) == [1, 2, 3, 4, 5, 6]
        assert {r["user"] for r in rows} == {"nobody"}
        assert all(r["rss_bytes"] > 0 and r["cpu_percent"] >= 0 for r in rows)
        # the table and status --processes list the same pids
        text = subprocess.run([STARTER, "top", job_id, "--once", "--interval", "0.1"], capture_output=True,
                              text=True, timeout=60).stdout
        assert {int(l.split()[0]) for l in text.splitlines()[1:]} == in_cgroup
        doc = json.loads(subprocess.run([STARTER, "status", job_id, "--json", "--processes"],
                                        capture_output=True, text=True, timeout=60).stdout)
        assert {r["pid"] for r in doc["processes"]} == in_cgroup
    finally:
        subprocess.run([STARTER, "kill", job_id], capture_output=True, timeout=60)
        proc.wait(30)
        proc.stdout.close()
    assert not process_alive(proc.pid)


def test_top_of_a_job_that_does_not_exist(state_dir):
    p = subprocess.run([STARTER, "top", "nosuchjob", "--once"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 125 and p.stderr.startswith("starter:") and len(p.stderr.splitlines()) == 1, p.stderr


def test_the_run_path_loads_none_of_this(state_dir, tmp_path):
    """metrics, top (psutil) and the ClassAd writer stay off `starter run`;
    the ClassAd writer is loaded only when asked for."""
    def modules(*args):
        p = subprocess.run([*starter_in_python("-X", "importtime"), "run", "--user", "nobody", *args,
                            "--", "true"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return {l.split("|")[2].strip() for l in p.stderr.splitlines() if l.startswith("import time:")}

    heavy = {"psutil", "json", "re", "argparse", "dataclasses", "signal", "ctypes", "subprocess", "pyroute2",
             "starter.observe.metrics", "starter.observe.top", "starter.observe.classad", "http.server"}
    assert modules() & heavy == set()
    assert modules("--report", str(tmp_path / "r.ad"), "--report-format", "classad") & heavy == {"starter.observe.classad"}
