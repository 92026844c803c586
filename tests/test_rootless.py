"""A pilot without root (starter/rootless/): an ordinary account (tests/pilot.py:
starter-pilot, no sudo, subordinate ids) runs `starter` from the wheelhouse,
installed with `pip install --no-index` into a venv in its home, in a cgroup
the test delegates to it as a batch system would, or in none.  Checked: the
job in fresh namespaces as PID 1 under an id of its own, limits and the
freezer in the delegated cgroup, the user-mode network's LAN/WAN counts,
what is not enforced without a cgroup (and --require refusing), the
payload against the pilot, the admin commands, gc after a kill -9, and each
refusal in one line."""

import json
import os
import signal
import subprocess
import time

import pytest

import nethosts
import pilot as P
from conftest import REPO

pytestmark = pytest.mark.skipif(P.account() is None, reason="no pilot account: scripts/setup --test makes it")


@pytest.fixture(scope="module")
def venv():
    """The wheelhouse (scripts/build-wheel, once per run) in the pilot's venv.
    In a test VM (no network: the build fetches its dependencies' wheels)
    the one the host built, in the checkout's copy."""
    house = os.path.join(REPO, "dist", "wheelhouse")
    if os.environ.get("STARTER_VM"):
        if not os.path.isdir(house):
            pytest.fail("no dist/wheelhouse in the checkout: run scripts/build-wheel on the host first "
                        "(scripts/test's native run does)")
    else:
        r = subprocess.run([os.path.join(REPO, "scripts", "build-wheel")], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    P.install(house)
    return P.venv()


@pytest.fixture
def state():
    """The pilot's state directory, empty before and after the test."""
    d = os.path.join(P.runtime_dir(), "starter")
    yield d
    left = os.listdir(d) if os.path.isdir(d) else []
    u = os.path.join(P.runtime_dir(), "starter-uids")
    leases = os.listdir(u) if os.path.isdir(u) else []
    assert not left and not leases, (left, leases)


def report_of(name="rep.json"):
    path = os.path.join(P.account().pw_dir, name)
    with open(path) as f:
        doc = json.load(f)
    os.unlink(path)
    return doc


def run(*args, cgroup=None, env=None, **kw):
    return P.as_pilot(["starter", "run", "--report", "rep.json", *args], cgroup=cgroup, check=False,
                      extra_env=env, **kw)


def refused(r, what):
    assert r.returncode == 125 and r.stderr.count("\n") == 1 and what in r.stderr, (r.returncode, r.stderr)


def test_a_job_in_fresh_namespaces_as_pid_1_under_its_own_id(venv, state):
    with P.Delegated() as d:
        r = run("--", "sh", "-c", "id -u; echo $$; readlink /proc/self/ns/pid; exit 3", cgroup=d)
        rep = report_of()
        assert r.returncode == 3, r.stderr
        uid, pid, pidns = r.stdout.split()
        assert pid == "1"
        assert pidns != os.readlink("/proc/self/ns/pid")
        assert 1000 <= int(uid) <= 65533, uid        # a subordinate id of the pilot's (transient)
        assert rep["uid"] == int(uid) and rep["exit_code"] == 3 and rep["cgroup"] != "none"
        assert rep["rootless"] == {"pilot_uid": P.account().pw_uid, "subordinate_ids": True}
        assert rep["not_enforced"] == {}
        # two jobs at once: two ids
        a = P.as_pilot(["starter", "run", "--", "sh", "-c", "id -u; sleep 1"], cgroup=d, popen=True)
        b = P.as_pilot(["starter", "run", "--", "sh", "-c", "id -u; sleep 1"], cgroup=d, popen=True)
        ua, ub = (p.communicate(timeout=60)[0].strip() for p in (a, b))
        assert ua != ub and a.returncode == b.returncode == 0


def test_memory_limit_kills_a_payload_over_it(venv, state):
    with P.Delegated() as d:
        r = run("--memory", "100M", "--", "python3", "-c", "b = bytearray(200 << 20); print('survived')", cgroup=d)
        rep = report_of()
        assert "survived" not in r.stdout
        assert rep["oom"] is True and rep["reason"] == "oom", rep


def test_suspend_resume_vacate_enter_status_of_a_running_job(venv, state):
    with P.Delegated() as d:
        job = P.as_pilot(["starter", "run", "--id", "pj1", "--report", "rep.json", "--", "sh", "-c",
                          "trap 'exit 7' TERM; while :; do echo tick >> /tmp/t; sleep 0.05; done"],
                         cgroup=d, popen=True)
        try:
            deadline = time.monotonic() + 20
            while "pj1" not in P.as_pilot(["starter", "ps"], check=False).stdout:
                assert time.monotonic() < deadline and job.poll() is None, job.communicate()
                time.sleep(0.1)

            def count():
                # (from the pilot's cgroup: enter clones into the job's)
                r = P.as_pilot(["starter", "enter", "pj1", "--", "sh", "-c", "wc -l < /tmp/t"], cgroup=d)
                return int(r.stdout)

            events = os.path.join([x for x in d.dirs if "/unified/" in x or x.startswith("/sys/fs/cgroup/starter")][0],
                                  "starter", "job-pj1", "cgroup.events")
            n = count()
            assert P.as_pilot(["starter", "suspend", "pj1"]).returncode == 0
            st = json.loads(P.as_pilot(["starter", "status", "pj1", "--json"]).stdout)
            assert st["state"] == "suspended", st
            with open(events) as f:
                assert "frozen 1" in f.read()
            assert P.as_pilot(["starter", "resume", "pj1"]).returncode == 0
            with open(events) as f:
                assert "frozen 0" in f.read()
            time.sleep(0.5)
            assert count() > n
            who = P.as_pilot(["starter", "enter", "pj1", "--", "sh", "-c", "id -u; echo $$"], cgroup=d).stdout.split()
            assert who[1] != "1" and 1000 <= int(who[0]) <= 65533
            assert P.as_pilot(["starter", "vacate", "pj1"]).returncode == 0
            job.communicate(timeout=60)
            assert job.returncode == 7
            assert report_of()["reason"] == "vacated"
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()


def test_user_mode_network_counts_lan_and_wan_bytes(venv, state):
    n_lan, n_wan = 1_000_000, 3_000_000
    with nethosts.site() as s, P.Delegated() as d:
        lan = s.serve("lan", "send", n_lan)
        wan = s.serve("wan", "recv", n_wan)
        code = (f"import socket\nc = socket.create_connection(('{s.lan_addr}', {lan.port})); n = 0\n"
                "while True:\n    b = c.recv(65536)\n    if not b: break\n    n += len(b)\n"
                "c.send(b'x'); c.close(); print('got', n)\n"
                f"w = socket.create_connection(('{s.wan_addr}', {wan.port})); w.sendall(b'y' * {n_wan})\n"
                "w.shutdown(socket.SHUT_WR); w.recv(1)\n"
                "import struct; i = w.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)\n"
                "print('retrans', struct.unpack_from('=Q', i, 208)[0] if len(i) >= 216 else 0); w.close()\n")
        # (--uplink: pasta's template interface; a node without a default route, as the VMs, needs it)
        r = run("--net", "nat", "--lan", s.lan_cidr, "--uplink", s.uplink, "--", "python3", "-c", code, cgroup=d)
        rep = report_of()
        assert r.returncode == 0, r.stderr
        assert f"got {n_lan}" in r.stdout
        assert f"received {n_wan}" in wan.result()[0]
        # What a sender put on the wire again crosses eth0 again, and counts
        # (pasta under TCG in the VMs drops some): the job's, and the LAN server's.
        resent_out = int(r.stdout.split("retrans")[1].split()[0])
        resent_in = nethosts.retransmitted(lan.result()[0])
        net = rep["network"]
        assert net["usermode"]["stack"] == "pasta"
        assert n_lan <= net["lan_in"]["bytes"] <= (n_lan + resent_in) * 1.01, (net, resent_in)
        assert n_wan <= net["wan_out"]["bytes"] <= (n_wan + resent_out) * 1.01, (net, resent_out)
        assert net["lan_out"]["bytes"] < n_lan * 0.01 and net["wan_in"]["bytes"] < n_wan * 0.01, net


def test_without_a_delegated_cgroup_the_report_says_what_is_not_enforced(venv, state):
    r = run("--", "sh", "-c", "echo $$")      # the pilot in the test's cgroup: root's, not its own
    rep = report_of()
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    assert rep["cgroup"] == "none"
    assert {"memory", "kill", "freeze", "accounting"} <= set(rep["not_enforced"]), rep
    refused(run("--require", "memory", "--", "true"), "--require memory: not enforced here")
    refused(run("--require", "all", "--", "true"), "kill")
    refused(run("--memory", "100M", "--", "true"), "needs a cgroup")
    for name in ("rep.json",):
        assert not os.path.exists(os.path.join(P.account().pw_dir, name)) or report_of(name)


def test_a_payload_cannot_signal_trace_or_read_the_pilot(venv, state, tmp_path):
    home = P.account().pw_dir
    secret = os.path.join(home, "secret")
    P.as_pilot(["sh", "-c", f"umask 077; echo pilot-only > {secret}"])
    holder = P.as_pilot(["sleep", "60"], popen=True)
    try:
        code = (
            "import ctypes, os, sys\n"
            f"pid = {holder.pid}\n"
            "out = []\n"
            "try:\n    os.kill(pid, 9); out.append('killed')\nexcept OSError as e: out.append('kill:' + str(e.errno))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "out.append('ptrace:%d' % libc.ptrace(16, pid, 0, 0))\n"
            f"try:\n    open('{secret}').read(); out.append('read')\nexcept OSError as e: out.append('read:' + str(e.errno))\n"
            "print(' '.join(out))\n")
        with P.Delegated() as d:
            r = run("--", "python3", "-c", code, cgroup=d)
            report_of()
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["kill:3", "ptrace:-1", "read:13"], r.stdout    # ESRCH, EACCES
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
        os.unlink(secret)


def test_without_subordinate_ids_the_job_is_the_pilot_without_capabilities(venv, state):
    env = {"STARTER_NO_SUBIDS": "1"}
    with P.Delegated() as d:
        r = run("--", "sh", "-c", "id -u; grep CapEff /proc/self/status", cgroup=d, env=env)
        rep = report_of()
    assert r.returncode == 0, r.stderr
    uid, _, caps = r.stdout.split()
    assert uid == "0" and int(caps, 16) == 0          # the pilot's uid, mapped to 0, no capability
    assert rep["rootless"]["subordinate_ids"] is False and "own-uid" in rep["not_enforced"]
    refused(run("--require", "own-uid", "--", "true", env=env), "own-uid")


def test_gc_after_kill_9_leaves_nothing(venv, state):
    with nethosts.site() as s, P.Delegated() as d:
        job = P.as_pilot(["starter", "run", "--id", "pj2", "--net", "nat", "--uplink", s.uplink, "--", "sleep", "60"],
                         cgroup=d, popen=True)
        deadline = time.monotonic() + 20
        while "running" not in P.as_pilot(["starter", "ps"], check=False).stdout:
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.1)
        os.kill(job.pid, signal.SIGKILL)      # setpriv exec'd the starter: this is it
        job.wait()
        deadline = time.monotonic() + 10
        while subprocess.run(["pgrep", "-u", P.NAME, "pasta"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "pasta outlived its starter"
            time.sleep(0.05)
        r = P.as_pilot(["starter", "gc"], cgroup=d, check=False)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "pj2" not in P.as_pilot(["starter", "ps"]).stdout


@pytest.mark.parametrize("args, what", [
    (["--disk", "1G", "--", "true"], "--disk needs the host's root"),
    (["--user", "nobody", "--", "true"], "--user needs the host's root"),
    (["--net", "job", "--", "true"], "--net job needs the host's root"),
    (["--require", "bogus", "--", "true"], "bogus"),
])
def test_what_needs_root_is_refused_in_one_line(venv, state, args, what):
    refused(run(*args), what)


def test_root_starter_refuses_only_what_the_job_gave_up(starter):
    """Root's starter enforces everything --require names, but the network
    of a --net host job."""
    assert starter("run", "--require", "all", "--", "true").returncode == 0
    r = starter("run", "--net", "host", "--require", "network", "--", "true")
    refused(r, "--require network: not enforced here (network: --net host)")


def _pure_v2():
    with open("/proc/self/mountinfo") as f:
        kinds = {line.partition(" - ")[2].split()[0] for line in f if " - cgroup" in line}
    return kinds == {"cgroup2"}


def test_a_pilot_inside_an_outer_starters_delegated_cgroup(venv, starter, tmp_path):
    """The pilot as a job of root's starter with --delegate (and
    --allow-userns: its own starter makes a user namespace): its jobs get
    cgroups in the subtree the outer job was given.  The outer job has
    NO_NEW_PRIVS, so newuidmap cannot help: the pilot's jobs run as its uid."""
    if not _pure_v2():
        pytest.skip("--delegate needs a pure cgroup v2 host: this runs in the v2 VM")
    inner = ("starter run --memory 60M --report /tmp/r.json -- python3 -c "
             "\"import os; print(os.getpid(), flush=True); b = bytearray(100 << 20)\"; cat /tmp/r.json")
    r = starter("run", "--delegate", "--allow-userns", "--user", P.NAME, "--memory", "500M",
                "--env", f"PATH={venv}/bin:/usr/bin:/bin", "--env", "XDG_RUNTIME_DIR=/tmp",
                "--", "sh", "-c", inner, timeout=120)
    assert r.returncode == 0, r.stderr
    pid, _, doc = r.stdout.partition("\n")
    assert pid == "1", (r.stdout, r.stderr)
    rep = json.loads(doc)
    assert rep["cgroup"] == "v2" and rep["oom"] is True, rep
    assert set(rep["not_enforced"]) == {"own-uid"}, rep
