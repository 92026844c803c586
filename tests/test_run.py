"""`starter run` end to end, through the real CLI, as an admin would run it."""

import json
import os
import signal
import subprocess

import pytest

from conftest import STARTER


def test_ps_faux_sees_only_the_job(starter):
    p = starter("run", "--", "ps", "faux", check=0)
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["USER", "PID"]
    procs = [l.split(None, 10) for l in lines[1:]]
    assert [pr[1] for pr in procs] == ["1"], p.stdout
    assert procs[0][10].startswith("ps faux")


def test_proc1_is_the_job_and_only_lo(starter):
    p = starter("run", "--", "sh", "-c", "tr '\\0' ' ' </proc/1/cmdline; echo; ls /proc | grep -c '^[0-9]'; ip -o link", check=0)
    cmdline, count, *links = p.stdout.strip().splitlines()
    assert cmdline.startswith("sh -c")
    assert int(count) <= 3  # sh, ls, grep
    assert len(links) == 1 and ": lo:" in links[0] and "UP" in links[0], links


def test_host_mountinfo_unchanged(starter):
    def mounts():
        with open("/proc/self/mountinfo") as f:
            return [" ".join(l.split()[2:]) for l in f]

    before = mounts()
    # The job's mounts are all made before it runs: its "ready" line means
    # "now"; it ends when its stdin closes.
    proc = subprocess.Popen([STARTER, "run", "--", "sh", "-c", "echo ready; read x; exit 0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        during = mounts()
    finally:
        proc.stdin.close()
        assert proc.wait(10) == 0
        proc.stdout.close()
    assert before == during == mounts()


@pytest.mark.parametrize("code", [0, 1, 2, 7, 42, 100, 125, 126, 127, 128, 200, 254, 255])
def test_exit_codes_propagate(starter, code):
    assert starter("run", "--", "sh", "-c", f"exit {code}").returncode == code


def test_all_256_exit_codes(starter):
    # One job that forks 256 children would not test the starter; run the
    # starter itself for each code, quickly, in one loop.  In the VMs every
    # 15th code, 0 to 255: a start takes ~0.3 s under TCG (256 of them were
    # 85 s, the longest test there), the decoding is the same on every
    # cgroup layout, and all 256 run natively.
    for code in range(0, 256, 15) if os.environ.get("STARTER_VM") else range(256):
        rc = subprocess.run([STARTER, "run", "--", "sh", "-c", f"exit {code}"], capture_output=True).returncode
        assert rc == code


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT])
def test_death_by_signal(starter, tmp_path, sig):
    report = tmp_path / "r.json"
    # PID 1 cannot be killed by a signal sent from inside its namespace unless
    # it has a handler; --init makes the job PID 2, where kill works as usual.
    p = starter("run", "--init", "--report", str(report), "--", "sh", "-c", f"kill -{int(sig)} $$")
    assert p.returncode == 128 + sig
    r = json.loads(report.read_text())
    assert r["signal"] == sig and r["reason"] == "signaled" and r["exit_code"] == 128 + sig


def test_missing_command_127_not_executable_126(starter, tmp_path):
    p = starter("run", "--", "/no/such/command")
    assert p.returncode == 127 and "ENOENT" in p.stderr
    f = tmp_path / "data.txt"
    f.write_text("not a program\n")
    f.chmod(0o644)
    tmp_path.chmod(0o755)  # the job (not root) may look in; only the x bit is missing
    p = starter("run", "--ro-bind", f"{tmp_path}:/srv", "--", "/srv/data.txt")  # /tmp is private in the job
    assert p.returncode == 126 and "EACCES" in p.stderr


def test_starter_failure_is_125_with_one_line_cause(starter, tmp_path):
    p = starter("run", "--bind", str(tmp_path / "missing"), "--", "true")
    assert p.returncode == 125
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "does not exist" in p.stderr


def test_job_sees_only_fds_0_1_2(starter):
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(100)]
    for fd in fds:
        os.set_inheritable(fd, True)
    try:
        p = subprocess.run([STARTER, "run", "--", "ls", "/proc/self/fd"], capture_output=True, text=True,
                           close_fds=False)
    finally:
        for fd in fds:
            os.close(fd)
    assert p.returncode == 0, p.stderr
    # ls itself opens one fd for the directory it lists
    assert sorted(int(x) for x in p.stdout.split()) in ([0, 1, 2], [0, 1, 2, 3]), p.stdout


def test_user_nobody_no_caps_clean_env(starter):
    env = dict(os.environ, SECRET_TOKEN="hunter2")
    p = starter("run", "--user", "nobody", "--env", "FOO=bar", "--",
                "sh", "-c", "id -u; id -g; id -G; grep -E '^(Cap|NoNewPrivs)' /proc/self/status; env",
                env=env, check=0)
    out = p.stdout.splitlines()
    assert out[0] == "65534" and out[1] == "65534" and out[2] == "65534"
    status = dict(l.split(":\t") for l in out[3:9])
    for cap in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"):
        assert int(status[cap], 16) == 0, (cap, status)
    assert status["NoNewPrivs"] == "1"
    env_lines = dict(l.split("=", 1) for l in out[9:] if "=" in l)
    assert "SECRET_TOKEN" not in env_lines
    assert env_lines["FOO"] == "bar"
    assert set(env_lines) <= {"FOO", "HOME", "USER", "LOGNAME", "PATH", "PWD", "SHLVL", "_"}


def test_job_cannot_inject_into_callers_terminal(starter):
    """TIOCSTI: the job runs in its own session, so the caller's tty is not its
    controlling terminal and pushing input into it fails."""
    master, slave = os.openpty()
    code = ("import fcntl, termios, sys\n"
            "try:\n"
            "    fcntl.ioctl(0, termios.TIOCSTI, b'x')\n"
            "    print('INJECTED')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n")
    try:
        p = subprocess.run([STARTER, "run", "--", "/usr/bin/python3", "-c", code],
                           stdin=slave, capture_output=True, text=True, timeout=30)
    finally:
        os.close(slave)
        os.close(master)
    assert "INJECTED" not in p.stdout
    assert "refused" in p.stdout, (p.stdout, p.stderr)


# 1000 orphans (each forked by a child that is reaped at once), then: how
# many processes other than PID 1 (the init) and the job are left, once none
# is or after 30 s.  Every orphan exists before the wait starts, so "none
# left" cannot be seen too early; no event says the init has reaped one, so
# the wait polls /proc, with a deadline.
_ORPHANS = """
import os, time
for _ in range(1000):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.waitpid(pid, 0)
deadline = time.monotonic() + 30
while True:
    left = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())]
    if not left or time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(len(left))
"""


def test_init_reaps_1000_orphans(starter):
    p = starter("run", "--init", "--pids", "2000", "--", "/usr/bin/python3", "-c", _ORPHANS, timeout=120, check=0)
    assert p.stdout.strip() == "0", p.stdout


def test_init_job_is_pid_2(starter):
    p = starter("run", "--init", "--", "sh", "-c", "echo $$; tr '\\0' ' ' </proc/1/cmdline", check=0)
    pid, init_cmd = p.stdout.strip().splitlines()
    assert pid == "2"


def test_sigterm_to_starter_reaches_job_with_init(tmp_path):
    report = tmp_path / "r.json"
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the job is not root
    marker = out / "got-term"
    proc = subprocess.Popen([STARTER, "run", "--init", "--report", str(report), "--bind", f"{out}:/srv",
                             "--", "sh", "-c", "trap 'echo term > /srv/got-term; exit 42' TERM; "
                             "echo ready; while :; do sleep 0.05; done"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # the trap is set
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 42
    proc.stdout.close()
    assert marker.read_text().strip() == "term"
    r = json.loads(report.read_text())
    assert r["reason"] == "vacated" and r["exit_code"] == 42


def test_ns_exec_fresh_network(starter):
    p = starter("ns-exec", "-nm", "--", "ip", "-o", "link", check=0)
    links = p.stdout.strip().splitlines()
    assert len(links) == 1 and ": lo:" in links[0]


def test_without_root_a_start_is_a_pilots(tmp_path):
    """Not through the set-user-ID launcher (tests/test_callers.py): the
    interpreter itself, run by a user, starts the job without root, in a
    user namespace of its own (starter/rootless/; tests/test_rootless.py);
    its state where the user's runtime directory is, and one line where
    that cannot be made."""
    from conftest import starter_in_python

    import shutil
    import tempfile

    run = tempfile.mkdtemp(prefix="starter-test-run-")      # (pytest's tmp_path is root's alone)
    os.chown(run, 65534, 65534)
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "-i", "PATH=/usr/bin:/bin",
            *starter_in_python(), "run", "--report", "/dev/stdout", "--", "sh", "-c", "echo $$"]
    try:
        p = subprocess.run(argv[:6] + [f"XDG_RUNTIME_DIR={run}"] + argv[6:], capture_output=True, text=True,
                           timeout=60)
        assert os.listdir(os.path.join(run, "starter")) == []
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert p.returncode == 0, p.stderr
    pid, doc = p.stdout.split("\n", 1)
    assert pid == "1" and json.loads(doc)["rootless"]["pilot_uid"] == 65534
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)    # nobody: no runtime directory, no home
    assert p.returncode == 125
    assert "state directory" in p.stderr and len(p.stderr.splitlines()) == 1


def test_report_schema(starter, tmp_path):
    report = tmp_path / "r.json"
    starter("run", "--report", str(report), "--", "sh", "-c", "exit 3", check=3)
    r = json.loads(report.read_text())
    for key in ("job_id", "exit_code", "signal", "reason", "wall_s", "cpu_user_s", "cpu_system_s",
                "memory_peak_bytes", "pids_peak", "io_read_bytes", "io_write_bytes", "oom_kills",
                "started_at", "ended_at", "cgroup"):
        assert key in r, key
    assert r["exit_code"] == 3 and r["reason"] == "exited"


def test_report_to_inherited_fd(tmp_path):
    r, w = os.pipe()
    os.set_inheritable(w, True)
    p = subprocess.Popen([STARTER, "run", "--report", f"fd:{w}", "--", "true"], pass_fds=(w,))
    os.close(w)
    assert p.wait(30) == 0
    with os.fdopen(r) as f:
        doc = json.loads(f.read())
    assert doc["exit_code"] == 0


def test_hostname_and_tmpfs_and_ro_bind(starter, tmp_path):
    (tmp_path / "in.txt").write_text("hello\n")
    tmp_path.chmod(0o755)  # readable by the job's (unprivileged) user
    # /srv becomes a tmpfs; mount points inside it are made on the fly, in order
    p = starter("run", "--hostname", "job-host", "--tmpfs", "/srv:size=1m", "--ro-bind", f"{tmp_path}:/srv/data",
                "--", "sh", "-c", "hostname; cat /srv/data/in.txt; touch /srv/data/x 2>/dev/null || echo ro; "
                "touch /srv/y && echo rw; stat -fc %T /srv", check=0)
    assert p.stdout.split() == ["job-host", "hello", "ro", "rw", "tmpfs"]
    assert not (tmp_path / "x").exists()


def test_private_tmp(starter, tmp_path):
    p = starter("run", "--", "sh", "-c", "ls -A /tmp | wc -l; touch /tmp/job-file", check=0)
    assert p.stdout.strip() == "0"
    assert not os.path.exists("/tmp/job-file")


def test_net_host_shares_network(starter):
    p = starter("run", "--net", "host", "--", "ip", "-o", "link", check=0)
    host = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = lambda out: sorted(l.split(": ")[1].split("@")[0] for l in out.splitlines())
    assert names(p.stdout) == names(host)


def test_report_never_written_through_a_planted_link(starter, tmp_path):
    """The report directory may be writable by the job; a symlink planted at
    the report path is replaced, and its target is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    report = tmp_path / "r.json"
    report.symlink_to(victim)
    (tmp_path / f"r.json.{os.getpid()}.tmp").symlink_to(victim)  # a guess at a temp name, harmless
    starter("run", "--report", str(report), "--", "true", check=0)
    assert victim.read_text() == "precious\n"
    assert not report.is_symlink() and json.loads(report.read_text())["exit_code"] == 0
