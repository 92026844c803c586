"""Mount destinations are walked once, in the job's view, without following
links (native/shim_mountfd.c, walk_dest): a link planted anywhere on the path of a
--bind, --ro-bind or --tmpfs destination, the last component included, is
refused with one line naming it, and a link swapped in while jobs start
never carries a mount over /usr/bin (runc's CVE-2021-30465).

The hostile user owns a host directory the destinations go through (outside
/tmp, which is private to the job); here the test plants the links for it.
"""

import ctypes
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

USER = ("--user", "nobody")
NOBODY = 65534


@pytest.fixture
def home():
    """A host directory the job's user owns, visible in the job (not under
    the private /tmp)."""
    d = tempfile.mkdtemp(prefix="starter-test-dest-", dir="/var/lib")
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def src(home):
    """A bind source of the user's: a directory with a marker file."""
    s = os.path.join(home, "src")
    os.mkdir(s)
    with open(os.path.join(s, "covered-by-the-job"), "w") as f:
        f.write("mine\n")
    return s


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# What the job runs if it starts: it says whether /usr/bin is still the host's.
PROBE = ("--", "/bin/sh", "-c",
         "test -e /usr/bin/covered-by-the-job && echo COVERED; "
         "grep -c ' /usr/bin ' /proc/self/mountinfo; echo ran")


def _cases(home, src):
    """(mount options, the link the refusal must name), one per kind and
    place of the link: each would put the user's mount on /usr/bin (or a file
    in it) if the link were followed."""
    f = os.path.join(src, "covered-by-the-job")
    os.symlink("/usr/bin", os.path.join(home, "bin"))        # a directory component
    os.symlink("/usr", os.path.join(home, "usr"))
    os.symlink("/usr/bin/true", os.path.join(home, "true"))   # the last component, a file
    h = home
    return {
        "bind-middle": (["--bind", f"{src}:{h}/bin/x"], f"{h}/bin"),
        "bind-last": (["--bind", f"{src}:{h}/bin"], f"{h}/bin"),
        "bind-deep": (["--bind", f"{src}:{h}/usr/bin"], f"{h}/usr"),
        "ro-bind-file-middle": (["--ro-bind", f"{f}:{h}/bin/true"], f"{h}/bin"),
        "ro-bind-file-last": (["--ro-bind", f"{f}:{h}/true"], f"{h}/true"),
        "tmpfs-last": (["--tmpfs", f"{h}/bin"], f"{h}/bin"),
        "tmpfs-middle": (["--tmpfs", f"{h}/usr/bin"], f"{h}/usr"),
    }


CASES = ["bind-middle", "bind-last", "bind-deep", "ro-bind-file-middle", "ro-bind-file-last",
         "tmpfs-last", "tmpfs-middle"]


@pytest.mark.parametrize("case", CASES)
def test_link_on_the_destination_is_refused(starter, home, src, case):
    opts, link = _cases(home, src)[case]
    p = starter("run", *USER, *opts, *PROBE)
    assert "COVERED" not in p.stdout, (case, p.stdout)
    assert p.returncode == 125, (case, p.returncode, p.stdout, p.stderr)
    line = _one_line(p.stderr)
    dst = opts[1].split(":")[-1]
    assert f"mount destination {dst}: {link} is a symlink (not followed)" in line, line
    assert p.stdout == ""
    assert not os.path.exists("/usr/bin/covered-by-the-job")


def test_destination_without_links_still_works(starter, home, src):
    """The user's own directories, links nowhere: mounted as before (a file
    made for a file bind inside the private /tmp)."""
    os.mkdir(os.path.join(home, "real"))
    f = os.path.join(src, "covered-by-the-job")
    p = starter("run", *USER, "--bind", f"{src}:{home}/real", "--ro-bind", f"{f}:/tmp/a/b/file",
                "--tmpfs", "/tmp/t:size=1m,mode=700", "--", "/bin/sh", "-c",
                f"cat {home}/real/covered-by-the-job /tmp/a/b/file; "
                "grep -E ' /tmp/(t|a/b/file) ' /proc/self/mountinfo", check=0)
    lines = p.stdout.splitlines()
    assert lines[:2] == ["mine", "mine"], p.stdout
    file_line = next(l for l in lines if " /tmp/a/b/file " in l)
    tmpfs_line = next(l for l in lines if " /tmp/t " in l)
    assert " ro," in file_line, file_line
    assert "nosuid" in tmpfs_line and "nodev" in tmpfs_line and "size=1024k" in tmpfs_line, tmpfs_line
    assert "mode=700" in tmpfs_line and " - tmpfs tmpfs " in tmpfs_line, tmpfs_line


# ---------------------------------------------------------------- the race

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_EXCHANGE = 2


def _exchange(a, b):
    if _libc.renameat2(AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_link_swapped_in_while_jobs_start_never_covers_usr_bin(starter, home, src):
    """home/a is, in turn, a real directory (with a bin/ to bind onto) and a
    link to /usr, swapped atomically in a tight loop while 40 jobs bind onto
    home/a/bin.  Each job either starts with the bind where it belongs or is
    refused naming the link; none ever sees /usr/bin covered (with a lookup
    by path, about every other one did)."""
    real = os.path.join(home, "a")
    os.makedirs(os.path.join(real, "bin"))
    alt = os.path.join(home, "alt")
    os.symlink("/usr", alt)
    stop = threading.Event()
    swaps = [0]

    def swapper():
        while not stop.is_set():
            _exchange(real, alt)
            swaps[0] += 1

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    try:
        def one(_):
            return starter("run", *USER, "--bind", f"{src}:{real}/bin", *PROBE)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(40)))
    finally:
        stop.set()
        t.join(10)
    if os.path.islink(real):
        _exchange(real, alt)
    started = refused = 0
    for p in results:
        assert "COVERED" not in p.stdout, p.stdout
        if p.returncode == 0:
            lines = p.stdout.splitlines()
            assert lines == ["0", "ran"], p.stdout   # no mount at /usr/bin
            started += 1
        else:
            assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
            assert f"{real}: {real} is a symlink (not followed)" in _one_line(p.stderr) or \
                f"{real}/bin: {real} is a symlink (not followed)" in _one_line(p.stderr), p.stderr
            refused += 1
    assert started + refused == 40 and swaps[0] > 100, (started, refused, swaps)
    assert not os.path.exists("/usr/bin/covered-by-the-job")


# ---------------------------------------------------------------- older kernels

@pytest.fixture(params=["new", "no-mount-setattr", "no-open-tree"])
def kernel(request):
    """As on this kernel, on 5.2..5.11 (no mount_setattr), before 5.2 (no
    open_tree, fsopen or mount_setattr): the shim's fallbacks mount onto the
    walked fd through /proc/self/fd."""
    from starter._native import lib

    toggle = {"no-mount-setattr": "shim_test_no_mount_setattr",
              "no-open-tree": "shim_test_no_open_tree"}.get(request.param)
    if toggle:
        getattr(lib, toggle)(1)
    yield request.param
    if toggle:
        getattr(lib, toggle)(0)


def _spawn(mounts, script):
    from conftest import spawn_output

    status, out = spawn_output(["/bin/sh", "-c", script], uid=NOBODY, gid=NOBODY, mounts=mounts)
    return status, out.decode()


def test_every_kernel_path_mounts_onto_the_walked_destination(kernel, home, src):
    from starter.isolate.mounts import Mount

    os.mkdir(os.path.join(home, "real"))
    f = os.path.join(src, "covered-by-the-job")
    mounts = (Mount("bind", f"{home}/real", src), Mount("ro-bind", "/tmp/a/file", f),
              Mount("tmpfs", "/tmp/t", None, "size=1m,mode=700"))
    status, out = _spawn(mounts, f"cat {home}/real/covered-by-the-job /tmp/a/file; "
                                 "echo x > /tmp/a/file 2>/dev/null || echo READONLY; "
                                 "grep -E ' /tmp/(t|a/file) | /var/lib/' /proc/self/mountinfo")
    assert status == 0, (kernel, out)
    lines = out.splitlines()
    assert lines[:3] == ["mine", "mine", "READONLY"], (kernel, out)
    bind_line = next(l for l in lines if f" {home}/real " in l)
    assert "master:" in bind_line.split(" - ")[0] or "shared:" not in bind_line, (kernel, bind_line)
    tmpfs_line = next(l for l in lines if " /tmp/t " in l)
    assert "nosuid" in tmpfs_line and "size=1024k" in tmpfs_line and "mode=700" in tmpfs_line, (kernel, tmpfs_line)


@pytest.mark.parametrize("kind", ["bind", "ro-bind", "tmpfs"])
def test_every_kernel_path_refuses_a_link(kernel, home, src, kind):
    from starter.errors import SpawnError
    from starter.isolate.mounts import Mount

    os.symlink("/usr", os.path.join(home, "usr"))
    m = Mount("tmpfs", f"{home}/usr/bin") if kind == "tmpfs" else Mount(kind, f"{home}/usr/bin", src)
    with pytest.raises(SpawnError) as e:
        _spawn((m,), "true")
    assert str(e.value).startswith(f"mount destination {home}/usr/bin: {home}/usr is a symlink (not followed)")
    assert e.value.exit_code == 125
