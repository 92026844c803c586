"""--delegate (issue 15): a pilot job manages its own cgroup subtree while the
starter keeps its limits above it, accounts for it, kills and removes it.

On a v1 or hybrid host (this project's host) only the refusal runs; the pilot
tests need a pure cgroup v2 host with nsdelegate (scripts/vm-test).  The
pilot is an unprivileged job (the default account) playing glideinWMS: two
payload cgroups with their own limits, one payload OOMs, the other is frozen
and killed; everything is synchronised on events (waitpid, cgroup.events,
a fifo), never on sleeps."""

import json
import os
import stat
import subprocess

import pytest

from conftest import SLOWDOWN, process_alive
from starter.cgroups import files, hierarchy, subtree

PY = "/usr/bin/python3"


def _layout():
    return hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"), files.read_text("/proc/self/cgroup"))


def _pure_v2_or_skip():
    lay = _layout()
    if lay.kind != "v2":
        pytest.skip(f"host cgroups are {lay.kind}: --delegate needs pure cgroup v2 (scripts/vm-test)")
    if "nsdelegate" not in hierarchy.super_options(files.read_text("/proc/self/mountinfo"), lay.unified.mount_point):
        pytest.skip("the cgroup2 mount lacks nsdelegate: --delegate is refused here")


# ---------------------------------------------------------------- everywhere

def test_refused_on_v1_and_hybrid(starter, tmp_path):
    if _layout().kind == "v2":
        pytest.skip("pure cgroup v2 host: --delegate is allowed here")
    p = starter("run", "--delegate", "--", "true")
    assert p.returncode == 125, p
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "--delegate needs a pure cgroup v2 host" in lines[0] and "not safe" in lines[0]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["true"], "delegate": True}))
    p = starter("run", "--job", str(job))
    assert p.returncode == 125 and len(p.stderr.splitlines()) == 1 and "not safe" in p.stderr


def test_job_file_delegate_must_be_a_boolean(starter, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["true"], "delegate": "yes"}))
    p = starter("run", "--job", str(job))
    assert p.returncode == 125 and len(p.stderr.splitlines()) == 1 and "delegate" in p.stderr


def test_payload_walk_escapes_names_and_follows_no_link(tmp_path):
    """The walk over the job's sub-cgroups on plain directories: names are
    the job's (escaped, bounded), links are not followed, the count limit
    holds and what is left out is counted."""
    top = tmp_path / "job-x"
    top.mkdir()
    (top / "a").mkdir()
    (top / "a" / "deep").mkdir()
    (top / "a" / "deep" / "memory.peak").write_text("12345\n")
    (top / "a" / "deep" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n")
    (top / "a" / "deep" / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    os.mkdir(os.fsencode(str(top)) + b"/bad\n\x1b[31m\\name")
    (top / "z").mkdir()
    (top / ("y" * 255)).mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").mkdir()
    os.symlink(outside, top / "link")
    got, left = subtree.subtree_figures(str(top), 64)
    names = [g["name"] for g in got]
    assert names == ["a", "a/deep", "bad\\x0a\\x1b[31m\\x5cname", "y" * 255, "z"]
    assert left == 0
    deep = got[1]
    assert deep["memory_peak_bytes"] == 12345 and deep["oom_kill"] == 2 and deep["oom"] == 1
    assert subtree.ran_out_of_memory(deep) and not subtree.ran_out_of_memory(got[0])
    assert deep["cpu_s"] == 1.5 and "memory_peak_bytes" not in got[0]
    got, left = subtree.subtree_figures(str(top), 2)
    assert [g["name"] for g in got] == ["a", "a/deep"] and left == 3
    assert len(subtree.show_name(b"\xff" * 255)) == subtree.NAME_MAX_SHOWN


# ---------------------------------------------------------------- pure v2 (VM)

# What every pilot script below starts with: its cgroup root (the job's
# subtree, through its cgroup namespace) and a plain write, no buffering.
PILOT_LIB = r'''
import os
CG = "/sys/fs/cgroup"

def w(path, value):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)
'''

# The pilot: runs as the job's (unprivileged) user; prints one JSON line.
PILOT = PILOT_LIB + r'''
import errno, json, select, sys
out = {}

def refused(path, value):
    try:
        w(path, value)
    except OSError as e:
        return errno.errorcode.get(e.errno, e.errno)
    return "written"

def wait_events(d, key, value):
    fd = os.open(d + "/cgroup.events", os.O_RDONLY)
    p = select.poll()
    p.register(fd, select.POLLPRI)
    try:
        while True:
            ev = dict(l.split() for l in os.pread(fd, 4096, 0).decode().splitlines())
            if ev.get(key) == value:
                return
            p.poll()
    finally:
        os.close(fd)

def payload(name, limit, argv):
    d = CG + "/" + name
    os.mkdir(d)
    w(d + "/memory.max", limit)
    if os.path.exists(d + "/memory.swap.max"):
        w(d + "/memory.swap.max", 0)
    w(d + "/pids.max", 50)
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(wr)
        os.read(r, 1)
        os.execv(argv[0], argv)
    os.close(r)
    w(d + "/cgroup.procs", pid)     # moved before it runs anything
    os.close(wr)
    return d, pid

out["uid"] = os.getuid()
out["self"] = open("/proc/self/cgroup").read().strip()
out["subtree_control"] = open(CG + "/cgroup.subtree_control").read().split()
out["own_limit"] = open(CG + "/memory.max").read().strip()
# The starter's limits and everything outside the subtree stay out of reach.
out["raise_memory"] = refused(CG + "/memory.max", "max")
out["raise_pids"] = refused(CG + "/pids.max", "max")
out["oom_group"] = refused(CG + "/memory.oom.group", 0)
out["max_depth"] = refused(CG + "/cgroup.max.depth", "max")
out["to_parent"] = refused(CG + "/../cgroup.procs", os.getpid())
out["to_root"] = refused(CG + "/cgroup.procs", os.getpid())
hog = "b = []\nwhile True:\n    b.append(bytearray(16 << 20))\n"
d1, p1 = payload("p256", 256 << 20, [sys.executable, "-c", hog])
d2, p2 = payload("p512", 512 << 20, ["/bin/sleep", "300"])
out["payload_limit_above_own"] = refused(d2 + "/memory.max", 2 << 30)
_, st = os.waitpid(p1, 0)
out["p256_signal"] = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
w(d2 + "/cgroup.freeze", 1)
wait_events(d2, "frozen", "1")
w(d2 + "/cgroup.kill", 1)
_, st = os.waitpid(p2, 0)
out["p512_signal"] = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
print(json.dumps(out), flush=True)
'''


@pytest.mark.cgroup_v2
def test_pilot_payloads_limits_oom_and_report(starter, tmp_path):
    _pure_v2_or_skip()
    report = tmp_path / "report.json"
    p = starter("run", "--id", "pilot1", "--delegate", "--memory", "1G", "--pids", "500",
                "--report", str(report), "--", PY, "-c", PILOT, timeout=300 * SLOWDOWN)
    assert p.returncode == 0, (p.stdout, p.stderr)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    r = json.loads(report.read_text())
    assert out["uid"] != 0 and out["self"] == "0::/job"
    assert {"memory", "pids", "cpu"} <= set(out["subtree_control"])
    assert out["own_limit"] == str(1 << 30)
    for k in ("raise_memory", "raise_pids", "oom_group", "max_depth"):
        assert out[k] in ("EPERM", "EACCES"), (k, out)
    assert out["to_parent"] in ("ENOENT", "EACCES", "EPERM", "EROFS"), out
    assert out["to_root"] == "EBUSY", out      # no internal processes, and still inside
    assert out["payload_limit_above_own"] == "written"     # but the 1G above still holds
    assert out["p256_signal"] == 9 and out["p512_signal"] == 9

    # The payload OOM did not end the job; the report names the payload.
    assert r["reason"] == "exited" and r["exit_code"] == 0 and r["oom"] is False, r
    assert r["delegated"] is True and r["payloads_truncated"] == 0
    assert r["payloads_oom"] == ["p256"], r["payloads"]
    pl = {x["name"]: x for x in r["payloads"]}
    assert set(pl) == {"job", "p256", "p512"}, pl
    assert pl["p256"]["oom_kill"] >= 1 and pl["p512"]["oom_kill"] == 0
    assert pl["p256"]["memory_max_bytes"] == 256 << 20 and pl["p512"]["memory_max_bytes"] == 2 << 30
    if "memory_peak_bytes" in pl["p256"]:
        assert 200 << 20 <= pl["p256"]["memory_peak_bytes"] <= 256 << 20, pl["p256"]
        assert r["memory_peak_bytes"] >= pl["p256"]["memory_peak_bytes"]
    # Totals cover the whole subtree.
    assert r["oom_kills"] >= 1
    assert r["cpu_user_s"] + r["cpu_system_s"] >= pl["p256"]["cpu_s"] + pl["job"]["cpu_s"] - 0.01


VACATE_PILOT = PILOT_LIB + r'''
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the kill after the grace must do it

def start(d):
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(wr)
        os.read(r, 1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.execv("/bin/sleep", ["sleep", "300"])
    os.close(r)
    w(d + "/cgroup.procs", pid)
    os.close(wr)

os.mkdir(CG + "/frozen")
start(CG + "/frozen")
w(CG + "/frozen/cgroup.freeze", 1)
deep = CG
for i in range(10):
    deep += "/d%d" % i
    os.mkdir(deep)
start(deep)
os.mkdir(CG + "/hidden")
start(CG + "/hidden")
os.chmod(CG + "/hidden", 0)
os.mkdir(CG + "/tdom")
os.mkdir(CG + "/tdom/t")
w(CG + "/tdom/t/cgroup.type", "threaded")
start(CG + "/tdom")
w(sys.argv[1], "ready")
signal.pause()
'''


STARTER = os.path.join(os.path.dirname(__file__), "..", ".venv", "bin", "starter")


def _start_pilot(tmp_path, state_dir, job_id):
    """Start VACATE_PILOT; once it says ready -> (proc, its cgroup, the host
    pids in its subtree, the cgroups in it)."""
    from starter.cgroups.dirs import subdirs_bottom_up

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    fifo = shared / "ready"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proc = subprocess.Popen([STARTER, "run", "--id", job_id, "--delegate", "--memory", "1G", "--pids", "500",
                             "--grace", "0.5", "--bind", f"{shared}:/srv",
                             "--report", str(tmp_path / "report.json"),
                             "--", PY, "-c", VACATE_PILOT, "/srv/ready"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import select

        poll = select.poll()
        poll.register(rfd, select.POLLIN)
        ready = poll.poll(int(240_000 * SLOWDOWN / 7)) and os.read(rfd, 16) == b"ready"
    finally:
        os.close(rfd)
    if not ready:
        proc.kill()
        raise AssertionError(f"the pilot never said ready: {proc.communicate()}")
    with open(os.path.join(state_dir, f"{job_id}.json")) as f:
        top = json.load(f)["cgroup"]["unified"]
    cgs = subdirs_bottom_up(top)
    pids = set()
    for d in cgs:
        for name in ("cgroup.procs", "cgroup.threads"):
            pids.update(files.read_pids(os.path.join(d, name)))
    return proc, top, pids, cgs


def _gone(proc):
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.cgroup_v2
def test_vacate_empties_and_removes_what_the_pilot_built(starter, tmp_path, state_dir):
    _pure_v2_or_skip()
    proc, top, pids, cgs = _start_pilot(tmp_path, state_dir, "pilot2")
    try:
        assert len(cgs) >= 15 and len(pids) >= 5, (cgs, pids)
        assert stat.S_IMODE(os.stat(os.path.join(top, "hidden")).st_mode) == 0
        assert files.read_text(os.path.join(top, "tdom", "t", "cgroup.type")).strip() == "threaded"
        assert os.stat(top).st_uid != 0 and os.stat(os.path.join(top, "memory.max")).st_uid == 0

        # status covers the whole subtree, payloads listed.
        sj = json.loads(starter("status", "pilot2", "--json", timeout=60 * SLOWDOWN).stdout)
        assert sj["delegate"] is True and sj["stats"]["pids_current"] >= 5, sj
        assert {"frozen", "hidden", "tdom"} <= {x["name"] for x in sj["payloads"]}, sj

        # `starter enter` lands in a leaf of its own, not in the pilot's cgroups.
        e = starter("enter", "pilot2", "--", "cat", "/proc/self/cgroup", timeout=120 * SLOWDOWN)
        assert e.returncode == 0 and e.stdout.strip().startswith("0::/enter-"), (e.stdout, e.stderr)

        v = starter("vacate", "pilot2", timeout=120 * SLOWDOWN)
        assert v.returncode == 0, (v.stdout, v.stderr)
        _, err = proc.communicate(timeout=120 * SLOWDOWN)
    finally:
        _gone(proc)
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["reason"] == "vacated", (r, err)
    assert not os.path.exists(top), "the delegated subtree was left behind"
    assert [pid for pid in pids if process_alive(pid)] == []
    names = {x["name"] for x in r["payloads"]}
    assert {"frozen", "hidden", "tdom", "tdom/t", "d0/d1/d2/d3/d4/d5/d6/d7/d8/d9"} <= names, names


@pytest.mark.cgroup_v2
def test_gc_after_kill9_removes_the_pilots_subtree(starter, tmp_path, state_dir):
    """The starter dies (kill -9) under a pilot with frozen, deep, chmod 000
    and threaded cgroups: its PID 1 dies with it, and gc kills and removes
    the rest bottom-up."""
    _pure_v2_or_skip()
    proc, top, pids, _ = _start_pilot(tmp_path, state_dir, "pilot3")
    try:
        proc.kill()
        proc.communicate(timeout=60 * SLOWDOWN)
        out = starter("gc", timeout=120 * SLOWDOWN)
        assert out.returncode == 0, (out.stdout, out.stderr)
    finally:
        _gone(proc)
    assert not os.path.exists(top), (out.stdout, out.stderr)
    assert [pid for pid in pids if process_alive(pid)] == []


JOB_OOM_PILOT = r'''
import os, sys
CG = "/sys/fs/cgroup"
os.mkdir(CG + "/nolimit")
r, wr = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(wr)
    os.read(r, 1)
    os.execv(sys.executable, [sys.executable, "-c",
             "b = []\nwhile True:\n    b.append(bytearray(16 << 20))\n"])
os.close(r)
with open(CG + "/nolimit/cgroup.procs", "w") as f:
    f.write(str(pid))
os.close(wr)
os.waitpid(pid, 0)
os.pause()     # the job-level group kill ends this too
'''


@pytest.mark.cgroup_v2
def test_reaching_the_jobs_own_limit_ends_the_job(starter, tmp_path):
    """A payload without a limit of its own reaches the job's: the starter's
    memory.oom.group on the job's cgroup kills the whole job, reason oom."""
    _pure_v2_or_skip()
    report = tmp_path / "report.json"
    p = starter("run", "--delegate", "--memory", "128M", "--report", str(report),
                "--", PY, "-c", JOB_OOM_PILOT, timeout=300 * SLOWDOWN)
    r = json.loads(report.read_text())
    assert r["reason"] == "oom" and r["oom"] is True and p.returncode == 137, (r, p.stderr)
    # No payload reached a limit of its own: the job did.
    assert r["payloads_oom"] == [], r["payloads"]
    assert {x["name"]: x for x in r["payloads"]}["nolimit"]["oom_kill"] >= 1


USERNS_PILOT = PILOT_LIB + r'''
import errno
assert os.getuid() == 0
os.mkdir(CG + "/p")
w(CG + "/p/memory.max", 64 << 20)
w(CG + "/p/cgroup.procs", os.getpid())
try:
    w(CG + "/memory.max", "max")
    print("raised")
except OSError as e:
    print(errno.errorcode[e.errno])
'''


@pytest.mark.cgroup_v2
def test_userns_root_pilot_owns_its_subtree(starter, tmp_path):
    """With --userns-root the subtree belongs to the mapped host uid: root in
    the job's user namespace manages it, and still cannot raise the limit."""
    _pure_v2_or_skip()
    p = starter("run", "--delegate", "--userns-root", "--memory", "256M", "--",
                PY, "-c", USERNS_PILOT, timeout=300 * SLOWDOWN)
    assert p.returncode == 0 and p.stdout.strip() in ("EPERM", "EACCES"), (p.stdout, p.stderr)


@pytest.mark.cgroup_v2
def test_freeze_kill_fallback_reaches_frozen_and_threaded_descendants():
    """Kernels before 5.14 (no cgroup.kill; --delegate is refused there, but
    a job can still have sub-cgroups): the freeze-and-SIGKILL fallback also
    empties a frozen sub-cgroup and a threaded one."""
    _pure_v2_or_skip()
    from starter import cgroups
    from starter.cgroups.dirs import EventsWatch
    from starter.cgroups.limits import Limits

    be = cgroups.backend_for(_layout(), f"starter-test-{os.getpid()}")
    cg = be.create(f"t{os.getpid()}-fallback", Limits(pids=50))
    procs = []
    try:
        top = cg.paths["unified"]
        for d in ("frozen", "tdom", "tdom/t"):
            os.mkdir(os.path.join(top, d))
        files.write(os.path.join(top, "tdom", "t", "cgroup.type"), "threaded")
        for d in ("frozen", "tdom", "tdom/t"):
            p = subprocess.Popen(["sleep", "300"])
            procs.append(p)
            files.write(os.path.join(top, d, "cgroup.procs"), p.pid)
        files.write(os.path.join(top, "frozen", "cgroup.freeze"), 1)
        assert files.read_pids(os.path.join(top, "tdom", "t", "cgroup.threads")) == [procs[2].pid]
        w = EventsWatch(os.path.join(top, "cgroup.events"))
        try:
            cg._kill_by_freezing()
            while not cg.is_empty():
                assert w.wait(30 * SLOWDOWN), "the fallback left processes behind"
        finally:
            w.close()
        assert [p.wait(10) for p in procs] == [-9, -9, -9]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        cg.destroy()
        be.close()
    assert not os.path.exists(top)
