"""The start path stays lean: which modules `starter run --net none` imports
(a fixed set: a heavy import cannot creep back unnoticed), STARTER_TRACE's
phases, and the v1 migration warm-up (which thread, which file, when it
ends).  Speed itself is measured in scripts/bench, never asserted here.
The warm-up's target on fixture layouts and the launcher's bundle:
tests/unit/test_start_bundle.py."""

import os
import subprocess
import sysconfig

import pytest

from conftest import REPO, running_netd
from starter import cgroups
from starter.cgroups import files, hierarchy

PY = os.path.join(REPO, ".venv", "bin", "python")

# Everything a `starter run --net none` imports after the interpreter's own
# start-up (python -IS, as the launcher runs it), with a cached seccomp
# profile.  Adding a module here is a decision: say in the commit what it
# costs per start (python -X importtime).
RUN_IMPORTS = {
    # C modules and the few pure-Python ones -S does not load by itself
    "_cffi_backend", "_collections_abc", "_sha256", "_stat", "_struct", "errno", "fcntl", "gc",
    "genericpath", "math", "os", "os.path", "posixpath", "pwd", "select", "stat",
    # the starter's own run path
    "starter", "starter._native", "starter._shim", "starter._shim.lib", "starter.callers",
    "starter.callers.policy", "starter.cgroups", "starter.cgroups.backend", "starter.cgroups.base",
    "starter.cgroups.dirs", "starter.cgroups.files", "starter.cgroups.hierarchy", "starter.cgroups.kill",
    "starter.cgroups.limits", "starter.cli", "starter.cli.main", "starter.cli.parse",
    "starter.errors", "starter.fileio", "starter.isolate", "starter.isolate.childspec",
    "starter.isolate.mounts", "starter.isolate.ns", "starter.isolate.nsidentity",
    "starter.isolate.seccomp", "starter.job", "starter.job.run", "starter.job.strays",
    "starter.job.supervisor", "starter.job.trace", "starter.job.watchdog", "starter.observe",
    "starter.observe.report", "starter.spec", "starter.spec.jobspec", "starter.spec.options",
    "starter.spec.registry", "starter.spec.values", "starter.state", "starter.state.store", "starter.storage",
    "starter.storage.paths",
}
# Only the host's cgroup backend is loaded (with the cgroup2 tracking where it has one).
BACKEND_IMPORTS = {"v2": {"starter.cgroups.v2", "starter.cgroups.unified", "starter.cgroups.parsers",
                          "starter.cgroups.subtree"},
                   "v1": {"starter.cgroups.v1", "starter.cgroups.parsers"},
                   "hybrid": {"starter.cgroups.hybrid", "starter.cgroups.v1", "starter.cgroups.unified",
                              "starter.cgroups.parsers"}}
# Named in docs/design.md, "The start path"; each costs milliseconds per start (measured
# with python -IS on the 2-CPU test host: json +9 ms (it pulls in re),
# contextlib +4.5 ms, threading +4.9 ms, signal +5 ms).
NEVER_ON_RUN_PATH = {"pyroute2", "psutil", "json", "re", "argparse", "dataclasses", "signal", "ctypes",
                     "subprocess", "contextlib", "threading", "collections", "functools", "enum",
                     "typing", "importlib", "hashlib", "tempfile", "traceback", "warnings"}

# What a NAT job adds when netd serves it: the facade, the client and the C
# socket module (+1.3 ms; `socket` and `json` would add 9.5 ms).
NAT_IMPORTS = {"_socket", "starter.net", "starter.net.netd",
               "_json"}  # netd's answer is read with state.loads

PROBE = """
import sys
sys.path[:0] = [{repo!r}, {site!r}]
before = set(sys.modules)
from starter.cli.main import main
code = main(["run", "--net", {net!r}, *{extra!r}, "--user", "nobody", "--state-dir", {state!r}, "--", "/bin/true"])
sys.stdout.write(str(code) + " " + " ".join(sorted(set(sys.modules) - before)))
"""


def _imports_of_run(state, net="none", extra=()):
    code = PROBE.format(repo=REPO, site=sysconfig.get_paths()["purelib"], state=state, net=net,
                        extra=list(extra))
    p = subprocess.run([PY, "-IS", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    status, *mods = p.stdout.split()
    assert status == "0", p.stderr
    return set(mods)


def test_run_imports_exactly_the_lean_set(state_dir):
    _imports_of_run(state_dir)          # fills the seccomp cache beside the state directory
    try:
        mods = _imports_of_run(state_dir)
    finally:
        _remove_seccomp_cache(state_dir)
    assert not mods & NEVER_ON_RUN_PATH, f"heavy imports on the run path: {sorted(mods & NEVER_ON_RUN_PATH)}"
    kind = hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"), files.read_text("/proc/self/cgroup")).kind
    want = RUN_IMPORTS | BACKEND_IMPORTS[kind]
    assert mods == want, (f"new on the run path: {sorted(mods - want)}; "
                          f"no longer imported: {sorted(want - mods)}")


def test_a_nat_run_through_netd_adds_only_the_client(state_dir):
    try:
        with running_netd(state_dir):
            _imports_of_run(state_dir)
            # Networks and a resolver: their parsing must not import `ipaddress`.
            mods = _imports_of_run(state_dir, net="nat", extra=["--lan", "192.0.2.0/24", "--lan", "2001:db8::/32",
                                                                "--resolver", "192.0.2.53"])
    finally:
        _remove_seccomp_cache(state_dir)
    kind = hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"), files.read_text("/proc/self/cgroup")).kind
    want = RUN_IMPORTS | BACKEND_IMPORTS[kind] | NAT_IMPORTS
    assert mods == want, (f"new on the NAT run path: {sorted(mods - want)}; "
                          f"no longer imported: {sorted(want - mods)}")


def _remove_seccomp_cache(state_dir):
    cache = state_dir.rstrip("/") + ".seccomp"
    if os.path.isdir(cache):
        for n in os.listdir(cache):
            os.unlink(os.path.join(cache, n))
        os.rmdir(cache)


def test_trace_prints_every_phase_and_nothing_without_it(starter, state_dir):
    try:
        p = starter("run", "--net", "none", "--user", "nobody", "--", "/bin/true",
                    env=dict(os.environ, STARTER_TRACE="1"), check=0)
        lines = p.stderr.splitlines()
        phases = [ln.split()[2] for ln in lines if ln.startswith("starter: trace ")]
        assert phases[:3] == ["interpreter", "import", "warm-up"], p.stderr
        for want in ("spec", "seccomp", "state", "cgroup", "clone", "attach", "exec", "job",
                     "measure", "teardown", "report"):
            assert want in phases, p.stderr
        assert phases[-1] == "total"
        assert all(ln.endswith(" ms") or "ms  (" in ln for ln in lines if ln.startswith("starter: trace ")), lines
        env = {k: v for k, v in os.environ.items() if k != "STARTER_TRACE"}
        quiet = starter("run", "--net", "none", "--user", "nobody", "--", "/bin/true", env=env, check=0)
        assert "trace" not in quiet.stderr
    finally:
        _remove_seccomp_cache(state_dir)


def test_warm_up_thread_moves_only_itself_and_ends_when_told():
    lay = hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"), files.read_text("/proc/self/cgroup"))
    if cgroups._warm_target(lay) is None:
        pytest.skip("this host's jobs join no v1 hierarchy: warm_up() starts no thread (checked below)")
    before = _own_cgroups()
    threads = set(os.listdir("/proc/self/task"))
    cgroups.warm_up()
    try:
        assert cgroups._warm_exited.locked(), "no warm-up thread started"
        new = set(os.listdir("/proc/self/task")) - threads
        assert len(new) <= 1
    finally:
        cgroups.warm_up_done()
    # The thread holds _warm_exited until its last line: acquiring it waits for the end.
    assert cgroups._warm_exited.acquire(timeout=5), "the warm-up thread did not end"
    cgroups._warm_exited.release()
    assert _own_cgroups() == before       # the process stayed where it was, in every hierarchy
    # the layout it probed is used once, by the next open_backend()
    be = cgroups.open_backend("starter-test")
    assert be.kind == lay.kind


def test_warm_up_starts_no_thread_without_v1(monkeypatch):
    monkeypatch.setattr(cgroups, "_warm_target", lambda layout: None)
    cgroups.warm_up()
    assert not cgroups._warm_exited.locked()


def test_warm_up_takes_the_launchers_pipe_and_closes_it_when_done(monkeypatch):
    """Where the launcher warms up (native/launcher_warm.c), warm_up() starts no
    thread: it takes the launcher's pipe out of the environment, keeps it
    from anything it starts, and warm_up_done() closes it (the launcher's
    process sees EOF and stops).  A value that is no pipe of ours is ignored."""
    r, w = os.pipe()
    try:
        monkeypatch.setenv("STARTER_WARM_FD", str(w))
        os.set_inheritable(w, True)
        cgroups.warm_up()
        assert "STARTER_WARM_FD" not in os.environ
        assert not cgroups._warm_exited.locked(), "a thread started besides the launcher's warm-up"
        assert not os.get_inheritable(w)
        cgroups.warm_up_done()
        assert os.read(r, 1) == b""          # EOF: the write end was closed
        w = None
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    with open("/dev/null") as f:
        for bad in ("x", "-1", "2", "99999", str(f.fileno())):
            monkeypatch.setenv("STARTER_WARM_FD", bad)
            assert not cgroups._take_launcher_fd()
    assert cgroups._launcher_fd[0] is None


def _own_cgroups():
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        return f.read()


# -- the `starter` launcher (native/launcher.c) --------------------------------

def test_launcher_passes_arguments_and_exit_code_through(state_dir):
    p = subprocess.run([os.path.join(REPO, ".venv", "bin", "starter"), "run", "--user", "root", "--",
                        "/bin/sh", "-c", 'printf "%s|" "$@"; exit 7', "sh", "a b", "", "é", "--x"],
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (7, "a b||é|--x|"), p


def test_launcher_ignores_the_callers_python_environment(tmp_path):
    """-I: a PYTHONPATH (or PYTHONSTARTUP, PYTHONHOME...) of the caller's
    cannot put its own `starter` package in front of ours."""
    evil = tmp_path / "starter"
    evil.mkdir()
    (evil / "__init__.py").write_text("raise SystemExit('the caller chose the code')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONSTARTUP=str(evil / "__init__.py"))
    p = subprocess.run([os.path.join(REPO, ".venv", "bin", "starter"), "--version"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("starter "), p


def test_launcher_starts_the_warm_up_before_the_interpreter(state_dir, tmp_path):
    """On a host with v1 hierarchies, a process of the launcher's (not the
    interpreter) moves itself into the v1 cgroup it is in, before Python runs;
    on pure v2, nothing is written."""
    import shutil

    if not shutil.which("strace"):
        pytest.skip("strace is not installed (scripts/setup --test installs it)")
    log = tmp_path / "trace"
    p = subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve,openat,write,poll", "-o", str(log),
                        os.path.join(REPO, ".venv", "bin", "starter"), "run", "--", "/bin/true"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = log.read_text().splitlines()
    python_at = next(i for i, l in enumerate(lines) if "execve(" in l and "/python" in l)
    tasks = [l.split()[0] for l in lines[:python_at + 40] if "/sys/fs/cgroup/" in l and "/tasks\"" in l
             and "openat(" in l and "= -1" not in l]
    kind = hierarchy.detect_layout(files.read_text("/proc/self/mountinfo"), files.read_text("/proc/self/cgroup")).kind
    if kind == "v2":
        assert tasks == [], tasks
        return
    launcher = lines[0].split()[0]
    assert tasks and tasks[0] == launcher, "the launcher opened no v1 tasks file before Python ran"
    movers = [l.split()[0] for l in lines
              if " write(" in l and l.split()[0] != launcher and f'"{l.split()[0]}"' in l]
    assert movers, "no process of the launcher's wrote its own pid"
    assert not any(l.startswith(f"{movers[0]} execve(") for l in lines)     # not the interpreter
    # It repeats the move until the starter, its job's migrations done,
    # closes the pipe: its last poll saw the hang-up (unless this run was so
    # slow that its 1 s limit, 250 rounds, came first).
    polls = [l for l in lines if l.split()[0] == movers[0] and ("poll(" in l or "<... poll resumed>" in l)]
    assert polls, "the launcher's process did not wait for the starter"
    assert "POLLHUP" in polls[-1] or len(polls) >= 250, polls[-3:]


def test_setup_made_the_bundle():
    import sys as _sys

    assert os.path.isfile(os.path.join(REPO, "starter", "__pycache__", "bundle." + _sys.implementation.cache_tag))
