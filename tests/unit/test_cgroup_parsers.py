"""starter.cgroups' pure parts on fixture text (the fast tier: no root, no
kernel): layout detection, the cgroup files' parsers, limit conversions,
job id checks, the backend interface's hook check, and the kept-open file
reader on plain files.  The behaviour on the real kernel is
tests/test_cgroups.py."""

import errno
import os

import pytest

from conftest import REPO
from starter import cgroups
from starter.cgroups import base, files, hierarchy, limits, parsers, Limits
from starter.cgroups.backend import Backend
from starter.errors import CgroupError, SpecError

pytestmark = pytest.mark.fast

FIX = os.path.join(REPO, "tests", "fixtures", "cgroup")


def fixture(name):
    with open(os.path.join(FIX, name)) as f:
        return f.read()


# ==========================================================================
# pure logic on fixture text


def test_detect_hybrid():
    lay = hierarchy.detect_layout(fixture("mountinfo.hybrid"), fixture("proc_cgroup.hybrid"))
    assert lay.kind == "hybrid"
    assert lay.unified.mount_point == "/sys/fs/cgroup/unified"
    assert lay.v1["memory"].mount_point == "/sys/fs/cgroup/memory"
    assert lay.own["memory"] == "/process_api/c54698aa1352a7bb3192728c84dc9cb2"
    assert lay.own["unified"] == "/"
    be = cgroups.backend_for(lay)
    assert be.kind == "hybrid"
    assert be.parents["unified"] == "/sys/fs/cgroup/unified/starter"
    assert be.parents["memory"] == "/sys/fs/cgroup/memory/process_api/c54698aa1352a7bb3192728c84dc9cb2/starter"
    assert be.parents["pids"] == "/sys/fs/cgroup/pids/starter"
    assert "freezer" not in be.parents  # hybrid freezes through cgroup2
    assert "cpuset" not in be.parents and "devices" not in be.parents
    assert be.job_paths("x1")["cpu"] == "/sys/fs/cgroup/cpu/starter/job-x1"


def test_detect_v2_goes_beside_slurms_task():
    """Slurm's cgroup/v2 signals the pids in task_T only: jobs go beside it,
    in the step's user/ (cgroups/v2.py, "Under Slurm")."""
    lay = hierarchy.detect_layout(fixture("mountinfo.v2"), fixture("proc_cgroup.v2"))
    assert lay.kind == "v2"
    be = cgroups.backend_for(lay)
    step = "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/step_0"
    assert be.parents == {"unified": step + "/user/starter"}
    assert be.job_paths("7")["unified"] == step + "/user/starter/job-7"
    assert cgroups.backend_for(lay, parent="starter-x/y").parents["unified"] == step + "/user/starter-x/y"
    assert cgroups.backend_for(lay, parent="/abs").parents["unified"] == "/sys/fs/cgroup/abs"
    slurm_like = {
        "/system.slice/s.scope/job_42/step_batch/user/task_special": "/job_42/step_batch/user/starter",
        "/job_7/step_extern/user/task_3": "/job_7/step_extern/user/starter",
        # not Slurm's: below the caller's own cgroup, as anywhere
        "/job_7/step_0/user/task_x": "/job_7/step_0/user/task_x/starter",
        "/job_x/step_0/user/task_0": "/job_x/step_0/user/task_0/starter",
        "/a/step_0/user/task_0": "/a/step_0/user/task_0/starter",
        "/job_7/step_0/other/task_0": "/job_7/step_0/other/task_0/starter",
        "/job_7/step_0/user/task_0/more": "/job_7/step_0/user/task_0/more/starter",
    }
    for own, parent in slurm_like.items():
        lay2 = hierarchy.Layout(kind="v2", unified=lay.unified, v1={}, own={"unified": own})
        assert cgroups.backend_for(lay2).parents["unified"].endswith(parent), own


def test_detect_v1_combined_hierarchies():
    lay = hierarchy.detect_layout(fixture("mountinfo.v1"), fixture("proc_cgroup.v1"))
    assert lay.kind == "v1"
    assert lay.v1["cpu"] is lay.v1["cpuacct"]
    assert lay.v1["cpu"].mount_point == "/sys/fs/cgroup/cpu,cpuacct"
    be = cgroups.backend_for(lay)
    assert be.parents["cpu"] == be.parents["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct/slurm/uid_1000/job_42/step_0/starter"
    assert be.parents["memory"] == "/sys/fs/cgroup/memory/slurm/uid_1000/job_42/step_0/task_0/starter"
    assert be.parents["freezer"].startswith("/sys/fs/cgroup/freezer/slurm/")
    # cpu and cpuacct share one directory: made and removed once.
    job = be.job_class(be, "j", be.job_paths("j"))
    assert len(job.dirs()) == len(set(job.paths.values())) == 5


def test_detect_container_mount_root_and_escapes():
    lay = hierarchy.detect_layout(fixture("mountinfo.container"), fixture("proc_cgroup.container"))
    assert lay.kind == "v2"
    # /sys/fs/cgroup shows /docker/abc123; the starter is in .../init below it.
    assert lay.unified.mount_point == "/sys/fs/cgroup"
    assert lay.own["unified"] == "/init"
    mounts = hierarchy.parse_mountinfo(fixture("mountinfo.container"))
    assert mounts[1].mount_point == "/mnt/my cgroup"


def test_detect_nothing_mounted():
    with pytest.raises(CgroupError, match="no cgroup hierarchy"):
        hierarchy.detect_layout(fixture("mountinfo.none"), "1:name=systemd:/\n")


def test_explicit_parent():
    lay = hierarchy.detect_layout(fixture("mountinfo.hybrid"), fixture("proc_cgroup.hybrid"))
    be = cgroups.backend_for(lay, parent="/htcondor//starter/")
    assert be.parents["memory"] == "/sys/fs/cgroup/memory/htcondor/starter"
    assert be.parents["unified"] == "/sys/fs/cgroup/unified/htcondor/starter"
    be = cgroups.backend_for(lay, parent="starter-x/y")
    assert be.parents["memory"] == "/sys/fs/cgroup/memory/process_api/c54698aa1352a7bb3192728c84dc9cb2/starter-x/y"
    assert be.parents["pids"] == "/sys/fs/cgroup/pids/starter-x/y"
    for bad in ("/a/../b", "/", "", "..", "/x/job-1", 5):
        with pytest.raises(SpecError):
            cgroups.backend_for(lay, parent=bad)


def test_proc_cgroup():
    lines = hierarchy.parse_proc_cgroup(fixture("proc_cgroup.v1"))
    assert lines[0].controllers == ("net_cls", "net_prio")
    assert lines[-1].controllers == ("name=systemd",)
    assert hierarchy.parse_proc_cgroup("0::/a:b\n")[0].path == "/a:b"


def test_flat_keyed_files():
    cpu = parsers.parse_flat_keyed(fixture("cpu.stat"))
    assert cpu["user_usec"] == 1990000 and cpu["system_usec"] == 13456
    assert parsers.parse_flat_keyed(fixture("memory.events"))["oom_kill"] == 2
    assert parsers.parse_flat_keyed(fixture("memory.stat"))["anon"] == 536870912
    assert parsers.parse_flat_keyed(fixture("memory.oom_control"))["oom_kill"] == 4
    assert "oom_kill" not in parsers.parse_flat_keyed(fixture("memory.oom_control.old"))
    assert parsers.parse_flat_keyed(fixture("cgroup.events")) == {"populated": 1, "frozen": 0}
    assert parsers.parse_flat_keyed(None) == {}


def test_io_totals():
    assert parsers.io_stat_totals(fixture("io.stat")) == (1459200 + 90430464, 314773504 + 299008000)
    assert parsers.io_stat_totals("") == (0, 0)
    assert parsers.blkio_totals(fixture("blkio.throttle.io_service_bytes")) == (
        1459200 + 90430464,
        314773504 + 299008000,
    )
    assert parsers.blkio_totals("Total 0\n") == (0, 0)


def test_pressure():
    assert parsers.pressure_totals(fixture("cpu.pressure")) == {"some": 76445, "full": 75144}
    assert parsers.pressure_totals(fixture("cpu.pressure.old")) == {"some": 12}
    assert parsers.pressure_totals(fixture("memory.pressure")) == {"some": 0, "full": 0}
    assert parsers.pressure_totals(None) is None
    nested = parsers.parse_nested_keyed(fixture("cpu.pressure"))
    assert nested["some"]["avg10"] == 1.53


def test_cpu_weight_to_shares_is_runc_inverse():
    assert limits.weight_to_shares(100) == 1024
    assert limits.weight_to_shares(1) == 2
    assert limits.weight_to_shares(10000) == 262144
    for w in (1, 2, 5, 39, 50, 100, 101, 500, 1000, 5000, 9999, 10000):
        assert limits.shares_to_weight(limits.weight_to_shares(w)) == w
    prev = 0
    for w in range(1, 10001, 37):
        s = limits.weight_to_shares(w)
        assert s >= prev
        prev = s


def test_limits_validation_names_the_field():
    Limits(memory_bytes=1 << 30, cpus=1.5, cpu_weight=100, pids=10).validate()
    for kw, field in [
        (dict(memory_bytes=-1), "limits.memory_bytes"),
        (dict(memory_bytes="1G"), "limits.memory_bytes"),
        (dict(cpus=0.001), "limits.cpus"),
        (dict(cpus=float("nan")), "limits.cpus"),
        (dict(cpu_weight=0), "limits.cpu_weight"),
        (dict(cpu_weight=10001), "limits.cpu_weight"),
        (dict(pids=0), "limits.pids"),
        (dict(pids=True), "limits.pids"),
    ]:
        with pytest.raises(SpecError) as ei:
            Limits(**kw).validate()
        assert ei.value.field == field
    assert limits.cpu_quota_us(1.5) == 150000


@pytest.mark.parametrize("bad", ["", "..", ".", "a/b", "-x", "a..b", "x" * 65, "a b", None])
def test_job_id_refused(bad):
    with pytest.raises(SpecError):
        base.check_job_id(bad)


# Every hook of the interface, and a backend's class that provides it.
JOB_HOOKS = {"is_empty": "V1Tracking", "freeze": "V1Tracking", "thaw": "V1Tracking", "frozen": "V1Tracking",
             "_kill_round": "V1Tracking", "_tracking_stats": "V1Tracking",
             "set_limits": "V1Resources", "_resource_stats": "V1Resources"}
BACKEND_HOOKS = {"roles", "supports_memory_peak", "supports_pids_peak"}


def test_the_interface_declares_every_hook_and_the_backends_provide_them():
    from starter.cgroups import hybrid, unified, v1, v2

    def hooks(cls):
        return {n for n in dir(cls) if getattr(getattr(cls, n), "__isabstractmethod__", False)}

    assert hooks(base.JobCgroup) == set(JOB_HOOKS)
    assert hooks(Backend) == BACKEND_HOOKS
    for be in (v1.V1Backend, v2.V2Backend, hybrid.HybridBackend):
        assert not hooks(be) and not hooks(be.job_class), be
    assert not hooks(unified.UnifiedTracking)   # a mixin: it only provides


@pytest.mark.parametrize("hook", sorted(JOB_HOOKS))
def test_a_job_class_missing_a_hook_is_refused_when_defined(hook):
    from starter.cgroups import v1

    # V1Job's mixins, one of them without `hook`
    mixins = [type(m.__name__, (), {k: v for k, v in vars(m).items() if k != hook})
              for m in (v1.V1Tracking, v1.V1Devices, v1.V1Resources)]
    with pytest.raises(TypeError, match=rf"lacks the JobCgroup hook {hook}:"):
        type("Partial", (*mixins, base.JobCgroup), {})
    type("Whole", (v1.V1Tracking, v1.V1Devices, v1.V1Resources, base.JobCgroup), {})   # all there: fine
    type("Later", (base.JobCgroup,), {}, abstract=True)                               # put off: fine


@pytest.mark.parametrize("hook", sorted(BACKEND_HOOKS) + ["kind", "job_class"])
def test_a_backend_missing_a_hook_is_refused_when_defined(hook):
    from starter.cgroups import v2

    body = {k: v for k, v in vars(v2.V2Backend).items() if k not in (hook, "__dict__", "__weakref__")}
    with pytest.raises(TypeError, match=rf"lacks the Backend hook {hook}:"):
        type("Partial", (Backend,), body)


# ==========================================================================
# files kept open (files.Kept), on plain files


def test_kept_reads_again_and_says_absent(tmp_path):
    f = tmp_path / "value"
    f.write_text("1\n")
    kept = files.Kept()
    assert kept.text(str(f)) == "1\n" and kept.fds == {}   # not kept until told
    kept.keep = True
    assert kept.text(str(f)) == "1\n"
    with open(f, "r+") as w:                     # the same file, new content
        w.write("22\n")
    assert kept.text(str(f)) == "22\n"
    assert kept.text(str(tmp_path / "missing")) is None
    with pytest.raises(CgroupError) as e:
        kept.write(str(tmp_path / "missing"), 1)
    assert e.value.errno == errno.ENOENT
    kept.close()
    assert kept.fds == {} and not kept.keep
