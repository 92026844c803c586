"""The node's image cache (starter image import|ls|rm|gc, starter/image/):
real squashfs files made by mksquashfs and SIF files around them; the
kernel mounts what the cache stores; every bad input is one line, exit 125,
and leaves nothing in the cache.  The formats' checks on fixture bytes are
unit/test_image_formats.py's."""

import json
import os
import shutil
import subprocess

import pytest

import imagefiles as IF
from conftest import GID, STARTER, UID


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def image(cache, *args, user=None):
    pre = ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups"] if user else []
    return subprocess.run([*pre, STARTER, "image", "--cache", cache, *args], capture_output=True, text=True,
                          timeout=120)


def leftovers(cache):
    return sorted(n for n in os.listdir(cache) if n.startswith(".tmp-")) if os.path.isdir(cache) else []


def refused(r, what):
    assert r.returncode == 125 and r.stderr.count("\n") == 1 and what in r.stderr, (r.returncode, r.stderr)


def os_release(tmp_path, name="Test Image"):
    if shutil.which("mksquashfs") is None:
        pytest.fail("mksquashfs is missing: scripts/setup --test installs squashfs-tools")
    return IF.squashfs(tmp_path / "tree", tmp_path / "img.sqfs",
                       {"etc/os-release": f'PRETTY_NAME="{name}"\n'.encode(), "opt/big": os.urandom(300000)})


def test_import_once_by_digest_from_squashfs_and_sif_and_the_kernel_mounts_it(cache, tmp_path):
    sqfs = os_release(tmp_path)
    r = image(cache, "import", sqfs, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["answer"] == "stored" and got["format"] == "squashfs" and got["size"] % 4096 == 0
    # the same file again, and the same file system in a SIF file: one entry
    assert json.loads(image(cache, "import", sqfs, "--json").stdout)["answer"] == "have"
    with open(sqfs, "rb") as f:
        fs = f.read()
    sif = IF.write(tmp_path / "img.sif", IF.sif([(b"Bootstrap: scratch\n", 0, 0), (fs, 1, 2)]))
    s = json.loads(image(cache, "import", sif, "--json").stdout)
    assert (s["digest"], s["answer"], s["format"]) == (got["digest"], "have", "sif")
    assert image(cache, "import", sif, "--digest", got["digest"]).returncode == 0
    ls = json.loads(image(cache, "ls", "--json").stdout)
    assert [e["digest"] for e in ls] == [got["digest"]] and ls[0]["source"] == sqfs
    st = os.stat(got["path"])
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o444
    # The kernel reads what the cache holds (a loop device, gone with the mount).
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        'mount -t squashfs -o ro,loop "$1" "$2" && cat "$2/etc/os-release"', "sh", got["path"],
                        str(mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and 'PRETTY_NAME="Test Image"' in r.stdout, r
    assert subprocess.run(["losetup", "-j", got["path"]], capture_output=True, text=True).stdout == ""
    # rm, then nothing is left but the lock
    assert image(cache, "rm", got["digest"]).returncode == 0
    assert image(cache, "ls").stdout == "" and os.listdir(cache) == [".lock"]
    r = image(cache, "rm", got["digest"])
    assert r.returncode == 1 and "is not in the cache" in r.stderr


def test_bad_images_are_one_line_and_leave_nothing(cache, tmp_path):
    sqfs = os_release(tmp_path)
    with open(sqfs, "rb") as f:
        fs = f.read()
    half = IF.write(tmp_path / "half.sqfs", fs[:len(fs) // 2])
    corrupt = bytearray(fs)
    corrupt[40:48] = (1 << 40).to_bytes(8, "little")            # bytes_used
    cases = [
        (half, (), "truncated"),
        (IF.write(tmp_path / "corrupt.sqfs", bytes(corrupt)), (), "truncated"),
        (IF.write(tmp_path / "ext3.sif", IF.sif([(fs, 2, 2)])), (), "no squashfs system partition"),
        (IF.write(tmp_path / "short.sif", IF.sif([(fs, 1, 2)])[:6000]), (), "lies outside the file's data"),
        (IF.write(tmp_path / "text", b"hello\n" * 100), (), "neither a squashfs nor a SIF file"),
        (sqfs, ("--digest", "sha256:" + "0" * 64), "not the sha256:" + "0" * 64),
        (sqfs, ("--digest", "md5:1"), "is not an image digest"),
        (sqfs, ("--limit", "100k"), "past its limit"),
        (str(tmp_path / "missing.sqfs"), (), "No such file"),
        (str(tmp_path), (), "not a regular file"),
    ]
    for path, extra, what in cases:
        refused(image(cache, "import", path, *extra), what)
        assert leftovers(cache) == [] and image(cache, "ls").stdout == "", path
    refused(image(cache, "ls", user=True), "starter image is root's")
    r = image(cache, "frob")
    assert r.returncode == 2 and "unknown image command" in r.stderr, r      # a usage error


def test_gc_removes_what_a_dead_import_left_and_a_cache_not_roots_is_refused(cache, tmp_path):
    sqfs = os_release(tmp_path)
    digest = json.loads(image(cache, "import", sqfs, "--json").stdout)["digest"]
    hexd = digest.split(":")[1]
    for name in (".tmp-999999999-abc", "sha256-" + "1" * 64 + ".json"):
        IF.write(os.path.join(cache, name), b"x")
    r = image(cache, "gc", "--json")
    assert r.returncode == 0 and sorted(json.loads(r.stdout)) == sorted([".tmp-999999999-abc",
                                                                         "sha256-" + "1" * 64 + ".json"])
    assert sorted(os.listdir(cache)) == [".lock", f"sha256-{hexd}.json", f"sha256-{hexd}.sqfs"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, UID, GID)
    refused(image(str(theirs), "import", sqfs), "is not root's alone")
