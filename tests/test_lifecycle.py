"""Job file, events, control (signals and commands), ps/status/enter, crash + gc."""

import json
import os
import re
import select
import signal
import subprocess
import time

import pytest

from conftest import SLOWDOWN, STARTER, process_alive, wait_for, wait_running


def _state(state_dir, job_id):
    try:
        with open(os.path.join(state_dir, job_id + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cgroup_dirs(job_id):
    out = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        if "job-" + job_id in dirs:
            out.append(os.path.join(root, "job-" + job_id))
        if root.count("/") > 8:
            dirs[:] = []
    return out


# ---------------------------------------------------------------- job file

def _job_file(tmp_path, doc, raw=None):
    p = tmp_path / "job.json"
    p.write_text(raw if raw is not None else json.dumps(doc))
    return str(p)


def test_job_file_full_example(starter, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    report = tmp_path / "report.json"
    events = tmp_path / "events.jsonl"
    doc = {
        "id": "example-1",
        "command": ["/bin/sh", "-c", "echo hello from $USER in $PWD > /srv/out/hello; exit 3"],
        "user": "nobody",
        "cwd": "/",
        "env": {"LANG": "C.UTF-8"},
        "hostname": "job1",
        "init": False,
        "limits": {"memory": "256M", "cpus": 1.0, "cpu_weight": 100, "pids": 64, "wall_time": 60},
        "network": {"mode": "none"},
        "mounts": [{"type": "tmpfs", "dst": "/srv", "options": "size=4m"},
                   {"type": "bind", "src": str(out), "dst": "/srv/out"}],
        "report": str(report),
        "events": str(events),
        "grace": 5,
    }
    os.chmod(out, 0o777)
    p = starter("run", "--job", _job_file(tmp_path, doc))
    assert p.returncode == 3, p.stderr
    assert (out / "hello").read_text().strip() == "hello from nobody in /"
    r = json.loads(report.read_text())
    assert r["job_id"] == "example-1" and r["exit_code"] == 3 and r["reason"] == "exited"
    evs = [json.loads(l) for l in events.read_text().splitlines()]
    assert [e["event"] for e in evs] == ["starting", "running", "exited"]
    assert evs[1]["pid"] > 0 and evs[1]["cgroup"]
    assert evs[2]["report"]["exit_code"] == 3


def test_toml_job_file(starter, tmp_path):
    report = tmp_path / "r.json"
    doc = (f'id = "toml-1"\ncommand = ["sh", "-c", "exit 6"]\nuser = "nobody"\nreport = "{report}"\n'
           '[limits]\nmemory = "128M"\npids = 32\n[network]\nmode = "none"\n')
    (tmp_path / "job.toml").write_text(doc)
    assert starter("run", "--job", str(tmp_path / "job.toml")).returncode == 6
    assert json.loads(report.read_text())["job_id"] == "toml-1"
    (tmp_path / "bad.toml").write_text('id = "a"\nid = "b"\ncommand = ["true"]\n')
    p = starter("run", "--job", str(tmp_path / "bad.toml"))
    assert p.returncode == 125 and p.stderr.startswith("starter: job: not valid TOML")


def test_cli_overrides_job_file(starter, tmp_path):
    doc = {"command": ["sh", "-c", "exit 1"]}
    p = starter("run", "--job", _job_file(tmp_path, doc), "--", "sh", "-c", "exit 4")
    assert p.returncode == 4


@pytest.mark.parametrize("raw,field", [
    ('{"command": ["true"], "limits": {"memory": "1G"', "job"),              # truncated
    ('{"command": ["true"], "command": ["false"]}', "command"),              # duplicate key
    ('{"command": ["true"], "user": "../root"}', "user"),
    ('{"command": ["true"], "id": "a;reboot"}', "id"),
    ('{"command": ["true"], "limits": {"pids": -1}}', "pids"),
    ('{"command": ["true"], "limits": {"memory": -1}}', "memory"),
    ('{"command": ["true"], "limits": {"cpus": 1e9}}', "cpus"),
    ('{"command": ["true"], "id": "../x"}', "id"),
    ('{"command": ["true"], "id": "a/b"}', "id"),
    ('{"command": ["true"], "id": "$(id)"}', "id"),
    ('{"command": ["true"], "id": "-rf"}', "id"),
    ('{"command": ["true"], "id": "' + "x" * 65 + '"}', "id"),
    ('{"command": ["true"], "bogus": 1}', "bogus"),
    ('{"command": "true"}', "command"),
    ('{"command": ["tr\\u0000ue"]}', "command"),
    ('{"command": ["true"], "env": {"A": 1}}', "env"),
    ('{"command": ["true"], "limits": {"pids": true}}', "pids"),
    ('{"command": ["true"], "network": {"mode": "bridge"}}', "net"),
    ('[1, 2]', "job"),
])
def test_hostile_job_file_refused(starter, tmp_path, state_dir, raw, field):
    before = set(os.listdir(state_dir)) if os.path.isdir(state_dir) else set()
    p = starter("run", "--job", _job_file(tmp_path, None, raw=raw))
    assert p.returncode == 125, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"starter: {field}"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    after = set(os.listdir(state_dir)) if os.path.isdir(state_dir) else set()
    assert after == before


@pytest.mark.parametrize("args,field", [
    (["--id", "../x"], "id"), (["--id", "a/b"], "id"), (["--id", "$(id)"], "id"),
    (["--user", "../root"], "user"), (["--memory", "-1"], "memory"), (["--pids", "0"], "pids"),
    (["--cpus", "abc"], "cpus"), (["--env", "1A=b"], "env"), (["--net", "bridge"], "net"),
    (["--on-signal", "KILL=vacate"], "on-signal"), (["--bind", "relative:/x"], "bind"),
    # _signal's handler and sigprocmask constants are not signals; SIGCLD is SIGCHLD
    (["--on-signal", "SIG_DFL=kill"], "on-signal"), (["--on-signal", "_BLOCK=vacate"], "on-signal"),
    (["--on-signal", "SIG_SETMASK=suspend"], "on-signal"), (["--on-signal", "CLD=kill"], "on-signal"),
    # fd:N not passed to the starter: its own (the signal pipe: events read as signals) or none
    (["--events", "fd:3"], "events"), (["--events", "fd:4"], "events"), (["--report", "fd:3"], "report"),
    (["--report", "fd:99"], "report"),
])
def test_hostile_cli_refused(starter, args, field):
    p = starter("run", *args, "--", "true")
    assert p.returncode == 125
    assert p.stderr.startswith(f"starter: {field}"), p.stderr


# ---------------------------------------------------------------- control

def _start(tmp_path, *args, job_id, cmd):
    report = tmp_path / f"{job_id}.report.json"
    events = tmp_path / f"{job_id}.events"
    proc = subprocess.Popen([STARTER, "run", "--id", job_id, "--report", str(report), "--events", str(events),
                             *args, "--", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, report, events


def test_vacate_of_job_ignoring_sigterm(tmp_path, state_dir):
    # PID 1 without a handler ignores SIGTERM: the grace period's end kills it.
    proc, report, events = _start(tmp_path, "--grace", "1", job_id="vac1", cmd=["sleep", "300"])
    wait_running(state_dir, "vac1")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert time.monotonic() - t0 < 1 + 1.0 * SLOWDOWN  # grace + 1 s
    r = json.loads(report.read_text())
    assert r["reason"] == "vacated" and r["signal"] == 9
    names = [json.loads(l)["event"] for l in events.read_text().splitlines()]
    assert names == ["starting", "running", "vacating", "exited"]


def test_signals_during_teardown_do_not_kill_the_starter_before_its_report(tmp_path, state_dir):
    # The batch system may repeat its SIGTERM while the starter tears down:
    # the handlers stay until the report is out (they were restored as a
    # teardown step, and a SIGTERM after it killed the starter unreported).
    for i in range(3):
        job_id = f"vacflood{i}"
        proc, report, events = _start(tmp_path, "--grace", "0.05", job_id=job_id, cmd=["sleep", "300"])
        wait_running(state_dir, job_id)
        while proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0002)
        assert proc.wait(30) == 137, proc.stderr.read()
        assert json.loads(report.read_text())["reason"] == "vacated"
        assert json.loads(events.read_text().splitlines()[-1])["event"] == "exited"


def test_vacate_command(tmp_path, state_dir, starter):
    proc, report, _ = _start(tmp_path, "--grace", "0.5", job_id="vac2", cmd=["sleep", "300"])
    wait_running(state_dir, "vac2")
    starter("vacate", "vac2", check=0)
    proc.wait(30)
    assert json.loads(report.read_text())["reason"] == "vacated"


def _counter_job():
    return ["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/c; done"]


def test_a_failed_suspend_is_reported_and_the_job_goes_on(tmp_path, state_dir, starter):
    # A freeze that cannot complete (a process stuck in D state past the
    # wait; planted here with STARTER_FAULT=suspend:fail) used to end the
    # supervision: the job was killed as a starter error.
    report, events = tmp_path / "r.json", tmp_path / "ev"
    proc = subprocess.Popen([STARTER, "run", "--id", "suspfail", "--report", str(report), "--events", str(events),
                             "--", "sleep", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, STARTER_FAULT="suspend:fail"))
    try:
        wait_running(state_dir, "suspfail")
        p = starter("suspend", "suspfail")
        assert p.returncode == 125 and p.stderr.startswith("starter: suspend of job 'suspfail' failed: "), p
        assert "planted fault" in p.stderr and len(p.stderr.splitlines()) == 1
        assert _state(state_dir, "suspfail")["state"] == "running"
        ev = [json.loads(line) for line in events.read_text().splitlines()]
        assert ev[-1]["event"] == "control_failed" and ev[-1]["action"] == "suspend", ev
        assert "planted fault" in ev[-1]["error"]
        starter("resume", "suspfail", check=0)   # nothing frozen: the thaw is a no-op
    finally:
        proc.send_signal(signal.SIGQUIT)       # kill
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    assert "starter: suspend failed: " in err and len(err.splitlines()) == 1, err
    assert json.loads(report.read_text())["reason"] == "killed"


def test_suspend_resume_by_signal_and_command(tmp_path, state_dir, starter):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the job is not root
    cmd = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /srv/c; sleep 0.01; done"]
    proc, report, events = _start(tmp_path, "--bind", f"{out}:/srv", job_id="susp", cmd=cmd)
    counter = out / "c"

    def value():
        try:
            return int(counter.read_text() or 0)
        except (OSError, ValueError):
            return 0

    try:
        wait_for(lambda: value() > 5)
        # by signal
        proc.send_signal(signal.SIGUSR1)
        # "suspended" is recorded once the freeze is complete (cgroup.events
        # or freezer.state): from then on nothing of the job runs.
        wait_for(lambda: _state(state_dir, "susp")["state"] == "suspended")
        v1 = value()
        # An observation window: no event can say that nothing happened.
        # Thawed, the job writes every 10 ms (~50 times in it).
        time.sleep(0.5)
        assert value() == v1, "the job made progress while frozen"
        ps = json.loads(starter("ps", "--json", check=0).stdout)
        assert [j["state"] for j in ps if j["id"] == "susp"] == ["suspended"]
        proc.send_signal(signal.SIGUSR2)
        wait_for(lambda: value() > v1 + 3)
        # by command
        starter("suspend", "susp", check=0)
        wait_for(lambda: _state(state_dir, "susp")["state"] == "suspended")
        v2 = value()
        time.sleep(0.5)  # the observation window again
        assert value() == v2, "the job made progress while frozen"
        starter("resume", "susp", check=0)
        wait_for(lambda: value() > v2 + 3)
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(30)
    r = json.loads(report.read_text())
    assert r["reason"] == "killed"
    names = [json.loads(l)["event"] for l in events.read_text().splitlines()]
    assert names.count("suspended") == 2 and names.count("resumed") == 2


def test_wall_time_limit(starter, tmp_path):
    report = tmp_path / "r.json"
    t0 = time.monotonic()
    p = starter("run", "--wall-time", "0.5", "--report", str(report), "--", "sleep", "30")
    assert time.monotonic() - t0 < 10
    assert p.returncode == 137
    assert json.loads(report.read_text())["reason"] == "timeout"


# ---------------------------------------------------------------- ps / status / enter

def test_ps_status_and_enter(tmp_path, state_dir, starter):
    proc, report, _ = _start(tmp_path, "--user", "nobody", job_id="ent1",
                             cmd=["sh", "-c", "sleep 300 & wait"])
    try:
        wait_running(state_dir, "ent1")
        table = starter("ps", check=0).stdout
        assert table.splitlines()[0].split()[:3] == ["ID", "USER", "STATE"]
        assert any(l.split()[:3] == ["ent1", "nobody", "running"] for l in table.splitlines()[1:]), table
        st = json.loads(starter("status", "ent1", "--json", check=0).stdout)
        assert st["id"] == "ent1" and st["live"] and st["pid"] == _state(state_dir, "ent1")["pid"]
        assert "stats" in st
        # enter: sees the job's processes, runs as the job's user, in the job's cgroup
        p = starter("enter", "ent1", "--", "sh", "-c",
                    "ps -eo pid,comm --no-headers; id -u; cat /proc/self/cgroup", check=0)
        lines = p.stdout.splitlines()
        pids = {l.split()[0]: l.split()[1] for l in lines if l.strip() and l.split()[0].isdigit() and len(l.split()) == 2}
        assert pids.get("1") == "sh" and "sleep" in pids.values(), p.stdout
        assert "65534" in lines
        # in the job's cgroup namespace, rooted at its cgroup (test_isolation checks the cgroup)
        cg = [l for l in lines if re.match(r"^\d+:[^:]*:", l)]
        assert cg and all(l.endswith(":/") for l in cg if not l.startswith("0::")), p.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


# ---------------------------------------------------------------- crash safety

def test_kill9_starter_then_gc_leaves_node_clean(tmp_path, state_dir, starter):
    proc, report, _ = _start(tmp_path, job_id="crash1", cmd=["sh", "-c", "sleep 300 & sleep 300 & wait"])
    st = wait_running(state_dir, "crash1")
    job_pid = st["pid"]
    assert _cgroup_dirs("crash1")
    pidfd = os.pidfd_open(job_pid)  # polls readable when the job exits
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # the job dies with its starter (parent-death signal on PID 1 of its namespace)
        died = select.select([pidfd], [], [], 1.0 * SLOWDOWN)[0]
    finally:
        os.close(pidfd)
    assert died and not process_alive(job_pid), "the job outlived its starter by a second"
    out = starter("gc", check=0).stdout
    assert "crash1" in out
    assert _cgroup_dirs("crash1") == []
    assert _state(state_dir, "crash1") is None
    assert not any(n.startswith("crash1") for n in os.listdir(state_dir)) if os.path.isdir(state_dir) else True


def test_duplicate_live_id_refused(tmp_path, state_dir, starter):
    proc, _, _ = _start(tmp_path, job_id="dup1", cmd=["sleep", "300"])
    try:
        wait_running(state_dir, "dup1")
        p = starter("run", "--id", "dup1", "--", "true")
        assert p.returncode == 125 and "already running" in p.stderr
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(30)
