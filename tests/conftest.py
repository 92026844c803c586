"""Shared fixtures: the starter command, a private state directory, and the
leak check every test passes through.

A test that leaves something on the node fails: after each test we compare
what the node holds (veths, network namespaces, nft tables, job cgroups,
mounts, state entries, our own child processes) with what it held before.
"""

import contextlib
import os
import stat as _stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTER = os.path.join(REPO, ".venv", "bin", "starter")


def starter_in_python(*python_flags):
    """argv running what the `starter` launcher (native/launcher.c) runs,
    with extra interpreter flags (e.g. -X importtime); arguments follow."""
    import sysconfig

    from starter.cli.main import launcher_code

    return [sys.executable, *python_flags, "-IS", "-c", launcher_code(REPO, sysconfig.get_paths()["purelib"])]


PYTHON = os.path.join(REPO, ".venv", "bin", "python")


# The fast tier: tests marked `fast`, each file of tests/unit/ as a whole
# (`pytestmark = pytest.mark.fast`), are pure (parsers, validators, renderers,
# codecs on fixture text), need no root and make nothing on the node.
# `scripts/test --fast` runs them as nobody; the full `scripts/test` runs them
# first, as nobody, then the rest as root with `--tier root`, which leaves
# them out (docs/testing.md).
def pytest_addoption(parser):
    parser.addoption("--tier", choices=("all", "fast", "root"), default="all",
                     help="fast: only the tests marked fast; root: all but those; all (default): both")


def _fast(item):
    return item.get_closest_marker("fast") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # The marker and the directory agree: a fast test lives in tests/unit/,
    # and every test there is fast.
    misfiled = [i.nodeid for i in items if _fast(i) != (i.path.parent.name == "unit")]
    if misfiled:
        raise pytest.UsageError(f"{len(misfiled)} tests are in the other tier's directory (e.g. {misfiled[0]}): "
                                "fast tests go in tests/unit/ (pytestmark = pytest.mark.fast), the rest in tests/")
    tier = config.getoption("--tier")
    if tier != "all":
        drop = [i for i in items if _fast(i) != (tier == "fast")]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [i for i in items if _fast(i) == (tier == "fast")]
    if os.geteuid() != 0:
        # The rest use real namespaces, cgroups and nftables: as root only
        # (no root-skip markers: a test that needs root fails loudly here).
        root = [i.nodeid for i in items if not _fast(i)]
        if root:
            raise pytest.UsageError(f"{len(root)} selected tests need root (e.g. {root[0]}): as another "
                                    "user only the fast tier runs (pytest --tier fast, scripts/test --fast)")


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="session")
def state_root(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    os.environ["STARTER_STATE_DIR"] = str(d / "run")
    # Root's starts read no node policy but the one a test writes (the
    # `policy` fixture): a policy of this machine's must not change them.
    os.environ["STARTER_POLICY"] = str(d / "no-policy.toml")
    yield str(d / "run")


@pytest.fixture
def state_dir(state_root):
    return state_root


@pytest.fixture
def starter(state_root):
    """Run the real CLI: starter(args...) -> CompletedProcess (text)."""

    def run(*args, timeout=60, check=None, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        p = subprocess.run([STARTER, *args], timeout=timeout, **kw)
        if check is not None:
            assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
        return p

    return run


def wait_for(pred, what="the condition", timeout=10.0, step=0.02):
    """Poll, with a deadline (timeout x SLOWDOWN), for what no event
    announces to us (a state file, a cgroup's processes, a file a job
    writes): pred()'s first true value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def wait_running(state_dir, job_id, proc=None, timeout=30):
    """The job's entry once its starter recorded it "running" (no event tells
    another process), polled with a deadline; `proc`: its starter, which must
    not have ended meanwhile."""
    from starter.state import store as state

    deadline = time.monotonic() + timeout * SLOWDOWN
    while (st := state.load(state_dir, job_id)).get("state") != "running":
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job {job_id}'s starter ended ({proc.returncode}) before it ran")
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} did not start")
        time.sleep(0.02)
    return st


POLICY = "/etc/starter/starter.toml"
# Callers that are not root (tests/test_callers.py, tests/test_slurm.py): nobody.
UID = GID = 65534


@pytest.fixture
def policy(state_root):
    """write(text): the node policy for this test (its state_dir the tests'
    own); whatever was there before is put back after."""
    made_dir = not os.path.isdir("/etc/starter")
    saved = None
    if os.path.exists(POLICY):
        with open(POLICY, "rb") as f:
            saved = f.read()

    def write(text="", defaults=""):
        os.makedirs("/etc/starter", mode=0o755, exist_ok=True)
        with open(POLICY, "w") as f:
            f.write(f'[defaults]\nstate_dir = "{state_root}"\n{defaults}\n{text}\n')
        os.chmod(POLICY, 0o644)
        return POLICY

    write()
    os.environ["STARTER_POLICY"] = POLICY       # root's starts read it too (a caller's always do)
    yield write
    os.environ["STARTER_POLICY"] = os.path.join(os.path.dirname(state_root), "no-policy.toml")
    if saved is not None:
        with open(POLICY, "wb") as f:
            f.write(saved)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(POLICY)
        if made_dir:
            with contextlib.suppress(OSError):
                os.rmdir("/etc/starter")


@pytest.fixture
def home(tmp_path):
    """A directory of the caller's own, reachable by it (pytest's are root's 0700)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="starter-caller-", dir="/tmp")
    os.chown(d, UID, GID)
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", d], check=True)


def caller_argv(*args, keep_env=False):
    """argv: the real `starter` (set-user-ID) run by the test caller, without
    the tests' own STARTER_* variables (a caller's are refused) unless keep_env."""
    unset = [] if keep_env else [a for k in os.environ if k.startswith("STARTER_") for a in ("-u", k)]
    return ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "env", *unset, STARTER, *args]


def spawn_output(argv, **spec):
    """ns.spawn of argv as nobody (ChildSpec keywords in `spec`); -> (wait
    status, all it wrote on stdout).  In-process: for tests of the shim's
    paths that the CLI cannot switch (the kernel-fallback toggles)."""
    from starter.isolate import ns

    spec.setdefault("uid", UID)
    spec.setdefault("gid", GID)
    r, w = os.pipe()
    try:
        child = ns.spawn(ns.ChildSpec(list(argv), {"PATH": "/usr/bin:/bin"}, stdio=(None, w, None), **spec))
    finally:
        os.close(w)
    try:
        with child:
            child.release()
            child.wait_started()
            out = b""
            while chunk := os.read(r, 65536):
                out += chunk
            return child.wait(), out
    finally:
        os.close(r)


# Under software emulation (scripts/vm-test runs qemu TCG, ~7x slower) time
# bounds that state a promise ("dead within a second") stretch by this much.
SLOWDOWN = 7.0 if os.environ.get("STARTER_VM") else 1.0


@contextlib.contextmanager
def running_netd(state_dir):
    """`starter netd` for state_dir, serving until the block ends; then
    SIGTERM, and its socket must be gone."""
    import signal
    import time

    os.makedirs(state_dir, exist_ok=True)
    proc = subprocess.Popen([STARTER, "netd", "--state-dir", state_dir], stderr=subprocess.PIPE, text=True)
    sock = os.path.join(state_dir, "netd.sock")
    try:
        # netd announces nothing: poll for its socket, with a deadline.
        deadline = time.monotonic() + 30 * SLOWDOWN
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "netd did not come up"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert not os.path.exists(sock)


def process_alive(pid):
    """True while pid runs; a zombie waiting for its reaper counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited while we read
        return False


# ---------------------------------------------------------------- leak check

def _lines(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {l.strip() for l in out.splitlines() if l.strip()}


def _veths():
    return {l.split(": ")[1].split("@")[0] for l in _lines(["ip", "-o", "link", "show", "type", "veth"]) if ": " in l}


def _job_cgroups():
    found = set()
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        for d in dirs:
            if d.startswith("job-") or d == "starter" or d.startswith(("starter-", "slurm_starter")):
                found.add(os.path.join(root, d))
        # do not descend into job cgroups or very deep trees
        depth = root.count("/")
        if depth > 9:
            dirs[:] = []
    return found


def _mounts():
    with open("/proc/self/mountinfo") as f:
        # mount ids change, the rest of the line must not
        return {" ".join(l.split()[2:]) for l in f}


def children_of(parent):
    """{pid: (comm, state letter)} of the processes whose parent is `parent`."""
    kids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        if int(fields[1]) == parent:
            kids[int(pid)] = (data[data.index("(") + 1:data.rindex(")")], fields[0])
    return kids


def _children():
    return {(str(pid), comm) for pid, (comm, _) in children_of(os.getpid()).items()}


def _image_loops():
    """Loop devices backed by a --disk image (starter/storage/disk.py keeps them in
    .starter-images/): other loop devices on the node are not ours."""
    found = set()
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return found
    for n in names:
        try:
            with open(f"/sys/block/{n}/loop/backing_file") as f:
                backing = f.read().strip()
        except OSError:
            continue
        if "/.starter-images/" in backing:
            found.add(f"/dev/{n} {backing}")
    return found


def _state_entries():
    d = os.environ.get("STARTER_STATE_DIR")
    found = set()
    # The node's default state directory is not the tests' (they use their
    # own, and the node policy a test writes names it): whatever appears in
    # it at any depth is a leak, a directory a test made there included.
    for root, dirs, files in os.walk("/run/starter"):
        found |= {os.path.join(root, n) for n in dirs + files}
    for base in filter(None, (d, "/run/starter")):
        try:
            found |= {os.path.join(base, n) for n in os.listdir(base)}
            # the transient uids its jobs leased (starter/callers/uids.py: the node's leases)
            found |= {f"uid lease {u}" for u in leases(base)}
            # and the project ids of their --disk quotas (starter/storage/quota.py)
            from starter.storage import quota
            from starter.callers import uids

            found |= {f"project lease {n}" for n in uids.leases(base, quota.PROJECTS)}
        except (FileNotFoundError, NotADirectoryError, PermissionError):  # the last: the fast tier, as nobody
            pass
    return found


def leases(state_dir):
    """{uid: job id} of the transient uids leased for state_dir's jobs."""
    from starter.callers import uids

    return {u: job for u, (_, job) in uids.leases(state_dir).items()}


def snapshot():
    return {
        "veth": _veths(),
        "netns": _lines(["ip", "netns", "list"]),
        "nft tables": _lines(["nft", "list", "tables"]),
        "job cgroups": {c for c in _job_cgroups() if os.path.basename(c).startswith(("job-", "slurm_starter"))},
        "mounts": _mounts(),
        "disk image loop devices": _image_loops(),
        "child processes": _children(),
        "state entries": _state_entries(),
    }


@pytest.fixture
def fake_dev_gpus():
    """/dev/nvidia0 and /dev/nvidia1 as fake nodes (two stand-in GPUs) where
    the host has no NVIDIA driver; removed after."""
    if os.path.exists("/proc/driver/nvidia") or any(os.path.lexists(f"/dev/nvidia{i}") for i in (0, 1)):
        pytest.skip("the host has an NVIDIA driver or /dev/nvidiaN: scripts/gpu-check tests real GPUs")
    made = []
    try:
        for i in (0, 1):
            path = f"/dev/nvidia{i}"
            os.mknod(path, _stat.S_IFCHR | 0o666, os.makedev(195, i))
            made.append(path)
            os.chmod(path, 0o666)
        yield made
    finally:
        for path in made:
            os.unlink(path)


@pytest.fixture
def execute_dir():
    """A root-owned 0755 execute directory (--execute-dir) the job's user can
    reach: pytest's tmp directories are 0700."""
    import tempfile

    d = tempfile.mkdtemp(prefix="starter-exec-", dir="/var/lib")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", d], check=True)


# STARTER_TEST_SHARED_NODE=1: other test runs share this node (parallel
# branches on one machine), so what the whole node holds (veths, netns, nft
# tables, job cgroups) cannot be blamed on this test; only what is this
# run's own (its mounts, child processes, state entries) is checked.  For
# development only: CI and scripts/test never set it.
NODE_WIDE = ("veth", "netns", "nft tables", "job cgroups")
SHARED_NODE = bool(os.environ.get("STARTER_TEST_SHARED_NODE"))


# What a fast test is checked for: it runs as any user and makes nothing on
# the node, so only what is cheap to read and the run's own (no `ip`, `nft`).
FAST_KEYS = ("child processes", "state entries")


def _blocked_signals():
    """This thread's blocked signal mask: a test that leaves signals blocked
    in the test process makes every process it starts later deaf to them
    (a netd that never sees its SIGTERM)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    return 0


@pytest.fixture(autouse=True)
def leak_check(request, state_root):
    blocked = _blocked_signals()
    yield from _leak_check(request)
    if _blocked_signals() != blocked:
        pytest.fail(f"test left signals blocked in the test process: SigBlk {_blocked_signals():#x}",
                    pytrace=False)


_LAST_TABLES = {}    # "after": (the last checked test's id, the node's nft tables then)


def _leak_check(request):
    if _fast(request.node):
        before = {"child processes": _children(), "state entries": _state_entries()}
        yield
        after = {"child processes": _children(), "state entries": _state_entries()}
        leaks = {k: sorted(after[k] - before[k]) for k in FAST_KEYS if after[k] - before[k]}
        if leaks:
            pytest.fail(f"fast test left: {leaks}", pytrace=False)
        return
    before = snapshot()
    # A test table (starter_t*) that appeared since the last test's check was
    # made by no test: by a process that outlived its test, or a fixture of
    # wider scope.  Named here, with the test before, not at the session's end.
    last = _LAST_TABLES.get("after")
    if last is not None and not SHARED_NODE:
        between = sorted(t for t in before["nft tables"] - last[1] if t.split()[-1].startswith("starter_t"))
        _LAST_TABLES.pop("after")
        if between:
            pytest.fail(f"test tables appeared between {last[0]} and this test: {between}", pytrace=False)
    yield
    after = snapshot()
    _LAST_TABLES["after"] = (request.node.nodeid, after["nft tables"])
    leaks = {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]
             and not (SHARED_NODE and k in NODE_WIDE)}
    # Give our own children a moment: a process we killed may still be
    # exiting.  Polled, with a deadline: nothing tells us when another
    # process's child is gone.
    if "child processes" in leaks:
        import time

        deadline = time.monotonic() + 0.5 * SLOWDOWN
        while (kids := _children() - before["child processes"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        leaks.pop("child processes")
        if kids:
            leaks["child processes"] = sorted(kids)
    if leaks:
        pytest.fail(f"test left on the node: {leaks}", pytrace=False)


def _test_tables():
    """The node's test tables (test_net's starter_t*)."""
    return {t for t in _lines(["nft", "list", "tables"]) if t.split()[-1].startswith("starter_t")}


def _test_policy():
    """Is the node policy a policy fixture's (its state_dir in pytest's temp)?"""
    try:
        with open(POLICY) as f:
            return "/pytest-of-" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def node_clean_at_end(request, state_root):
    """After the whole run: gc, then nothing of ours may remain at all (a
    run of the fast tier alone makes nothing: nothing to check)."""
    # What a killed earlier run left is not this run's: it is named at the
    # end, apart from what this run left.
    if all(_fast(i) for i in request.session.items):
        yield
        return
    before = _test_tables()
    if _test_policy():
        # A policy fixture's file whose run was killed before it put the
        # old one back: every later `starter run` on the node reads it.
        sys.stderr.write(f"\nnote: {POLICY}, a test's policy left by an earlier run, removed\n")
        os.unlink(POLICY)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(POLICY))
    yield
    if _test_policy():
        raise RuntimeError(f"left after the session: {POLICY}, a test's policy")
    if os.path.exists(STARTER):
        subprocess.run([STARTER, "gc", "--state-dir", state_root], capture_output=True, timeout=60)
    if SHARED_NODE:
        return
    left = {c for c in _job_cgroups()}
    # Test tables (test_net's starter_t*) and private Slurm trees (slurm_starter*) too.
    tables = _test_tables() - before
    if before:
        sys.stderr.write(f"\nnote: test tables left by an earlier run (not this one's): {sorted(before)}\n")
    if left or tables:
        sys.stderr.write(f"\nLEAK: left after the session: cgroups {sorted(left)}, nft tables {sorted(tables)}\n")
        for t in sorted(tables):    # its rules name the test's uplink and LAN: whose it was
            sys.stderr.write(subprocess.run(["nft", "list", "table", *t.split()[1:]], capture_output=True,
                                            text=True).stdout[:3000])
        raise RuntimeError(f"left after the session: cgroups {sorted(left)}, nft tables {sorted(tables)}")
