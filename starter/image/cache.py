"""The node's image cache, root's: each image once, keyed by the digest of
its squashfs, shared by every job that names it.

    <cache>/                      root's, 0755 (jobs' images are readable)
        .lock                     flock: one import, removal or gc at a time
        sha256-<hex>.sqfs         the squashfs, 0444, never changed once there
        sha256-<hex>.json         what was imported: format, source, size, when
        .tmp-<pid>-<random>       an import under way (gc removes a dead one's)

An import reads its source once (a squashfs file, or a SIF file's squashfs
partition: formats.py), hashing and copying it into a temporary file in the
cache, checks the copy's superblock against the bytes it holds, then renames
it into place: an entry is whole or absent, and its name is the digest of
exactly the bytes it holds.  An image already there is not copied again.
The digest is the image's identity everywhere (the report, a job file's
pin): sha256 of its squashfs, whatever file brought it.

The cache's limit (bytes, all entries together) refuses an import that would
pass it; an import never takes more than the room ordinary users still have
on the cache's file system (fileio.sized_to_fit).
"""

import fcntl
import os
import stat
import time

from starter.errors import StarterError
from starter.fileio import NoRoom, sized_to_fit, unlink_quiet, write_all
from starter.image import formats

DEFAULT_CACHE = "/var/lib/starter/images"     # or $STARTER_IMAGE_CACHE (cli/image.py)
DEFAULT_LIMIT = 64 << 30
PREFIX, SUFFIX, META = "sha256-", ".sqfs", ".json"
TMP_PREFIX = ".tmp-"
CHUNK = 1 << 20
PAD = 4096


class CacheError(StarterError):
    pass


def check_digest(value):
    """'sha256:<64 hex>' (or the bare hex) -> the hex; CacheError else."""
    v = str(value)
    hexd = v[7:] if v.startswith("sha256:") else v
    if len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise CacheError(f"{v[:80]!r} is not an image digest", "give sha256:<64 lowercase hex digits>, "
                         "as `starter image ls` shows it")
    return hexd


class Cache:
    def __init__(self, path=DEFAULT_CACHE, limit=DEFAULT_LIMIT):
        self.path, self.limit = path, limit

    # -- the directory --------------------------------------------------------
    def _open(self, create):
        if create:
            os.makedirs(self.path, mode=0o755, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CacheError(f"the image cache {self.path}: {e.strerror}") from None
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o022:
            os.close(fd)
            raise CacheError(f"the image cache {self.path} is not root's alone (owner {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o})", "the starter makes it: remove it")
        return fd

    def _locked(self, dfd):
        lock = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock

    def entries(self, dfd=None):
        """[(hex digest, size)] of the images in the cache."""
        own = dfd is None
        if own:
            dfd = self._open(create=False)
            if dfd is None:
                return []
        try:
            out = []
            for name in os.listdir(dfd):
                if name.startswith(PREFIX) and name.endswith(SUFFIX):
                    hexd = name[len(PREFIX):-len(SUFFIX)]
                    try:
                        out.append((hexd, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size))
                    except FileNotFoundError:
                        continue
            return sorted(out)
        finally:
            if own:
                os.close(dfd)

    def path_of(self, digest):
        """The cached squashfs of `digest`; CacheError if it is not there."""
        hexd = check_digest(digest)
        p = os.path.join(self.path, PREFIX + hexd + SUFFIX)
        if not os.path.isfile(p):
            raise CacheError(f"image sha256:{hexd} is not in the cache {self.path}",
                             "import it first: starter image import FILE")
        return p

    # -- import -----------------------------------------------------------------
    def import_oci(self, src_fd, source, want=None, rights=None):
        """An OCI image layout directory or a docker-archive open at src_fd:
        unpacked in a staging directory of the cache, made a squashfs,
        stored as import_ does -> as import_, format "oci" or
        "docker-archive".  rights: a context in which the layout's files
        are opened (a caller's: Caller.rights); the archive is read from
        src_fd, which its opener opened."""
        import shutil

        from starter.image import oci

        st = os.fstat(src_fd)
        if stat.S_ISDIR(st.st_mode) and oci.is_layout(src_fd):
            def layers():
                if rights is None:
                    return oci.layout_layers(src_fd, source)
                with rights():
                    return oci.layout_layers(src_fd, source)
            fmt = "oci"
        elif stat.S_ISREG(st.st_mode) and oci.is_docker_archive(src_fd):
            fmt, layers = "docker-archive", lambda: oci.archive_layers(src_fd, source)
        else:
            return None
        self._open(create=True)
        tag = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        staging, out = os.path.join(self.path, tag + ".d"), os.path.join(self.path, tag + SUFFIX)
        try:
            os.mkdir(staging, 0o700)
            oci.unpack_to_squashfs(layers(), staging, out, self.limit, source)
            fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                got = self.import_(fd, source, want, label=fmt)
            finally:
                os.close(fd)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            try:
                os.unlink(out)
            except FileNotFoundError:
                pass
        return got

    def import_(self, src_fd, source, want=None, label=None, rights=None):
        """Store the image open at src_fd (a squashfs or SIF file; source: its
        name, for the record) -> (hex digest, size, format, stored: False if
        it was there already).  want: a digest it must have; label: the
        format to record instead (an OCI image made a squashfs); rights: a
        context an OCI layout's files are opened in (import_oci)."""
        st = os.fstat(src_fd)
        if not stat.S_ISREG(st.st_mode):
            got = self.import_oci(src_fd, source, want, rights) if stat.S_ISDIR(st.st_mode) else None
            if got is not None:
                return got
            raise CacheError(f"{source} is not a regular file (nor an OCI image layout)")
        size = st.st_size

        def read_at(off, n):
            return os.pread(src_fd, n, off)

        what = source
        fmt = formats.kind(read_at(0, 64))
        if fmt == "squashfs":
            off, length = 0, size
        elif fmt == "sif":
            off, length = formats.sif_partition(read_at, size, what)
        else:
            got = self.import_oci(src_fd, source, want, rights) if label is None else None
            if got is not None:
                return got
            raise formats.ImageError(f"{what} is neither a squashfs, a SIF file, an OCI image layout nor a "
                                     "docker-archive")
        sb = formats.squashfs(lambda o, n: read_at(off + o, min(n, max(0, length - o))), length, what)
        # What is stored: the file system's bytes, then zeros to a 4 KiB
        # boundary (a loop device sees whole sectors only), whatever padding
        # the file had: one image, one digest, from a squashfs or a SIF file.
        used = sb.bytes_used
        length = -(-used // PAD) * PAD
        dfd = self._open(create=True)
        lock = None
        tmp = None
        try:
            lock = self._locked(dfd)
            have = sum(s for _h, s in self.entries(dfd))
            if have + length > self.limit:
                raise CacheError(f"{what} ({length} bytes) would take the image cache past its limit "
                                 f"({self.limit} bytes, {have} in use)",
                                 "remove images (starter image rm) or raise the limit (--limit)")
            try:
                sized_to_fit(src_fd, dfd)
            except NoRoom as e:
                raise CacheError(f"{what}: {e.strerror}: no room in {self.path}") from None
            tmp = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)
            try:
                hexd = _copy_range(src_fd, out, off, used, length, what)
                os.fchmod(out, 0o444)
                os.fsync(out)
            finally:
                os.close(out)
            _check_copy(dfd, tmp, length, what)
            if want is not None and check_digest(want) != hexd:
                raise CacheError(f"{what} has digest sha256:{hexd}, not the {want} asked for",
                                 "the file is not the image the digest names")
            name = PREFIX + hexd + SUFFIX
            if os.path.exists(os.path.join(self.path, name)):
                return hexd, length, label or fmt, False
            import json

            fmt = label or fmt
            meta = json.dumps({"digest": "sha256:" + hexd, "size": length, "format": fmt, "source": source,
                               "imported_at": round(time.time(), 3), "compression": sb.compression}).encode()
            mfd = os.open(PREFIX + hexd + META, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o644, dir_fd=dfd)
            try:
                write_all(mfd, meta + b"\n")
            finally:
                os.close(mfd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = None
            os.fsync(dfd)
            return hexd, length, fmt, True
        finally:
            if tmp is not None:
                unlink_quiet(tmp, dfd)
            if lock is not None:
                os.close(lock)
            os.close(dfd)

    # -- removal ----------------------------------------------------------------
    def remove(self, digest):
        """Remove an image -> True, or False if it was not there."""
        hexd = check_digest(digest)
        dfd = self._open(create=False)
        if dfd is None:
            return False
        lock = self._locked(dfd)
        try:
            gone = _unlink(PREFIX + hexd + SUFFIX, dfd)
            _unlink(PREFIX + hexd + META, dfd)
            return gone
        finally:
            os.close(lock)
            os.close(dfd)

    def gc(self):
        """Remove what no import finished: temporary files of imports whose
        process is gone, and records without their image -> their names."""
        dfd = self._open(create=False)
        if dfd is None:
            return []
        lock = self._locked(dfd)
        try:
            names = set(os.listdir(dfd))
            removed = []
            for name in sorted(names):
                if name.startswith(TMP_PREFIX):
                    pid = name[len(TMP_PREFIX):].split("-")[0]
                    if pid.isdigit() and os.path.exists(f"/proc/{pid}") and int(pid) != os.getpid():
                        continue    # (an import under way holds the lock: only a crashed one's is left)
                elif name.startswith(PREFIX) and name.endswith(META):
                    if name[:-len(META)] + SUFFIX in names:
                        continue
                else:
                    continue
                if name.startswith(TMP_PREFIX) and name.endswith(".d") and os.path.isdir(os.path.join(self.path, name)):
                    import shutil

                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
                    removed.append(name)
                elif _unlink(name, dfd):
                    removed.append(name)
            return removed
        finally:
            os.close(lock)
            os.close(dfd)

    def record(self, hexd):
        import json

        try:
            with open(os.path.join(self.path, PREFIX + hexd + META)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}


def _unlink(name, dfd):
    """-> whether it was there."""
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False


def _copy_range(src, dst, off, used, length, what):
    """Copy `used` bytes of src from off into dst, then zeros up to
    `length`, hashing all of it -> hex digest."""
    import hashlib

    h = hashlib.sha256()
    done = 0
    while done < used:
        buf = os.pread(src, min(CHUNK, used - done), off + done)
        if not buf:
            raise formats.ImageError(f"{what} ended while it was read (truncated meanwhile)")
        h.update(buf)
        write_all(dst, buf)
        done += len(buf)
    pad = b"\0" * (length - used)
    h.update(pad)
    write_all(dst, pad)
    return h.hexdigest()


def _check_copy(dfd, name, length, what):
    """The stored copy's superblock, checked again (the source may have
    changed between the first check and the copy)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        formats.squashfs(lambda o, n: os.pread(fd, n, o), length, what)
    finally:
        os.close(fd)

