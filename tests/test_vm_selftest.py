"""Checks of the test VM itself (scripts/vm-test, scripts/vm/vm-init).

They run only inside the VM (vm-init sets STARTER_VM=1):

    scripts/vm-test -- python -m pytest -q tests/test_vm_selftest.py

and prove that the VM gives the cgroup v2 tests what they need: one pure v2
hierarchy with its controllers enabled below the root, and the project built
inside the VM rather than borrowed from the host checkout.
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
