"""Fault injection (STARTER_FAULT, starter/state/store.py): a NAT job with a scratch
is killed at every step of its life, or has each teardown step fail; then
`starter gc` must leave nothing: veth, nft set elements and counters, lease,
cgroup, scratch, state entry, temp files."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import STARTER, leases  # noqa: E402
from starter import cgroups  # noqa: E402
from starter.state import store as S  # noqa: E402
from starter.net import ipam  # noqa: E402
from test_run_nat import POOL  # noqa: E402

TEARDOWN_STEPS = ("net", "child", "cgroup", "scratch", "resolv", "entry", "uid")


@pytest.fixture(scope="module")
def site():
    with nethosts.site() as s:
        yield s


def _user(fault):
    """The steps of a transient uid's lease need a job without --user."""
    return [] if "uid" in fault else ["--user", "nobody"]


def _run(site, state_dir, ex, job_id, fault, cmd=("true",)):
    env = dict(os.environ, STARTER_FAULT=fault, STARTER_STATE_DIR=state_dir)
    return subprocess.run(
        [STARTER, "run", "--id", job_id, *_user(fault), "--net", "nat", "--pool", POOL,
         "--lan", site.lan_cidr, "--uplink", site.uplink, "--execute-dir", str(ex), "--memory", "256M",
         "--pids", "100", "--", *cmd],
        env=env, capture_output=True, text=True, timeout=120)


def _left(state_dir, ex, job_id):
    """Everything of job_id still on the node (empty: nothing)."""
    left = []
    key = ipam.job_key(job_id)
    for root, _, files in os.walk(state_dir):
        left += [os.path.join(root, f) for f in files if f.startswith(job_id + ".") or f.endswith(".tmp")
                 or f.startswith(key)]
    left += [f"uid lease {u}" for u, job in leases(state_dir).items() if job == job_id]
    slots = os.path.join(state_dir, "net", "slots")
    if os.path.isdir(slots):
        left += [f"slot {n}" for n in os.listdir(slots) if os.readlink(os.path.join(slots, n)) == key]
    left += [p for p in cgroups.open_backend().job_paths(job_id).values() if os.path.exists(p)]
    if os.path.exists(ex / f"job-{job_id}"):
        left.append(str(ex / f"job-{job_id}"))
    if os.path.exists(f"/sys/class/net/{key}"):
        left.append(f"veth {key}")
    nft = subprocess.run(["nft", "list", "table", "inet", "starter"], capture_output=True, text=True).stdout
    left += [f"nft: {line.strip()}" for line in nft.splitlines() if key in line]
    return left


@pytest.fixture
def ex(tmp_path):
    d = tmp_path / "exec"
    d.mkdir()
    return d


@pytest.mark.net
@pytest.mark.parametrize("step", S.FAULT_STEPS)
def test_starter_killed_at_every_step_then_gc_leaves_nothing(site, state_dir, ex, step):
    job_id = f"fault-{step}"
    p = _run(site, state_dir, ex, job_id, step)
    assert p.returncode == -9, (step, p.returncode, p.stderr)
    g = subprocess.run([STARTER, "gc", "--state-dir", state_dir], capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, (g.stdout, g.stderr)
    assert _left(state_dir, ex, job_id) == [], g.stdout


@pytest.mark.net
@pytest.mark.parametrize("step", TEARDOWN_STEPS)
def test_a_failed_teardown_step_keeps_the_entry_until_gc_succeeds(site, state_dir, ex, step):
    job_id = f"tdfail-{step}"
    p = _run(site, state_dir, ex, job_id, f"teardown-{step}:fail")
    assert p.returncode == 0, p.stderr              # the job itself ran and exited 0
    assert f"teardown {'state entry' if step == 'entry' else step} failed" in p.stderr, p.stderr
    st = S.load(state_dir, job_id)
    assert st["state"] == "reclaiming" and any("planted fault" in h for h in st["held"]), st
    assert not S.is_live(state_dir, job_id)
    ps = subprocess.run([STARTER, "ps", "--state-dir", state_dir], capture_output=True, text=True).stdout
    user = st["user"] if step == "uid" else "nobody"
    assert any(l.split()[:3] == [job_id, user, "reclaiming"] for l in ps.splitlines()), ps
    g = subprocess.run([STARTER, "gc", "--state-dir", state_dir], capture_output=True, text=True, timeout=120)
    assert g.returncode == 0 and f"job {job_id}: state entry removed" in g.stdout, (g.stdout, g.stderr)
    assert _left(state_dir, ex, job_id) == [], g.stdout


@pytest.mark.net
def test_table_removed_under_running_jobs_is_rebuilt_without_refusing_the_next(site, tmp_path):
    # What the soak found: another state dir's last job removed the shared
    # table; the rebuild took this state dir's own live veths for a conflict.
    from starter import net
    from starter.net import ipam

    cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=POOL, table=f"startert{os.getpid()}")
    a, b = site.job(), site.job()
    try:
        fd = a.open_fd()
        try:
            net.setup("rebuild-a", fd, cfg)
        finally:
            os.close(fd)
        assert ipam.LeaseStore(cfg.state_dir).table_record()["marks"] is True
        subprocess.run(["nft", "delete", "table", "inet", cfg.table], check=True)
        fd = b.open_fd()
        try:
            assert net.setup("rebuild-b", fd, cfg).address
        finally:
            os.close(fd)
        # rebuilt under a's connections, which carry no mark now: a's and b's
        # are found by address at their ends
        assert ipam.LeaseStore(cfg.state_dir).table_record()["marks"] is False
        assert net.counters("rebuild-a", cfg) is not None and net.counters("rebuild-b", cfg) is not None
    finally:
        net.teardown("rebuild-b", cfg)
        net.teardown("rebuild-a", cfg)
        a.close()
        b.close()
    assert net.gc(cfg, set()) == []
