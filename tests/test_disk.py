"""--disk SIZE / --disk-inodes N (starter/storage/disk.py): the job's scratch is a
file system of its own size (a per-job ext4 image on a loop device, mounted
on the scratch), so the kernel stops its writes there; the report says when
it was full; nothing is left: not after the job, not after a crash and
`starter gc`, not after a start that could not make the image.

Every test goes through the real `starter` command.  The leak check
(conftest.py) covers mounts and loop devices backed by a .starter-images/
file; _left() below looks at everything of one job."""

import json
import os
import select
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import SLOWDOWN, STARTER, caller_argv, process_alive, wait_running  # noqa: E402
from starter.state import store as S  # noqa: E402

MB = 1 << 20
KILL_STEPS = tuple(s for s in S.DISK_FAULT_STEPS if not s.startswith("teardown-"))
TEARDOWN_STEPS = tuple(s[len("teardown-"):] for s in S.DISK_FAULT_STEPS if s.startswith("teardown-"))


@pytest.fixture(autouse=True, scope="module")
def loop_devices():
    """The images need loop devices: where the loop module is not loaded yet
    (the test VMs boot without udev), load it; skip where there is none."""
    if not os.path.exists("/dev/loop-control"):
        subprocess.run(["modprobe", "loop"], capture_output=True)
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("no loop devices (/dev/loop-control) and `modprobe loop` did not make them")


def _report(path):
    with open(path) as f:
        return json.load(f)


def _mounted_under(d):
    with open("/proc/self/mountinfo") as f:
        return [l.split()[4] for l in f if l.split()[4].startswith(d + "/")]


def _loops_under(d):
    out = []
    for n in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{n}/loop/backing_file") as f:
                backing = f.read().strip()
        except OSError:
            continue
        if backing.startswith(d + "/"):
            out.append(f"/dev/{n} {backing}")
    return out


def _left(state_dir, ex, job_id):
    """Everything of job_id still on the node (empty: nothing)."""
    left = _mounted_under(ex) + _loops_under(ex)
    if os.path.exists(os.path.join(ex, f"job-{job_id}")):
        left.append(os.path.join(ex, f"job-{job_id}"))
    images = os.path.join(ex, ".starter-images")
    if os.path.isdir(images):
        left += [os.path.join(images, n) for n in os.listdir(images)]
    if os.path.isdir(state_dir):
        left += [os.path.join(state_dir, n) for n in os.listdir(state_dir) if n.startswith(job_id + ".")]
    return left


def _one_line(p):
    assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("starter: "), p.stderr
    return lines[0]


# ---------------------------------------------------------------- the limit

def test_a_full_disk_stops_the_job_at_its_size_and_the_report_says_so(starter, execute_dir, tmp_path, state_dir):
    """dd until it fails: it stops at about 20 MB (ext4's metadata takes a
    little), with ENOSPC; the report's disk object says full, with the bytes
    used.  A second job on the same file system, without --disk, writes 50 MB."""
    rep = str(tmp_path / "r.json")
    p = starter("run", "--id", "full1", "--disk", "20M", "--execute-dir", execute_dir, "--report", rep, "--",
                "sh", "-c", "df -P . | tail -1; dd if=/dev/zero of=fill bs=1M 2>&1; echo dd=$?; "
                "stat -c %s fill", check=0)
    out = p.stdout.splitlines()
    assert out[0].split()[0].startswith("/dev/loop"), p.stdout      # the scratch is its own file system
    assert "No space left on device" in p.stdout and "dd=1" in out, p.stdout
    written = int(out[-1])
    assert 17 * MB <= written <= 20 * MB, written
    d = _report(rep)["disk"]
    assert d["limit_bytes"] == 20 * MB and d["full"] is True and d["inodes_full"] is False, d
    assert abs(d["used_bytes"] - written) < MB, (d, written)
    assert _report(rep)["scratch_bytes"] >= written
    assert _left(state_dir, execute_dir, "full1") == []

    p = starter("run", "--id", "free1", "--execute-dir", execute_dir, "--report", rep, "--",
                "sh", "-c", "dd if=/dev/zero of=big bs=1M count=50 2>/dev/null && stat -c %s big", check=0)
    assert int(p.stdout) == 50 * MB
    r = _report(rep)
    assert "disk" not in r and r["scratch_bytes"] >= 50 * MB, r


def test_a_job_that_stays_below_its_disk_is_not_full(starter, execute_dir, tmp_path):
    rep = str(tmp_path / "r.json")
    starter("run", "--disk", "64M", "--execute-dir", execute_dir, "--report", rep, "--",
            "sh", "-c", "dd if=/dev/zero of=f bs=1M count=8 2>/dev/null; sync", check=0)
    d = _report(rep)["disk"]
    assert d["full"] is False and 8 * MB <= d["used_bytes"] < 9 * MB, d


def test_the_inode_limit_stops_new_files_and_the_report_says_so(starter, execute_dir, tmp_path):
    """--disk-inodes 100: mkfs rounds up to a whole inode table block, so at
    least 100 and a few more files, then ENOSPC; the report says inodes_full."""
    rep = str(tmp_path / "r.json")
    p = starter("run", "--disk", "20M", "--disk-inodes", "100", "--execute-dir", execute_dir, "--report", rep,
                "--", "sh", "-c", "i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; echo $i; "
                "touch last 2>&1; true", check=0)
    made = int(p.stdout.splitlines()[0])
    assert 100 <= made <= 140 and "No space left on device" in p.stdout, p.stdout
    d = _report(rep)["disk"]
    assert d["inodes_full"] is True and d["full"] is False and d["inodes_used"] == made == d["inodes_limit"], d


def test_the_job_sees_an_empty_scratch_of_its_own(starter, execute_dir):
    """The image's root is the job's, 0700, no lost+found; mounted nosuid,nodev."""
    p = starter("run", "--user", "nobody", "--disk", "8M", "--execute-dir", execute_dir, "--",
                "sh", "-c", "stat -c '%U %a' .; ls -A | wc -l; grep \" $PWD \" /proc/self/mounts", check=0)
    lines = p.stdout.splitlines()
    assert lines[:2] == ["nobody 700", "0"], p.stdout
    opts = lines[2].split()[3].split(",")
    assert lines[2].split()[2] == "ext4" and "nosuid" in opts and "nodev" in opts, lines[2]


def test_disk_from_a_job_file(starter, execute_dir, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["sh", "-c", "df -P . | tail -1"], "execute_dir": execute_dir,
                               "limits": {"disk": "10M", "disk_inodes": 64}}))
    rep = str(tmp_path / "r.json")
    starter("run", "--job", str(job), "--report", rep, check=0)
    d = _report(rep)["disk"]
    assert d["limit_bytes"] == 10 * MB and 64 <= d["inodes_limit"] < 100, d


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("args, words", [
    (["--disk", "20M"], ["--disk", "scratch", "--execute-dir"]),
    (["--disk-inodes", "100", "--scratch", "/var/lib/starter-nope"], ["disk-inodes", "--disk"]),
    (["--disk", "100K", "--scratch", "/var/lib/starter-nope"], ["disk", "1M"]),
    (["--disk", "20M", "--scratch", "/var/lib/starter-nope", "--keep-scratch"], ["keep-scratch", "--disk"]),
    (["--disk", "1M", "--disk-inodes", "100000", "--scratch", "/var/lib/starter-nope"], ["inodes"]),
])
def test_disk_without_a_scratch_and_other_misuse_refused_in_one_line(starter, args, words):
    line = _one_line(starter("run", *args, "--", "true"))
    for w in words:
        assert w in line, (w, line)
    assert not os.path.exists("/var/lib/starter-nope")


def test_no_mkfs_the_job_does_not_start_and_nothing_is_left(starter, execute_dir, state_dir):
    """Fail closed: a --disk job whose image cannot be made does not run."""
    p = starter("run", "--id", "nomkfs", "--disk", "20M", "--execute-dir", execute_dir, "--",
                "sh", "-c", "echo ran", env=dict(os.environ, STARTER_MKFS="/nonexistent/mkfs.ext4"))
    line = _one_line(p)
    assert "mkfs.ext4" in line and "e2fsprogs" in line and p.stdout == "", line
    assert _left(state_dir, execute_dir, "nomkfs") == []


def test_mkfs_failing_the_job_does_not_start_and_nothing_is_left(starter, execute_dir, state_dir, tmp_path):
    fake = tmp_path / "mkfs.ext4"
    fake.write_text("#!/bin/sh\necho 'mkfs.ext4: could not allocate inode table' >&2\nexit 1\n")
    fake.chmod(0o755)
    p = starter("run", "--id", "badmkfs", "--disk", "20M", "--execute-dir", execute_dir, "--",
                "sh", "-c", "echo ran", env=dict(os.environ, STARTER_MKFS=str(fake)))
    assert "could not allocate inode table" in _one_line(p) and p.stdout == ""
    assert _left(state_dir, execute_dir, "badmkfs") == []


def test_an_images_directory_not_roots_is_refused(starter, execute_dir, state_dir):
    os.mkdir(os.path.join(execute_dir, ".starter-images"), 0o755)
    line = _one_line(starter("run", "--id", "baddir", "--disk", "20M", "--execute-dir", execute_dir, "--", "true"))
    assert ".starter-images must be root's, mode 0700" in line, line
    os.rmdir(os.path.join(execute_dir, ".starter-images"))
    assert _left(state_dir, execute_dir, "baddir") == []


# ---------------------------------------------------------------- crashes and gc

def test_kill9_of_a_running_disk_jobs_starter_then_gc_leaves_nothing(execute_dir, state_dir, starter):
    proc = subprocess.Popen([STARTER, "run", "--id", "crashd", "--disk", "20M", "--execute-dir", execute_dir,
                             "--", "sh", "-c", "dd if=/dev/zero of=f bs=1M count=5 2>/dev/null; sleep 300"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    st = wait_running(state_dir, "crashd", proc)
    assert _mounted_under(execute_dir) and _loops_under(execute_dir)
    pidfd = os.pidfd_open(st["pid"])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        died = select.select([pidfd], [], [], 2.0 * SLOWDOWN)[0]
    finally:
        os.close(pidfd)
        proc.stderr.close()
    assert died and not process_alive(st["pid"])
    # What the crash left: the mount, its loop device, the image, the scratch.
    assert _mounted_under(execute_dir) and _loops_under(execute_dir)
    g = starter("gc", "--state-dir", state_dir, timeout=120)
    assert g.returncode == 0, (g.stdout, g.stderr)
    for said in ("disk image unmounted", "detached", "disk image", "removed", "state entry removed"):
        assert said in g.stdout, g.stdout
    assert _left(state_dir, execute_dir, "crashd") == [], g.stdout


@pytest.mark.parametrize("step", KILL_STEPS)
def test_starter_killed_at_every_disk_step_then_gc_leaves_nothing(execute_dir, state_dir, starter, step):
    job_id = f"dfault-{step}"
    p = starter("run", "--id", job_id, "--disk", "20M", "--execute-dir", execute_dir, "--", "true",
                env=dict(os.environ, STARTER_FAULT=step))
    assert p.returncode == -9, (step, p.returncode, p.stderr)
    g = starter("gc", "--state-dir", state_dir, timeout=120)
    assert g.returncode == 0, (g.stdout, g.stderr)
    assert _left(state_dir, execute_dir, job_id) == [], g.stdout


@pytest.mark.parametrize("step", TEARDOWN_STEPS)
def test_a_failed_disk_teardown_step_keeps_the_entry_until_gc(execute_dir, state_dir, starter, step):
    job_id = f"dtd-{step}"
    p = starter("run", "--id", job_id, "--disk", "20M", "--execute-dir", execute_dir, "--", "true",
                env=dict(os.environ, STARTER_FAULT=f"teardown-{step}:fail"))
    assert p.returncode == 0 and f"teardown {step} failed" in p.stderr, p.stderr
    st = S.load(state_dir, job_id)
    assert st["state"] == "reclaiming" and any("planted fault" in h for h in st["held"]), st
    g = starter("gc", "--state-dir", state_dir, timeout=120)
    assert g.returncode == 0 and f"job {job_id}: state entry removed" in g.stdout, (g.stdout, g.stderr)
    assert _left(state_dir, execute_dir, job_id) == [], g.stdout


def test_gc_leaves_an_image_that_is_not_the_jobs_alone(execute_dir, state_dir, starter):
    """An entry (of a dead starter) naming an image the starter did not make
    for it: gc removes nothing and says so."""
    images = os.path.join(execute_dir, ".starter-images")
    os.mkdir(images, 0o700)
    planted = os.path.join(images, "job-plant.img")
    open(planted, "w").close()
    p = starter("run", "--id", "plant", "--disk", "20M", "--execute-dir", execute_dir, "--", "true",
                env=dict(os.environ, STARTER_FAULT="scratch-create"))
    assert p.returncode == -9
    # The dead starter's entry now (falsely) records that image.
    st = S.load(state_dir, "plant")
    st.update(disk_image=planted)
    S.write_atomic(os.path.join(state_dir, "plant.json"), S.dumps(st))
    g = starter("gc", "--state-dir", state_dir)
    assert g.returncode != 0 and "not the one the starter made" in g.stdout, g.stdout
    assert os.path.exists(planted)
    os.unlink(planted)
    g = starter("gc", "--state-dir", state_dir, check=0)
    assert _left(state_dir, execute_dir, "plant") == [], g.stdout


# ---------------------------------------------------------------- the node policy

def test_policy_default_disk_for_jobs_with_a_scratch(policy, starter, execute_dir, tmp_path):
    """defaults.disk applies to a job with a scratch, not to one without."""
    policy(defaults='disk = "16M"\ndisk_inodes = 200\n')
    rep = str(tmp_path / "r.json")
    starter("run", "--execute-dir", execute_dir, "--report", rep, "--", "true", check=0)
    d = _report(rep)["disk"]
    assert d["limit_bytes"] == 16 * MB and 200 <= d["inodes_limit"] < 300, d
    starter("run", "--report", rep, "--", "true", check=0)
    assert "disk" not in _report(rep)


def test_a_caller_gets_max_disk_and_may_not_ask_for_more(policy, home, execute_dir):
    policy(f'[callers]\nexecute_dirs = ["{execute_dir}"]\nmax_disk = "12M"\n')

    def as_caller(*args):
        return subprocess.run(caller_argv("run", *args), capture_output=True, text=True, cwd=home,
                              timeout=60 * SLOWDOWN)

    p = as_caller("--execute-dir", execute_dir, "--", "sh", "-c", "df -P -k . | tail -1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0].startswith("/dev/loop") and 11000 < int(p.stdout.split()[1]) <= 12288, p.stdout
    p = as_caller("--execute-dir", execute_dir, "--disk", "8M", "--", "true")
    assert p.returncode == 0, p.stderr
    line = _one_line(as_caller("--execute-dir", execute_dir, "--disk", "1G", "--", "true"))
    assert "callers.max_disk" in line, line
    # Without a scratch there is nothing to limit: max_disk is not forced on it.
    p = as_caller("--", "true")
    assert p.returncode == 0, p.stderr


def test_verified_inputs_are_staged_into_the_image(starter, execute_dir, tmp_path):
    """--manifest with --disk: the inputs land in the image (what the job sees),
    not in the directory under the mount."""
    import hashlib

    inputs = tmp_path / "in"
    inputs.mkdir()
    script = inputs / "run.sh"
    script.write_text("#!/bin/sh\ndf -P . | tail -1\nls\n")
    sig = inputs / "sig.sha256"
    sig.write_text(f"{hashlib.sha256(script.read_bytes()).hexdigest()} xrun.sh\n")
    digest = hashlib.sha256(sig.read_bytes()).hexdigest()
    p = starter("run", "--disk", "8M", "--execute-dir", execute_dir, "--manifest", str(sig),
                "--manifest-digest", digest, "--inputs", str(inputs), "--", "./run.sh", check=0)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("/dev/loop") and lines[1:] == ["run.sh"], p.stdout
