"""A job's root from a cached image (--image), made by the kernel, before
the job's clone, and nowhere on the host.

    loop device    one per cached image on the node, read-only, autoclear,
                   shared by every job on that image: one squashfs superblock,
                   one page cache; the kernel detaches it when its last
                   mount (the last job's namespace) is gone
    squashfs       mounted by the starter, detached (the job's child, in the
                   job's cgroup, may not open a block device); every job's
                   is the same superblock
    root           the child builds it in its own mount namespace
                   (native/shim_image.c): that squashfs under an overlay whose upper and work directories are in a tmpfs
                   of the job's own (its pages charged to the job's memory
                   cgroup as it writes them, its size capped by --memory),
                   then pivots into it before /proc and the mount plan:
                   nothing of the host's file systems is in its view but what
                   the plan binds.  What a job writes goes with its namespace; the image is never
written.  Nothing is left on the host for gc but the loop device, which the
kernel detaches by itself once no job (and no netd: keep_warm) holds the
image's squashfs.
"""

import errno
import os
import struct

from starter.errors import StarterError

LO_FLAGS_READ_ONLY = 1
TRIES = 32


class ImageMountError(StarterError):
    pass


def _open_bound(path, ident):
    """An fd on a loop device bound to the file `ident` already (read-only),
    held open (so not detached under us), or None."""
    from starter.storage import disk

    for n in disk.loops_of(ident):
        try:
            fd = os.open(f"/dev/loop{n}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        got, check = disk._backing(n)
        if check is not None:
            os.close(check)
        if got == ident:
            return fd, n
        os.close(fd)         # detached and taken by another file meanwhile
    return None


def _attach(path, src_fd):
    import fcntl

    from starter.storage import disk

    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ImageMountError("--image: this kernel has no loop devices (no /dev/loop-control)",
                              "modprobe loop") from None
    try:
        for _ in range(TRIES):
            n = fcntl.ioctl(ctl, disk.LOOP_CTL_GET_FREE)
            try:
                lfd = os.open(f"/dev/loop{n}", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            info = disk._loop_info(os.fsencode(path), disk.LO_FLAGS_AUTOCLEAR | LO_FLAGS_READ_ONLY)
            try:
                fcntl.ioctl(lfd, disk.LOOP_CONFIGURE, struct.pack("II", src_fd, 0) + info + bytes(64))
            except OSError as e:
                os.close(lfd)
                if e.errno == errno.EBUSY:
                    continue
                raise ImageMountError(f"--image: cannot attach {path} to /dev/loop{n}: {e.strerror}",
                                      "see `losetup -a`; Linux 5.8 or later is needed (LOOP_CONFIGURE)") from None
            return lfd, n
    finally:
        os.close(ctl)
    raise ImageMountError("--image: no free loop device after 32 tries",
                          "too many loop devices in use (`losetup -a`); raise max_loop or retry later")


def loop_for(path):
    """(fd, N) of the loop device of the cached image `path`: the one its
    other jobs share, or a new one (held open until the mount holds it)."""
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        ident = (st.st_dev, st.st_ino)
        # (under the cache's lock: nobody attaches it meanwhile)
        return _open_bound(path, ident) or _attach(path, src)
    finally:
        os.close(src)


def squashfs(path):
    """The cached image at `path`, mounted read-only on its loop device, as
    a detached mount -> its fd, which the job's child attaches under its
    root (native/shim_image.c).  The loop device is held only until the
    mount holds it."""
    import fcntl

    from starter._native import lib

    # One at a time per cache, from finding the image's loop device to its
    # mount holding it: two jobs starting at once share one device.
    lock = os.open(os.path.join(os.path.dirname(path), ".lock"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lfd, n = loop_for(path)
        try:
            fd = lib.shim_image_mount(f"/dev/loop{n}".encode())
        finally:
            os.close(lfd)
    finally:
        os.close(lock)
    if fd < 0:
        raise ImageMountError(f"--image: mounting the image's squashfs (/dev/loop{n}) failed: {os.strerror(-fd)}",
                              "is squashfs, with its compressor, in this kernel? (grep squashfs /proc/filesystems)")
    return fd


UPPER = ".image"


def upper_dir(scratch_fd):
    """The directory for what a job in an image writes, in its scratch
    (root's, 0700, made fresh: the scratch is new) -> a detached bind of it
    (the child attaches it in its own namespace)."""
    from starter._native import lib

    try:
        os.mkdir(UPPER, 0o700, dir_fd=scratch_fd)
        fd = os.open(UPPER, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=scratch_fd)
    except OSError as e:
        raise ImageMountError(f"--image: cannot make the job's {UPPER} in its scratch: {e.strerror}") from None
    try:
        tree = lib.shim_image_tree(fd)
    finally:
        os.close(fd)
    if tree < 0:
        raise ImageMountError(f"--image: cannot bind the job's {UPPER} in its scratch: {os.strerror(-tree)}")
    return tree


def keep_warm(state_dir, hexd, fd):
    """Hand the image's squashfs (a detached mount) to netd, where it runs,
    which holds it a while after this job's start: the next job on the
    image finds its superblock and page cache warm (a first one decompresses
    what it reads: docs/benchmarks.md has both).  Best effort."""
    from starter.net import SOCKET_NAME, netd

    try:
        netd.call(os.path.join(state_dir, SOCKET_NAME), {"op": "image-hold", "digest": hexd,
                                                         "cfg": {"state_dir": state_dir}}, fds=[fd])
    except (netd.Unavailable, StarterError, OSError):
        pass
