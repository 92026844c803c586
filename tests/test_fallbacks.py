"""The kernel-fallback matrix: every combination of the shim's test toggles
(native/shim.h), each as on a kernel without that syscall, and a job started
through each must start, mount and close fds as on a new kernel.

  clone3        shim_test_no_clone3: clone() instead of clone3 (before 5.3)
  close_range   shim_test_no_close_range: one close() per fd (before 5.9)
  mounts        new: open_tree + mount_setattr; no-mount-setattr: 5.2..5.11
                (read-only and slave by remount through /proc/self/fd);
                no-open-tree: before 5.2 (no open_tree, fsopen or
                mount_setattr: binds by path, checked against the starter's fd)

All 2 x 2 x 3 combinations: the toggles are independent code paths, and a
real kernel may lack any subset (a backported or seccomp-filtered syscall).
In-process through ns.spawn (conftest.spawn_output), as nobody.  The job
checks, in one run: it is PID 1; a bind is the source and writable, a
read-only bind of a file (in that tmpfs) refuses a write, a tmpfs has its options and
nosuid; the fds the starter holds open without CLOEXEC (one just under the
soft RLIMIT_NOFILE, the fallback loop's edge) are closed and a keep fd is
open; its exit code comes back.
"""

import os
import resource
import shutil
import tempfile

import pytest

from conftest import spawn_output
from starter.isolate import ns
from starter._native import lib
from starter.isolate.mounts import Mount

NOBODY = 65534
MOUNTS = {"new": (), "no-mount-setattr": ("shim_test_no_mount_setattr",),
          "no-open-tree": ("shim_test_no_open_tree",)}


@pytest.fixture(params=[(c3, cr, m) for c3 in ("clone3", "no-clone3") for cr in ("close_range", "no-close_range")
                        for m in MOUNTS], ids=lambda p: "-".join(p))
def kernel(request):
    clone3, close_range, mounts = request.param
    toggles = list(MOUNTS[mounts])
    if clone3 == "no-clone3":
        toggles.append("shim_test_no_clone3")
    if close_range == "no-close_range":
        toggles.append("shim_test_no_close_range")
    for t in toggles:
        getattr(lib, t)(1)
    try:
        yield request.param
    finally:
        for t in toggles:
            getattr(lib, t)(0)


@pytest.fixture
def tree():
    """A host directory the job's user owns (outside the private /tmp) with
    a bind source directory and a file for a read-only bind."""
    d = tempfile.mkdtemp(prefix="starter-test-fallback-", dir="/run")
    os.chmod(d, 0o755)
    os.makedirs(os.path.join(d, "src"))
    os.makedirs(os.path.join(d, "dst"))
    with open(os.path.join(d, "src", "marker"), "w") as f:
        f.write("mine\n")
    with open(os.path.join(d, "file"), "w") as f:
        f.write("read-only\n")
    for p in (d, os.path.join(d, "src"), os.path.join(d, "dst"), os.path.join(d, "src", "marker")):
        os.chown(p, NOBODY, NOBODY)
    os.chmod(os.path.join(d, "file"), 0o666)   # writable but for the mount
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def leaked_fds():
    """Inheritable fds the job must not get: one low, one at the top of the
    soft RLIMIT_NOFILE; and one to keep."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = min(soft, 65536) - 1
    base = os.open("/dev/null", os.O_RDONLY)
    fds = []
    try:
        for want in (top, 300):
            fds.append(os.dup2(base, want, inheritable=True))
        keep = os.dup2(base, 299, inheritable=False)
        fds.append(keep)
        yield fds[:2], keep
    finally:
        for fd in fds + [base]:
            os.close(fd)


SCRIPT = r"""
echo "pid $$"
cat {d}/dst/marker
echo written > {d}/dst/new && echo WROTE
echo x > /tmp/t/file 2>/dev/null || echo READONLY
grep -E ' /tmp/t(/file)? ' /proc/self/mountinfo | sed 's/ - .*//' | awk '{{print $5, $6}}'
grep -E ' /tmp/t ' /proc/self/mountinfo | sed 's/.* - //'
for fd in {leaked}; do [ -e /proc/self/fd/$fd ] && echo "LEAKED $fd"; done
[ -e /proc/self/fd/{keep} ] && echo "KEPT {keep}"
exit 7
"""


def test_every_fallback_combination_starts_mounts_and_closes_fds(kernel, tree, leaked_fds):
    leaked, keep = leaked_fds
    mounts = (Mount("bind", f"{tree}/dst", f"{tree}/src"),
              Mount("tmpfs", "/tmp/t", None, "size=1m,mode=700"),
              Mount("ro-bind", "/tmp/t/file", f"{tree}/file"))   # its mount point made in the tmpfs
    script = SCRIPT.format(d=tree, leaked=" ".join(map(str, leaked)), keep=keep)
    status, out = spawn_output(["/bin/sh", "-c", script], uid=NOBODY, gid=NOBODY, mounts=mounts,
                               keep_fds=(keep,))
    out = out.decode()
    lines = out.splitlines()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, (kernel, status, out)
    assert lines[:4] == ["pid 1", "mine", "WROTE", "READONLY"], (kernel, out)
    with open(os.path.join(tree, "src", "new")) as f:   # the bind is the source
        assert f.read() == "written\n", kernel
    with open(os.path.join(tree, "file")) as f:
        assert f.read() == "read-only\n", kernel
    opts = dict(l.split(" ", 1) for l in lines if l.startswith("/tmp/"))
    assert set(opts) == {"/tmp/t/file", "/tmp/t"}, (kernel, out)
    assert "ro" in opts["/tmp/t/file"].split(","), (kernel, out)
    assert {"rw", "nosuid", "nodev"} <= set(opts["/tmp/t"].split(",")), (kernel, out)
    tmpfs_super = next(l for l in lines if l.startswith("tmpfs "))
    assert "size=1024k" in tmpfs_super and "mode=700" in tmpfs_super, (kernel, tmpfs_super)
    assert not [l for l in lines if l.startswith("LEAKED")], (kernel, out)
    assert f"KEPT {keep}" in lines, (kernel, out)
    # The path asked for is the one taken: clone() after shim_test_no_clone3.
    assert lib.shim_clone3_supported() == (-1 if kernel[0] == "no-clone3" else 1), kernel


def test_fallbacks_with_init_and_a_failing_exec(kernel):
    """The same paths with --init (the job is PID 2; the init closes fds
    too) and with a command not found: the report still comes back (127)."""
    status, out = spawn_output(["/bin/sh", "-c", "echo $$; exit 3"], init=True)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3 and out == b"2\n", (kernel, status, out)
    with pytest.raises(ns.SpawnError) as e:
        spawn_output(["starter-no-such-command"])
    assert e.value.exit_code == 127, (kernel, e.value)
