"""A caller's lowered limits, and what root writes and reads for every job.

Where root lacks CAP_SYS_RESOURCE (this host), the set-user-ID launcher
cannot raise a hard limit the caller lowered.  A limit that would let the
caller reach past its own job (a cut file root writes for everyone, a root
starter killed mid-job) refuses the start in one line; the node's shared
files are written whole or not at all, and read back only when whole; an
entry that cannot be read is a live job of unknown owner, never skipped.
"""

import os
import subprocess

import pytest

from conftest import GID, SLOWDOWN, STARTER, UID, wait_running
from test_callers import as_caller, refused

from starter.isolate import seccomp
from starter.state import store as S


def _with_limit(home, limit, *args):
    """`starter run ARGS` as the caller under `limit` (prlimit's --NAME=N:
    hard and soft)."""
    unset = [a for k in os.environ if k.startswith("STARTER_") for a in ("-u", k)]
    return subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "env", *unset,
                           "prlimit", limit, STARTER, "run", *args],
                          capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)


def _root_may_raise_limits():
    """Has root CAP_SYS_RESOURCE here (the VMs)?  Then the launcher restores
    every limit a caller lowered, and the caller's start runs."""
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def _cache_files(state_root):
    d = state_root.rstrip("/") + seccomp.CACHE_SUFFIX
    return {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)} if os.path.isdir(d) else {}


@pytest.mark.parametrize("limit, words", [
    ("--fsize=300", "file size"),
    ("--cpu=5", "CPU time"),
    ("--as=2000000000", "address space"),
    ("--data=2000000000", "data size"),
    ("--stack=1048576", "stack size"),
    ("--nproc=20", "processes"),
])
def test_caller_limit_root_cannot_restore_is_refused(policy, home, state_root, starter, limit, words):
    """Each limit that would reach past the caller's own job refuses its start,
    naming the limit; nothing is written, and the next jobs of root and of
    the caller start."""
    for n in _cache_files(state_root):          # the caller's start would write the filter cache
        os.unlink(os.path.join(state_root.rstrip("/") + seccomp.CACHE_SUFFIX, n))
    p = _with_limit(home, limit, "--", "true")
    if _root_may_raise_limits():
        assert p.returncode == 0, p.stderr      # restored: the start runs, the cache is whole
        assert _cache_files(state_root) and seccomp.check_cache(state_root) == []
    else:
        refused(p, words, "ulimit -H")
        assert _cache_files(state_root) == {}
    assert S.list_ids(state_root) == []
    starter("run", "--", "true", check=0)
    assert as_caller("run", "--", "true", cwd=home).returncode == 0


def test_caller_small_fd_limit_is_its_own(policy, home):
    """A lowered fd limit only limits the caller's own start and job: it runs."""
    p = _with_limit(home, "--nofile=200", "--", "sh", "-c", "ulimit -Hn")
    assert p.returncode == 0, p.stderr
    if not _root_may_raise_limits():
        assert int(p.stdout) <= 200


def test_root_half_writes_no_byte_code(policy, home):
    """The root half runs with -B: nothing it imports is written as byte code
    under a caller's limits."""
    p = subprocess.Popen(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "env",
                          *[a for k in os.environ if k.startswith("STARTER_") for a in ("-u", k)],
                          STARTER, "run", "--id", "nobc", "--", "sleep", "30"], cwd=home,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        st = wait_running(os.environ["STARTER_STATE_DIR"], "nobc", p)
        argv = open(f"/proc/{st['starter_pid']}/cmdline", "rb").read().split(b"\0")
        assert argv[1] == b"-ISB", argv[:3]
    finally:
        subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "kill",
                        str(p.pid)], check=False)
        p.wait(60)


# ---------------------------------------------------------------- shared files, cut short

def _cut(path, n=7):
    with open(path, "r+b") as f:
        f.truncate(n)


@pytest.fixture
def cut_job(starter, state_root):
    """A running root job whose entry (its .json and its lock file's copy)
    is cut to a few bytes, as a write under a caller's file size limit left it."""
    p = subprocess.Popen([STARTER, "run", "--id", "cut", "--", "sleep", "60"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    saved = {}
    try:
        wait_running(state_root, "cut", p)
        for suffix in (".json", ".lock"):
            path = os.path.join(state_root, "cut" + suffix)
            saved[path] = open(path, "rb").read()
            _cut(path)
        yield p
    finally:
        if p.poll() is None:
            # A failed test: the entry whole again, so that the kill and gc
            # find the job's cgroup (a cut entry no longer records it).
            for path, data in saved.items():
                if os.path.exists(path):
                    with open(path, "wb") as f:
                        f.write(data)
            starter("kill", "cut")
            if p.poll() is None:
                p.kill()
        p.wait(60)
        starter("gc")


def test_unreadable_entry_is_shown_counted_and_killable(cut_job, starter, state_root, policy, home):
    import json

    rows = json.loads(starter("ps", "--json", check=0).stdout)
    row = [r for r in rows if r["id"] == "cut"]
    assert row and row[0]["state"] == "unknown" and row[0]["user"] == "?", rows
    assert 'job_id="cut"' in starter("metrics", check=0).stdout
    doc = starter("status", "cut", "--json", check=0).stdout
    assert json.loads(doc)["unreadable"] is True
    # A caller's start reads every entry once the node holds max_jobs of
    # them: the cut one counts as the caller's, and nothing crashes.
    policy("[callers]\nmax_jobs = 1\n")
    refused(as_caller("run", "--", "true", cwd=home), "max_jobs")
    policy("[callers]\nmax_jobs = 2\n")
    assert as_caller("run", "--", "true", cwd=home).returncode == 0
    starter("kill", "cut", check=0)
    assert cut_job.wait(30 * SLOWDOWN) == 137
    assert S.list_ids(state_root) == []


def test_cut_filter_cache_is_not_used_and_gc_repairs_it(starter, state_root):
    d = state_root.rstrip("/") + seccomp.CACHE_SUFFIX
    for n in _cache_files(state_root):          # other tests' profiles: only this job's file is left
        os.unlink(os.path.join(d, n))
    starter("run", "--", "true", check=0)
    (name,) = os.listdir(d)
    size = os.path.getsize(os.path.join(d, name))
    _cut(os.path.join(d, name), size - 8)        # a whole number of instructions short
    starter("run", "--", "true", check=0)         # compiled again, not the cut program
    assert os.path.getsize(os.path.join(d, name)) == size
    _cut(os.path.join(d, name), size - 8)
    p = starter("gc", check=0)
    assert f"removed {name}" in p.stdout
    assert os.listdir(d) == []


# ---------------------------------------------------------------- every file that moves processes

def test_caller_cgroup_with_a_writable_mover_is_refused(policy, home):
    """A caller whose cgroup in the tracking hierarchy has a `tasks` (v1) or
    `cgroup.threads` (cgroup2) file it may write, though its directory and
    cgroup.procs are root's, is refused: either file moves the job's
    processes as well."""
    from test_callers import _layout, _remove_cgroup_dir

    layout = _layout()
    if layout.unified is None:      # v1 only: the freezer hierarchy tracks
        m, own, mover = layout.v1["freezer"], layout.own.get("freezer"), "tasks"
    else:
        m, own, mover = layout.unified, layout.own.get("unified"), "cgroup.threads"
    d = os.path.join(m.mount_point, own.lstrip("/"), f"starter-mover-{os.getpid()}")
    os.mkdir(d)
    try:
        os.chown(os.path.join(d, mover), UID, GID)
        argv = ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh",
                *__import__("conftest").caller_argv("run", "--", "true")]
        p = subprocess.run(argv, capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)
        refused(p, "is not root's alone", mover)
    finally:
        _remove_cgroup_dir(d)
