"""--disk by project quota (starter/storage/quota.py): on an execute directory whose
file system enforces project quotas, the scratch gets a project id and a
limit, no image; the job cannot move its files out of the project; the
report says when it was full; nothing is left, after the job and after a
crash and `starter gc` (the limit cleared, the id's lease given back).

These need a kernel with a quota format (Debian 12's, in the test VMs).
This host's kernel has none: here they skip, and test_disk.py covers the
image that runs instead.  Each test gets an ext4 file system of its own
(`-O quota,project`, mounted `prjquota` on a loop device)."""

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import STARTER, wait_running  # noqa: E402
from starter.storage import quota
from starter.callers import uids  # noqa: E402
from starter.state import store as S  # noqa: E402

MB = 1 << 20


@pytest.fixture
def prj_dir():
    """An execute directory on a fresh ext4 with project quotas enforced."""
    if not os.path.exists("/dev/loop-control"):
        subprocess.run(["modprobe", "loop"], capture_output=True)
    top = tempfile.mkdtemp(prefix="starter-prj-", dir="/var/lib")
    os.chmod(top, 0o755)        # the job's uid walks through it to its scratch
    img, mnt = os.path.join(top, "fs.img"), os.path.join(top, "mnt")
    os.mkdir(mnt)
    mounted = False
    try:
        subprocess.run(["truncate", "-s", "256M", img], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "quota,project", "-E", "quotatype=prjquota", img],
                       check=True, capture_output=True)
        m = subprocess.run(["mount", "-o", "loop,prjquota", img, mnt], capture_output=True, text=True)
        if m.returncode != 0:
            pytest.skip(f"this kernel mounts no ext4 with project quotas: {' '.join(m.stderr.split())}")
        mounted = True
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            why = quota.why_not(fd, "default")
        finally:
            os.close(fd)
        if why is not None:
            pytest.skip(f"no project quotas the job cannot step out of here: {why}")
        ex = os.path.join(mnt, "execute")
        os.mkdir(ex)
        os.chmod(ex, 0o755)
        yield ex
    finally:
        if mounted:
            subprocess.run(["umount", mnt], check=True)
        subprocess.run(["rm", "-rf", top], check=True)


def _report(path):
    with open(path) as f:
        return json.load(f)


def _fs_of(ex):
    return os.path.dirname(ex)


def _project(ex, qid):
    fd = os.open(_fs_of(ex), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return quota.get(fd, qid)
    finally:
        os.close(fd)


def test_a_full_quota_stops_the_job_and_the_report_says_so(starter, prj_dir, tmp_path, state_dir):
    """dd stops at 20 MB with EDQUOT; no image, no mount; the report's disk
    object says full, backend project-quota; the limit is cleared and the
    lease given back after; a second job on the same file system writes 50 MB."""
    rep = str(tmp_path / "r.json")
    p = starter("run", "--id", "q1", "--disk", "20M", "--execute-dir", prj_dir, "--report", rep, "--",
                "sh", "-c", "dd if=/dev/zero of=fill bs=1M 2>&1; echo dd=$?; stat -c %s fill", check=0)
    out = p.stdout.splitlines()
    assert "Disk quota exceeded" in p.stdout and "dd=1" in out, p.stdout
    written = int(out[-1])
    assert 19 * MB <= written <= 20 * MB, written
    d = _report(rep)["disk"]
    assert d["backend"] == "project-quota" and d["limit_bytes"] == 20 * MB and d["full"] is True, d
    assert abs(d["used_bytes"] - written) < MB, (d, written)
    assert written <= _report(rep)["scratch_bytes"] < written + MB     # counted once
    assert not os.path.exists(os.path.join(prj_dir, ".starter-images"))
    assert not any(_project(prj_dir, d["project"])[:6]), "the project's limit and usage are gone"
    assert uids.holder(d["project"], quota.PROJECTS) is None

    p = starter("run", "--id", "q2", "--execute-dir", prj_dir, "--report", rep, "--",
                "sh", "-c", "dd if=/dev/zero of=big bs=1M count=50 2>/dev/null && stat -c %s big", check=0)
    assert int(p.stdout) == 50 * MB


def test_the_job_cannot_move_its_files_out_of_the_project(starter, prj_dir, tmp_path):
    """FS_IOC_FSSETXATTR (a new project id) and FS_IOC_SETFLAGS (clearing
    PROJINHERIT) from the job: EPERM, the 32-bit command in a 64-bit register
    with high bits set too; the file keeps the job's id."""
    code = (
        "import fcntl, os, struct\n"
        "fd = os.open('f', os.O_WRONLY | os.O_CREAT, 0o600)\n"
        "x = bytearray(28); fcntl.ioctl(fd, 0x801C581F, x); mine = struct.unpack_from('I', x, 12)[0]\n"
        "x[12:16] = struct.pack('I', 0)\n"
        "for cmd in (0x401C5820, 0x401C5820 | (1 << 40), 0x40086602, 0x40046602):\n"
        "    try:\n"
        "        fcntl.ioctl(fd, cmd, x if cmd & 0xFFFFFFFF == 0x401C5820 else bytearray(8))\n"
        "        print('changed', hex(cmd))\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "y = bytearray(28); fcntl.ioctl(fd, 0x801C581F, y); print('id', mine, struct.unpack_from('I', y, 12)[0])\n"
    )
    rep = str(tmp_path / "r.json")
    p = starter("run", "--disk", "20M", "--execute-dir", prj_dir, "--report", rep, "--",
                "python3", "-c", code, check=0)
    lines = p.stdout.splitlines()
    assert lines[:4] == ["refused 1"] * 4, p.stdout
    qid = _report(rep)["disk"]["project"]
    assert lines[4] == f"id {qid} {qid}", p.stdout


def test_a_jobs_other_seccomp_gets_the_image(starter, prj_dir, tmp_path):
    """--seccomp off could step out of a quota: that job gets the image."""
    rep = str(tmp_path / "r.json")
    starter("run", "--disk", "20M", "--seccomp", "off", "--execute-dir", prj_dir, "--report", rep, "--",
            "true", check=0)
    assert _report(rep)["disk"]["backend"] == "image"


def test_kill9_of_a_quota_jobs_starter_then_gc_clears_it(starter, prj_dir, state_dir):
    proc = subprocess.Popen([STARTER, "run", "--id", "qcrash", "--disk", "20M", "--execute-dir", prj_dir,
                             "--", "sh", "-c", "dd if=/dev/zero of=f bs=1M count=5 2>/dev/null; sleep 300"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    qid = wait_running(state_dir, "qcrash", proc)["disk_project"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert _project(prj_dir, qid)[0] >= 20 * 1024, "the limit is still set"
    g = starter("gc", "--state-dir", state_dir, timeout=120)
    assert g.returncode == 0 and f"disk project {qid}: limits cleared" in g.stdout, (g.stdout, g.stderr)
    assert not any(_project(prj_dir, qid)[:6]) and uids.holder(qid, quota.PROJECTS) is None
    assert not os.path.exists(os.path.join(prj_dir, "job-qcrash"))


@pytest.mark.parametrize("step", S.QUOTA_FAULT_STEPS)
def test_starter_killed_or_failing_at_every_quota_step_then_gc_leaves_nothing(starter, prj_dir, state_dir, step):
    job_id = f"qfault-{step}"
    teardown = step.startswith("teardown-")
    p = starter("run", "--id", job_id, "--disk", "20M", "--execute-dir", prj_dir, "--", "true",
                env=dict(os.environ, STARTER_FAULT=step + (":fail" if teardown else "")))
    assert p.returncode == (0 if teardown else -9), (step, p.returncode, p.stderr)
    g = starter("gc", "--state-dir", state_dir, timeout=120)
    assert g.returncode == 0, (g.stdout, g.stderr)
    assert job_id not in S.list_ids(state_dir), g.stdout
    assert uids.leases(state_dir, quota.PROJECTS) == {}, g.stdout
    assert not os.path.exists(os.path.join(prj_dir, f"job-{job_id}")), g.stdout


# ---------------------------------------------------------------- everywhere

SAME_XATTR = (
    "import fcntl, os\n"
    "fd = os.open('f', os.O_WRONLY | os.O_CREAT, 0o600)\n"
    "x = bytearray(28); fcntl.ioctl(fd, 0x801C581F, x)\n"
    "for cmd, arg in ((0x401C5820, x), (0x401C5820 | (1 << 40), x), (0x40086602, bytearray(8))):\n"
    "    if cmd == 0x40086602: fcntl.ioctl(fd, 0x80086601, arg)\n"
    "    try:\n"
    "        fcntl.ioctl(fd, cmd, arg); print('set')\n"
    "    except OSError as e:\n"
    "        print('refused', e.errno)\n"
)


@pytest.mark.parametrize("seccomp, said", [("default", ["refused 1"] * 3), ("off", ["set"] * 3)])
def test_the_default_filter_refuses_setting_a_files_project_attributes(starter, execute_dir, seccomp, said):
    """Setting a file's own attributes back unchanged (FS_IOC_FSSETXATTR, also
    with high bits above the 32-bit command; FS_IOC_SETFLAGS): EPERM from the
    default filter, on any file system; reading them still works.  Without
    the filter the same calls succeed (the control)."""
    p = starter("run", "--seccomp", seccomp, "--execute-dir", execute_dir, "--", "python3", "-c", SAME_XATTR,
                check=0)
    assert p.stdout.splitlines() == said, (p.stdout, p.stderr)


def test_gc_gives_back_a_project_lease_no_entry_recorded(starter, state_dir):
    """A starter killed between leasing a project id and recording it: no
    limit was set; gc gives the lease back (a recorded one is its entry's)."""
    import subprocess
    import sys

    # Leased by a process that then dies, as the killed starter did.
    qid = int(subprocess.run([sys.executable, "-c", "from starter.callers import uids\nfrom starter.storage import quota\n"
                              f"print(uids.lease(quota.PROJECTS, {state_dir!r}, 'ghost', quota.FIRST, "
                              "quota.FIRST + quota.COUNT - 1, lambda n: True))"],
                             capture_output=True, text=True, check=True).stdout)
    g = starter("gc", "--state-dir", state_dir, check=0)
    assert f"disk project {qid} (job ghost): lease given back" in g.stdout, g.stdout
    assert uids.holder(qid, quota.PROJECTS) is None
