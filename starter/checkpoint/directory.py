"""A checkpoint directory (`starter checkpoint --to DIR`): its record, its
signature and CRIU's images, written after a dump and checked before a
restore (starter/checkpoint/criu.py runs CRIU).  What DIR holds:

    images/        CRIU's images (`criu dump`): every process and thread, its
                   namespaces, private mounts and tmpfs contents, SysV IPC,
                   the seccomp filter
    starter.json   the starter's record: what the job asked for (the options
                   it was started with, before the node policy), its uid,
                   the stdio it had, and its usage so far, one segment per
                   run (the report sums them, as HTCondor's cumulative wall
                   clock does)
    starter.sig    HMAC-SHA256, keyed with the node's checkpoint key, over
                   the record, the size of every image file and the SHA-256
                   of every one (of the raw memory pages, their size only:
                   raw_pages())

Every byte of an image is the job's data, and the directory may travel
through the job's user's hands to another node.  So a restore checks the
signature first (the key is root's, /etc/starter/checkpoint.key, the same
on every node that restores another's images, as munge's key is), CRIU reads
images only root may change (a private copy of any other's), and the job is
built from the record exactly as a new job is built: the same policy
checks, the same uid (a transient uid is leased again, the same one, or the
restore is refused).  An image cannot ask for more than a new job could.
The signature is checked over what was read (the record, the names and
sizes it signs) before a byte of an image is copied or hashed, so a copy
is bounded by the signed sizes.

Where a dump goes (Target) is made and written by fd, under a parent
opened without following links; what root removes there (remove_tree) is
removed by fds, never through a link nor below a mount point.
"""

import errno
import hashlib
import hmac
import json
import os
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


def _signature(key, record, digests, sizes):
    """HMAC over the record, every image file's digest and every one's size
    (the sizes bound what a restore copies before it has hashed a byte)."""
    msg = (record + b"\0" + json.dumps(digests, sort_keys=True).encode() + b"\0"
           + json.dumps(sizes, sort_keys=True).encode())
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _key_id(key):
    return hashlib.sha256(b"starter-checkpoint-key\0" + key).hexdigest()[:16]


SCRATCH = "scratch.tar"     # the job's scratch (starter/checkpoint/criu.py), beside CRIU's images


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
    from starter.fileio import write_all

    images_fd = os.open(os.path.join(to, IMAGES), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fds = _open_images(images_fd)
    finally:
        os.close(images_fd)
    try:
        sizes = {name: os.fstat(fd).st_size for name, fd in fds.items()}
        digests = _digests(fds)
    finally:
        _close_all(fds)
    data = json.dumps(record, sort_keys=True, indent=1).encode() + b"\n"
    sig = {"key_id": _key_id(key), "hmac_sha256": _signature(key, data, digests, sizes), "images": digests,
           "sizes": sizes}
    for name, blob in ((RECORD, data), (SIG, json.dumps(sig, sort_keys=True, indent=1).encode() + b"\n")):
        fd = os.open(os.path.join(to, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            write_all(fd, blob)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- the dump's directory

class Left(StarterError):
    """remove_tree() left something in place (a mount point, another's
    directory): the message names it."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 32          # a checkpoint directory is two levels deep; a deeper tree is not one of ours


def mount_id(fd):
    """The mount an open fd is on (/proc/self/fdinfo: a bind mount of the
    same file system has the same st_dev, never the same mount id)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/fdinfo/{fd} names no mount")


def remove_tree(dir_fd, name, path):
    """Remove `name` in the directory `dir_fd`: a link or file by its name
    only, a directory depth first, every step relative to the fd of the
    directory above, opened with O_NOFOLLOW.  Never below a mount point (a
    directory whose st_dev or mount id is not dir_fd's), never into a
    directory of another owner than `name`'s (a process of that owner could
    move another's directory in while root removes), nor deeper than
    MAX_DEPTH.  What stays raises Left, naming it, after the rest is gone.
    `path`: `name`'s path, for messages.  A name that does not exist is
    fine."""
    left = []
    _remove(dir_fd, name, path, os.fstat(dir_fd).st_dev, mount_id(dir_fd), None, 0, left)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise Left(f"{path} was not removed: {'; '.join(left[:3])}{more}",
                   "see what is left there: unmount what is mounted, then remove it by hand")


def _remove(dir_fd, name, path, dev, mnt, owner, depth, left):
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if st.st_dev != dev:
        left.append(f"{path} is a mount point")
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:        # EBUSY: a file mounted over the name
            left.append(f"{path} is a mount point" if e.errno == errno.EBUSY else f"{path}: {e.strerror}")
        return
    if owner is not None and st.st_uid != owner:
        left.append(f"{path} is a directory of uid {st.st_uid}'s, not entered")
        return
    if depth >= MAX_DEPTH:
        left.append(f"{path} is more than {MAX_DEPTH} levels deep, not entered")
        return
    before = len(left)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        left.append(f"{path}: {e.strerror}")
        return
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            left.append(f"{path} changed while it was removed")
            return
        if mount_id(fd) != mnt:
            left.append(f"{path} is a mount point")
            return
        for child in os.listdir(fd):
            _remove(fd, child, f"{path}/{child}", dev, mnt, st.st_uid, depth + 1, left)
    finally:
        os.close(fd)
    if len(left) == before:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            left.append(f"{path}: {e.strerror}")


class Target:
    """The new directory a dump writes, made and held by fd: `to` itself
    (`starter checkpoint --to`), or with `replace` (--on-vacate) `to`.new,
    which commit() renames to `to` once it is whole (the previous `to`
    becomes `to`.old and is removed), so the last whole image is at `to` or
    `to`.old whenever a dump is cut short.

    `to`'s parent is opened without following a link at any component
    (paths.open_dir), and everything after is relative to that fd: what was
    at `to`.new and `to`.old is removed first with remove_tree() (a link
    there loses its name, a mount point stays and the dump is refused), the
    new directory is made 0700 and opened with O_NOFOLLOW, and must then be
    root's and private (else someone put another in its place).  `where` is
    its path through this process's fd table (/proc/self/fd/N), for CRIU
    and for files made in it: nothing is looked up by its name again."""

    def __init__(self, to, replace=False):
        from starter.storage import paths

        to = os.path.normpath(to)
        parent, self.name = os.path.split(to)
        if not self.name:
            raise StarterError(f"checkpoint directory {to}: not a directory to make")
        self.to, self.replace, self.fd = to, replace, -1
        self.new = self.name + ".new" if replace else self.name
        self.path = os.path.join(parent, self.new)
        self.pfd = paths.open_dir(parent, "checkpoint directory", full=to)
        try:
            if replace:
                remove_tree(self.pfd, self.new, self.path)
                if self._exists(self.name):     # else `to`.old is the last whole image: kept until commit()
                    remove_tree(self.pfd, self.name + ".old", to + ".old")
            try:
                os.mkdir(self.new, 0o700, dir_fd=self.pfd)
            except FileExistsError:
                raise StarterError(f"checkpoint directory {self.path} exists",
                                   "a checkpoint goes to a new directory: name one that does not exist") from None
            try:
                fd = os.open(self.new, _DIR_FLAGS, dir_fd=self.pfd)
            except OSError as e:
                raise StarterError(f"checkpoint directory {self.path}: {e.strerror} as it was made "
                                   "(something was put in its place)") from None
            st = os.fstat(fd)
            if st.st_uid != 0 or st.st_mode & 0o077:
                os.close(fd)
                raise StarterError(f"checkpoint directory {self.path} is not the one root made "
                                   "(something was put in its place)")
            self.fd, self.ident = fd, (st.st_dev, st.st_ino)
        except BaseException:
            os.close(self.pfd)
            raise

    @property
    def where(self):
        return f"/proc/self/fd/{self.fd}"

    def _exists(self, name):
        try:
            os.stat(name, dir_fd=self.pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def _is_ours(self, name):
        try:
            st = os.stat(name, dir_fd=self.pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def commit(self):
        """`to`.new becomes `to` (replace only; the previous one, renamed
        `to`.old, is removed).  -> None, or what was left of it and why (the
        new image is in place: the dump did not fail)."""
        if not self.replace:
            return None
        if not self._is_ours(self.new):
            raise StarterError(f"checkpoint directory {self.path} was moved or replaced before it became {self.to}")
        old = self.name + ".old"
        had = self._exists(self.name)
        try:
            if had:
                remove_tree(self.pfd, old, self.to + ".old")        # one made since __init__
                os.rename(self.name, old, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
            os.rename(self.new, self.name, src_dir_fd=self.pfd, dst_dir_fd=self.pfd)
        except OSError as e:
            raise StarterError(f"checkpoint: cannot put {self.path} in the place of {self.to}: {e.strerror}") from None
        try:        # the one before (or one a dump cut short between the renames left)
            remove_tree(self.pfd, old, self.to + ".old")
        except Left as e:
            return str(e)
        return None

    def abort(self):
        """A dump that failed: what it wrote removed through our fd (even if
        the directory was moved meanwhile), then the directory, if it is
        still ours at its name."""
        for name in os.listdir(self.fd):
            remove_tree(self.fd, name, f"{self.path}/{name}")
        if self._is_ours(self.new):
            try:
                os.rmdir(self.new, dir_fd=self.pfd)
            except FileNotFoundError:
                pass

    def close(self):
        for fd in (self.fd, self.pfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.pfd = -1


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
            private, self.private = self.private, None
            _remove_private(private)


def _remove_private(private):
    """A private copy (a directory of root's in the state directory) removed
    by remove_tree(), which never leaves its mount."""
    parent = os.open(os.path.dirname(private), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        remove_tree(parent, os.path.basename(private), private)
    finally:
        os.close(parent)


def _read_small(dir_fd, name):
    from starter.fileio import read_regular

    try:
        return read_regular(name, MAX_RECORD, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ImageError(f"no {name}: not a checkpoint directory of starter's") from None


def _private_copy(src_fds, sizes, state_dir):
    """Copy the caller's image files (fds opened with its rights, each of its
    signed size: _check_signed) into a directory of root's, hashing the
    bytes written: CRIU reads the copy, so the caller cannot change a file
    between its check and CRIU's read.  Each copy stops at the signed size.
    -> (path, dir fd, {name: digest as _digests gives it})."""
    import tempfile

    from starter.state import store as state
    from starter.fileio import copy_hashing, sized_to_fit

    state.ensure_dir(state_dir)
    vfs = os.statvfs(state_dir)
    need, room = sum(sizes.values()), vfs.f_bavail * vfs.f_frsize
    if need > room:     # (each file is checked again as it is copied: the room may shrink)
        raise ImageError(f"the images ({need} bytes) do not fit in the state directory {state_dir} ({room} bytes "
                         "free), where a restore copies images others may write",
                         "restore from a directory only root may write (no copy is made), or make room there")
    priv = tempfile.mkdtemp(prefix=".restore-", dir=state_dir)
    dfd = os.open(priv, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    digests = {}
    try:
        for name, fd in src_fds.items():
            sized_to_fit(fd, dfd)
            size = sizes[name]
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
        _remove_private(priv)
        raise
    return priv, dfd, digests


def _check_signed(path, key, data, sig, fds):
    """The signature checked over what was read: the record, and the names,
    digests and sizes it signs, before a byte of an image is copied or
    hashed; then every open image file must be one it names, of the size it
    names.  -> (digests, sizes) as signed."""
    digests, sizes = sig.get("images"), sig.get("sizes")
    if not (isinstance(digests, dict) and isinstance(sizes, dict) and digests.keys() == sizes.keys()
            and all(isinstance(v, str) for v in digests.values())
            and all(type(v) is int and v >= 0 for v in sizes.values())):
        raise ImageError(f"{SIG} signs no size of every image (made by an older starter, or not a signature)")
    if not hmac.compare_digest(str(sig.get("hmac_sha256", "")), _signature(key, data, digests, sizes)):
        raise ImageError(f"{path}: the signature does not match its record and images "
                         "(changed since the checkpoint)")
    extra, missing = sorted(fds.keys() - sizes.keys()), sorted(sizes.keys() - fds.keys())
    if extra:
        raise ImageError(f"{path}: images/{extra[0]} is not in the signature (added since the checkpoint)")
    if missing:
        raise ImageError(f"{path}: the signature does not match images/{missing[0]}: it is missing "
                         "(removed since the checkpoint)")
    for name, fd in sorted(fds.items()):
        size = os.fstat(fd).st_size
        if size != sizes[name]:
            raise ImageError(f"{path}: the signature does not match images/{name}: {size} bytes, signed as "
                             f"{sizes[name]} (changed since the checkpoint)")
    return digests, sizes


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
    from starter.storage import paths

    # (a root caller's: paths.as_user with no one to switch to, as job/run.py's)
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
        signed, sizes = _check_signed(path, key, data, sig, src_fds)
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
        if copy:
            os.close(images_fd)
            images_fd = -1
            private, images_fd, digests = _private_copy(src_fds, sizes, state_dir)
        else:
            digests = _digests(src_fds)
        if not all(hmac.compare_digest(digests[n], str(signed[n])) for n in sorted(signed)):
            raise ImageError(f"{path}: the signature does not match its record and images "
                             "(changed since the checkpoint)")
        return Image(path, record, images_fd, private)
    except BaseException:
        if images_fd >= 0:
            os.close(images_fd)
        if private is not None:
            _remove_private(private)
        raise
    finally:
        _close_all(src_fds)
