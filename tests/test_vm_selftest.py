"""Checks of the test VM itself (scripts/vm-test, scripts/vm/vm-init).

They run only inside the VM (vm-init sets STARTER_VM=1):

    scripts/vm-test -- python -m pytest -q tests/test_vm_selftest.py

and prove that the VM gives the tests the layout it promises: one pure v2
hierarchy with its controllers enabled below the root, or (--cgroup v1) the
v1 controller hierarchies and no cgroup2; and the project built inside the
VM rather than borrowed from the host checkout.
test_deliberate_failure fails on request, to prove that a failing test makes
scripts/vm-test exit non-zero:

    scripts/vm-test --env STARTER_VM_SELFTEST_FAIL=1 -- python -m pytest -q tests/test_vm_selftest.py
"""
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("STARTER_VM") != "1",
    reason="checks the scripts/vm-test VM; run: scripts/vm-test -- python -m pytest -q tests/test_vm_selftest.py",
)

CGROOT = Path("/sys/fs/cgroup")
LAYOUT = os.environ.get("STARTER_VM_CGROUP", "v2")
v2_only = pytest.mark.skipif(LAYOUT != "v2", reason=f"the VM runs the cgroup {LAYOUT} layout")
v1_only = pytest.mark.skipif(LAYOUT != "v1", reason=f"the VM runs the cgroup {LAYOUT} layout")


def _cgroup_mounts():
    return [
        line.split()[1:4]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[2] in ("cgroup", "cgroup2")
    ]


@v2_only
@pytest.mark.cgroup_v2
def test_one_pure_cgroup2_hierarchy():
    cgroup_mounts = [
        line.split()[1:3]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[2] in ("cgroup", "cgroup2")
    ]
    assert cgroup_mounts == [["/sys/fs/cgroup", "cgroup2"]]
    # Only the v2 line, in the root cgroup (vm-init itself sits in /init).
    assert Path("/proc/self/cgroup").read_text() == "0::/\n"
    assert Path("/proc/1/cgroup").read_text() == "0::/init\n"


@v2_only
@pytest.mark.cgroup_v2
def test_controllers_enabled_below_the_root():
    wanted = {"cpu", "memory", "pids", "io"}
    assert wanted <= set((CGROOT / "cgroup.subtree_control").read_text().split())
    child = CGROOT / f"starter-vm-selftest-{os.getpid()}"
    child.mkdir()
    try:
        assert wanted <= set((child / "cgroup.controllers").read_text().split())
        assert (child / "memory.max").read_text() == "max\n"
        assert (child / "pids.max").read_text() == "max\n"
        assert "oom_kill" in (child / "memory.events").read_text()
    finally:
        child.rmdir()


@v1_only
@pytest.mark.cgroup_v1
def test_v1_hierarchies_and_no_cgroup2():
    mounts = _cgroup_mounts()
    assert all(fstype == "cgroup" for _, fstype, _ in mounts), mounts
    by_point = {point: set(opts.split(",")) for point, _, opts in mounts}
    for ctrl in ("memory", "pids", "freezer", "blkio"):
        assert ctrl in by_point[f"/sys/fs/cgroup/{ctrl}"]
    assert {"cpu", "cpuacct"} <= by_point["/sys/fs/cgroup/cpu,cpuacct"]  # co-mounted, as systemd does
    assert (CGROOT / "cpu").resolve() == CGROOT / "cpu,cpuacct"
    # Every v1 hierarchy at its root (the kernel may still print its "0::"
    # line for the unmounted default hierarchy).
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    assert all(l.endswith(":/") for l in lines if not l.startswith("0::")), lines
    # What the starter's v1 backend and OOM policy use.
    for f in ("memory.oom_control", "cgroup.event_control", "memory.memsw.limit_in_bytes"):
        assert (CGROOT / "memory" / f).exists(), f
    assert "oom_kill" in (CGROOT / "memory" / "memory.oom_control").read_text()


def test_project_built_in_the_vm():
    import starter
    import starter._shim

    src = Path("/src")
    assert Path(starter.__file__).resolve().is_relative_to(src)
    assert Path(starter._shim.__file__).resolve().is_relative_to(src)


def test_deliberate_failure():
    if os.environ.get("STARTER_VM_SELFTEST_FAIL") != "1":
        pytest.skip("fails only with STARTER_VM_SELFTEST_FAIL=1 (proves scripts/vm-test reports failures)")
    pytest.fail("deliberate failure (STARTER_VM_SELFTEST_FAIL=1)")
