"""OOM policy and unkillable processes, through `starter run`, on whatever
cgroup layout this host has (hybrid natively; pure v2 and v1-only in the VM:
scripts/vm-test [--cgroup v1] -- python -m pytest -q tests/test_oom.py).

Every job names its user (--user nobody): the default user is not what
these tests are about."""

import json
import os
import subprocess
import time

import pytest

from conftest import SLOWDOWN, STARTER, process_alive, wait_for, wait_running

PY = "/usr/bin/python3"
# Touches every page it allocates, 16 MiB at a time, until the OOM killer comes.
HOG = "b = []\nwhile True:\n    b.append(b'x' * (16 << 20))\n"


def _run(starter, tmp_path, *args, timeout=120):
    report = tmp_path / "report.json"
    events = tmp_path / "events.jsonl"
    p = starter("run", "--user", "nobody", "--report", str(report), "--events", str(events), *args,
                timeout=timeout)
    return p, json.loads(report.read_text()), [json.loads(l)["event"] for l in events.read_text().splitlines()]


def test_helper_oom_ends_the_job(starter, tmp_path):
    """The issue's case: a helper is OOM-killed while the main process waits
    for a 30 s sleeper.  The whole job ends at once, reason oom."""
    script = f"sleep 30 & {PY} -c \"$HOG\"; wait"
    p, r, events = _run(starter, tmp_path, "--memory", "64M", "--env", f"HOG={HOG}", "--", "sh", "-c", script)
    assert r["reason"] == "oom", r
    assert r["oom"] is True and r["oom_kills"] >= 1 and r["oom_policy"] == "kill"
    assert p.returncode == 137 and r["signal"] == 9
    assert r["wall_s"] < 10 * SLOWDOWN, r  # not the sleeper's 30 s
    assert r["pids_current"] in (0, None)
    assert "oom" in events and events[-1] == "exited"


def test_oom_policy_continue_lets_the_main_process_finish(starter, tmp_path):
    script = f"{PY} -c \"$HOG\"; echo main finished; exit 3"
    p, r, events = _run(starter, tmp_path, "--memory", "64M", "--oom-policy", "continue",
                        "--env", f"HOG={HOG}", "--", "sh", "-c", script)
    assert p.returncode == 3 and "main finished" in p.stdout
    assert r["reason"] == "exited" and r["exit_code"] == 3, r
    assert r["oom"] is True and r["oom_kills"] >= 1 and r["oom_policy"] == "continue"
    assert "oom" in events


def test_no_oom_is_reported_as_such(starter, tmp_path):
    p, r, events = _run(starter, tmp_path, "--memory", "64M", "--", "true")
    assert p.returncode == 0 and r["reason"] == "exited"
    assert r["oom"] in (False, None) and r["oom_policy"] == "kill"
    assert "oom" not in events


def test_oom_policy_in_the_job_file_and_refused_values(starter, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"oom_policy": "sometimes", "command": ["true"], "user": "nobody"}))
    p = starter("run", "--job", str(job))
    assert p.returncode == 125 and p.stderr.startswith("starter: oom-policy"), p.stderr
    assert len(p.stderr.splitlines()) == 1
    job.write_text(json.dumps({"oom_policy": "continue", "command": ["true"], "user": "nobody",
                               "report": str(tmp_path / "r.json")}))
    p = starter("run", "--job", str(job))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "r.json").read_text())["oom_policy"] == "continue"
    p = starter("run", "--user", "nobody", "--", "true", env={**os.environ, "STARTER_KILL_TIMEOUT": "x"})
    assert p.returncode == 125 and "STARTER_KILL_TIMEOUT" in p.stderr


# ---------------------------------------------------------------- unkillable

def _v1_freezer():
    """(mount point, the starter's own freezer cgroup) of a v1 freezer
    hierarchy, or None (pure v2)."""
    mnt = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _, opts = post.split()[:3]
            if fstype == "cgroup" and "freezer" in opts.split(","):
                mnt = pre.split()[4]
    if mnt is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if "freezer" in ctrls.split(","):
                return mnt, path
    return None


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _write(path, value):
    with open(path, "w") as f:
        f.write(value)


def _load(state_dir, job_id):
    try:
        with open(os.path.join(state_dir, job_id + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def test_unkillable_process_costs_no_cpu_and_is_reported(starter, tmp_path, state_dir):
    """A D-state stand-in: a job process frozen in a v1 freezer cgroup the
    test makes (the starter never uses the v1 freezer on hybrid, and on v1
    freezes only the job's own), so SIGKILL stays pending.  The main process
    (PID 1 of the job's namespace) is then stuck in its exit, waiting for it.
    The starter waits without burning CPU, reports `unkillable` after the
    kill timeout, and leaves the job to gc, which reclaims it once thawed."""
    fz = _v1_freezer()
    if fz is None:
        pytest.skip("needs a cgroup v1 freezer hierarchy for the stand-in: on pure cgroup v2 "
                    "cgroup.kill gets through the v2 freezer, so no frozen process is unkillable")
    mnt, own = fz
    freezer = os.path.join(mnt, own.lstrip("/"), f"starter-test-freeze-{os.getpid()}")
    job_id = f"unkillable-{os.getpid()}"
    report = tmp_path / "report.json"
    env = {**os.environ, "STARTER_KILL_TIMEOUT": str(4 * SLOWDOWN)}
    # Files, not pipes: the stuck processes keep the job's stdout open.
    errf = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([STARTER, "run", "--user", "nobody", "--id", job_id, "--report", str(report),
                             "--", "sh", "-c", "sleep 300 & wait"],
                            env=env, stdout=subprocess.DEVNULL, stderr=errf, text=True)
    os.mkdir(freezer)
    victim = track = None
    ok = False
    try:
        st = wait_running(state_dir, job_id, timeout=20)
        track = st["cgroup"].get("unified") or st["cgroup"]["memory"]

        def sleeper():
            pids = [int(x) for x in open(os.path.join(track, "cgroup.procs")).read().split()]
            return next((p for p in pids if p != st["pid"]), None)

        victim = wait_for(sleeper, "the job's sleep", timeout=20)
        _write(os.path.join(freezer, "cgroup.procs"), str(victim))
        _write(os.path.join(freezer, "freezer.state"), "FROZEN")
        wait_for(lambda: open(os.path.join(freezer, "freezer.state")).read().strip() == "FROZEN",
                  "the freezer", timeout=20)

        assert starter("kill", job_id).returncode == 0
        wait_for(lambda: (_load(state_dir, job_id) or {}).get("state") == "killing", "the kill", timeout=20)
        # From the kill on, an observation window (shorter than the kill
        # timeout): how much CPU the waiting starter burns in it.
        t0, c0 = time.monotonic(), _cpu_ticks(proc.pid)
        time.sleep(2.5)
        used = (_cpu_ticks(proc.pid) - c0) / os.sysconf("SC_CLK_TCK")
        waited = time.monotonic() - t0
        assert proc.poll() is None, "the starter gave up before the kill timeout"
        assert used <= 0.02 * waited * SLOWDOWN, f"the waiting starter used {used:.3f} s CPU in {waited:.1f} s"

        proc.wait(timeout=60 * SLOWDOWN)
        errf.seek(0)
        err = errf.read()
        assert proc.returncode == 125, err
        r = json.loads(report.read_text())
        assert r["reason"] == "unkillable" and r["kill_reason"] == "killed", r
        stuck = {u["pid"]: u for u in r["unkillable"]}
        assert victim in stuck and stuck[victim]["wchan"], r["unkillable"]
        assert "unkillable" in err and len(err.splitlines()) == 1, err
        # The entry, the cgroup and the lock stay for gc; the lock is free.
        st = _load(state_dir, job_id)
        assert st and st["state"] == "reclaiming", st
        assert os.path.isdir(track)
        ok = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errf.close()
        _write(os.path.join(freezer, "freezer.state"), "THAWED")
        if not ok:  # leave the node clean for the next test anyway
            wait_for(lambda: victim is None or not process_alive(victim), "the thawed process to die", timeout=20)
            starter("gc")
            os.rmdir(freezer)
    # Thawed, the SIGKILL is delivered; then gc reclaims everything.
    wait_for(lambda: not process_alive(victim), "the thawed process to die", timeout=20)
    g = starter("gc")
    assert g.returncode == 0, g.stderr
    assert _load(state_dir, job_id) is None
    assert not os.path.exists(track)
    os.rmdir(freezer)
