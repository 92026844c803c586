"""--disk by project quota, the parts that need no file system: the default
syscall filter guards every ioctl that sets a file's project, and whether a
mount enforces project quotas is read from mountinfo text.  The quotas on a
real ext4 are in tests/test_quota.py."""

import os

import pytest

from starter.storage import quota

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def test_the_default_profile_names_every_guarded_ioctl():
    from starter.isolate.seccomp import profile as P

    prof = P.parse(open(os.path.join(os.path.dirname(quota.__file__), "..", "isolate", "seccomp", "default.json"), "rb").read(),
                   "default")
    guarded = {r.args[0][3] for r in prof.rules if any(n == "ioctl" for n, _ in r.names)
               if r.action == P.ACT_ERRNO | 1 and len(r.args) == 1
               and r.args[0][:3] == (1, P.OPS["SCMP_CMP_MASKED_EQ"], 0xFFFFFFFF)}
    assert guarded == set(quota.GUARDED_IOCTLS)


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 7:0 / /var/lib/x/mnt rw,relatime shared:20 - ext4 /dev/loop0 rw,prjquota
41 22 7:1 / /srv/a rw,relatime - xfs /dev/loop1 rw,attr2,inode64,logbufs=8,prjquota
42 22 7:2 / /srv/b rw,relatime - xfs /dev/loop2 rw,attr2,inode64,pqnoenforce
43 22 7:3 / /srv/c rw,relatime master:3 shared:9 - ext4 /dev/loop3 rw,quota,usrquota
"""


@pytest.mark.parametrize("dev, yes", [((8, 1), False), ((7, 0), True), ((7, 1), True), ((7, 2), False),
                                      ((7, 3), False), ((9, 9), False)])
def test_project_quotas_enforced_from_mountinfo(dev, yes):
    assert quota.enforced(quota.mount_options(os.makedev(*dev), MOUNTINFO)) is yes
