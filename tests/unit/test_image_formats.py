"""Image files read from their bytes (starter/image/formats.py): squashfs
superblocks and SIF headers on fixture bytes made here, every corrupt case
refused with its reason, and random bytes never taken for an image nor
raising anything but ImageError.  The cache and the kernel's mount of what
it stores are tests/test_image.py's."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import imagefiles as IF  # noqa: E402
from starter.image import formats as F  # noqa: E402

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def reader(data):
    return lambda off, n: data[off:off + n]


def test_a_good_superblock():
    data = IF.superblock().ljust(4096, b"\0")
    sb = F.squashfs(reader(data), len(data))
    assert (sb.bytes_used, sb.block_size, sb.compression) == (4000, 131072, "gzip")
    assert F.kind(data) == "squashfs"


@pytest.mark.parametrize("over, size, what", [
    ({"magic": b"hsqt"}, 4096, "not a squashfs"),
    ({"major": 3}, 4096, "squashfs 3.0"),
    ({"block_size": 100000}, 4096, "block size"),
    ({"block_log": 16}, 4096, "block size"),
    ({"comp": 9}, 4096, "unknown compression"),
    ({}, 3000, "truncated"),
    ({"used": 50}, 4096, "corrupt"),
    ({"id_table": 5000}, 8192, "id table lies outside"),
    ({"frag_table": 4000}, 4096, "fragment table lies outside"),
    ({"inode_table": 350}, 4096, "out of order"),
    ({"inodes": 0}, 4096, "no inodes"),
])
def test_corrupt_superblocks(over, size, what):
    data = IF.superblock(**over).ljust(size, b"\0")
    with pytest.raises(F.ImageError, match=what):
        F.squashfs(reader(data), len(data))


def test_a_short_file_is_truncated():
    with pytest.raises(F.ImageError, match="ends at byte 40"):
        F.squashfs(reader(IF.superblock()[:40]), 40)


def test_sif_partitions():
    fs = IF.superblock().ljust(4096, b"\0")
    data = IF.sif([(b"deffile", 0, 0), (fs, F.SIF_FS_SQUASHFS, F.SIF_PART_PRIMARY)])
    assert F.kind(data) == "sif"
    off, length = F.sif_partition(reader(data), len(data))
    assert data[off:off + length] == fs
    # a system partition when there is no primary one
    data = IF.sif([(fs, F.SIF_FS_SQUASHFS, F.SIF_PART_SYSTEM)])
    off, length = F.sif_partition(reader(data), len(data))
    assert data[off:off + 4] == b"hsqs"


def test_corrupt_sif_files():
    fs = IF.superblock().ljust(4096, b"\0")
    good = IF.sif([(fs, F.SIF_FS_SQUASHFS, F.SIF_PART_PRIMARY)])
    cases = [
        (IF.sif([(fs, 2, F.SIF_PART_PRIMARY)]), "no squashfs system partition"),     # ext3
        (IF.sif([(fs, F.SIF_FS_SQUASHFS, 3)]), "no squashfs system partition"),      # a data partition
        (IF.sif([(fs, F.SIF_FS_SQUASHFS, 2), (fs, F.SIF_FS_SQUASHFS, 2)]), "more than one"),
        (good[:5000], "lies outside the file's data"),
        (good[:100], "ends at byte 100"),
        (IF.sif([], descriptors=[]), "0 descriptors"),
        (IF.sif([], descriptors=[IF.descriptor(F.SIF_DATA_PARTITION, 200, 4096)]), "lies outside"),
        (IF.sif([], descriptors=[IF.descriptor(F.SIF_DATA_PARTITION, 1 << 40, 4096)]), "lies outside"),
        (b"x" * 32 + b"SIF_MAGIX\0" + good[42:], "not a SIF file"),
    ]
    for data, what in cases:
        with pytest.raises(F.ImageError, match=what):
            F.sif_partition(reader(data), len(data))


def test_random_bytes_are_never_an_image():
    rng = random.Random(38)
    good = IF.sif([(IF.superblock().ljust(4096, b"\0"), F.SIF_FS_SQUASHFS, F.SIF_PART_PRIMARY)])
    for i in range(2000):
        if i % 2:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data) if i % 4 == 1 else 700)] = rng.randrange(256)
            data = bytes(data[:rng.randrange(len(data) + 1)])
        else:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        for fn in (F.squashfs, F.sif_partition):
            try:
                fn(reader(data), len(data))
            except F.ImageError:
                pass
