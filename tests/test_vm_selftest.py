"""Checks of the test VM itself (scripts/vm-test, scripts/vm/vm-init).

They run only inside the VM (vm-init sets STARTER_VM=1):

    scripts/vm-test -- python -m pytest -q tests/test_vm_selftest.py

and prove that the VM gives the cgroup v2 tests what they need: one pure v2
hierarchy, its controllers enabled, the command in a leaf of its own, and the
project built inside the VM rather than borrowed from the host checkout.
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
    # Only the v2 line in /proc/self/cgroup: no v1 hierarchy is even mountable.
    assert Path("/proc/self/cgroup").read_text() == "0::/test\n"


@pytest.mark.cgroup_v2
def test_controllers_enabled_for_the_command_leaf():
    wanted = {"cpu", "memory", "pids", "io"}
    assert wanted <= set((CGROOT / "cgroup.subtree_control").read_text().split())
    # Available in our leaf, for the project to enable below it once it has
    # moved itself out of the way (no internal processes).
    assert wanted <= set((CGROOT / "test" / "cgroup.controllers").read_text().split())
    assert (CGROOT / "test" / "memory.max").read_text() == "max\n"
    assert (CGROOT / "test" / "pids.max").read_text() == "max\n"
    assert "oom_kill" in (CGROOT / "test" / "memory.events").read_text()


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
