"""Nothing the node daemon set on the starter reaches the job (issue 10):
resource limits, oom_score_adj, nice, scheduling, affinity, umask, the
session keyring, ... through the real CLI, for a default job and a --user
nobody one (the rest of the privilege boundary: tests/test_privilege.py)."""

import ctypes
import json
import os
import resource
import subprocess

import pytest

from conftest import STARTER
from privhelp import _one_line_error, _running, who  # noqa: F401 (who: a fixture)


# ---------------------------------------------------------------- inherited attributes

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_TIMERSLACK = 29
ADDR_NO_RANDOMIZE = 0x0040000


def _hostile_daemon():
    """preexec_fn: what a node daemon might hand the starter."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except PermissionError:
        # No CAP_SYS_RESOURCE here (a container): lowering is refused, so
        # show the reset from the other side.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")
    os.nice(5)
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    resource.setrlimit(resource.RLIMIT_CORE, resource.getrlimit(resource.RLIMIT_CORE)[1:] * 2)
    os.umask(0o077)
    _libc.prctl(PR_SET_TIMERSLACK, 1000000, 0, 0, 0)
    _libc.personality(ADDR_NO_RANDOMIZE)


# The job's view of what it inherited, as JSON.
_SHOW = r"""
import json, os, resource
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
print(json.dumps({
    "oom": int(open("/proc/self/oom_score_adj").read()),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "policy": os.sched_getscheduler(0),
    "personality": int(open("/proc/self/personality").read(), 16),
    "slack": int(open("/proc/self/timerslack_ns").read()),
    "umask": status["Umask"].strip(),
    "cpus": sorted(os.sched_getaffinity(0)),
    "limits": {n: resource.getrlimit(getattr(resource, "RLIMIT_" + n.upper()))
               for n in ("nofile", "core", "stack", "memlock", "nproc", "nice", "cpu", "as", "msgqueue")},
}))
"""
INF = resource.RLIM_INFINITY


def _can_raise_limits():
    """CAP_SYS_RESOURCE (24) in our effective set (not so in some containers)."""
    with open("/proc/self/status") as f:
        eff = next(int(l.split()[1], 16) for l in f if l.startswith("CapEff:"))
    return bool(eff & (1 << 24))


def _show(*opts, **kw):
    p = subprocess.run([STARTER, "run", *opts, "--", "/usr/bin/python3", "-I", "-c", _SHOW],
                       capture_output=True, text=True, timeout=60, **kw)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("init", [False, True], ids=["pid1", "init"])
def test_inherited_attributes_are_reset(who, init):
    opts, _, _ = who
    all_cpus = sorted(os.sched_getaffinity(0))
    got = _show(*opts, *(["--init"] if init else []), preexec_fn=_hostile_daemon)
    assert got["oom"] == 0, got
    assert got["nice"] == 0, got
    assert got["policy"] == os.SCHED_OTHER, got
    assert got["personality"] == 0, got
    assert got["slack"] == 50000, got
    assert got["umask"] == "0022", got
    assert got["cpus"] == all_cpus, got
    lim = got["limits"]
    # Hard limits are capped at the starter's own where it lacks CAP_SYS_RESOURCE.
    nofile_hard = 524288 if _can_raise_limits() else min(524288, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert lim["nofile"] == [1024, nofile_hard], lim
    assert lim["core"] == [0, INF], lim
    assert lim["stack"] == [8 << 20, INF], lim
    assert lim["memlock"] == [8 << 20, 8 << 20], lim
    assert lim["nice"] == [0, 0], lim
    assert lim["cpu"] == lim["as"] == [INF, INF], lim
    nproc = INF if _can_raise_limits() else resource.getrlimit(resource.RLIMIT_NPROC)[1]
    assert lim["nproc"] == [nproc, nproc], lim


def test_enter_resets_inherited_attributes(starter, state_dir, who):
    opts, _, _ = who
    job_id = "priv-enter-attrs-" + ("nobody" if opts else "default")

    def enter(entry):
        return subprocess.run([STARTER, "enter", job_id, "--", "/usr/bin/python3", "-I", "-c", _SHOW],
                              preexec_fn=_hostile_daemon, capture_output=True, text=True, timeout=60)

    _, p, _ = _running(job_id, opts, "true", state_dir, starter, probe=enter)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert (got["oom"], got["nice"], got["policy"], got["personality"], got["umask"]) == \
        (0, 0, os.SCHED_OTHER, 0, "0022"), got
    assert got["limits"]["nofile"][0] == 1024 and got["limits"]["core"][0] == 0, got


def test_rlimit_option(tmp_path, who):
    opts, _, _ = who
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["true"], "rlimits": {"stack": "16M", "core": 0}}))
    lim = _show("--job", str(job), *opts, "--rlimit", f"nofile=512:{hard}", "--rlimit", "CORE=unlimited",
                "--rlimit", "RLIMIT_MSGQUEUE=4096", "--rlimit", "cpu=100:200")["limits"]
    assert lim["nofile"] == [512, hard], lim
    assert lim["core"] == [INF, INF], lim          # the command line wins over the file
    assert lim["stack"] == [16 << 20, 16 << 20], lim
    assert lim["msgqueue"] == [4096, 4096], lim
    assert lim["cpu"] == [100, 200], lim


@pytest.mark.parametrize("value, words", [
    ("nofile", ["NAME=SOFT"]), ("bogus=1", ["bogus"]), ("nofile=abc", ["abc"]),
    ("nofile=10:5", ["soft limit is above"]), ("nofile=-1", ["-1"]),
    ("nofile=99999999999999999999999", ["too large"]),
])
def test_rlimit_bad_values(starter, value, words):
    _one_line_error(starter("run", "--user", "nobody", "--rlimit", value, "--", "true"), "rlimit", *words)


def test_rlimit_above_the_kernel_ceiling(starter, state_dir):
    with open("/proc/sys/fs/nr_open") as f:
        nr_open = int(f.read())
    p = starter("run", "--id", "priv-rl", "--user", "nobody", "--rlimit", f"nofile={nr_open + 1}", "--", "true")
    _one_line_error(p, "setrlimit NOFILE", "EPERM")
    assert not os.path.exists(os.path.join(state_dir, "priv-rl.json"))


def test_rlimits_job_file_type_error(starter, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["true"], "user": "nobody", "rlimits": ["nofile=1"]}))
    _one_line_error(starter("run", "--job", str(job)), "rlimits")
    job.write_text(json.dumps({"command": ["true"], "user": "nobody", "rlimits": {"nofile": [1, 2]}}))
    _one_line_error(starter("run", "--job", str(job)), "rlimits")


# keyctl(2) and friends by number (no keyutils needed, here or in the VM).
_KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
_KEY_PROBE = r"""
import ctypes, os, platform, sys
add_key, request_key, keyctl = {nums}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
k = libc.syscall(request_key, b"user", b"priv-test-secret", None, 0)
print("FOUND" if k >= 0 else "not-found", ctypes.get_errno())
"""


def _session_key_holder():
    """preexec_fn: the starter runs in a session keyring holding a key."""
    add_key, _, keyctl = _KEY_SYSCALLS[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(keyctl, 1, b"priv-test", 0, 0, 0) < 0:       # KEYCTL_JOIN_SESSION_KEYRING
        raise OSError(ctypes.get_errno(), "join session keyring")
    if libc.syscall(add_key, b"user", b"priv-test-secret", b"s3cret", 6, -3) < 0:  # @s
        raise OSError(ctypes.get_errno(), "add_key")


def test_session_keyring_not_inherited(who):
    # A job that shared the starter's session keyring would possess (and so
    # could read) its keys whatever its uid.
    opts, _, _ = who
    if os.uname().machine not in _KEY_SYSCALLS:
        pytest.skip(f"no keyctl syscall numbers for {os.uname().machine} in this test")
    probe = _KEY_PROBE.replace("{nums}", repr(_KEY_SYSCALLS))
    # The probe itself finds the key where it shares the keyring: as host root
    # without the reset, i.e. in the starter's own session.
    p = subprocess.run(["/usr/bin/python3", "-I", "-c", probe], preexec_fn=_session_key_holder,
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.startswith("FOUND"), (p.stdout, p.stderr)
    p = subprocess.run([STARTER, "run", *opts, "--", "/usr/bin/python3", "-I", "-c", probe],
                       preexec_fn=_session_key_holder, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("not-found"), p.stdout
