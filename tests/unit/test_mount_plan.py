"""The job's mount plan (starter/isolate/mounts.py) as data: the cgroup view
each layout gives a job (on fixture text), its private directories and the
hidden entries.  Nothing is mounted; what a job sees is in
tests/test_isolation.py."""

import os

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

MiB = 1 << 20
FIX = os.path.join(REPO, "tests", "fixtures", "cgroup")


def _backend(kind):
    from starter import cgroups

    def text(name):
        with open(os.path.join(FIX, name)) as f:
            return f.read()

    return cgroups.open_backend(None, text(f"mountinfo.{kind}"), text(f"proc_cgroup.{kind}"))


def test_cgroup_view_per_layout():
    from starter.isolate import mounts as M

    assert _backend("v2").view() == [("cgroup2", "", "")]
    v1 = _backend("v1").view()
    assert v1[0][0] == "tmpfs"
    # the job's hierarchies, co-mounted ones once; not systemd, not net_cls
    assert sorted(v1[1:]) == sorted([("cgroup", "cpu,cpuacct", "cpu,cpuacct"), ("cgroup", "memory", "memory"),
                                     ("cgroup", "freezer", "freezer"), ("cgroup", "pids", "pids"),
                                     ("cgroup", "blkio", "blkio")])
    hy = dict((rel, (fs, o)) for fs, rel, o in _backend("hybrid").view()[1:])
    assert hy["unified"] == ("cgroup2", "") and "freezer" not in hy  # hybrid freezes through cgroup2
    plan = M.cgroup_view(_backend("v1").view())
    assert plan[0].fstype == "tmpfs" and "ro" not in plan[0].flags
    assert all("ro" in m.flags for m in plan[1:])
    assert plan[-1].fstype is None and "remount" in plan[-1].flags  # the tmpfs, read-only at last
    assert not any("ro" in m.flags for m in M.cgroup_view(_backend("v2").view(), writable=True))


def test_private_dirs_and_hide_entries():
    from starter.isolate import mounts as M

    plan = M.private_dirs(65534, 65534, 64 * MiB)
    shm = next(m for m in plan if m.dst == "/dev/shm")
    assert shm.fstype == "tmpfs" and f"size={64 * MiB}" in shm.options and "nosuid" in shm.flags
    assert "size=" not in next(m for m in M.private_dirs(0, 0) if m.dst == "/dev/shm").options
    hidden = M.hide(["/run/starter-no-such-dir", "/proc"], files=())
    assert [m.dst for m in hidden] == ["/proc"] and "ro" in hidden[0].flags and hidden[0].optional
    # the internal kind is not a user kind
    from starter.errors import SpecError
    from starter.spec.jobspec import parse_mount

    with pytest.raises(SpecError):
        parse_mount("mounts", "fs", "/x")
