"""ns.spawn / ns.enter against the real kernel, as root.

Every test reaps and closes what it made; the `no_leaks` fixture checks that
no fd and no child (zombie or running) outlives a test.
"""

import errno
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from starter.isolate import ns
from starter.errors import SpawnError, SpecError, StarterError
from starter.isolate.mounts import Mount

from conftest import SLOWDOWN

PY = "/usr/bin/python3"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
NOBODY = 65534


def _fds():
    return set(os.listdir("/proc/self/fd"))


def _children():
    me = str(os.getpid())
    kids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me:
            kids.append((int(p), fields[0]))
    return kids


@pytest.fixture(autouse=True)
def no_leaks():
    before = _fds()
    yield
    assert _children() == [], "a test left a child (running or zombie)"
    assert len(_fds()) <= len(before), "a test leaked fds"


def run(argv, env=ENV, stdin=None, **kw):
    """Spawn, release, wait; return (raw status, stdout text)."""
    r, w = os.pipe()
    try:
        child = ns.spawn(ns.ChildSpec(argv, env, stdio=(stdin, w, None), **kw))
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    os.close(w)
    try:
        with child:
            child.release()
            child.wait_started()
            out = _read_all(r)
            return child.wait(), out
    finally:
        os.close(r)


def _read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            return b"".join(chunks).decode()
        chunks.append(b)


def py(code):
    return [PY, "-c", textwrap.dedent(code)]


class Running:
    """A job that prints "ready" and then waits for its stdin to close."""

    def __init__(self, argv=None, **kw):
        argv = argv or ["sh", "-c", "echo ready; read x; echo done"]
        self.out_r, out_w = os.pipe()
        in_r, self.in_w = os.pipe()
        try:
            self.child = ns.spawn(ns.ChildSpec(argv, ENV, stdio=(in_r, out_w, None), **kw))
        finally:
            os.close(out_w)
            os.close(in_r)
        self.child.release()
        self.child.wait_started()
        line = os.read(self.out_r, 6)
        assert line == b"ready\n", line

    def finish(self):
        os.close(self.in_w)
        self.in_w = -1
        status = self.child.wait()
        out = _read_all(self.out_r)
        return status, out

    def close(self):
        if self.in_w >= 0:
            os.close(self.in_w)
        self.child.send_signal(signal.SIGKILL)
        self.child.wait()
        self.child.close()
        os.close(self.out_r)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- namespaces ---------------------------------------------------------------

def test_job_is_pid_1_and_sees_only_its_processes():
    status, out = run(py("""
        import os
        print(os.getpid())
        print(open('/proc/1/cmdline').read().split('\\0')[:2])
        print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
    """))
    assert status == 0
    pid, cmdline, pids = out.splitlines()
    assert pid == "1"
    assert cmdline == str([PY, "-c"])
    assert pids == "[1]"


def test_ps_inside_shows_the_job_only():
    status, out = run(["sh", "-c", "ps -e -o pid=,comm="])
    assert status == 0
    rows = [line.split() for line in out.splitlines()]
    assert rows == [["1", "sh"], [rows[1][0], "ps"]]


def test_network_namespace_has_only_loopback_up():
    status, out = run(["ip", "-o", "link"])
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 1
    assert lines[0].split(":")[1].strip() == "lo"
    assert ",UP" in lines[0]
    status, out = run(["ip", "-o", "-4", "addr"])
    assert "127.0.0.1/8" in out


def test_sysfs_shows_the_jobs_network():
    status, out = run(["ls", "/sys/class/net"])
    assert out.split() == ["lo"]


def test_host_mountinfo_unchanged_before_during_after(tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    (src / "f").write_text("x")
    with open("/proc/self/mountinfo") as f:
        before = f.read()
    mounts = (Mount("bind", "/mnt", str(src)), Mount("ro-bind", "/srv", str(src)),
              Mount("tmpfs", "/media", options="size=1m"))
    with Running(mounts=mounts) as job:
        with open("/proc/self/mountinfo") as f:
            during = f.read()
        job.finish()
    with open("/proc/self/mountinfo") as f:
        after = f.read()
    assert before == during == after


def test_mounts_bind_ro_bind_tmpfs_and_private_tmp(tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    (src / "f").write_text("hello")
    mounts = (Mount("bind", "/mnt", str(src)),
              Mount("ro-bind", "/srv", str(src)),
              Mount("tmpfs", "/media", options="size=1m,mode=700"),
              Mount("ro-bind", "/tmp/in/data", str(src)),  # mount point made in the private /tmp
              Mount("bind", "/tmp/in/file", str(src / "f")))  # a file, from the host's /tmp
    status, out = run(["sh", "-c", """
        cat /mnt/f; echo
        echo new > /mnt/g && echo bind-writable
        echo new > /srv/h 2>/dev/null || echo ro-bind-readonly
        cat /tmp/in/data/f; echo
        cat /tmp/in/file; echo
        stat -c %a /media /tmp
        grep -E ' /(media|tmp|srv|proc|sys) ' /proc/self/mountinfo | cut -d' ' -f5,6
    """], mounts=mounts)
    assert status == 0, out
    lines = out.splitlines()
    assert lines[:5] == ["hello", "bind-writable", "ro-bind-readonly", "hello", "hello"]
    assert lines[5:7] == ["700", "1777"]
    opts = dict(line.split() for line in lines[7:])
    assert opts["/srv"].startswith("ro,")
    assert "nosuid" in opts["/tmp"] and "nodev" in opts["/tmp"]
    assert {"nosuid", "nodev", "noexec"} <= set(opts["/proc"].split(","))
    assert (src / "g").read_text() == "new\n"
    assert not (src / "h").exists()


def test_hostname_needs_and_uses_uts():
    status, out = run(["hostname"], namespaces=frozenset({"pid", "net", "mnt", "uts"}),
                      hostname="job-42")
    assert out.strip() == "job-42"
    with pytest.raises(SpecError) as e:
        ns.spawn(ns.ChildSpec(["true"], ENV, hostname="x"))
    assert e.value.field == "hostname"


def test_mounts_without_mnt_namespace_are_refused():
    with pytest.raises(SpecError) as e:
        ns.spawn(ns.ChildSpec(["true"], ENV, namespaces=frozenset({"pid"}),
                              mounts=(Mount("tmpfs", "/mnt"),)))
    assert e.value.field == "mounts"


# ---- exit codes ---------------------------------------------------------------

def test_every_exit_code_propagates():
    for code in range(256):
        status, _ = run(["sh", "-c", f"exit {code}"])
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == code


def test_death_by_signal_is_a_signaled_status():
    with Running() as job:
        job.child.send_signal(signal.SIGKILL)
        status = job.child.wait()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert ns.decode_status(status) == (137, signal.SIGKILL)


def test_pid_1_without_handler_ignores_sigterm_but_not_sigkill():
    # The kernel only delivers signals a namespace's PID 1 has a handler for
    # (SIGKILL from an ancestor namespace excepted).  Python installs none
    # for SIGTERM, so the job keeps running and exits 7 when told to (its
    # stdin closes: only after the SIGTERM was sent, whatever the load).
    with Running(py("""
        import sys
        print('ready', flush=True); sys.stdin.read(); sys.exit(7)
    """)) as job:
        job.child.send_signal(signal.SIGTERM)
        status, _ = job.finish()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, status
    with Running() as job:
        job.child.send_signal(signal.SIGKILL)
        assert os.WTERMSIG(job.child.wait()) == signal.SIGKILL


def test_missing_command_is_127():
    for argv in (["no-such-command-xyz"], ["/no/such/file"]):
        with pytest.raises(SpawnError) as e:
            run(argv)
        assert e.value.exit_code == 127
        assert e.value.errno == errno.ENOENT
        assert e.value.step == f"execve {argv[0]}"


def test_not_executable_is_126(tmp_path):
    f = tmp_path / "script"
    f.write_text("#!/bin/sh\necho hi\n")
    f.chmod(0o644)
    with pytest.raises(SpawnError) as e:
        run([str(f)], private_tmp=False)  # tmp_path lives in the host's /tmp
    assert e.value.exit_code == 126
    assert e.value.errno == errno.EACCES
    assert "not executable" in str(e.value)


def test_path_search_uses_the_jobs_path_not_ours(tmp_path):
    exe = tmp_path / "only-here"
    exe.write_text("#!/bin/sh\necho found\n")
    exe.chmod(0o755)
    status, out = run(["only-here"], env={"PATH": f"/nonexistent:{tmp_path}"}, private_tmp=False)
    assert out == "found\n"
    with pytest.raises(SpawnError) as e:
        run(["only-here"], env={"PATH": "/usr/bin"}, private_tmp=False)
    assert e.value.exit_code == 127
    assert "PATH=/usr/bin" in str(e.value)


def test_setup_failure_is_125_and_names_the_step(tmp_path):
    # A missing bind source is found before clone, when it is opened
    # (without following links) for the shim.
    missing = str(tmp_path / "missing")
    with pytest.raises(StarterError) as e:
        ns.spawn(ns.ChildSpec(["true"], ENV, mounts=(Mount("bind", "/mnt", missing),)))
    assert e.value.exit_code == 125
    assert str(e.value) == f"bind source {missing}: does not exist"
    # A missing mount point (outside any tmpfs the job made) names the target.
    child = ns.spawn(ns.ChildSpec(["true"], ENV, mounts=(Mount("bind", "/no-such-mountpoint", "/etc"),)))
    with child:
        child.release()
        with pytest.raises(SpawnError) as e:
            child.wait_started()
        assert os.WEXITSTATUS(child.wait()) == 125
    assert e.value.step == "bind /no-such-mountpoint" and e.value.exit_code == 125
    assert str(e.value).startswith("bind /no-such-mountpoint failed: ENOENT")
    assert len(str(e.value).splitlines()) == 1


def test_chdir_failure_names_the_directory():
    with pytest.raises(SpawnError) as e:
        run(["true"], cwd="/no/such/dir")
    assert e.value.step == "chdir /no/such/dir"
    assert e.value.exit_code == 125


def test_unreleased_child_is_killed_on_close():
    child = ns.spawn(ns.ChildSpec(["true"], ENV))
    child.close()  # never released: SIGKILL + reap, nothing ran
    assert child.pidfd == -1


# ---- what the job holds -------------------------------------------------------

def test_job_sees_only_0_1_2_of_100_inheritable_fds():
    held = []
    try:
        for _ in range(100):
            fd = os.open("/dev/null", os.O_RDONLY)
            os.set_inheritable(fd, True)
            held.append(fd)
        status, out = run(["sh", "-c", "ls /proc/$$/fd"])
        assert sorted(out.split(), key=int) == ["0", "1", "2"]
        status, out = run(["sh", "-c", "ls /proc/$$/fd"], keep_fds=(held[50],))
        assert sorted(out.split(), key=int) == ["0", "1", "2", str(held[50])]
    finally:
        for fd in held:
            os.close(fd)


def test_credentials_capabilities_and_no_new_privs():
    status, out = run(py("""
        import os
        print(os.getresuid(), os.getresgid(), sorted(os.getgroups()))
        for line in open('/proc/self/status'):
            if line.startswith(('Cap', 'NoNewPrivs')):
                print(line.split()[0], line.split()[1])
    """), uid=NOBODY, gid=NOBODY, groups=(NOBODY, 100))
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0] == f"({NOBODY}, {NOBODY}, {NOBODY}) ({NOBODY}, {NOBODY}, {NOBODY}) [100, {NOBODY}]"
    fields = dict(line.split() for line in lines[1:])
    for cap in ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"):
        assert int(fields[cap], 16) == 0, cap
    assert fields["NoNewPrivs:"] == "1"


# Root-owned sysfs files, 0644, whose store checks no capability: a uid-0 job
# without capabilities passes the owner check, so only a read-only /sys stops
# the write.  The job writes back the value it read (a no-op, were it to pass).
# /proc/self/mountinfo lists the mounts at /sys bottom up: the last is what the job sees.
SYSFS_ROOT_WRITABLE = ("/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan",
                       "/sys/kernel/mm/ksm/sleep_millisecs")


def test_root_job_has_no_capabilities_and_readonly_proc_sys():
    attr = next(p for p in SYSFS_ROOT_WRITABLE if os.path.exists(p))
    status, out = run(["sh", "-c", """
        grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status | cut -f2
        echo 1 > /proc/sys/kernel/printk_ratelimit 2>/dev/null && echo writable || echo readonly
        grep ' /sys ' /proc/self/mountinfo | tail -n1 | cut -d' ' -f6 | cut -d, -f1
        v=$(cat "$0") && { err=$( (echo "$v" > "$0") 2>&1 ) && echo sys-writable || echo "sys-refused $err"; }
    """, attr])
    lines = out.splitlines()
    assert lines[:5] == ["0000000000000000"] * 3 + ["readonly", "ro"], out
    assert lines[5].startswith("sys-refused") and "Read-only file system" in lines[5], out


def test_drop_privileges_false_keeps_root_and_caps():
    status, out = run(["sh", "-c", "id -u; grep ^CapEff /proc/self/status | cut -f2"],
                      drop_privileges=False)
    uid, capeff = out.split()
    assert uid == "0" and int(capeff, 16) != 0


def test_environment_is_exactly_as_given():
    env = {"PATH": "/usr/bin:/bin", "A": "1", "EMPTY": "", "SPACES": "a b  c"}
    status, out = run(["env"], env=env)
    assert out.splitlines() == [f"{k}={v}" for k, v in env.items()]


_TIOCSTI_PROBE = r"""
import fcntl, os, sys, termios, tty
from starter.isolate import ns
master, slave = os.openpty()
tty.setraw(slave)
os.setsid()
fcntl.ioctl(slave, termios.TIOCSCTTY, 0)        # the pty is now our controlling tty
fcntl.ioctl(slave, termios.TIOCSTI, b"A")       # and we may inject into it
assert os.read(slave, 1) == b"A"
r, w = os.pipe()
code = "import fcntl, termios, errno\ntry:\n fcntl.ioctl(0, termios.TIOCSTI, b'B'); print('injected')\nexcept OSError as e:\n print(errno.errorcode[e.errno])"
child = ns.spawn(ns.ChildSpec(["/usr/bin/python3", "-c", code], {"PATH": "/usr/bin:/bin"},
                              uid=65534, gid=65534, stdio=(slave, w, w)))
os.close(w)
child.release(); child.wait_started(); child.wait(); child.close()
print(os.read(r, 100).decode().strip())
"""


def test_tiocsti_into_the_callers_terminal_fails():
    out = subprocess.run([sys.executable, "-c", _TIOCSTI_PROBE], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EPERM"


# Makes n orphans, then prints how many other processes (neither PID 1 nor
# itself) are left and how many of those are zombies, once that is what
# argv[2] expects ("reaped": none left; "zombies": n zombies) or after 30 s.
# Every orphan exists before the wait starts (its parent forked it and was
# reaped), so "none left" cannot be seen too early.  No event tells that the
# kernel has reparented an orphan and PID 1 has reaped it: the wait polls
# /proc, with a deadline.
_ORPHANS = """
import os, sys, time
n, want = int(sys.argv[1]), sys.argv[2]
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            os._exit(0)   # an orphan: reparented to PID 1 of the namespace
        os._exit(0)
    os.waitpid(pid, 0)

def others():
    states = []
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) not in (1, os.getpid()):
            try:
                states.append(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0])
            except OSError:
                pass
    return states

deadline = time.monotonic() + 30
while True:
    st = others()
    done = not st if want == "reaped" else st.count('Z') == n
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.01)
print(len(st), st.count('Z'))
"""


def test_init_reaps_1000_orphans():
    status, out = run([PY, "-c", _ORPHANS, "1000", "reaped"], init=True)
    assert status == 0
    assert out.split() == ["0", "0"], "orphans left (all, zombies)"


def test_without_init_orphans_stay_zombies():
    # The control for the test above: a PID 1 that does not reap.
    status, out = run([PY, "-c", _ORPHANS, "20", "zombies"])
    assert out.split() == ["20", "20"], "orphans left (all, zombies)"


def test_init_is_pid_1_and_job_pid_2():
    status, out = run(["sh", "-c", "echo $$; cat /proc/1/comm"], init=True, uid=NOBODY, gid=NOBODY)
    assert out.split() == ["2", "starter-init"]


def test_init_forwards_sigterm_to_the_job():
    job = py("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
        print('ready', flush=True)
        time.sleep(30)
    """)
    r, w = os.pipe()
    child = ns.spawn(ns.ChildSpec(job, ENV, init=True, stdio=(None, w, None)))
    os.close(w)
    with child:
        child.release()
        child.wait_started()
        assert os.read(r, 6) == b"ready\n"
        child.send_signal(signal.SIGTERM)
        status = child.wait()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 42
        assert child.job_status() == 42 << 8
    os.close(r)


def test_init_reports_the_jobs_true_status():
    status, _ = run(["sh", "-c", "kill -KILL $$"], init=True)
    # The init can only exit 137; the job's own status says "signal 9".
    assert os.WEXITSTATUS(status) == 137
    with Running(init=True) as job:
        job.child.send_signal(signal.SIGTERM)  # forwarded; sh has no handler: dies
        assert os.WEXITSTATUS(job.child.wait()) == 128 + signal.SIGTERM
        js = job.child.job_status()
        assert os.WIFSIGNALED(js) and os.WTERMSIG(js) == signal.SIGTERM
    status, _ = run(["sh", "-c", "exit 137"], init=True)
    assert os.WEXITSTATUS(status) == 137


def test_init_exec_failure_is_reported():
    with pytest.raises(SpawnError) as e:
        run(["no-such-command-xyz"], init=True)
    assert e.value.exit_code == 127


@pytest.mark.parametrize("init", [False, True], ids=["pid1", "init"])
def test_job_dies_when_the_starter_is_killed(init):
    probe = textwrap.dedent(f"""
        import os, sys
        from starter.isolate import ns
        c = ns.spawn(ns.ChildSpec(["sleep", "60"], {{"PATH": "/usr/bin:/bin"}}, uid=65534, gid=65534,
                                  init={init}))
        c.release(); c.wait_started()
        print(c.pid, flush=True)
        sys.stdin.read()
    """)
    # As a subreaper, the orphaned job comes to us: we reap it (the node's
    # PID 1 may not), and waitpid proves it died.
    _subreaper(True)
    p = subprocess.Popen([sys.executable, "-c", probe], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        pidfd = os.pidfd_open(pid)  # the job runs: its pidfd polls readable when it exits
        try:
            p.kill()
            p.wait()
            if not select.select([pidfd], [], [], 10 * SLOWDOWN)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"job {pid} survived its starter")
        finally:
            os.close(pidfd)
        # Orphaned, it came to us (the subreaper): reap it, and see how it died.
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    finally:
        _subreaper(False)
        p.stdin.close()
        p.stdout.close()


def _subreaper(on):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0


# ---- cgroup -------------------------------------------------------------------

UNIFIED = "/sys/fs/cgroup/unified"


def _cgroup2_root():
    for root in ("/sys/fs/cgroup", UNIFIED):
        if os.path.exists(os.path.join(root, "cgroup.procs")) and \
                os.statvfs(root).f_fsid is not None and _is_cgroup2(root):
            return root
    return None


def _is_cgroup2(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path and " - cgroup2 " in line for line in f)


@pytest.mark.skipif(_cgroup2_root() is None, reason="no cgroup2 hierarchy mounted")
@pytest.mark.parametrize("clone3", [True, False], ids=["clone3", "clone-fallback"])
def test_clone_into_cgroup(clone3, monkeypatch):
    """clone3(CLONE_INTO_CGROUP) puts the child in its cgroup; without clone3
    the clone() fallback does, by pid before release.  Each path is checked to
    be the one taken: the shim's clone3 state and the by-pid attach."""
    root = _cgroup2_root()
    path = os.path.join(root, f"starter_test_core_{os.getpid()}")
    attached_by_pid = []
    by_pid = ns._attach_by_pid
    monkeypatch.setattr(ns, "_attach_by_pid", lambda child, fd: (attached_by_pid.append(child.pid), by_pid(child, fd)))
    os.mkdir(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not clone3:
                ns.lib.shim_test_no_clone3(1)
            status, out = run(["cat", "/proc/self/cgroup"], cgroup_fd=fd,
                              namespaces=frozenset({"pid", "net"}))
            # Read before the finally below resets it: -1 = clone() was used.
            used = ns.lib.shim_clone3_supported()
            if not clone3:  # the rest of the suite, through clone()
                test_job_is_pid_1_and_sees_only_its_processes()
                test_every_exit_code_propagates()
                assert ns.lib.shim_clone3_supported() == -1, "the fallback went back to clone3"
        finally:
            ns.lib.shim_test_no_clone3(0)
            os.close(fd)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert f"0::/{os.path.basename(path)}" in out.splitlines()
        if clone3:
            assert used == 1 and attached_by_pid == [], (used, attached_by_pid)
        else:
            assert used == -1 and len(attached_by_pid) == 1, (used, attached_by_pid)
    finally:
        os.rmdir(path)
