"""What an image file is, read from its bytes (pure: callers hand in a
read_at(offset, length) function): a squashfs file system, or a SIF file
(Apptainer's) whose primary system partition is one.

    kind(head)                         -> "squashfs" | "sif" | None
    squashfs(read_at, size)            -> Squashfs: what its superblock says,
                                          checked against the bytes there are
    sif_partition(read_at, size)       -> (offset, length) of the squashfs in it

Every check that fails raises ImageError with what is wrong, in a line: a
file that lies about its own sizes (a truncated copy, a corrupt header) is
refused before a byte of it is stored or mounted.  The kernel's squashfs
reads the rest; these checks keep it from being handed what is plainly not
a whole file system.

Squashfs 4.0's superblock (96 bytes, little-endian): magic "hsqs", inode
count, mkfs time, block size, fragment count, compression (u16), block log
(u16), flags, id count, major 4, minor 0, root inode, bytes used, then the
offsets of the id, xattr, inode, directory, fragment and export tables.

SIF (github.com/apptainer/sif): a 128-byte global header (a launch line,
"SIF_MAGIC\\0", a version, an arch, a UUID, times, the descriptor count,
offset and size, the data offset and size), then descriptors of 585 bytes
each: type (0x4004: a partition), used, ids, the object's offset and size,
times, a name, and for a partition its file system type (1: squashfs) and
partition type (2: the primary system, 1: a system).
"""

import struct

from starter.errors import StarterError

SQUASHFS_MAGIC = b"hsqs"
SIF_MAGIC = b"SIF_MAGIC\0"
SUPERBLOCK = struct.Struct("<4sIIIIHHHHHHQQQQQQQQ")     # 96 bytes
COMPRESSORS = {1: "gzip", 2: "lzma", 3: "lzo", 4: "xz", 5: "lz4", 6: "zstd"}
NONE = 0xFFFFFFFFFFFFFFFF       # a table the file system does not have

SIF_HEADER = struct.Struct("<32s10s3s3s16sqqqqqqqq")    # 128 bytes
SIF_DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s384s")  # 585 bytes
SIF_PARTITION = struct.Struct("<ii3s")
SIF_DATA_PARTITION, SIF_FS_SQUASHFS = 0x4004, 1
SIF_PART_SYSTEM, SIF_PART_PRIMARY = 1, 2
SIF_MAX_DESCRIPTORS = 4096


class ImageError(StarterError):
    """The image is not what it claims to be."""


class Squashfs:
    __slots__ = ("bytes_used", "block_size", "compression", "inodes")

    def __init__(self, bytes_used, block_size, compression, inodes):
        self.bytes_used, self.block_size = bytes_used, block_size
        self.compression, self.inodes = compression, inodes


def kind(head):
    """The format of a file from its first bytes (at least 64)."""
    if head[:4] == SQUASHFS_MAGIC:
        return "squashfs"
    if head[32:42] == SIF_MAGIC:
        return "sif"
    return None


def _read(read_at, offset, length, what):
    data = read_at(offset, length)
    if len(data) != length:
        raise ImageError(f"{what}: the file ends at byte {offset + len(data)}, before its {length}-byte "
                         f"{'header' if offset == 0 else 'part'} does")
    return data


def squashfs(read_at, size, what="the image"):
    """The superblock of the squashfs that read_at reads (size bytes of
    it), checked: squashfs 4.0, a block size the kernel takes, a known
    compressor, and every table inside the bytes it says it uses, which
    must all be there."""
    sb = SUPERBLOCK.unpack(_read(read_at, 0, SUPERBLOCK.size, what))
    (magic, inodes, _mtime, block_size, _frags, comp, block_log, _flags, _ids, major, minor,
     _root, used, id_table, xattr_table, inode_table, dir_table, frag_table, export_table) = sb
    if magic != SQUASHFS_MAGIC:
        raise ImageError(f"{what} is not a squashfs file system (no magic 'hsqs')")
    if (major, minor) != (4, 0):
        raise ImageError(f"{what} is squashfs {major}.{minor}: the kernel reads 4.0 only")
    if not 4096 <= block_size <= 1 << 20 or block_size & (block_size - 1) or 1 << block_log != block_size:
        raise ImageError(f"{what}: its superblock's block size ({block_size}, log {block_log}) is corrupt")
    if comp not in COMPRESSORS:
        raise ImageError(f"{what}: unknown compression {comp} in its superblock")
    if not SUPERBLOCK.size < used <= size:
        raise ImageError(f"{what}: its superblock says it uses {used} bytes, but it has {size}: "
                         + ("truncated" if used > size else "corrupt"))
    for name, off in (("id", id_table), ("inode", inode_table), ("directory", dir_table)):
        if not SUPERBLOCK.size <= off < used:
            raise ImageError(f"{what}: its {name} table lies outside the file system (corrupt)")
    for name, off in (("xattr", xattr_table), ("fragment", frag_table), ("export", export_table)):
        if off != NONE and not SUPERBLOCK.size <= off < used:
            raise ImageError(f"{what}: its {name} table lies outside the file system (corrupt)")
    if not inode_table < dir_table:
        raise ImageError(f"{what}: its inode and directory tables are out of order (corrupt)")
    if inodes == 0:
        raise ImageError(f"{what}: its superblock counts no inodes (corrupt)")
    return Squashfs(used, block_size, COMPRESSORS[comp], inodes)


def sif_partition(read_at, size, what="the image"):
    """(offset, length) of the squashfs partition of a SIF file: its
    primary system partition, else its only system one."""
    h = SIF_HEADER.unpack(_read(read_at, 0, SIF_HEADER.size, what))
    _launch, magic, _version, _arch, _uuid, _ct, _mt, _free, total, doff, dsize, _dataoff, _datalen = h
    if magic != SIF_MAGIC:
        raise ImageError(f"{what} is not a SIF file (no SIF_MAGIC)")
    if not 0 < total <= SIF_MAX_DESCRIPTORS or dsize < total * SIF_DESCRIPTOR.size:
        raise ImageError(f"{what}: its header counts {total} descriptors in {dsize} bytes (corrupt)")
    if not SIF_HEADER.size <= doff <= size - total * SIF_DESCRIPTOR.size:
        raise ImageError(f"{what}: its descriptors lie outside the file (truncated or corrupt)")
    table = _read(read_at, doff, total * SIF_DESCRIPTOR.size, what)
    found = {}
    for i in range(total):
        (dtype, used, _id, _group, _link, off, length, _padded, _c, _m, _u, _g, _name,
         extra) = SIF_DESCRIPTOR.unpack_from(table, i * SIF_DESCRIPTOR.size)
        if not used or dtype != SIF_DATA_PARTITION:
            continue
        fstype, parttype, _arch = SIF_PARTITION.unpack_from(extra)
        if fstype != SIF_FS_SQUASHFS or parttype not in (SIF_PART_PRIMARY, SIF_PART_SYSTEM):
            continue
        overlaps = off < doff + dsize and doff < off + length       # the descriptors
        if off < SIF_HEADER.size or length <= 0 or off + length > size or overlaps:
            raise ImageError(f"{what}: its system partition (bytes {off}..{off + length}) lies outside the "
                             f"file's data (truncated or corrupt)")
        found.setdefault(parttype, []).append((off, length))
    primary = found.get(SIF_PART_PRIMARY) or found.get(SIF_PART_SYSTEM) or []
    if len(primary) != 1:
        raise ImageError(f"{what}: a SIF file with {'no' if not primary else 'more than one'} squashfs system "
                         f"partition", "build it with a squashfs root file system (apptainer build)")
    return primary[0]
