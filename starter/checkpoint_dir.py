"""A checkpoint directory (`starter checkpoint --to DIR`): its record, its
signature and CRIU's images, written after a dump and checked before a
restore (starter/checkpoint.py runs CRIU).  What DIR holds:

    images/        CRIU's images (`criu dump`): every process and thread, its
                   namespaces, private mounts and tmpfs contents, SysV IPC,
                   the seccomp filter
    starter.json   the starter's record: what the job asked for (the options
                   it was started with, before the node policy), its uid,
                   the stdio it had, and its usage so far, one segment per
                   run (the report sums them, as HTCondor's cumulative wall
                   clock does)
    starter.sig    HMAC-SHA256, keyed with the node's checkpoint key, over
                   the record and the SHA-256 of every image file (of the
                   raw memory pages, their size: raw_pages())

Every byte of an image is the job's data, and the directory may travel
through the job's user's hands to another node.  So a restore checks the
signature first (the key is root's, /etc/starter/checkpoint.key, the same
on every node that restores another's images, as munge's key is), CRIU reads
images only root may change (a private copy of any other's), and the job is
built from the record exactly as a new job is built: the same policy
checks, the same uid (a transient uid is leased again, the same one, or the
restore is refused).  An image cannot ask for more than a new job could.
"""

import hashlib
import hmac
import json
import os
import shutil
import stat

from starter.errors import StarterError

KEY = "/etc/starter/checkpoint.key"
RECORD, SIG, IMAGES = "starter.json", "starter.sig", "images"
VERSION = 1
MAX_RECORD = 1 << 20


class ImageError(StarterError):
    def __init__(self, msg, hint="make a new checkpoint, or restore an untouched copy of the directory"):
        super().__init__(msg, hint)


# ---------------------------------------------------------------- the key

def node_key(create=False):
    """The node's checkpoint key: root's, mode 0600, at least 32 bytes.
    Made (random) by the first checkpoint on a node that has none."""
    try:
        fd = os.open(KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise ImageError(f"{KEY} does not exist: this node cannot check a checkpoint's signature",
                             f"copy {KEY} from the node that made the checkpoint (root's, mode 0600)") from None
        os.makedirs(os.path.dirname(KEY), 0o755, exist_ok=True)
        fd = os.open(KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, os.urandom(32).hex().encode() + b"\n")
        finally:
            os.close(fd)
        return node_key()
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise StarterError(f"{KEY} must be a regular file of root's, mode 0600",
                               f"chown root:root {KEY}; chmod 600 {KEY}")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 32:
        raise StarterError(f"{KEY} holds fewer than 32 bytes", "remove it; the next checkpoint makes a new one")
    return data


def _signature(key, record, digests):
    msg = record + b"\0" + json.dumps(digests, sort_keys=True).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _key_id(key):
    return hashlib.sha256(b"starter-checkpoint-key\0" + key).hexdigest()[:16]


SCRATCH = "scratch.tar"     # the job's scratch (starter/checkpoint.py), beside CRIU's images


def raw_pages(name):
    """CRIU's pages-N.img: the job's memory, raw bytes that CRIU copies into
    the restored job's own mappings, at the addresses the pagemap and mm
    images give, and never interprets.  Its content is the job's own data:
    whoever changes it can only change what the job's memory holds, which
    the job itself could write, and nothing a new job could not have (the
    uid, limits, mounts, fds and seccomp filter are in the other images).
    So the signature covers its size, not its bytes: hashing what CRIU
    wrote by splicing would cost more than the dump itself (SHA-256 of 128
    MiB: 2.8 s in the TCG VM, where CRIU's whole dump takes 2.2 s).  The
    scratch's archive too: it is unpacked with the job's own rights, so it
    can only make what the job could.  Every other image (the metadata CRIU
    parses, the tmpfs archives it unpacks as root) is hashed."""
    return name.startswith("pages-") and name.endswith(".img") or name == SCRATCH


def _open_images(images_fd):
    """{name: fd} of every file of the images directory, each opened once
    (not following links) and checked: a regular file with no other link (a
    link could be to a file the job may not read, and the pages and the
    scratch's archive are signed by size).  The caller closes them."""
    fds = {}
    try:
        for name in sorted(os.listdir(images_fd)):
            fd = fds[name] = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                     dir_fd=images_fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ImageError(f"images/{name} is not a regular file")
            if st.st_nlink != 1:
                raise ImageError(f"images/{name} has other links")
    except BaseException:
        _close_all(fds)
        raise
    return fds


def _close_all(fds):
    for fd in fds.values():
        os.close(fd)


def _digests(fds):
    """{name: digest} of the open image files: raw_pages(), its size; every
    other, the SHA-256 of its bytes."""
    out = {}
    for name, fd in fds.items():
        if raw_pages(name):
            out[name] = f"size:{os.fstat(fd).st_size}"
            continue
        h = hashlib.sha256()
        while True:
            buf = os.read(fd, 1 << 20)
            if not buf:
                break
            h.update(buf)
        out[name] = h.hexdigest()
    return out


def write_signed(to, key, record):
    images_fd = os.open(os.path.join(to, IMAGES), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fds = _open_images(images_fd)
    finally:
        os.close(images_fd)
    try:
        digests = _digests(fds)
    finally:
        _close_all(fds)
    data = json.dumps(record, sort_keys=True, indent=1).encode() + b"\n"
    sig = {"key_id": _key_id(key), "hmac_sha256": _signature(key, data, digests), "images": digests}
    for name, blob in ((RECORD, data), (SIG, json.dumps(sig, sort_keys=True, indent=1).encode() + b"\n")):
        fd = os.open(os.path.join(to, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, blob)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- restore

class Image:
    """A checked checkpoint directory: its record, and an fd of its images
    (for a caller that is not root, of a private copy, removed by close())."""

    def __init__(self, path, record, images_fd, private=None):
        self.path, self.record, self.images_fd, self.private = path, record, images_fd, private

    def close(self):
        if self.images_fd >= 0:
            os.close(self.images_fd)
            self.images_fd = -1
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None


def _read_small(dir_fd, name):
    from starter.fileio import read_regular

    try:
        return read_regular(name, MAX_RECORD, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ImageError(f"no {name}: not a checkpoint directory of starter's") from None


def _private_copy(src_fds, state_dir):
    """Copy the caller's image files (fds opened with its rights) into a
    directory of root's, hashing the bytes written: CRIU reads the copy, so
    the caller cannot change a file between its check and CRIU's read.
    -> (path, dir fd, {name: digest as _digests gives it})."""
    import tempfile

    from starter import state
    from starter.fileio import copy_hashing, sized_to_fit

    state.ensure_dir(state_dir)
    vfs = os.statvfs(state_dir)
    need, room = sum(os.fstat(fd).st_size for fd in src_fds.values()), vfs.f_bavail * vfs.f_frsize
    if need > room:     # (each file is checked again as it is copied: the sizes may change)
        raise ImageError(f"the images ({need} bytes) do not fit in the state directory {state_dir} ({room} bytes "
                         "free), where a restore copies images others may write",
                         "restore from a directory only root may write (no copy is made), or make room there")
    priv = tempfile.mkdtemp(prefix=".restore-", dir=state_dir)
    dfd = os.open(priv, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    digests = {}
    try:
        for name, fd in src_fds.items():
            size = sized_to_fit(fd, dfd)
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)
            try:
                if raw_pages(name):     # copied by the kernel; its size is what is signed
                    copy_hashing(fd, out, (), limit=size)
                    digests[name] = f"size:{os.fstat(out).st_size}"
                else:
                    digests[name] = copy_hashing(fd, out, ("sha256",), limit=size)["sha256"]
            finally:
                os.close(out)
    except BaseException:
        os.close(dfd)
        shutil.rmtree(priv, ignore_errors=True)
        raise
    return priv, dfd, digests


def _roots_alone(images_fd, fds):
    """Are the images directory and its files (open: _open_images) root's,
    and may no one else write them?  Else (images that came back through
    their user's hands) whoever may write one could swap it for another
    between the check of its digest and CRIU's read: CRIU reads a private
    copy instead."""
    return all(st.st_uid == 0 and not st.st_mode & 0o022
               for st in [os.fstat(images_fd)] + [os.fstat(fd) for fd in fds.values()])


def load(path, caller=None, state_dir=None):
    """Open and check a checkpoint directory: signature, every image's
    digest, the record's form.  -> Image.  A caller that is not root names
    a directory of its own: it is read with the caller's rights, its images
    copied to a private place first, and only its own job's image restores.
    A root caller's is copied too unless it is root's alone (_roots_alone)."""
    from starter import paths

    # (a root caller's: paths.as_user with no one to switch to, as job.py's)
    rights = caller.rights("to read the caller's checkpoint") if caller is not None else paths.as_user(None)
    src_fds = {}
    images_fd = -1
    private = None
    try:
        with rights:
            dfd = paths.open_dir(path, "checkpoint directory")
            try:
                d = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                data = _read_small(d, RECORD)
                sig_data = _read_small(d, SIG)
                images_fd = os.open(IMAGES, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
                src_fds = _open_images(images_fd)
                copy = caller is not None or not _roots_alone(images_fd, src_fds)
            finally:
                os.close(d)
        try:
            sig = json.loads(sig_data)
        except ValueError:
            raise ImageError(f"{SIG} is not JSON") from None
        key = node_key()
        if not isinstance(sig, dict) or sig.get("key_id") != _key_id(key):
            raise ImageError(f"{path} was signed with another node's checkpoint key",
                             f"give every node that restores another's checkpoints the same {KEY}")
        if copy:
            os.close(images_fd)
            images_fd = -1
            private, images_fd, digests = _private_copy(src_fds, state_dir)
        else:
            digests = _digests(src_fds)
        if not hmac.compare_digest(str(sig.get("hmac_sha256", "")), _signature(key, data, digests)):
            raise ImageError(f"{path}: the signature does not match its record and images "
                             "(changed since the checkpoint)")
        try:
            record = json.loads(data)
        except ValueError:
            raise ImageError(f"{RECORD} is not JSON") from None
        if not isinstance(record, dict) or record.get("version") != VERSION or not isinstance(record.get("asked"),
                                                                                            dict):
            raise ImageError(f"{RECORD}: not a version {VERSION} record")
        if caller is not None and (record.get("uid") != caller.uid or record.get("transient")):
            raise StarterError(f"{path} is the checkpoint of uid {record.get('uid')}'s job: a caller that is not "
                               f"root restores only its own", "ask the node's admin to restore it")
        return Image(path, record, images_fd, private)
    except BaseException:
        if images_fd >= 0:
            os.close(images_fd)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        raise
    finally:
        _close_all(src_fds)
