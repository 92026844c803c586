"""--disk by project quota: where the scratch's file system enforces project
quotas, the scratch directory gets a project id of its own and the kernel
limits that project's blocks and inodes (no image, no loop device, no mkfs).

    /run/starter-projects/<id> -> <state dir>/<job id>
                      the id's lease (uids.lease: the kernel arbitrates
                      between starters; the node's, like the uids')
    FS_IOC_FSSETXATTR on the fresh, empty scratch: that id, PROJINHERIT
                      (everything made inside inherits it; ext4 and XFS
                      refuse links and renames in from another project)
    quotactl_fd(Q_SETQUOTA, PRJQUOTA, id): hard limits, --disk bytes and
                      --disk-inodes (default one per 16 KiB, as the image)

When (usable): the file system is mounted with project quotas enforced
(`prjquota` in its options: ext4 with the `project` and `quota` features,
XFS), and the job cannot move its files out of the project.  A file's owner
may change its project id, and clear PROJINHERIT on its directories, from
the initial user namespace (measured on Debian 12's 6.1: the job's
FS_IOC_FSSETXATTR set its file's id to 0 and it wrote past the limit).  The
default syscall profile refuses both ioctls (FS_IOC_FSSETXATTR,
FS_IOC_SETFLAGS); another profile, --seccomp off, or a kernel with
file_setattr() (6.17, which the filter cannot name yet) gets the image
(disk.py) instead.  Fail closed: never a quota the job can step out of.

An id is taken only when its lease is ours and the file system shows it
unused (no blocks, no inodes, no limits): a site's own projects, a kept
scratch's files and a crashed job's limit are all passed over.  Every step
is recorded before it is made (disk_project) and undone in reverse: the
report's `disk` measured and the limits cleared, then the lease given back;
the scratch's removal (scratch.py) frees the blocks.  gc does the same from
the entry (reclaim_recorded).
"""

import errno
import os
import struct

from starter.callers import uids
from starter.errors import StagingError
from starter.fileio import libc_handle
from starter.state.store import fault

PROJECTS = "/run/starter-projects"
FIRST, COUNT = uids.DEFAULT_FIRST, uids.DEFAULT_COUNT     # the transient uids' numbers, leased apart
FULL_SLACK = 1 << 20        # as disk.FULL_SLACK
INODE_BYTES = 16384         # the default inode limit: one per 16 KiB, as mkfs.ext4 -T default

SYS_QUOTACTL_FD = 443       # x86_64, arm64 and the generic table alike
SYS_FILE_SETATTR = 469      # 6.17
Q_GETINFO, Q_GETQUOTA, Q_SETQUOTA = 0x800005, 0x800007, 0x800008
PRJQUOTA = 2
QIF_BLIMITS, QIF_ILIMITS = 1, 4
_DQBLK = struct.Struct("QQQQQQQQI4x")  # struct if_dqblk
FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR = 0x801C581F, 0x401C5820
FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS = 0x40086602, 0x40046602
FS_XFLAG_PROJINHERIT = 0x200
# What the job's filter must refuse (seccomp/default.json has both; a test checks).
GUARDED_IOCTLS = (FS_IOC_FSSETXATTR, FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS)


class Project:
    """One job's project, as far as it got."""

    def __init__(self, fd, job_id, state_dir, limit):
        self.fd = fd            # the scratch (not ours to close): the file system's handle
        self.root_fd = fd       # what disk.setup's callers stage into
        self.job_id = job_id
        self.state_dir = state_dir
        self.limit = limit
        self.id = None
        self.inodes = None
        self.base = (0, 0)      # (bytes, inodes) of the scratch directory itself
        self.tagged = False     # the scratch carries the id


def _quotactl(fd, cmd, qid, buf):
    ctypes, libc = libc_handle()
    if libc.syscall(SYS_QUOTACTL_FD, ctypes.c_int(fd), ctypes.c_uint((cmd << 8) | PRJQUOTA),
                    ctypes.c_int(qid), buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def get(fd, qid):
    """The project's if_dqblk: (bhard KiB, bsoft, bytes used, ihard, isoft, inodes used, ...)."""
    ctypes, _ = libc_handle()
    buf = ctypes.create_string_buffer(_DQBLK.size)
    _quotactl(fd, Q_GETQUOTA, qid, buf)
    return _DQBLK.unpack(buf.raw)


def set_limits(fd, qid, nbytes, inodes):
    """Hard limits (0: none); block limits are in KiB, rounded up."""
    ctypes, _ = libc_handle()
    buf = ctypes.create_string_buffer(_DQBLK.pack(-(-nbytes // 1024), 0, 0, inodes, 0, 0, 0, 0,
                                                  QIF_BLIMITS | QIF_ILIMITS), _DQBLK.size)
    _quotactl(fd, Q_SETQUOTA, qid, buf)


def enforced(options):
    """Project quotas enforced, from a mount's options (mountinfo's per-mount
    and super options, comma-separated): ext4 and XFS say `prjquota`."""
    return not {"prjquota", "pquota"}.isdisjoint(options.split(","))


def mount_options(dev, mountinfo):
    """Every option of the mount(s) of device `dev` (st_dev), from mountinfo text."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) > 6 and f[2] == want and "-" in f[6:]:
            sep = f.index("-", 6)
            return ",".join([f[5]] + f[sep + 3:sep + 4])
    return ""


def why_not(fd, seccomp):
    """None when the scratch `fd` can have a project quota the job cannot
    step out of; else why not (the job gets the image)."""
    if seccomp != "default":
        return f"the job's syscall filter is {seccomp!r}, not the default that refuses project id changes"
    from starter.cgroups.files import read_text

    if not enforced(mount_options(os.fstat(fd).st_dev, read_text("/proc/self/mountinfo"))):
        return "its file system is not mounted with project quotas (prjquota)"
    ctypes, libc = libc_handle()
    if libc.syscall(SYS_FILE_SETATTR, -1, None, None, 0, 0) != 0 and ctypes.get_errno() != errno.ENOSYS:
        return "this kernel's file_setattr() would let the job change its files' project id"
    try:
        _quotactl(fd, Q_GETINFO, 0, ctypes.create_string_buffer(32))
    except OSError as e:
        return f"quotactl_fd: {e.strerror}"
    return None


def setup(fd, spec, job_state, undo, report):
    """The scratch `fd` (just made, empty) as the job's project, limited to
    its --disk and --disk-inodes; -> Project.  Each step recorded before it
    is made, its undo pushed right after."""
    job_id, state_dir, size, inodes = spec.id, spec.state_dir, spec.limits.disk, spec.limits.disk_inodes
    p = Project(fd, job_id, state_dir, size)
    p.inodes = inodes or max(size // INODE_BYTES, 16)

    def unused(qid):
        try:
            return not any(get(fd, qid)[:6])
        except OSError:
            return False

    try:
        p.id = uids.lease(PROJECTS, state_dir, job_id, FIRST, FIRST + COUNT - 1, unused)
    except OSError as e:
        raise StagingError(f"--disk: cannot lease a project id in {PROJECTS}: {e.strerror}") from None
    if p.id is None:
        raise StagingError(f"--disk: no unused project id in {FIRST}-{FIRST + COUNT - 1}",
                           "too many jobs, or leases a crashed starter left: run `starter gc`")
    undo.push(end, p, report, label="disk-quota")
    job_state.update(disk_project=p.id)
    fault("disk-project")
    try:
        import fcntl

        x = bytearray(28)       # struct fsxattr
        fcntl.ioctl(fd, FS_IOC_FSGETXATTR, x)
        x[0:4] = struct.pack("I", struct.unpack_from("I", x)[0] | FS_XFLAG_PROJINHERIT)
        x[12:16] = struct.pack("I", p.id)
        fcntl.ioctl(fd, FS_IOC_FSSETXATTR, x)
        p.tagged = True
        got = get(fd, p.id)
        p.base = (got[2], got[5])
        set_limits(fd, p.id, size + p.base[0], p.inodes + p.base[1])
    except OSError as e:
        raise StagingError(f"--disk: cannot set the scratch's project quota: {e.strerror}",
                           "run the job without --disk, or check the file system's quota setup") from None
    fault("disk-quota")
    return p


def measure(p):
    """The report's `disk` object (as disk.measure's, backend project-quota)."""
    got = get(p.fd, p.id)
    used, files = max(got[2] - p.base[0], 0), max(got[5] - p.base[1], 0)
    avail = max(p.limit - used, 0)
    return {"limit_bytes": p.limit, "used_bytes": used, "available_bytes": avail,
            "full": avail < max(FULL_SLACK, p.limit // 100),
            "inodes_limit": p.inodes, "inodes_used": files, "inodes_full": files >= p.inodes,
            "backend": "project-quota", "project": p.id}


def end(p, report=None):
    """Measure, clear the limits, then give the lease back: one step, so a
    lease is never given back while its limits stand (a clear that fails
    keeps both, and the entry, for gc).  The scratch's removal frees the
    blocks."""
    try:
        if report is not None and p.tagged:
            report.disk = measure(p)
    finally:
        try:
            set_limits(p.fd, p.id, 0, 0)
        except OSError as e:
            raise StagingError(f"--disk: cannot clear project {p.id}'s limits: {e.strerror}") from None
        uids.release(p.id, p.state_dir, p.job_id, PROJECTS)


def reclaim_recorded(st, job_id, state_dir):
    """gc after a crashed starter: the recorded project's limits cleared on
    the scratch's file system, and its lease given back, only while the
    lease still names this job.  -> what was done."""
    from starter.storage import paths, scratch

    qid = st.get("disk_project")
    if not isinstance(qid, int) or uids.holder(qid, PROJECTS) != (os.path.abspath(state_dir), job_id):
        return []
    parent = os.path.dirname(scratch.recorded_path(st, job_id))
    try:
        fd = paths.open_dir(parent, "execute directory", readable=True)
    except paths.MissingError:
        # Its file system is gone with it: nothing here can clear the limits,
        # and an id with limits is never taken again (setup's `unused`).
        uids.release(qid, state_dir, job_id, PROJECTS)
        return [f"disk project {qid}: execute directory {parent} gone; lease given back"]
    except paths.LinkError as e:
        raise StagingError(e.args[0], e.hint) from None
    try:
        set_limits(fd, qid, 0, 0)
    except OSError as e:
        raise StagingError(f"disk project {qid}: cannot clear its limits: {e.strerror}") from None
    finally:
        os.close(fd)
    uids.release(qid, state_dir, job_id, PROJECTS)
    return [f"disk project {qid}: limits cleared, lease given back"]
