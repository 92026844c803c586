"""Image files for the tests (tests/test_image.py, unit/test_image_formats.py):
a squashfs made by mksquashfs, and a SIF file around one, built here from
the format's layout (starter/image/formats.py), as Apptainer lays it out."""

import os
import subprocess

from starter.image import formats as F


def squashfs(tree, out, files):
    """mksquashfs of a tree holding `files` ({relative path: bytes}) -> out."""
    for rel, data in files.items():
        p = os.path.join(tree, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    subprocess.run(["mksquashfs", str(tree), str(out), "-noappend", "-quiet", "-no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    return str(out)


def descriptor(dtype, offset, size, fstype=F.SIF_FS_SQUASHFS, parttype=F.SIF_PART_PRIMARY, used=True, ident=1):
    extra = F.SIF_PARTITION.pack(fstype, parttype, b"02\0").ljust(384, b"\0")
    return F.SIF_DESCRIPTOR.pack(dtype, used, ident, 1 | 0xf0000000, 0, offset, size, size, 0, 0, 0, 0,
                                 b"rootfs".ljust(128, b"\0"), extra)


def sif(payloads, descriptors=None):
    """A SIF file's bytes: payloads [(bytes, fstype, parttype)] placed after
    the descriptors, 4 KiB aligned; descriptors: override (a list of
    descriptor bytes) for corrupt files."""
    ndesc = max(len(payloads), 1)
    doff = F.SIF_HEADER.size
    dsize = ndesc * F.SIF_DESCRIPTOR.size
    dataoff = -(-(doff + dsize) // 4096) * 4096
    data, descs, off = b"", [], dataoff
    for i, (blob, fstype, parttype) in enumerate(payloads):
        descs.append(descriptor(F.SIF_DATA_PARTITION, off, len(blob), fstype, parttype, ident=i + 1))
        pad = -(-len(blob) // 4096) * 4096
        data += blob.ljust(pad, b"\0")
        off += pad
    if descriptors is not None:
        descs = descriptors
        ndesc = len(descs)
        dsize = ndesc * F.SIF_DESCRIPTOR.size
    header = F.SIF_HEADER.pack(b"#!/usr/bin/env run-singularity\n".ljust(32, b"\0"), F.SIF_MAGIC, b"01\0", b"02\0",
                               os.urandom(16), 0, 0, 0, ndesc, doff, dsize, dataoff, len(data))
    table = b"".join(descs)
    return (header + table).ljust(dataoff, b"\0") + data


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def superblock(**over):
    """A squashfs 4.0 superblock's 96 bytes, fields overridden by name."""
    f = dict(magic=F.SQUASHFS_MAGIC, inodes=2, mtime=0, block_size=131072, frags=0, comp=1, block_log=17,
             flags=0, ids=1, major=4, minor=0, root=0, used=4000, id_table=3900, xattr=F.NONE, inode_table=200,
             dir_table=300, frag_table=F.NONE, export=F.NONE)
    f.update(over)
    return F.SUPERBLOCK.pack(*f.values())



TOOLS = ("/bin/sh", "/bin/cat", "/bin/ls", "/bin/dd", "/usr/bin/id", "/bin/sleep", "/bin/mkdir", "/usr/bin/stat",
         "/bin/true")


def rootfs(tree, out, name="Starter Test Image"):
    """A small root file system made of this host's own tools and their
    libraries (as ldd names them), an /etc/os-release of `name` and a
    world-writable /opt: a squashfs at `out`."""
    import shutil

    for tool in TOOLS:
        real = os.path.realpath(tool)
        libs = subprocess.run(["ldd", real], capture_output=True, text=True).stdout.split()
        for src, dst in [(real, tool)] + [(p, p) for p in libs if p.startswith("/")]:
            d = os.path.join(tree, dst.lstrip("/"))
            os.makedirs(os.path.dirname(d), exist_ok=True)
            if not os.path.exists(d):
                shutil.copy2(os.path.realpath(src), d)
    os.makedirs(os.path.join(tree, "etc"), exist_ok=True)
    with open(os.path.join(tree, "etc", "os-release"), "w") as f:
        f.write(f'PRETTY_NAME="{name}"\n')
    os.makedirs(os.path.join(tree, "opt"), exist_ok=True)
    os.chmod(os.path.join(tree, "opt"), 0o1777)
    return squashfs(tree, out, {})


# -- OCI images ------------------------------------------------------------------

def layer(entries, gz=True):
    """A layer's bytes: entries [(name, kind, data)], kind "file" (data: bytes),
    "dir", "symlink"/"hardlink" (data: the target), "chr" (a device node),
    or a tarfile.TarInfo-ready (name, "tree", path): a directory of the host
    taken whole."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as t:
        for name, kind, data in entries:
            if kind == "tree":
                t.add(data, arcname=name)
                continue
            ti = tarfile.TarInfo(name)
            ti.mode = 0o755 if kind == "dir" else 0o644
            if kind == "file":
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                       "chr": tarfile.CHRTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                ti.linkname = data
            if kind == "chr":
                ti.devmajor, ti.devminor = 1, 3
            t.addfile(ti)
    return buf.getvalue()


def oci_layout(path, layers, drop_blob=None, corrupt_blob=None):
    """An OCI image layout at path with these layers (bytes, bottom first)."""
    import hashlib
    import json

    blobs = os.path.join(path, "blobs", "sha256")
    os.makedirs(blobs)

    def put(data):
        h = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, h), "wb") as f:
            f.write(data)
        return {"digest": "sha256:" + h, "size": len(data)}

    descs = [dict(put(l), mediaType="application/vnd.oci.image.layer.v1.tar+gzip") for l in layers]
    config = dict(put(json.dumps({"architecture": "amd64", "os": "linux",
                                  "rootfs": {"type": "layers", "diff_ids": []}}).encode()),
                  mediaType="application/vnd.oci.image.config.v1+json")
    manifest = dict(put(json.dumps({"schemaVersion": 2, "config": config, "layers": descs}).encode()),
                    mediaType="application/vnd.oci.image.manifest.v1+json")
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [manifest]}, f)
    with open(os.path.join(path, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion": "1.0.0"}')
    if drop_blob is not None:
        os.unlink(os.path.join(blobs, descs[drop_blob]["digest"][7:]))
    if corrupt_blob is not None:
        with open(os.path.join(blobs, descs[corrupt_blob]["digest"][7:]), "r+b") as f:
            f.seek(40)
            f.write(b"\xff" * 8)
    return str(path)


def docker_archive(path, layers):
    """A docker-archive tarball (docker save's) with these layers (uncompressed tar bytes)."""
    import io
    import json
    import tarfile

    with tarfile.open(path, "w") as t:
        names = []
        for i, data in enumerate(layers):
            name = f"l{i}/layer.tar"
            names.append(name)
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
        m = json.dumps([{"Config": "config.json", "RepoTags": ["test:1"], "Layers": names}]).encode()
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(m)
        t.addfile(ti, io.BytesIO(m))
    return str(path)
