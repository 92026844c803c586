"""OCI images into the node's image cache: an OCI image layout directory
(`oci-layout`, `index.json`, `blobs/sha256/...`: what `skopeo copy
docker://... oci:DIR` writes) or a docker-archive tarball (`docker save`,
`skopeo copy ... docker-archive:FILE`: `manifest.json` and layer tars),
unpacked once, layer by layer, into a staging directory in the cache, made
a squashfs (mksquashfs) and imported like any other (cache.py).

Every blob a layout names is checked against its digest as it is read, and
a missing one refuses the image.  A layer is applied as the OCI spec says:
its whiteouts (`.wh.NAME` removes NAME, `.wh..wh..opq` empties the
directory of what lower layers put there) first, then its entries, each
replacing what was at its path.  Refused, with nothing left: an entry whose
path is absolute or climbs out (`..`), one that would be written through a
symlink to outside the image (its parents resolved, what was at the path
itself removed first), a device node or FIFO (a job's /dev is the starter's), a hard link to outside,
an image larger than the cache's limit once unpacked.  Set-id bits are
cleared (the image is mounted nosuid anyway); symlinks are kept as they are
(an absolute one points into the job's root, not the host's).  Every time
in the squashfs is 0: the same image, however it came, is one digest.
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile

from starter.image.formats import ImageError

MAX_JSON = 4 << 20
MEDIA_INDEX = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def _open(dfd, rel, what):
    """A file of the layout (relative to its directory's fd), not through
    a link at its end."""
    try:
        return os.fdopen(os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd), "rb")
    except OSError as e:
        raise ImageError(f"{what}: the OCI layout's {rel}: {e.strerror}") from None


def is_layout(dfd):
    try:
        st = os.stat("oci-layout", dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def _from_start(fd):
    """A file object of its own on fd's file, at its start (a dup shares
    the offset: seek it)."""
    f = os.fdopen(os.dup(fd), "rb")
    f.seek(0)
    return f


def is_docker_archive(fd):
    """A tar file with a manifest.json at its top (read from fd's start)."""
    try:
        with tarfile.open(fileobj=_from_start(fd), mode="r:") as t:
            return any(m.name in ("manifest.json", "./manifest.json") for m in t.getmembers())
    except (tarfile.TarError, OSError, EOFError):
        return False


class Budget:
    """Bytes unpacked so far against the cache's limit."""

    def __init__(self, limit, what):
        self.left, self.what, self.limit = limit, what, limit

    def take(self, n):
        self.left -= n
        if self.left < 0:
            raise ImageError(f"{self.what} unpacks to more than the image cache's limit ({self.limit} bytes)",
                             "remove images or raise the limit (--limit)")


# -- reading the two formats ------------------------------------------------------
def _blob(layout, digest, what):
    """An open blob of the layout (its dir fd) -> (file, hex digest)."""
    algo, _, hexd = str(digest).partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise ImageError(f"{what}: {str(digest)[:80]!r} is not a sha256 digest")
    try:
        fd = os.open(os.path.join("blobs", "sha256", hexd), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=layout)
    except FileNotFoundError:
        raise ImageError(f"{what}: the OCI layout has no blob {digest}", "copy the whole image (skopeo copy)") from None
    except OSError as e:
        raise ImageError(f"{what}: the OCI layout's blob {digest}: {e.strerror}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ImageError(f"{what}: the OCI layout's blob {digest} is not a file")
    return f, hexd


def _json_blob(layout, digest, what):
    f, hexd = _blob(layout, digest, what)
    with f:
        data = f.read(MAX_JSON + 1)
    if len(data) > MAX_JSON or hashlib.sha256(data).hexdigest() != hexd:
        raise ImageError(f"{what}: blob {digest} does not have its digest (corrupt)")
    return _loads(data, what)


def _loads(data, what):
    try:
        return json.loads(data)
    except ValueError:
        raise ImageError(f"{what}: a manifest that is not JSON") from None


def layout_layers(layout, what):
    """The layers of an OCI layout's image (its directory's fd), bottom
    first, each open and checked against its digest: [(file object, name)]."""
    with _open(layout, "index.json", what) as f:
        index = _loads(f.read(MAX_JSON), what)
    manifest = None
    for _ in range(4):       # an index may name an index (multi-platform): amd64/linux, else the first
        entries = index.get("manifests") if isinstance(index, dict) else None
        if not entries:
            raise ImageError(f"{what}: the OCI layout's index names no image")
        pick = next((m for m in entries if isinstance(m, dict) and (m.get("platform") or {}).get("architecture")
                     in ("amd64", None)), entries[0])
        got = _json_blob(layout, pick.get("digest"), what)
        if pick.get("mediaType") in MEDIA_INDEX or "manifests" in got:
            index = got
            continue
        manifest = got
        break
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise ImageError(f"{what}: the OCI layout's manifest lists no layers")
    out = []
    try:
        for layer in manifest["layers"]:
            f, hexd = _blob(layout, (layer or {}).get("digest"), what)
            out.append((f, f"layer {layer['digest'][:19]}"))
            _check_digest(f, hexd, what)        # (before a byte of it is unpacked)
    except BaseException:
        for f, _n in out:
            f.close()
        raise
    return out


def _check_digest(f, hexd, what):
    h = hashlib.sha256()
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        h.update(b)
    if h.hexdigest() != hexd:
        raise ImageError(f"{what}: blob sha256:{hexd} does not have its digest (corrupt)")
    f.seek(0)


def archive_layers(fd, what):
    """The layers of a docker-archive, bottom first: [(file object, name)]."""
    outer = tarfile.open(fileobj=_from_start(fd), mode="r:")
    names = {m.name.lstrip("./") if m.name.startswith("./") else m.name: m for m in outer.getmembers()}
    m = names.get("manifest.json")
    if m is None:
        raise ImageError(f"{what}: not a docker-archive (no manifest.json)")
    data = _loads(outer.extractfile(m).read(MAX_JSON), what)
    if not isinstance(data, list) or not data or not isinstance(data[0].get("Layers"), list):
        raise ImageError(f"{what}: its manifest.json lists no layers")
    out = []
    for name in data[0]["Layers"]:
        member = names.get(str(name))
        if member is None or not member.isfile():
            raise ImageError(f"{what}: its manifest names layer {str(name)[:80]!r}, which the archive lacks")
        out.append((outer.extractfile(member), f"layer {name}"))
    return out


# -- applying layers ------------------------------------------------------------------
def _clean(name):
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise ImageError(f"an entry {name[:80]!r} climbs out of the image")
    return "/".join(parts)


def _inside(root, rel):
    """root/rel with no symlink on the way out of root (the parents resolved)."""
    parent = os.path.realpath(os.path.join(root, os.path.dirname(rel)))
    if parent != root and not parent.startswith(root + "/"):
        raise ImageError(f"an entry {rel[:80]!r} is written through a symlink to outside the image")
    return os.path.join(parent, os.path.basename(rel))


def _remove(path):
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path)


def apply_layer(root, fileobj, budget, what):
    """One layer (a tar stream, compressed or not) onto the tree at root."""
    try:
        t = tarfile.open(fileobj=fileobj, mode="r|*")
    except tarfile.TarError as e:
        raise ImageError(f"{what}: not a tar archive ({e})") from None
    try:
        for m in t:
            rel = _clean(m.name)
            if not rel:
                continue
            base = os.path.basename(rel)
            if base.startswith(".wh."):
                d = _inside(root, rel)
                if base == ".wh..wh..opq":
                    parent = os.path.dirname(d)
                    if os.path.isdir(parent) and not os.path.islink(parent):
                        for child in os.listdir(parent):
                            _remove(os.path.join(parent, child))
                else:
                    _remove(os.path.join(os.path.dirname(d), base[4:]))
                continue
            if m.ischr() or m.isblk() or m.isfifo():
                raise ImageError(f"{what}: {rel[:80]!r} is a device node or FIFO (refused: a job's /dev is the "
                                 "starter's)")
            if m.islnk():
                target = _clean(m.linkname)
                _inside(root, target)
            budget.take(max(m.size, 0) + 512)
            dest = _inside(root, rel)
            if os.path.lexists(dest) and not (m.isdir() and os.path.isdir(dest) and not os.path.islink(dest)):
                _remove(dest)
            m.name, m.mode = rel, m.mode & 0o1777     # no set-id bits
            if m.islnk():
                m.linkname = _clean(m.linkname)
            # (every check the path needs is made above: no extraction
            # filter's rules about link targets, which an image's absolute
            # links would break)
            t.extract(m, root, set_attrs=True, numeric_owner=True)
    except (tarfile.TarError, EOFError, OSError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{what}: the layer is corrupt or truncated ({e})") from None
    finally:
        t.close()


def unpack_to_squashfs(layers, staging, out, limit, what):
    """Apply `layers` in order into staging (a fresh directory), then make
    the squashfs `out` of it."""
    budget = Budget(limit, what)
    root = os.path.realpath(staging)
    os.chmod(root, 0o755)
    for fileobj, name in layers:
        try:
            apply_layer(root, fileobj, budget, f"{what}: {name}")
        finally:
            fileobj.close()
    mk = shutil.which("mksquashfs")
    if mk is None:
        raise ImageError("importing an OCI image needs mksquashfs", "apt-get install squashfs-tools")
    # Times fixed: the same image unpacked twice (or from a layout and from
    # an archive) is the same squashfs, byte for byte: one digest, one entry.
    r = subprocess.run([mk, root, out, "-noappend", "-quiet", "-no-progress", "-comp", "zstd", "-mkfs-time", "0",
                        "-all-time", "0"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise ImageError(f"{what}: mksquashfs failed: {' '.join(r.stderr.split())[-300:]}")
    st = os.stat(out)
    if not stat.S_ISREG(st.st_mode):
        raise ImageError(f"{what}: mksquashfs made no file")
