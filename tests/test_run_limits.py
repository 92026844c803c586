"""Limits, accounting and cleanup through `starter run`, on whatever cgroup
layout this host has (hybrid natively, pure v2 in the VM)."""

import json
import os
import subprocess
import time

import pytest

from conftest import SLOWDOWN

PY = "/usr/bin/python3"


def _report(starter, tmp_path, *args, timeout=120):
    report = tmp_path / "report.json"
    events = tmp_path / "events.jsonl"
    p = starter("run", "--report", str(report), "--events", str(events), *args, timeout=timeout)
    return p, json.loads(report.read_text()), [json.loads(l)["event"] for l in events.read_text().splitlines()]


def test_fork_bomb_capped_and_killed(starter, tmp_path):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    p, r, _ = _report(starter, tmp_path, "--pids", "64", "--wall-time", "3", "--", PY, "-c", bomb)
    assert r["reason"] == "timeout" and p.returncode == 137
    if r.get("pids_peak") is not None:
        assert r["pids_peak"] <= 64
    assert "unkillable" not in r
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_double_forked_daemon_dies_with_the_job(starter, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the job is not root
    # The daemon setsid()s away and re-parents; it must not outlive the job,
    # and the report is written only once the cgroup is empty.  It holds the
    # write end of a FIFO for as long as it lives (sleep inherits it), and
    # says "up" through it first: the job exits only after that line, and the
    # FIFO reads EOF only once no process holds it (the daemon is dead).
    fifo = out / "alive"
    os.mkfifo(fifo, 0o666)
    fifo.chmod(0o666)
    alive = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the job: its open does not block
    try:
        script = ("(setsid sh -c 'echo up >&3; exec sleep 300' 3>/srv/alive </dev/null >/dev/null 2>&1 &) ; "
                  "read up </srv/alive; exit 0")
        p, r, _ = _report(starter, tmp_path, "--bind", f"{out}:/srv", "--", "sh", "-c", script)
        try:
            rest = os.read(alive, 64)
        except BlockingIOError:  # a writer holds it and has nothing to say: the daemon lives
            rest = None
        assert rest == b"", "the daemon outlived its job (it still holds the FIFO)"
    finally:
        os.close(alive)
    assert p.returncode == 0 and r["reason"] == "exited", (p.returncode, p.stderr, r)
    assert r["pids_current"] in (0, None)


def test_oom_is_reported_and_starter_survives(starter, tmp_path):
    hog = "b = []\nwhile True:\n    b.append(bytearray(16 << 20))\n"
    p, r, events = _report(starter, tmp_path, "--memory", "64M", "--", PY, "-c", hog)
    assert r["reason"] == "oom", r
    assert r["oom_kills"] >= 1 and r["signal"] == 9 and p.returncode == 137
    assert "oom" in events and events[-1] == "exited"


def test_cpu_time_of_a_busy_loop(starter, tmp_path):
    loop = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2.0:\n    pass\n"
    p, r, _ = _report(starter, tmp_path, "--", PY, "-c", loop)
    cpu = r["cpu_user_s"] + r["cpu_system_s"]
    # Plus interpreter start-up and exit, slower under emulation (STARTER_VM).
    assert 1.8 <= cpu <= (2.8 if os.environ.get("STARTER_VM") else 2.2), r


def test_memory_peak_of_512_mib(starter, tmp_path):
    touch = ("import mmap\nn = 512 << 20\nm = mmap.mmap(-1, n)\n"
             "for i in range(0, n, 4096):\n    m[i] = 1\n")
    p, r, _ = _report(starter, tmp_path, "--memory", "1G", "--", PY, "-c", touch)
    assert p.returncode == 0, p.stderr
    peak = r["memory_peak_bytes"]
    if peak is None:
        pytest.skip("this kernel has no memory peak file (memory.peak needs Linux 5.19 on v2)")
    assert 512 << 20 <= peak <= (512 << 20) * 1.05 + (8 << 20), r


def test_cpu_quota(starter, tmp_path):
    # A known amount of CPU work: 1 s of the process's own CPU time (start-up
    # included), the same whatever else runs on the node.
    loop = "import time\nwhile time.process_time() < 1.0:\n    pass\n"
    p, r, _ = _report(starter, tmp_path, "--cpus", "0.5", "--", PY, "-c", loop)
    assert p.returncode == 0, p.stderr
    cpu = r["cpu_user_s"] + r["cpu_system_s"]
    # The work is all counted (load cannot lower it: it is CPU time) ...
    assert cpu >= 0.9, r
    # ... and it ran at no more than half a CPU: at least ~2 s of wall time
    # (load only makes the wall time longer).
    assert cpu <= 0.5 * r["wall_s"] * 1.3 + 0.1, r


def test_limit_that_cannot_be_applied_fails_closed(starter, tmp_path, state_dir):
    p = starter("run", "--pids", "4194304000", "--", "true")
    assert p.returncode == 125 and p.stderr.startswith("starter: pids")


def test_job_subcgroup_frozen_and_chmodded_is_still_cleaned(starter, tmp_path, state_dir):
    """A job with a delegated cgroup could make, freeze and chmod its own
    sub-cgroups; the test plays that part from outside, on the live job."""
    proc = subprocess.Popen([os.path.join(os.path.dirname(__file__), "..", ".venv", "bin", "starter"),
                             "run", "--id", "subcg", "--report", str(tmp_path / "r.json"), "--grace", "0.5",
                             "--", "sh", "-c", "sleep 300 & sleep 300 & echo ready; wait"],
                            stdout=subprocess.PIPE, text=True)
    try:
        # The job says when both children run; the state file is polled (the
        # starter writes "running" around the release: no event announces it).
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 20 * SLOWDOWN
        st = None
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(state_dir, "subcg.json")) as f:
                    st = json.load(f)
                if st.get("state") == "running":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        assert st and st["state"] == "running"
        track = st["cgroup"].get("unified") or next(iter(st["cgroup"].values()))
        sub = os.path.join(track, "inner")
        os.mkdir(sub)
        pids = [int(x) for x in open(os.path.join(track, "cgroup.procs")).read().split()]
        victim = next(p for p in pids if p != st["pid"])
        with open(os.path.join(sub, "cgroup.procs"), "w") as f:
            f.write(str(victim))
        if os.path.exists(os.path.join(sub, "cgroup.freeze")):
            with open(os.path.join(sub, "cgroup.freeze"), "w") as f:
                f.write("1")
        for name in os.listdir(sub):
            os.chmod(os.path.join(sub, name), 0)
        os.chmod(sub, 0)
    finally:
        proc.terminate()
        assert proc.wait(30) == 137
        proc.stdout.close()
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["reason"] == "vacated" and "unkillable" not in r
    assert not os.path.exists(track)
