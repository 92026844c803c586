"""--disk: the job's scratch on a file system of its own size, so the kernel
stops its writes there (ENOSPC) and nothing has to poll.

What runs: a per-job ext4 image, as HTCondor does where it has no LVM.

    <scratch parent>/.starter-images/        root's, 0700, on the scratch's own
                                             file system (refused otherwise)
    <scratch parent>/.starter-images/job-<id>.img
                                             a sparse file of SIZE, root's, 0600,
                                             marked with trusted.starter.job
    mkfs.ext4: no journal, no reserved blocks, no resize inode, -N INODES,
               the root directory owned by the job (root_owner=)
    a loop device (LOOP_CTL_GET_FREE + LOOP_CONFIGURE, autoclear)
    mounted nosuid,nodev on the scratch; lost+found removed, the root 0700

Where the scratch's file system enforces project quotas, setup() hands the
job to starter/storage/quota.py instead (no image, no mount); this module is the
fallback everywhere else, and for jobs that could step out of a quota.

Every step is recorded in the job's state entry before it is made
(disk_image, then disk_image_id, then disk_loop) and its teardown registered
right after it exists (job.Undo: disk-mount, disk-loop, disk-image), so a
crash anywhere leaves `starter gc` (reclaim_recorded) a record to act on,
and gc acts only on what is provably the job's: a mount at the recorded
scratch whose loop device is backed by the recorded image inode, loop devices
backed by that inode, and the image carrying the job's mark.

Measured before the unmount (fstatvfs of the mounted root): the report's
`disk` object (limit, used, full; the same for inodes).

ctypes (fileio.libc_handle: mount, umount2) and fcntl are loaded only by this
module's work: a job without --disk never loads this module.
"""

import errno
import os
import stat
import struct

from starter.errors import StagingError
from starter.fileio import libc_handle
from starter.state.store import fault

IMAGES = ".starter-images"
# "full": less than this (or 1% of the limit) left at the end.  ext4 refuses
# a write with a little room left (measured: 260 KiB of a 20 MiB image after
# `dd bs=1M` got ENOSPC; 0 after `dd bs=4k`), so exact zero would miss most.
FULL_SLACK = 1 << 20
DETACH_WAIT_S = 2.0      # how long a teardown waits for autoclear (_wait_unbound)
MKFS_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
MARK = "trusted.starter.job"            # as scratch.MARK

# linux/loop.h
LOOP_SET_FD = 0x4C00
LOOP_CLR_FD = 0x4C01
LOOP_SET_STATUS64 = 0x4C04
LOOP_GET_STATUS64 = 0x4C05
LOOP_CONFIGURE = 0x4C0A
LOOP_CTL_GET_FREE = 0x4C82
LO_FLAGS_AUTOCLEAR = 4
_INFO64 = 232           # sizeof(struct loop_info64)
_INFO_FLAGS = 52        # offsetof(struct loop_info64, lo_flags)
_INFO_NAME = 56         # offsetof(struct loop_info64, lo_file_name), 64 bytes

MS_NOSUID, MS_NODEV = 2, 4
UMOUNT_NOFOLLOW = 8

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def image_name(job_id):
    return f"job-{job_id}.img"


def mkfs_path():
    """$STARTER_MKFS (root's environment only: a caller's is emptied), else
    mkfs.ext4 from the system directories (never the caller's PATH)."""
    given = os.environ.get("STARTER_MKFS")
    if given:
        return given
    for d in MKFS_DIRS:
        p = os.path.join(d, "mkfs.ext4")
        if os.access(p, os.X_OK):
            return p
    return os.path.join(MKFS_DIRS[0], "mkfs.ext4")


class Image:
    """One job's image, as far as it got.  Every teardown tolerates "already gone"."""

    def __init__(self, job_id, mount_point, images_path, limit):
        self.job_id = job_id
        self.name = image_name(job_id)
        self.path = os.path.join(images_path, self.name)
        self.mount_point = mount_point
        self.limit = limit
        self.dir_fd = None      # the images directory
        self.id = None          # (st_dev, st_ino) of the image file
        self.loop = None        # N of /dev/loopN
        self.rdev = None
        self.root_fd = None     # the mounted file system's root (staging, measuring)
        self.base = (0, 0)      # (bytes, inodes) the empty file system uses


def setup(sc, spec, job_state, undo, report):
    """The scratch `sc` (scratch.Scratch, just made) limited to the job's
    --disk (spec.limits.disk): a project quota where its file system
    enforces them and the job cannot step out (starter/storage/quota.py),
    else the job's image, attached and mounted on it.  -> quota.Project or
    Image (root_fd: the scratch as the job will see it).  Each step recorded
    in `job_state` before it is made, its teardown pushed on `undo` right
    after; `report` (observe.report.Report) gets the `disk` object at the
    end."""
    from starter.storage import quota

    if quota.why_not(sc.fd, spec.seccomp) is None:
        return quota.setup(sc.fd, spec, job_state, undo, report)
    job_id, size = spec.id, spec.limits.disk
    mkfs = mkfs_path()
    if not os.access(mkfs, os.X_OK):
        raise StagingError(f"--disk: {mkfs} not found: the job's disk image cannot be made",
                           "install e2fsprogs (apt install e2fsprogs), or run the job without --disk")
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise StagingError(f"--disk: /dev/loop-control: {e.strerror}: this node has no loop devices for "
                           "the job's disk image", "load the loop module (modprobe loop), or run the job "
                           "without --disk") from None
    try:
        parent = os.path.dirname(sc.path)
        img = Image(job_id, sc.path, os.path.join(parent, IMAGES), size)
        img.dir_fd = _images_dir(sc.parent_fd, parent)
        job_state.update(disk_image=img.path)
        fault("disk-record")
        fd = _create_image(img, size)
        undo.push(remove_image, img, label="disk-image")
        try:
            job_state.update(disk_image_id=list(img.id))
            fault("disk-image")
            _mkfs(mkfs, fd, img, spec.uid, spec.gid, spec.limits.disk_inodes)
            lfd = _attach(ctl, fd, img, job_state)
        finally:
            os.close(fd)
        undo.push(detach, img, label="disk-loop")
        try:
            fault("disk-loop")
            _mount(img, sc.fd)
        finally:
            os.close(lfd)       # the mount holds the device now; autoclear detaches it after
        undo.push(unmount, img, report, label="disk-mount")
        fault("disk-mount")
        _open_root(img, sc.parent_fd, os.path.basename(sc.path))
        return img
    finally:
        os.close(ctl)


def _images_dir(parent_fd, parent):
    path = os.path.join(parent, IMAGES)
    try:
        os.mkdir(IMAGES, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as e:
        raise StagingError(f"--disk: cannot create {path}: {e.strerror}") from None
    try:
        fd = os.open(IMAGES, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        raise StagingError(f"--disk: {path} is not a directory ({e.strerror})",
                           "remove it; the starter makes it, root's, mode 0700") from None
    st, pst = os.fstat(fd), os.fstat(parent_fd)
    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077 or st.st_dev != pst.st_dev:
        os.close(fd)
        raise StagingError(f"--disk: {path} must be root's, mode 0700, on the file system of {parent} "
                           f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
                           f"remove it (the starter makes it) or chown root: {path} && chmod 0700 {path}")
    return fd


def _create_image(img, size):
    try:
        fd = os.open(img.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=img.dir_fd)
    except FileExistsError:
        raise StagingError(f"--disk: {img.path} already exists",
                           "an earlier run with this id left it: `starter gc` removes it") from None
    except OSError as e:
        raise StagingError(f"--disk: cannot create {img.path}: {e.strerror}") from None
    st = os.fstat(fd)
    img.id = (st.st_dev, st.st_ino)
    try:
        try:
            os.setxattr(fd, MARK, img.job_id.encode())
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        os.ftruncate(fd, size)          # sparse: space is taken as the job writes
    except OSError as e:
        os.close(fd)
        _unlink_if(img.dir_fd, img.name, img.id)
        raise StagingError(f"--disk: cannot make the {size}-byte image {img.path}: {e.strerror}",
                           "is the execute directory's file system full?") from None
    return fd


def _mkfs(mkfs, fd, img, uid, gid, inodes):
    argv = [mkfs, "-q", "-F", "-T", "default", "-O", "^has_journal,^resize_inode", "-m", "0",
            "-E", f"root_owner={uid}:{gid},lazy_itable_init=1,nodiscard"]
    if inodes:
        # -N counts ext4's reserved inodes 1-10 (the root directory is 2;
        # 11, lost+found, is removed): the job gets at least `inodes`.
        argv += ["-N", str(inodes + 10)]
    argv.append(f"/proc/self/fd/{fd}")
    r, w = os.pipe()
    try:
        os.set_inheritable(fd, True)
        try:
            # setsigmask: not setup's blocked signals (job/watchdog.py) for mkfs
            pid = os.posix_spawn(mkfs, argv, {"PATH": ":".join(MKFS_DIRS), "LC_ALL": "C"}, setsigmask=(),
                                 file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_DUP2, w, 2)])
        finally:
            os.set_inheritable(fd, False)
        os.close(w)
        w = None
        out = b""
        while len(out) < 65536:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            out += chunk
        status = os.waitpid(pid, 0)[1]
    except OSError as e:
        raise StagingError(f"--disk: cannot run {mkfs}: {e.strerror}",
                           "install e2fsprogs, or run the job without --disk") from None
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    if status != 0:
        said = " ".join(out.decode(errors="replace").split())[-300:] or f"wait status {status}"
        raise StagingError(f"--disk: mkfs.ext4 failed for the job's image: {said}",
                           "check --disk and --disk-inodes (at most one inode per 256 bytes of --disk)")


def _loop_info(path_text=b"", flags=LO_FLAGS_AUTOCLEAR):
    info = bytearray(_INFO64)
    struct.pack_into("I", info, _INFO_FLAGS, flags)
    name = path_text[:63]
    info[_INFO_NAME:_INFO_NAME + len(name)] = name
    return bytes(info)


def _attach(ctl, fd, img, job_state):
    """A free loop device backed by `fd`, autoclear; -> its open fd."""
    import fcntl

    for _ in range(32):
        n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
        job_state.update(disk_loop=n)     # before it is ours: gc checks by the image's inode
        try:
            lfd = os.open(f"/dev/loop{n}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue                        # udev or devtmpfs has not made the node yet
        try:
            info = _loop_info(img.path.encode(errors="replace"))
            try:
                fcntl.ioctl(lfd, LOOP_CONFIGURE, struct.pack("II", fd, 0) + info + bytes(64))
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOTTY):
                    raise
                fcntl.ioctl(lfd, LOOP_SET_FD, fd)          # before Linux 5.8
                try:
                    fcntl.ioctl(lfd, LOOP_SET_STATUS64, info)
                except OSError:
                    fcntl.ioctl(lfd, LOOP_CLR_FD)
                    raise
        except OSError as e:
            os.close(lfd)
            if e.errno == errno.EBUSY:
                continue                    # another process took it between GET_FREE and ours
            raise StagingError(f"--disk: cannot attach {img.path} to /dev/loop{n}: {e.strerror}",
                               "see `losetup -a`; run the job without --disk") from None
        img.loop = n
        img.rdev = os.fstat(lfd).st_rdev
        return lfd
    raise StagingError("--disk: no free loop device after 32 tries",
                       "too many loop devices in use (`losetup -a`); raise max_loop or retry later")


def _mount(img, target_fd):
    ctypes, libc = libc_handle()
    # The target by its fd: the scratch directory just made, whatever its path does.
    if libc.mount(f"/dev/loop{img.loop}".encode(), f"/proc/self/fd/{target_fd}".encode(), b"ext4",
                  MS_NOSUID | MS_NODEV, b"noinit_itable") != 0:
        e = ctypes.get_errno()
        raise StagingError(f"--disk: cannot mount the job's image on {img.mount_point}: {os.strerror(e)}",
                           "does this kernel have ext4 (grep ext4 /proc/filesystems)?")


def _open_root(img, parent_fd, name):
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_dev != img.rdev:
            raise StagingError(f"--disk: {img.mount_point} is not the job's image after mounting it")
        os.fchmod(fd, 0o700)
        try:
            os.rmdir("lost+found", dir_fd=fd)     # root's: the job sees an empty scratch
        except FileNotFoundError:
            pass
        st = os.fstatvfs(fd)
    except BaseException:
        os.close(fd)
        raise
    img.root_fd = fd
    img.base = ((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree)


def measure(img):
    """The report's `disk` object, from the mounted file system (None if it is gone)."""
    if img.root_fd is None:
        return None
    st = os.fstatvfs(img.root_fd)
    avail = st.f_bavail * st.f_frsize
    return {
        "limit_bytes": img.limit,
        "used_bytes": max((st.f_blocks - st.f_bfree) * st.f_frsize - img.base[0], 0),
        "available_bytes": avail,
        "full": avail < max(FULL_SLACK, img.limit // 100),
        "inodes_limit": st.f_files - img.base[1],
        "inodes_used": max(st.f_files - st.f_ffree - img.base[1], 0),
        "inodes_full": st.f_favail == 0,
        "backend": "image",
    }


# ---------------------------------------------------------------- teardown

def unmount(img, report=None):
    """Measure, then unmount the image from the scratch (not lazily: a busy
    mount stays, and with it the entry, for `starter gc`)."""
    if img.root_fd is not None:
        try:
            got = measure(img)
            if report is not None and got is not None:
                report.disk = got
        finally:
            os.close(img.root_fd)
            img.root_fd = None
    _umount(img.mount_point)


def _umount(path):
    ctypes, libc = libc_handle()
    if libc.umount2(path.encode(), UMOUNT_NOFOLLOW) != 0:
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOENT):
            return          # not mounted (any more)
        raise StagingError(f"--disk: cannot unmount the job's image from {path}: {os.strerror(e)}",
                           f"something on the host uses it (fuser -vm {path}); `starter gc` retries")


def detach(img):
    """The loop device, once the image is unmounted: autoclear has usually
    detached it already; if not, LOOP_CLR_FD (deferred by the kernel while
    another holder has it).  Only a device backed by our image's inode."""
    if img.loop is None or img.id is None:
        return
    _clear_loops(img.id, img.path, [img.loop])


def remove_image(img):
    if img.dir_fd is None:
        return
    try:
        _unlink_if(img.dir_fd, img.name, img.id)
    finally:
        os.close(img.dir_fd)
        img.dir_fd = None


def _unlink_if(dir_fd, name, ident):
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if ident is not None and (st.st_dev, st.st_ino) != tuple(ident):
        raise StagingError(f"--disk: image {name} is not the file the starter made; left alone")
    os.unlink(name, dir_fd=dir_fd)
    return True


def _backing(n):
    """(st_dev, st_ino) of loop N's backing file, None if it is not bound."""
    import fcntl

    try:
        fd = os.open(f"/dev/loop{n}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        buf = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_INFO64))
    except OSError:
        os.close(fd)
        return None, None
    dev, ino = struct.unpack_from("QQ", buf, 0)
    # The kernel's huge_encode_dev (new_encode_dev); glibc's makedev agrees
    # below major 4096, but decode it to be sure.
    major, minor = (dev & 0xfff00) >> 8, (dev & 0xff) | ((dev >> 12) & 0xfff00)
    return (os.makedev(major, minor), ino), fd


def _bound_loops():
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return []
    return [int(n[4:]) for n in names if n.startswith("loop") and n[4:].isdigit()
            and os.path.exists(f"/sys/block/{n}/loop")]


def loops_of(ident, candidates=None):
    """Loop device numbers bound to the file with (st_dev, st_ino) `ident`."""
    out = []
    for n in candidates if candidates is not None else _bound_loops():
        got, fd = _backing(n)
        if fd is not None:
            os.close(fd)
        if got == tuple(ident):
            out.append(n)
    return out


def _wait_unbound(n, path):
    """Autoclear detaches a loop device when its last holder lets go, which
    on recent kernels is done a moment after the unmount returns (measured
    here: under a millisecond, but never at once): wait for it, briefly,
    looking at sysfs only (opening the device would make us a holder)."""
    import time

    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        try:
            with open(f"/sys/block/loop{n}/loop/backing_file") as f:
                backing = f.read().rstrip("\n")
        except OSError:
            return                  # not bound
        if backing not in (path, path + " (deleted)"):
            return                  # another file's now
        time.sleep(0.001)


def _clear_loops(ident, path, candidates=None):
    import fcntl

    left = []
    for n in candidates if candidates is not None else _bound_loops():
        _wait_unbound(n, path)
        got, fd = _backing(n)
        if fd is None:
            continue
        try:
            if got != tuple(ident):
                continue
            try:
                fcntl.ioctl(fd, LOOP_CLR_FD)
            except OSError as e:
                if e.errno != errno.ENXIO:      # ENXIO: already unbound
                    left.append(f"/dev/loop{n}: {e.strerror}")
        finally:
            os.close(fd)        # with autoclear: our close may be what detaches it
        if _backing(n)[0] == tuple(ident):
            left.append(f"/dev/loop{n}")
    if left:
        raise StagingError(f"--disk: loop device(s) {', '.join(left)} still hold the job's image after "
                           "it was unmounted (mounted in another mount namespace?)",
                           "the kernel detaches it when the last user goes; `starter gc` checks again")


def mounts_at(path):
    """[(major, minor)] of what is mounted at `path` (this mount namespace)."""
    from starter.cgroups.hierarchy import unescape_mountinfo   # the one mountinfo unescaping

    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and unescape_mountinfo(fields[4]) == path:
                major, _, minor = fields[2].partition(":")
                out.append((int(major), int(minor)))
    return out


# ---------------------------------------------------------------- gc

def recorded_image(st, job_id):
    """The image a state entry records, if it is where the starter makes it
    for this job: <scratch parent>/.starter-images/job-<id>.img, beside a
    scratch that is one the starter makes (scratch.recorded_path)."""
    from starter.storage import scratch

    path = st.get("disk_image")
    scratch.recorded_path(st, job_id)
    if path != os.path.join(st["scratch_parent"], IMAGES, image_name(job_id)):
        raise StagingError(f"disk image {path!r} is not where the starter makes job {job_id!r}'s; left alone")
    return path


def reclaim_recorded(st, job_id):
    """gc after a crashed starter: unmount, detach and remove what its entry
    records, only where it is the job's (the mount's device is a loop backed
    by the recorded image inode; the image carries the job's mark or the
    recorded inode).  -> what was done; StagingError while something is held."""
    from starter.storage import paths, scratch

    path = recorded_image(st, job_id)
    done = []
    ident = tuple(st["disk_image_id"]) if st.get("disk_image_id") else None
    mount_point = scratch.recorded_path(st, job_id)
    if ident is not None:
        loops = loops_of(ident)
        for major, minor in mounts_at(mount_point):
            if any(os.major(os.stat(f"/dev/loop{n}").st_rdev) == major
                   and os.minor(os.stat(f"/dev/loop{n}").st_rdev) == minor for n in loops):
                _umount(mount_point)
                done.append(f"disk image unmounted from {mount_point}")
        if loops:
            _clear_loops(ident, path, loops)
            done.append("loop device " + ", ".join(f"/dev/loop{n}" for n in loops) + " detached")
    images, name = os.path.split(path)
    try:
        dfd = paths.open_dir(images, "disk images directory")
    except (FileNotFoundError, paths.MissingError):
        return done
    except paths.LinkError as e:
        raise StagingError(e.args[0], e.hint) from None
    try:
        dst = os.fstat(dfd)
        if dst.st_uid != 0 or stat.S_IMODE(dst.st_mode) & 0o077:
            raise StagingError(f"{images}: not root's 0700: not where the starter keeps images; left alone")
        try:
            lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return done
        ours = ident is not None and (lst.st_dev, lst.st_ino) == ident
        if not ours and stat.S_ISREG(lst.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            try:
                ours = os.getxattr(fd, MARK) == job_id.encode()
            except OSError:
                ours = False
            finally:
                os.close(fd)
        if not ours or not stat.S_ISREG(lst.st_mode) or lst.st_uid != 0:
            raise StagingError(f"disk image {path} is not the one the starter made for job {job_id!r}; left alone",
                               "if it is a leftover, remove it by hand")
        if ident is None and loops_of((lst.st_dev, lst.st_ino)):
            raise StagingError(f"disk image {path}: a loop device still holds it",
                               "see `losetup -a`; `starter gc` retries")
        os.unlink(name, dir_fd=dfd)
        done.append(f"disk image {path} removed")
    finally:
        os.close(dfd)
    return done
