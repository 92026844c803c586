"""Callers that are not root: the set-user-ID `starter run` under the node policy.

Every test runs the real `starter` command as an ordinary user (nobody, with
setpriv), through the launcher's relay and root half (native/launcher_relay.c,
starter/callers/caller.py), against a node policy written to /etc/starter/starter.toml
for the test (the one a caller's starter reads: its environment is emptied).
What a hostile caller asks for is refused with exit 125 and one line, and
leaves nothing (the leak check) and no file written with root's rights.
The policy parsed and applied on text alone: tests/unit/test_policy_apply.py.
"""

import errno
import json
import os
import shlex
import signal
import stat
import subprocess
import time

import pytest

from conftest import GID, POLICY, PYTHON, SLOWDOWN, STARTER, UID, caller_argv, children_of, wait_running


def as_caller(*args, cwd=None, timeout=60, check=None, env=None, **kw):
    p = subprocess.run(caller_argv(*args, keep_env=env is not None), capture_output=True, text=True, timeout=timeout * SLOWDOWN,
                       cwd=cwd or "/", env=env, **kw)
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def refused(p, *words):
    assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("starter: "), p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---------------------------------------------------------------- it runs

def test_caller_job_runs_as_the_caller(policy, home):
    p = as_caller("run", "--", "sh", "-c", "id -u; id -g; id -G; echo $$; readlink /proc/self/ns/pid; exit 7",
                  cwd=home)
    assert p.returncode == 7, p.stderr
    uid, gid, groups, pid, pidns = p.stdout.split("\n")[:5]
    assert (uid, gid, groups, pid) == ("65534", "65534", "65534", "1")
    assert pidns != os.readlink("/proc/self/ns/pid")


def test_caller_report_and_events_are_the_callers(policy, home):
    report, events = f"{home}/r.json", f"{home}/e.jsonl"
    as_caller("run", "--report", report, "--events", events, "--", "sh", "-c", "exit 3", cwd=home, check=3)
    for f in (report, events):
        st = os.stat(f)
        assert (st.st_uid, st.st_gid) == (UID, GID), f
    r = json.loads(open(report).read())
    assert r["reason"] == "exited" and r["exit_code"] == 3


def test_caller_environment_does_not_reach_root(policy, home, state_root):
    """The caller's environment never reaches the root starter (the launcher
    empties it): PYTHONPATH, LD_PRELOAD do nothing, and the starter's own
    variables are refused, each in one line."""
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": home, "LD_PRELOAD": f"{home}/x.so", "PYTHONSTARTUP": home}
    with open(f"{home}/starter.py", "w") as f:      # would shadow the package on a PYTHONPATH
        f.write("raise SystemExit(99)\n")
    as_caller("run", "--", "true", cwd=home, env=base, check=0)
    for var, value in (("STARTER_FAULT", "state-entry"), ("STARTER_STATE_DIR", f"{home}/state"),
                       ("STARTER_KILL_TIMEOUT", "0.1"), ("STARTER_POLICY", f"{home}/p.toml"),
                       ("STARTER_CALLER", "0:0:"), ("STARTER_DEBUG", "1")):
        env = {k: v for k, v in base.items() if k != "LD_PRELOAD"}    # ld.so warns for setpriv itself
        refused(as_caller("run", "--", "true", cwd=home, env={**env, var: value}), var, "root callers only")
    assert not os.path.exists(f"{home}/state")


def test_caller_hostile_context(policy, home):
    """Closed stdio, a tiny fd limit, umask 0777, SIGTERM ignored: the root
    starter gets none of it, and the relay still forwards the TERM."""
    script = ("import os, resource, signal, subprocess, sys\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
              "os.umask(0o777)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"p = subprocess.Popen({caller_argv('run', '--report', home + '/r.json', '--', 'sh', '-c', TRAP + 'sleep 60 & wait')!r}[4:],\n"
              "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
              "                     close_fds=True)\n"
              "import time\n"
              "def running():\n"      # the job's sleep, seen from here (its PID namespace hides nothing from us)
              "    for d in os.listdir('/proc'):\n"
              "        try:\n"
              "            if d.isdigit() and open(f'/proc/{d}/cmdline', 'rb').read() == b'sleep\\x0060\\x00':\n"
              "                return True\n"
              "        except OSError:\n"
              "            pass\n"
              "deadline = time.monotonic() + 60\n"
              "while not running() and time.monotonic() < deadline:\n"
              "    time.sleep(0.05)\n"
              "p.send_signal(signal.SIGTERM)\n"
              "sys.exit(p.wait(30))\n")
    p = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", PYTHON, "-c", script],
                       capture_output=True, text=True, timeout=60 * SLOWDOWN, cwd=home)
    assert p.returncode == 143, (p.returncode, p.stderr)
    r = json.loads(open(f"{home}/r.json").read())
    assert r["reason"] == "vacated"
    assert stat.S_IMODE(os.stat(f"{home}/r.json").st_mode) == 0o644   # not the caller's umask 0777


# ---------------------------------------------------------------- refusals

ROOT_ONLY_FILE = "/root/.starter-caller-test"
# PID 1 of a PID namespace gets no default action for SIGTERM: the job says what TERM does.
TRAP = "trap 'exit 143' TERM; "


@pytest.fixture
def root_only(tmp_path):
    """A job file, a manifest and an input only root may read."""
    with open(ROOT_ONLY_FILE, "w") as f:
        f.write('{"command": ["true"]}\n')
    os.chmod(ROOT_ONLY_FILE, 0o600)
    yield ROOT_ONLY_FILE
    os.unlink(ROOT_ONLY_FILE)


@pytest.mark.parametrize("args, words", [
    (["--user", "root"], ["--user", "runs its jobs as itself"]),
    (["--user", "starter-job"], ["--user", "runs its jobs as itself"]),
    (["--user", "0"], ["--user"]),
    (["--group", "0"], ["--group", "runs its jobs as itself"]),
    (["--report", "/etc/cron.d/starter-caller-test"], ["not writable by the caller"]),
    (["--report", "/root/starter-caller-test.json"], ["Permission denied"]),
    (["--events", "/etc/cron.d/starter-caller-test"], ["events"]),
    (["--bind", "/etc/shadow:/x"], ["callers.bind"]),
    (["--ro-bind", "/etc/shadow:/x"], ["callers.ro_bind"]),
    (["--tmpfs", "/usr/bin"], ["callers.mount_destinations"]),
    (["--seccomp", "off"], ["callers.seccomp"]),
    (["--cgroup-parent", "/"], ["--cgroup-parent", "only root"]),
    (["--state-dir", "/tmp/starter-caller-x"], ["--state-dir", "only root"]),
    (["--net", "host"], ["callers.net"]),
    (["--net", "nat"], ["callers.net"]),
    (["--delegate"], ["callers.delegate"]),
    (["--userns-root"], ["callers.userns_root"]),
    (["--allow-userns"], ["callers.allow_userns"]),
    (["--init"], ["callers.init"]),
    (["--execute-dir", "/tmp"], ["callers.execute_dirs"]),
    (["--scratch", "/tmp/starter-caller-x"], ["callers.execute_dirs"]),
    (["--rlimit", "rtprio=99"], ["--rlimit", "only lower"]),
    (["--rlimit", "nofile=4000000"], ["--rlimit", "only lower"]),
])
def test_caller_refused(policy, home, args, words):
    before = set(os.listdir("/etc/cron.d")) if os.path.isdir("/etc/cron.d") else set()
    refused(as_caller("run", *args, "--", "true", cwd=home), *words)
    assert not os.path.exists("/tmp/starter-caller-x")
    assert not os.path.exists("/root/starter-caller-test.json")
    if os.path.isdir("/etc/cron.d"):
        assert set(os.listdir("/etc/cron.d")) == before


@pytest.mark.parametrize("nofile", [4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 20])
def test_caller_tiny_fd_limit_fails_closed(policy, home, nofile):
    """Where root lacks CAP_SYS_RESOURCE (this host), the caller's hard
    limits bind the starter too: a start that runs out fails whole, in one
    line, wherever it runs out (the launcher's socket and warm-up pipe take
    fds 3-6 before anything of the job exists)."""
    p = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "sh", "-c",
                        f'ulimit -n {nofile}; exec {STARTER} run -- true'], capture_output=True, text=True,
                       cwd=home, timeout=60 * SLOWDOWN)
    assert p.returncode in (0, 125), p
    if p.returncode == 125:
        refused(p)


def test_caller_cannot_read_root_files(policy, home, root_only):
    refused(as_caller("run", "--job", root_only, cwd=home), "Permission denied")
    os.makedirs("/root", exist_ok=True)
    digest = "0" * 64
    refused(as_caller("run", "--execute-dir", "/tmp", "--manifest", root_only, "--manifest-digest", digest,
                      "--", "true", cwd=home))
    policy(f'[callers]\nro_bind = ["/root"]\nmount_destinations = ["/tmp"]\n')
    refused(as_caller("run", "--ro-bind", f"{root_only}:/tmp/x", "--", "true", cwd=home), "Permission denied")


def test_caller_manifest_input_read_with_its_rights(policy, home):
    """A manifest the caller may read, listing an input it may not (root's,
    0600, in the caller's own directory): refused before the job runs, no
    scratch left; the same input made readable is staged and run."""
    import hashlib
    import tempfile

    ex = tempfile.mkdtemp(prefix="starter-exec-", dir="/tmp")
    os.chmod(ex, 0o755)
    try:
        policy(f'[callers]\nexecute_dirs = ["{ex}"]\n')
        secret = f"{home}/input.sh"
        with open(secret, "w") as f:
            f.write("#!/bin/sh\necho staged\n")
        os.chmod(secret, 0o600)                       # root's, in the caller's directory
        digest = hashlib.sha256(open(secret, "rb").read()).hexdigest()
        with open(f"{home}/sig.sha256", "w") as f:
            f.write(f"{digest} xinput.sh\n")
        os.chown(f"{home}/sig.sha256", UID, GID)
        sig = hashlib.sha256(open(f"{home}/sig.sha256", "rb").read()).hexdigest()
        args = ("run", "--execute-dir", ex, "--manifest", f"{home}/sig.sha256", "--manifest-digest", sig,
                "--", "./input.sh")
        refused(as_caller(*args, cwd=home))
        assert os.listdir(ex) == []
        os.chmod(secret, 0o644)
        assert as_caller(*args, cwd=home, check=0).stdout == "staged\n"
    finally:
        subprocess.run(["rm", "-rf", ex], check=True)


def test_job_cannot_start_a_job(policy, home, starter, state_root):
    """Inside a job no_new_privs is set: the set-user-ID bit does nothing,
    so a job's process (of the caller's or of root's starting) cannot start
    one as root; nor one without root (starter/rootless), whose user
    namespace the job's syscall filter refuses (without --allow-userns)."""
    inner = f"{STARTER} run -- true; echo rc=$?"
    p = as_caller("run", "--", "sh", "-c", inner, cwd=home, check=0)
    assert "rc=125" in p.stdout and "needs a user namespace" in p.stderr, (p.stdout, p.stderr)
    p = starter("run", "--user", "nobody", "--", "sh", "-c", inner, check=0)
    assert "rc=125" in p.stdout, (p.stdout, p.stderr)


# ---------------------------------------------------------------- lifecycle

DAEMON = TRAP + "(setsid sh -c 'sleep 300 & sleep 300' &); echo up; sleep 300 & wait"


def _start(home, *args):
    proc = subprocess.Popen(caller_argv("run", "--report", f"{home}/r.json", *args, "--", "sh", "-c", DAEMON),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home)
    assert proc.stdout.readline().strip() == "up", proc.stderr.read()
    return proc


def _job_gone(state_root, deadline_s=10):
    """No nobody process, no entry left, within the deadline."""
    deadline = time.monotonic() + deadline_s * SLOWDOWN
    while True:
        left = subprocess.run(["pgrep", "-u", str(UID), "-x", "sleep"], capture_output=True, text=True).stdout.split()
        entries = [n for n in os.listdir(state_root) if n.endswith(".lock")] if os.path.isdir(state_root) else []
        if not left and not entries:
            return
        assert time.monotonic() < deadline, (left, entries)
        time.sleep(0.1)


def test_caller_sigterm_vacates(policy, home, state_root):
    proc = _start(home, "--grace", "1")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30 * SLOWDOWN) == 143
    r = json.loads(open(f"{home}/r.json").read())
    assert r["reason"] == "vacated"
    _job_gone(state_root)


def test_caller_signals_map(policy, home, state_root):
    """USR1/USR2 suspend and resume the job through the relay, as for root;
    --on-signal maps them."""
    proc = _start(home, "--on-signal", "HUP=kill")
    entry = None
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10 * SLOWDOWN
    while time.monotonic() < deadline:
        ids = [n[:-5] for n in os.listdir(state_root) if n.endswith(".json")]
        entry = json.loads(open(os.path.join(state_root, ids[0] + ".json")).read()) if ids else {}
        if entry.get("state") == "suspended":
            break
        time.sleep(0.05)
    assert entry.get("state") == "suspended", entry
    proc.send_signal(signal.SIGUSR2)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(30 * SLOWDOWN) == 137
    assert json.loads(open(f"{home}/r.json").read())["reason"] == "killed"
    _job_gone(state_root)


def test_caller_sigkill_leaves_nothing(policy, home, state_root):
    proc = _start(home)
    proc.kill()
    proc.wait(10)
    _job_gone(state_root, 10)
    deadline = time.monotonic() + 10 * SLOWDOWN     # the report follows the teardown
    while not os.path.exists(f"{home}/r.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    r = json.loads(open(f"{home}/r.json").read())
    assert r["reason"] == "caller_gone"


def test_caller_relay_reaps_and_reports_a_dead_starter(policy, home, state_root, starter):
    """While the job runs the relay's one child is the root starter: the
    warm-up mover it started beside it (v1 layouts) is reaped, not left a
    zombie.  A root starter killed by a signal is said in one line, exit 125."""
    proc = _start(home)
    deadline = time.monotonic() + 5 * SLOWDOWN
    while len(kids := children_of(proc.pid)) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kids) == 1, kids
    (root_starter, (_, st)), = kids.items()
    assert st != "Z"
    with open(f"/proc/{root_starter}/status") as f:
        assert [line.split()[1:] for line in f if line.startswith("Uid:")] == [["0"] * 4]
    os.kill(root_starter, signal.SIGKILL)
    assert proc.wait(30 * SLOWDOWN) == 125
    lines = proc.stderr.read().strip().splitlines()
    assert lines == ["starter: the root starter died of signal 9 (exit 125)"], lines
    assert starter("gc", "--state-dir", state_root).returncode == 0
    _job_gone(state_root)


def _layout():
    from starter.cgroups import hierarchy
    return hierarchy.detect_layout(open("/proc/self/mountinfo").read(), open("/proc/self/cgroup").read())


def _own_cgroup_dir(name):
    """A new cgroup below the test's own in the hierarchy that tracks jobs:
    cgroup2 where there is one, else v1's freezer."""
    layout = _layout()
    role = "unified" if layout.unified else "freezer"
    m = layout.unified or layout.v1[role]
    d = os.path.join(m.mount_point, layout.own.get(role).lstrip("/"), f"{name}-{os.getpid()}")
    os.mkdir(d)
    return d


def _remove_cgroup_dir(d):
    """rmdir d and what the starter made in it, once empty (no process, not
    populated), with a deadline."""
    events = os.path.join(d, "cgroup.events")
    deadline = time.monotonic() + 10 * SLOWDOWN
    while time.monotonic() < deadline and (open(os.path.join(d, "cgroup.procs")).read().strip() or (
            os.path.exists(events) and "populated 1" in open(events).read().splitlines())):
        time.sleep(0.01)
    for sub in sorted((e.path for e in os.scandir(d) if e.is_dir()), reverse=True):
        os.rmdir(sub)
    os.rmdir(d)


def test_caller_leaves_nothing_in_its_cgroup(policy, home):
    """When a caller's `starter run` returns, nothing the launcher started is
    left in the caller's cgroup, not even a zombie: the relay exits only
    once it has reaped the root starter and the warm-up mover.  The batch
    system removes its step's cgroup the moment its child ends."""
    d = _own_cgroup_dir("starter-callercg")
    try:
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh", *caller_argv("run", "--", "true")]
        for _ in range(5):
            p = subprocess.run(argv, capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)
            assert p.returncode == 0, p.stderr
            assert open(os.path.join(d, "cgroup.procs")).read() == ""
            if os.path.exists(os.path.join(d, "cgroup.events")):
                assert "populated 0" in open(os.path.join(d, "cgroup.events")).read().splitlines()
    finally:
        _remove_cgroup_dir(d)


def test_caller_cgroup_its_user_owns_on_cgroup2(policy, home):
    """A caller whose cgroup2 directory its user owns, its cgroup.procs and
    cgroup.threads root's (Slurm's cgroup/v2 with its constraints on):
    the job runs, nested in it, and a process of the user outside cannot
    move the job's processes out, not even into a cgroup it makes there."""
    layout = _layout()
    if layout.unified is None:
        pytest.skip("no cgroup2 hierarchy: the kernel's rule on moves across a common ancestor is cgroup2's")
    d = _own_cgroup_dir("starter-userdir")
    evil = os.path.join(d, "mine")
    try:
        os.chown(d, UID, GID)
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh",
                *caller_argv("run", "--id", "userdir", "--", "sh", "-c", TRAP + "sleep 30 & wait")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home)
        try:
            st = wait_running(os.environ["STARTER_STATE_DIR"], "userdir", proc)
            job_cg = st["cgroup"]["unified"]
            assert job_cg.startswith(d + "/"), job_cg
            move = (f"import os\nos.mkdir({evil!r})\nfd = os.open({evil!r} + '/cgroup.procs', os.O_WRONLY)\n"
                    f"try:\n    os.write(fd, b'{st['pid']}')\nexcept OSError as e:\n    print(e.errno)\n")
            p = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", PYTHON, "-c", move],
                               capture_output=True, text=True)
            assert p.stdout.strip() == str(errno.EACCES), p
            assert str(st["pid"]) in open(os.path.join(job_cg, "cgroup.procs")).read().split()
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30 * SLOWDOWN)
        assert proc.returncode == 143, err
        if os.path.isdir(evil):
            os.rmdir(evil)
        assert sorted(e.name for e in os.scandir(d) if e.is_dir()) == []
    finally:
        _remove_cgroup_dir(d)


def test_caller_v1_memory_cgroup_its_user_owns_is_watched(policy, home):
    """A caller whose v1 memory cgroup directory its user owns (Slurm's
    cgroup/v1 with ConstrainRAMSpace): the job runs; a process of the user
    that moves the job's process into a cgroup it made there (past the job's
    memory limit) is found within seconds, and the job killed, reason
    "escaped"."""
    layout = _layout()
    if "memory" not in layout.v1:
        pytest.skip("no cgroup v1 memory hierarchy (pure cgroup v2: the kernel stops such a move)")
    m = layout.v1["memory"]
    d = os.path.join(m.mount_point, layout.own["memory"].lstrip("/"), f"starter-memdir-{os.getpid()}")
    os.mkdir(d)
    evil = os.path.join(d, "mine")
    report = f"{home}/r.json"
    try:
        os.chown(d, UID, GID)
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh",
                *caller_argv("run", "--id", "memdir", "--memory", "100M", "--report", report, "--",
                             "sleep", "60")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home)
        try:
            st = wait_running(os.environ["STARTER_STATE_DIR"], "memdir", proc)
            assert st["cgroup"]["memory"].startswith(d + "/")
            subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "sh", "-c",
                            f"mkdir {evil} && echo {st['pid']} > {evil}/tasks"], check=True)
            assert proc.wait(timeout=15 * SLOWDOWN) == 137
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert json.loads(open(report).read())["reason"] == "escaped"
        if os.path.isdir(evil):
            os.rmdir(evil)
    finally:
        _remove_cgroup_dir(d)


def test_caller_v1_freezer_cgroup_its_user_owns_is_watched_against_pids(policy, home):
    """v1 only: a caller whose freezer cgroup directory (the tracking one)
    its user owns (Slurm's proctrack/cgroup chowns the step's): the job
    runs, watched against its pids cgroup, which only root may write; a
    process of the user that moves the job's process out of the job's
    freezer cgroup is found within seconds and the job killed, every
    process of it, reason "escaped"."""
    layout = _layout()
    if layout.unified is not None or "freezer" not in layout.v1 or "pids" not in layout.v1:
        pytest.skip("needs cgroup v1 only (the v1 VM): elsewhere tracking is cgroup2's, where the kernel "
                    "stops such a move")
    m = layout.v1["freezer"]
    d = os.path.join(m.mount_point, layout.own["freezer"].lstrip("/"), f"starter-frzdir-{os.getpid()}")
    os.mkdir(d)
    evil = os.path.join(d, "mine")
    report = f"{home}/r.json"
    try:
        os.chown(d, UID, GID)
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh",
                *caller_argv("run", "--id", "frzdir", "--report", report, "--", "sh", "-c", "sleep 60 & exec sleep 61")]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home)
        try:
            st = wait_running(os.environ["STARTER_STATE_DIR"], "frzdir", proc)
            assert st["cgroup"]["freezer"].startswith(d + "/")
            job_pids = [int(p) for p in children_of(st["pid"])] + [st["pid"]]
            subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "sh", "-c",
                            f"mkdir {evil} && echo {st['pid']} > {evil}/tasks"], check=True)
            assert proc.wait(timeout=15 * SLOWDOWN) == 137, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert json.loads(open(report).read())["reason"] == "escaped"
        # the moved one too, killed through the pids hierarchy (gone once reaped)
        deadline = time.monotonic() + 5 * SLOWDOWN
        while any(os.path.exists(f"/proc/{p}") for p in job_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in job_pids if os.path.exists(f"/proc/{p}")], job_pids
        if os.path.isdir(evil):
            os.rmdir(evil)
    finally:
        _remove_cgroup_dir(d)


def test_caller_parent_its_user_made_first_is_refused(policy, home):
    """In a cgroup2 directory its user owns, the user makes the starter's
    parent first (its own cgroup.procs): refused, in one line."""
    layout = _layout()
    if layout.unified is None:
        pytest.skip("no cgroup2 hierarchy")
    d = _own_cgroup_dir("starter-userpre")
    try:
        os.chown(d, UID, GID)
        subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "mkdir",
                        os.path.join(d, "starter")], check=True)
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh", *caller_argv("run", "--", "true")]
        p = subprocess.run(argv, capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)
        refused(p, "is not root's alone")
    finally:
        _remove_cgroup_dir(d)


def test_caller_batch_script_without_exec(policy, home):
    """A batch script that runs `starter run` as a child, not by exec, three
    times in a row and then four at once, twice, in a cgroup of its own
    (Slurm's task cgroup): every job runs; on pure cgroup v2 the script and
    the relays are moved into a leaf below their cgroup for the job's time
    and back after, the starters taking turns (one's prune must not undo
    another's setup); nothing is left below the script's cgroup."""
    d = _own_cgroup_dir("starter-batch")
    try:
        run = shlex.join(caller_argv("run", "--", "sh", "-c", "exit 3"))
        script = (f"echo $$ > {d}/cgroup.procs || exit 90\n"
                  f"for i in 1 2 3; do {run}; [ $? = 3 ] || exit 91; done\n"
                  f"for i in 1 2; do\n"
                  f"  {run} & a=$!; {run} & b=$!; {run} & c=$!; {run}; d=$?\n"
                  f"  for p in $a $b $c; do wait $p; [ $? = 3 ] || exit 92; done\n"
                  f"  [ $d = 3 ] || exit 92\n"
                  f"done\n"
                  f"grep -qx $$ {d}/cgroup.procs || exit 93\n")
        p = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=home, timeout=120 * SLOWDOWN)
        assert p.returncode == 0, (p.returncode, p.stderr)
        assert sorted(e.name for e in os.scandir(d) if e.is_dir()) == []
    finally:
        _remove_cgroup_dir(d)


def test_caller_max_jobs(policy, home, state_root):
    policy("[callers]\nmax_jobs = 1\n")
    proc = _start(home)
    try:
        refused(as_caller("run", "--", "true", cwd=home), "callers.max_jobs", "line 5")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30 * SLOWDOWN)
    as_caller("run", "--", "true", cwd=home, check=0)


# ---------------------------------------------------------------- the policy

def test_policy_allows_and_caps(policy, home):
    os.makedirs(f"{home}/data", exist_ok=True)
    with open(f"{home}/data/in.txt", "w") as f:
        f.write("hello\n")
    policy(f'[callers]\nro_bind = ["{home}/data"]\nmount_destinations = ["/tmp"]\nmax_memory = "256M"\n'
           'max_wall_time = 600\ninit = true\n')
    p = as_caller("run", "--init", "--ro-bind", f"{home}/data:/tmp/in", "--", "sh", "-c",
                  "cat /tmp/in/in.txt; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
                  "|| cat /sys/fs/cgroup/memory.max", cwd=home, check=0)
    assert p.stdout.split() == ["hello", str(256 << 20)]
    refused(as_caller("run", "--memory", "1G", "--", "true", cwd=home), "callers.max_memory", "line 7")
    refused(as_caller("run", "--bind", f"{home}/data", "--", "true", cwd=home), "callers.bind")


def test_root_gets_the_defaults_and_stays_trusted(policy, starter):
    policy(defaults='memory = "300M"\n')
    p = starter("run", "--user", "root", "--seccomp", "off", "--", "sh", "-c",
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
                check=0)
    assert p.stdout.split() == [str(300 << 20)]


@pytest.mark.parametrize("text, words", [
    ("[callers]\nnet = [1,, 2]\n", ["not valid TOML", "line 5"]),
    ("[callers]\nnets = [\"nat\"]\n", ["line 5", "callers.nets", "unknown key"]),
    ("[callers]\nmax_memory = \"lots\"\n", ["line 5", "callers.max_memory"]),
    ("[callers]\nnet = [\"bridge\"]\n", ["line 5", "callers.net"]),
    ("[other]\n", ["other", "unknown table"]),
])
def test_policy_errors_name_file_line_key(policy, home, text, words):
    policy(text)
    line = refused(as_caller("run", "--", "true", cwd=home), POLICY, *words)
    assert "Traceback" not in line
    p = subprocess.run([STARTER, "config", "check"], capture_output=True, text=True)
    assert p.returncode == 125 and POLICY in p.stderr


@pytest.mark.parametrize("owner, mode", [(UID, 0o644), (0, 0o664), (0, 0o646)])
def test_policy_must_be_roots_alone(policy, home, owner, mode):
    os.chown(POLICY, owner, 0)
    os.chmod(POLICY, mode)
    refused(as_caller("run", "--", "true", cwd=home), "must be owned by root")


def test_config_check_and_show(policy, tmp_path):
    policy('[callers]\nnet = ["none", "nat"]\nmax_jobs = 4\n', defaults='memory = "1G"\n')
    p = subprocess.run([STARTER, "config", "check"], capture_output=True, text=True)
    assert p.returncode == 0 and "ok" in p.stdout
    p = subprocess.run([STARTER, "config", "show"], capture_output=True, text=True)
    assert p.returncode == 0
    assert 'net = ["none", "nat"]' in p.stdout and "max_jobs = 4" in p.stdout and 'memory = "1G"' in p.stdout
    p = subprocess.run([STARTER, "config", "show", str(tmp_path / "none.toml")], capture_output=True, text=True)
    assert "built in" in p.stdout and 'net = ["none"]' in p.stdout and "bind = []" in p.stdout


def test_caller_cgroup_must_be_roots(policy, home):
    """A caller in a cgroup it may write (delegated to it) is refused: it
    could move the job's processes out of the job's cgroup.  On v1-only
    hosts, where a v1 directory of the user's is watched against one it
    cannot move processes in (test_caller_v1_freezer_...), it is refused
    when every hierarchy the job would be in is the user's."""
    from starter.cgroups.v1 import V1_ROLES

    layout = _layout()
    dirs = [_own_cgroup_dir("starter-caller")]
    if layout.unified is None:
        for m in {id(m): m for r, m in layout.v1.items() if r != "freezer" and r in V1_ROLES}.values():
            role = next(r for r in m.controllers if r in V1_ROLES)
            d = os.path.join(m.mount_point, layout.own[role].lstrip("/"), f"starter-caller-{os.getpid()}")
            os.mkdir(d)
            dirs.append(d)
    try:
        for d in dirs:
            os.chown(d, UID, GID)
            os.chown(os.path.join(d, "cgroup.procs"), UID, GID)
        enter = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in dirs)
        argv = ["sh", "-c", f'{enter} && exec "$@"', "sh", *caller_argv("run", "--", "true")]
        p = subprocess.run(argv, capture_output=True, text=True, cwd=home, timeout=60)
        refused(p, "is not root's alone")
    finally:
        for d in dirs:
            _remove_cgroup_dir(d)


def test_policy_cache_follows_the_file(policy, home):
    """The parsed policy is cached (tomllib costs ~12 ms a start); an edit
    of the file is seen at the next start."""
    policy("[callers]\nmax_jobs = 0\n")
    refused(as_caller("run", "--", "true", cwd=home), "callers.max_jobs")
    refused(as_caller("run", "--", "true", cwd=home), "callers.max_jobs")
    policy("[callers]\nmax_jobs = 5\n")
    as_caller("run", "--", "true", cwd=home, check=0)


def test_caller_scratch_in_the_policys_execute_dir(policy, home):
    """defaults.execute_dir gives a caller's job a fresh scratch there,
    owned by the caller and gone after; one the caller cannot reach is refused."""
    import tempfile

    ex = tempfile.mkdtemp(prefix="starter-exec-", dir="/tmp")
    os.chmod(ex, 0o755)
    try:
        policy(defaults=f'execute_dir = "{ex}"\n')
        p = as_caller("run", "--", "sh", "-c", "pwd; stat -c %u .; touch made", cwd=home, check=0)
        cwd, owner = p.stdout.split()
        assert os.path.dirname(cwd) == ex and owner == str(UID)
        assert os.listdir(ex) == []
        os.chmod(ex, 0o700)
        refused(as_caller("run", "--", "true", cwd=home), "execute directory")
        assert os.listdir(ex) == []
    finally:
        os.rmdir(ex)
