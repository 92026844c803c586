"""A uid of its own for every job that names no user (starter/callers/uids.py), and
processes of a job's uid found outside its cgroup (starter/job/strays.py).

Through the real CLI: two default jobs share neither files nor per-uid
kernel quotas; many default jobs never share a uid while they run; a
kill -9 of their starters and a gc give every uid back; a same-uid host
daemon's process started for the job is killed (transient uid) or reported
(named user).
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import SLOWDOWN, STARTER, leases, process_alive

FIRST = 0x70000000 + 8000


def _range(policy, n, first=FIRST):
    policy(defaults=f'job_uids = "{first}-{first + n - 1}"\n')


@pytest.fixture
def exdir():
    d = tempfile.mkdtemp(prefix="starter-exec-", dir="/var/lib")     # /tmp, /var/tmp: private in a job
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(*args, **kw):
    return subprocess.Popen([STARTER, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def _line(proc):
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    return line


def test_two_default_jobs_cannot_reach_each_others_files(policy, exdir, state_dir):
    """Both have scratches in one execute directory: B can list it, but can
    neither read nor overwrite A's file (0666 in A's 0700 scratch)."""
    a = _start("--execute-dir", exdir, "--", "sh", "-c",
               "umask 0; echo secret > s; pwd; id -u; read x; cat s", stdin=subprocess.PIPE)
    try:
        a_dir, a_uid = _line(a), _line(a)
        b = subprocess.run([STARTER, "run", "--execute-dir", exdir, "--", "sh", "-c",
                            f"id -u; ls {exdir} | wc -l; cat {a_dir}/s && echo READ; "
                            f"echo mine > {a_dir}/s && echo WROTE; true"],
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 0, b.stderr
        out = b.stdout.split("\n")
        assert out[0] != a_uid and out[1] == "2", out
        assert "READ" not in b.stdout and "WROTE" not in b.stdout, b.stdout
        out, _ = a.communicate("\n", timeout=30)
        assert out == "secret\n"                   # A's file as A left it
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()


QUOTAS = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init() >= 0:
    n += 1
print("inotify", n, os.strerror(ctypes.get_errno()), flush=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
a = attr(0, 10, 8192, 0)
q = 0
while rt.mq_open(("/q%d" % q).encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(a)) >= 0:
    q += 1
print("mqueues", q, os.strerror(ctypes.get_errno()), flush=True)
if sys.argv[1] == "hold":
    sys.stdin.readline()
"""


def test_per_uid_quotas_are_not_shared(policy, tmp_path):
    """A exhausts its uid's inotify instances and POSIX message queue bytes
    and holds them; B, another default job, still gets its own."""
    (tmp_path / "q.py").write_text(QUOTAS)
    tmp_path.chmod(0o755)
    a = subprocess.Popen([STARTER, "run", "--ro-bind", f"{tmp_path}:/srv", "--", "python3", "/srv/q.py", "hold"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ino, mq = a.stdout.readline().split(), a.stdout.readline().split()
        assert ino[0] == "inotify" and int(ino[1]) > 0 and mq[0] == "mqueues" and int(mq[1]) > 0, (ino, mq)
        b = subprocess.run([STARTER, "run", "--ro-bind", f"{tmp_path}:/srv", "--", "python3", "/srv/q.py", "go"],
                           capture_output=True, text=True, timeout=60)
        got = [l.split() for l in b.stdout.splitlines()]
        assert [int(got[0][1]), int(got[1][1])] == [int(ino[1]), int(mq[1])], (got, ino, mq)
    finally:
        a.communicate("\n", timeout=30)


def test_many_default_jobs_never_share_a_uid(policy, state_dir):
    """1,000 default jobs, 50 at once, from a range of 64 uids (so uids are
    reused all the time): no two jobs ran at the same time with one uid.
    Each job says its uid and when it ran, from inside (its run lies within
    its lease), and the report says the same uid."""
    _range(policy, 64)
    reports = tempfile.mkdtemp(prefix="starter-uids-")
    running, spans, n = {}, [], 1000
    script = "echo $(id -u) $(date +%s.%N); sleep 0.05; date +%s.%N"
    try:
        i = 0
        while i < n or running:
            while i < n and len(running) < 50:
                p = subprocess.Popen([STARTER, "run", "--report", f"{reports}/{i}.json", "--", "sh", "-c", script],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                running[p] = i
                i += 1
            for p in [p for p in running if p.poll() is not None]:
                out, err = p.communicate()
                assert p.returncode == 0, err
                (uid, start), end = out.split("\n")[0].split(), out.split("\n")[1]
                with open(f"{reports}/{running.pop(p)}.json") as f:
                    assert json.load(f)["uid"] == int(uid)
                spans.append((int(uid), float(start), float(end)))
            time.sleep(0.005)
        by_uid = {}
        for uid, s, e in spans:
            assert FIRST <= uid < FIRST + 64
            by_uid.setdefault(uid, []).append((s, e))
        for uid, ss in by_uid.items():
            ss.sort()
            for (s1, e1), (s2, e2) in zip(ss, ss[1:]):
                assert s2 > e1, (uid, (s1, e1), (s2, e2))     # the next ran after the last ended
        assert len(spans) == n and len(by_uid) > 32           # reuse was spread over the range
        assert not leases(state_dir)
    finally:
        for p in running:
            p.kill()
            p.wait()
        if running:             # a failed run: what the killed starters held
            subprocess.run([STARTER, "gc"], capture_output=True, timeout=120)
        shutil.rmtree(reports, ignore_errors=True)


def test_kill9_of_every_starter_then_gc_frees_every_uid(policy, state_dir):
    _range(policy, 200)
    before = set(leases(state_dir))
    procs = [subprocess.Popen([STARTER, "run", "--", "sh", "-c", "echo up; sleep 300"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(50)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "up"
        leased = set(leases(state_dir)) - before
        assert len(leased) == 50
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            p.stdout.close()
    r = subprocess.run([STARTER, "gc"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not leases(state_dir), r.stdout
    # (zombies aside: a starter's dead child waits for the host's init to reap it)
    left = [l.split() for l in subprocess.run(["ps", "-eo", "ruid=,stat="], capture_output=True,
                                              text=True).stdout.splitlines()]
    assert not leased & {int(u) for u, st in left if not st.startswith("Z")}


# ---------------------------------------------------------------- escapes

def _host_tmux(uid, sock):
    """A tmux server of `uid` on this host, its socket in a directory the job
    is given: the same-uid daemon a job can ask to start processes for it.
    SHELL is set: without it tmux takes the account's shell, and nobody's is
    nologin, which ends the session, and the server, at once."""
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env", "HOME=/", "SHELL=/bin/sh",
                    "tmux", "-S", sock, "new-session", "-d", "sleep 600"], check=True, timeout=30)
    return int(subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                               "tmux", "-S", sock, "display", "-p", "#{pid}"],
                              capture_output=True, text=True, check=True, timeout=30).stdout)


# The job asks the host's tmux for a window running `sleep N`, and waits
# (up to 10 s) until the window's shell has become that sleep: an escape
# check right after would otherwise find the shell instead.
_ASK_SLEEP = ("p=$(tmux -S {sock} new-window -d -P -F '#{{pane_id}}' 'exec sleep {n}') && i=0 && "
              "while [ \"$(tmux -S {sock} display -p -t \"$p\" '#{{pane_current_command}}')\" != sleep ] "
              "&& [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; echo asked")


def _end_host_tmux(uid, d, server, before):
    """Stop _host_tmux's server, kill the sleeps it started for the test
    (not those of `before`), remove its directory."""
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "tmux", "-S", f"{d}/s",
                    "kill-server"], capture_output=True, timeout=30)
    for pid in _pids_of(uid, "sleep") - before:
        os.kill(pid, signal.SIGKILL)
    if server and process_alive(server):
        os.kill(server, signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def _pids_of(uid, comm):
    out = subprocess.run(["pgrep", "-u", str(uid), "-x", comm], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (scripts/setup --test installs it)")
def test_escape_of_a_transient_uid_is_killed_and_reported(policy, tmp_path):
    uid = FIRST + 4000
    _range(policy, 1, uid)
    d = tempfile.mkdtemp(prefix="starter-tmux-", dir="/var/lib")
    os.chown(d, uid, uid)
    server = job = None
    try:
        report = tmp_path / "r.json"
        # The host's tmux of the uid starts once the job holds the uid: no
        # uid is leased while a process of it lives.
        job = subprocess.Popen([STARTER, "run", "--id", "esc-t", "--report", str(report), "--bind", d, "--",
                                "sh", "-c", f"echo ready; read x; tmux -S {d}/s new-window -d 'exec sleep 1234' "
                                "&& echo asked; read x"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert job.stdout.readline() == "ready\n"
        server = _host_tmux(uid, f"{d}/s")
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.stdout.readline() == "asked\n"
        # While the job runs, `starter status` shows it too (the job's own
        # processes never). tmux starts the window through its shell, which
        # becomes sleep a moment later: ask until it has.
        deadline = time.monotonic() + 5 * SLOWDOWN
        while True:
            st = json.loads(subprocess.run([STARTER, "status", "esc-t", "--json"], capture_output=True, text=True,
                                           check=True, timeout=30).stdout)
            comms = {e["comm"] for e in st["escaped"]}
            if "sleep" in comms or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "sleep" in comms, st["escaped"]
        for e in st["escaped"]:         # none of them is in the job's cgroup
            try:
                with open(f"/proc/{e['pid']}/cgroup") as f:
                    assert "job-esc-t" not in f.read(), e
            except FileNotFoundError:
                pass
        out, err = job.communicate("\n", timeout=60)
        p = subprocess.CompletedProcess(job.args, job.returncode, out, err)
        assert p.returncode == 0, (p.stdout, p.stderr)
        r = json.loads(report.read_text())
        comms = {e["comm"] for e in r["escaped"]}
        assert "sleep" in comms and r["escaped_action"] == "killed", r
        assert "escaped" in p.stderr and len(p.stderr.splitlines()) == 1
        deadline = time.monotonic() + 5 * SLOWDOWN
        while (_pids_of(uid, "sleep") or process_alive(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pids_of(uid, "sleep") and not process_alive(server)
    finally:
        if job is not None and job.poll() is None:
            job.terminate()             # vacate: the starter kills the job and cleans up
            job.communicate(timeout=60)
        if server and process_alive(server):
            os.kill(server, signal.SIGKILL)
        for pid in _pids_of(uid, "sleep"):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (scripts/setup --test installs it)")
def test_escape_of_a_named_user_is_reported(policy, tmp_path):
    # A uid nothing else on the node uses (--user by number: no account
    # needed), so that only the job's escape is found.
    uid = 2000000000 + os.getpid() % 100000
    d = tempfile.mkdtemp(prefix="starter-tmux-", dir="/var/lib")
    os.chown(d, uid, uid)
    server, before = None, _pids_of(uid, "sleep")
    try:
        server = _host_tmux(uid, f"{d}/s")
        report = tmp_path / "r.json"
        p = subprocess.run([STARTER, "run", "--user", str(uid), "--report", str(report), "--bind", d, "--",
                            "sh", "-c", _ASK_SLEEP.format(sock=f"{d}/s", n=4321)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "asked" in p.stdout, (p.stdout, p.stderr)
        r = json.loads(report.read_text())
        assert [e["comm"] for e in r["escaped"]] == ["sleep"] and r["escaped_action"] == "reported", r
        # reported, not killed; the server itself started before the job: not the job's
        assert r["escaped"][0]["pid"] in _pids_of(uid, "sleep") and process_alive(server)
    finally:
        _end_host_tmux(uid, d, server, before)


def test_no_escape_report_is_empty(policy, tmp_path):
    report = tmp_path / "r.json"
    subprocess.run([STARTER, "run", "--report", str(report), "--", "true"], check=True, timeout=60)
    r = json.loads(report.read_text())
    assert r["escaped"] == [] and "escaped_action" not in r


@pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (scripts/setup --test installs it)")
def test_escape_of_a_caller_is_reported_past_its_relay(policy):
    """A caller that is not root: its relay, a process of the job's uid, is
    known to the escape check (one probe, no /proc walk when it is alone),
    and never hides a process a same-uid daemon started for the job."""
    from conftest import UID, caller_argv

    d = tempfile.mkdtemp(prefix="starter-tmux-", dir="/var/lib")
    os.chown(d, UID, UID)
    policy(f'[callers]\nbind = ["{d}"]\n')
    server, before = None, _pids_of(UID, "sleep")
    try:
        server = _host_tmux(UID, f"{d}/s")
        report = f"{d}/r.json"
        p = subprocess.run(caller_argv("run", "--report", report, "--bind", d, "--",
                                       "sh", "-c", _ASK_SLEEP.format(sock=f"{d}/s", n=4322)),
                           capture_output=True, text=True, timeout=60 * SLOWDOWN, cwd="/")
        assert p.returncode == 0 and "asked" in p.stdout, (p.stdout, p.stderr)
        r = json.loads(open(report).read())
        # (tmux's shell for the window, sh or bash, may not have become sleep yet)
        mine = {e["comm"] for e in r["escaped"] if e["pid"] not in before}
        assert mine & {"sleep", "sh", "bash"} and r["escaped_action"] == "reported", r
        # ... and a caller's job with nothing escaping reports nothing (its relay is not an escape)
        p = subprocess.run(caller_argv("run", "--report", report, "--", "true"), capture_output=True, text=True,
                           timeout=60 * SLOWDOWN, cwd="/")
        assert p.returncode == 0, p.stderr
        r = json.loads(open(report).read())
        assert not [e for e in r["escaped"] if e["comm"] == "starter"], r
    finally:
        _end_host_tmux(UID, d, server, before)
