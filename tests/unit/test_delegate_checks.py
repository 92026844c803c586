"""--delegate's checks and report on fixture text: nsdelegate read from a
mount line, the refusal on v1 and hybrid backends and on a cgroup2 mount
without nsdelegate, and the payloads' figures in the ClassAd.  The pilot
jobs themselves are in tests/test_delegate.py."""

import os

import pytest

from conftest import REPO
from starter.cgroups import hierarchy

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

FIX = os.path.join(REPO, "tests", "fixtures", "cgroup")


def test_nsdelegate_is_read_from_the_mount():
    mi = ("26 24 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
          "27 24 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    assert "nsdelegate" in hierarchy.super_options(mi, "/sys/fs/cgroup")
    assert "nsdelegate" not in hierarchy.super_options(mi, "/sys/fs/cgroup/unified")
    assert hierarchy.super_options(mi, "/nowhere") == set()


def _fixture_backend(kind):
    from starter import cgroups

    def read(name):
        with open(os.path.join(FIX, name)) as f:
            return f.read()

    mi = read(f"mountinfo.{kind}")
    return cgroups.backend_for(hierarchy.detect_layout(mi, read(f"proc_cgroup.{kind}")), "/starter"), mi


@pytest.mark.parametrize("kind", ["v1", "hybrid"])
def test_backends_without_v2_refuse(kind):
    from starter.errors import CgroupError

    be, mi = _fixture_backend(kind)
    with pytest.raises(CgroupError, match="not safe"):
        be.check_delegation(mi)


def test_v2_without_nsdelegate_fails_closed():
    """Without nsdelegate the job's namespace root is no delegation boundary:
    refused, with the remount that fixes it."""
    from starter.errors import CgroupError

    be, mi = _fixture_backend("v2")
    assert "nsdelegate" in mi
    with pytest.raises(CgroupError, match="needs the nsdelegate option") as ei:
        be.check_delegation(mi.replace("nsdelegate,", ""))
    assert "remount,nsdelegate" in ei.value.hint and "\n" not in str(ei.value)


def test_classad_report_lists_payload_figures():
    from starter.observe import classad

    ad = dict(classad.attributes({
        "exit_code": 0, "signal": None, "delegated": True, "payloads_truncated": 0, "payloads_oom": ["p256"],
        "payloads": [{"name": "p256", "cpu_s": 1.5, "memory_peak_bytes": 268 << 20, "oom_kill": 1, "oom_group_kill": 0},
                     {"name": "p512", "cpu_s": 0.25, "oom_kill": 0, "oom_group_kill": 0}]}))
    assert ad["StarterPayloadNames"] == ["p256", "p512"]
    assert ad["StarterPayloadMemoryPeakBytes"] == [268 << 20, None]
    assert ad["StarterPayloadOomKills"] == [1, 0] and ad["StarterPayloadsOom"] == ["p256"]
    assert "StarterPayloads" not in ad
