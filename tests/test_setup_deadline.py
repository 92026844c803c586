"""Setup's deadline and signals during setup (starter/job/watchdog.py), against a
real FUSE mount whose daemon never answers: every request to it waits in the
kernel, as on a hung NFS server.  The leak check (conftest) checks that a
start that gave up left nothing: state entry, cgroup, mount, child."""

import hashlib
import os
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import STARTER, SLOWDOWN


def _mount_hung(path, rootmode, fds):
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    fds.append(fd)
    subprocess.run(["mount", "-t", "fuse", "-o",
                    f"fd={fd},rootmode={rootmode},user_id=0,group_id=0,allow_other", "starter-hung", path],
                   check=True, pass_fds=(fd,))


@pytest.fixture
def hung_fuse():
    """Two FUSE mounts whose daemon is this test, which never reads
    /dev/fuse: a directory (outside /tmp, so the job's view has it too) and,
    in a plain directory `inputs`, the file `input`.  Closing the fds at the
    end aborts the connections, so the unmounts cannot hang."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    base = tempfile.mkdtemp(prefix="starter-hung-", dir="/var/lib")
    os.chmod(base, 0o755)
    mnt, inputs = os.path.join(base, "mnt"), os.path.join(base, "inputs")
    os.mkdir(mnt)
    os.mkdir(inputs)
    open(os.path.join(inputs, "input"), "w").close()
    fds, mounted = [], []
    try:
        for path, mode in ((mnt, "40000"), (os.path.join(inputs, "input"), "100644")):
            _mount_hung(path, mode, fds)
            mounted.append(path)
        yield {"dir": mnt, "inputs": inputs}
    finally:
        for fd in fds:
            os.close(fd)
        for path in mounted:
            subprocess.run(["umount", path], check=True)
        subprocess.run(["rm", "-rf", base], check=True)


def _start(args, timeout=None):
    env = dict(os.environ)
    env.pop("STARTER_SETUP_TIMEOUT", None)
    if timeout is not None:
        env["STARTER_SETUP_TIMEOUT"] = str(timeout)
    return subprocess.Popen([STARTER, "run", "--user", "nobody", *args], env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _blocked_on_fuse(p, deadline=10):
    """Wait until the starter (or its child) waits on the FUSE mount."""
    end = time.monotonic() + deadline * SLOWDOWN
    while time.monotonic() < end:
        pids = [p.pid] + [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                                           text=True).stdout.split()]
        for pid in pids:
            try:
                with open(f"/proc/{pid}/wchan") as f:
                    if "fuse" in f.read():
                        return
            except OSError:
                pass
        assert p.poll() is None, p.communicate()
        time.sleep(0.02)
    pytest.fail("the starter never waited on the FUSE mount")


def _ends_125(p, msg, within):
    t0 = time.monotonic()
    out, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 125, (out, err)
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err, err
    assert took < within * SLOWDOWN, took


def _manifest(tmp_path):
    """A signature file listing one input (the inputs directory is elsewhere)."""
    sig = tmp_path / "sig.sha256"
    sig.write_text(f"{hashlib.sha256(b'x').hexdigest()}  input\n")
    return ["--manifest", str(sig), "--manifest-digest", hashlib.sha256(sig.read_bytes()).hexdigest()]


# Where setup waits on the hung mount, and what exists by then:
#   bind source: nothing yet (the spec); a verified input: the state entry and
#   the scratch; --cwd: everything, the child too (it waits in its chdir).
CASES = {
    "bind": lambda h, ex, tp: ["--bind", f"{h['dir']}/data:/data", "--", "true"],
    "input": lambda h, ex, tp: ["--execute-dir", ex, *_manifest(tp), "--inputs", h["inputs"], "--", "true"],
    "cwd": lambda h, ex, tp: ["--execute-dir", ex, "--cwd", f"{h['dir']}/work", "--", "true"],
}
WHAT = {"bind": "bind source {dir}/data", "input": "manifest: input input in {inputs}",
        "cwd": "the job's working directory {dir}/work or command true"}


@pytest.mark.parametrize("case", CASES)
def test_setup_gives_up_at_its_deadline(case, hung_fuse, execute_dir, tmp_path):
    p = _start(CASES[case](hung_fuse, execute_dir, tmp_path), timeout=1)
    what = WHAT[case].format(**hung_fuse)
    _ends_125(p, f"{what}: no answer within 1 s (a hung NFS or FUSE mount?)", within=10)
    assert os.listdir(execute_dir) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
@pytest.mark.parametrize("case", CASES)
def test_a_signal_during_setup_ends_the_start(case, sig, hung_fuse, execute_dir, tmp_path):
    p = _start(CASES[case](hung_fuse, execute_dir, tmp_path))     # the default deadline: 60 s
    _blocked_on_fuse(p)
    t0 = time.monotonic()
    p.send_signal(sig)
    _ends_125(p, f"interrupted by {sig.name} during setup", within=5)
    assert time.monotonic() - t0 < 5 * SLOWDOWN
    assert os.listdir(execute_dir) == []


def _descends(pid, ancestor):
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def test_a_signal_after_setup_still_vacates_the_job(execute_dir):
    p = _start(["--execute-dir", execute_dir, "--init", "--", "sleep", "60"])
    # running once the child is sleep
    end = time.monotonic() + 10 * SLOWDOWN
    while time.monotonic() < end:
        if any(_descends(int(pid), p.pid) for pid in subprocess.run(
                ["pgrep", "-f", "-x", "sleep 60"], capture_output=True, text=True).stdout.split()):
            break
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, (out, err)
    assert os.listdir(execute_dir) == []


def test_a_bad_setup_timeout_is_refused():
    p = _start(["--", "true"], timeout="soon")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 125 and "STARTER_SETUP_TIMEOUT" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_callers_signal_or_death_during_setup_ends_the_start(sig, hung_fuse, policy, home, state_root):
    """A caller that is not root, its start waiting on the hung mount (its
    bind source, opened with its rights): its SIGTERM reaches the root
    starter through the relay and ends the start (125, one line); its death
    (SIGKILL) ends it too, and nothing is left within 10 s."""
    from conftest import caller_argv, process_alive

    policy(f'[callers]\nro_bind = ["{hung_fuse["dir"]}"]\n')
    p = subprocess.Popen(caller_argv("run", "--ro-bind", f"{hung_fuse['dir']}/data", "--", "true"), cwd=home,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _blocked_on_fuse(p)
    root = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                           text=True).stdout.split()]
    p.send_signal(sig)
    if sig == signal.SIGTERM:
        _ends_125(p, "interrupted by SIGTERM during setup", within=5)
        return
    p.wait(10)
    deadline = time.monotonic() + 10 * SLOWDOWN
    def entries():
        return [n for n in os.listdir(state_root) if n.endswith(".lock")] if os.path.isdir(state_root) else []

    while (any(process_alive(r) for r in root) or entries()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(r) for r in root) and not entries()


def test_a_signal_right_after_exec_is_the_jobs():
    """The job can run, and print, before its starter has seen the exec: a
    SIGTERM sent on the job's first line is a vacate of the running job (its
    trap's code), never a failed start (125).  30 times, each as early as
    the test can."""
    for _ in range(30):
        p = subprocess.Popen([STARTER, "run", "--user", "nobody", "--", "sh", "-c",
                              "trap 'exit 42' TERM; echo up; while :; do sleep 0.01; done"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "up\n"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 42, err
