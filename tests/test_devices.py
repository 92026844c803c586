"""Devices by assignment only (issue 25): a job gets a minimal /dev and its
own devpts, may open only the nodes it was given (--device, --gpus), and
the kernel enforces that through the job's cgroup (a BPF device program on
cgroup2, the v1 devices controller on v1): a node reached by another path
is refused (EPERM) too.

Fake GPUs: character nodes of major 195 (NVIDIA's) made in a directory of
the test's own under /tmp; with no driver, an open the cgroup lets through
fails ENXIO (the kernel found no driver), one it refuses EPERM.  On a GPU
host (scripts/gpu-check runs this file there) a fake 195:0 that the cgroup
lets through reaches the real driver: the open succeeds.  A fake
/dev/nvidiaN is made (and removed) only where the host has no NVIDIA driver.
"""

import json
import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from conftest import SLOWDOWN, STARTER, caller_argv

MINIMAL = {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
           "urandom", "zero"}

# Opens each path given, read-write (or as the mode after '@'), and prints
# "PATH ERRNO-NAME" or "PATH ok".
OPEN = r"""
import errno, os, sys
for arg in sys.argv[1:]:
    path, _, mode = arg.partition("@")
    flags = {"r": os.O_RDONLY, "w": os.O_WRONLY}.get(mode, os.O_RDWR)
    try:
        os.close(os.open(path, flags | os.O_NONBLOCK))
        print(path, "ok")
    except OSError as e:
        print(path, errno.errorcode[e.errno])
"""


def _through():
    """What an open of char 195:0 that the cgroup lets through gives: ENXIO
    with no driver, "ok" where the NVIDIA driver serves minor 0."""
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        from starter.isolate import devices

        if any(minor == 0 for _, _, minor in devices.nvidia_gpus()):
            return "ok"
    return "ENXIO"


THROUGH = _through()


def opened(p):
    """{path: "ok" | errno name} from OPEN's output."""
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    return dict(line.rsplit(" ", 1) for line in p.stdout.splitlines() if line.startswith("/"))


def _dev_ok_dir():
    """Where device nodes can be opened: /tmp, unless it is mounted nodev
    (a tmpfs /tmp on Debian 13), then /var/tmp (both private in the job:
    binds at the same path land in its own copy)."""
    for d in ("/tmp", "/var/tmp"):
        if not os.statvfs(d).f_flag & os.ST_NODEV:
            return d
    pytest.skip("/tmp and /var/tmp are both mounted nodev: no place for fake device nodes")


@pytest.fixture
def fake():
    """A directory of the test's own with fake device nodes: nvidia0 and
    nvidia1 (char 195:0, 195:1) and blk0 (block 195:0), all 0666."""
    d = tempfile.mkdtemp(prefix="starter-fakegpu-", dir=_dev_ok_dir())
    os.chmod(d, 0o755)
    try:
        os.mknod(os.path.join(d, "nvidia0"), stat.S_IFCHR | 0o666, os.makedev(195, 0))
        os.mknod(os.path.join(d, "nvidia1"), stat.S_IFCHR | 0o666, os.makedev(195, 1))
        os.mknod(os.path.join(d, "blk0"), stat.S_IFBLK | 0o666, os.makedev(195, 0))
        for n in ("nvidia0", "nvidia1", "blk0"):
            os.chmod(os.path.join(d, n), 0o666)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_default_dev_is_minimal(starter):
    p = starter("run", "--", "sh", "-c", "ls -A /dev; echo --; ls -A /dev/pts; echo --; readlink /dev/ptmx /dev/fd; "
                "test -e /dev/kmsg || echo no-kmsg; test -e /dev/loop0 || echo no-loop0; "
                "test -e /dev/fuse || echo no-fuse; echo hi > /dev/null && echo null-ok; "
                "touch /dev/x 2>/dev/null || echo ro", check=0)
    listing, pts, rest = p.stdout.split("--\n")
    want = MINIMAL | ({"mqueue"} if os.path.ismount("/dev/mqueue") else set())
    assert set(listing.split()) == want, listing
    assert pts.split() == ["ptmx"]                  # a devpts of its own: none of the host's ptys
    assert rest.split() == ["pts/ptmx", "/proc/self/fd", "no-kmsg", "no-loop0", "no-fuse", "null-ok", "ro"]


def test_minimal_dev_works_for_root_and_userns_root(starter):
    for args in (["--user", "root"], ["--userns-root"]):
        p = starter("run", *args, "--", "python3", "-c",
                    "import os, pty; a, b = pty.openpty(); print(os.ttyname(b)); "
                    "print(len(open('/dev/urandom', 'rb').read(8))); open('/dev/full', 'w')", check=0)
        assert p.stdout.split() == ["/dev/pts/0", "8"], (args, p.stdout)


def test_ptys_are_the_jobs_own_and_bounded(tmp_path):
    """A job opening ptys until it fails gets the policy's defaults.ptys
    (its devpts' max=), and the host still opens one meanwhile."""
    pol = tmp_path / "starter.toml"     # a root caller's own policy file: /etc/starter's is shared
    pol.write_text("[defaults]\nptys = 40\n")
    code = ("import os, sys\nfds = []\n"
            "while True:\n"
            "    try: fds.append(os.openpty())\n"
            "    except OSError as e:\n"
            "        err = e.strerror\n"
            "        break\n"
            "print(len(fds), err, flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([STARTER, "run", "--", "python3", "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, STARTER_POLICY=str(pol)))
    try:
        line = proc.stdout.readline()
        assert line.split()[0] == "40", (line, proc.stderr.read() if not line else "")
        a, b = os.openpty()                 # the host's own devpts is untouched
        os.close(a)
        os.close(b)
    finally:
        proc.stdin.close()
        assert proc.wait(30 * SLOWDOWN) == 0


def test_unassigned_device_is_refused_by_any_path(starter, fake):
    nv0, nv1, blk = (os.path.join(fake, n) for n in ("nvidia0", "nvidia1", "blk0"))
    # An admin's bind of the node, or of its directory: the files are there, the kernel refuses.
    got = opened(starter("run", "--bind", nv0, "--bind", f"{fake}:/tmp/elsewhere", "--",
                         "python3", "-c", OPEN, nv0, "/tmp/elsewhere/nvidia0", "/tmp/elsewhere/blk0"))
    assert got == {nv0: "EPERM", "/tmp/elsewhere/nvidia0": "EPERM", "/tmp/elsewhere/blk0": "EPERM"}


def test_device_given_reaches_the_driver(starter, fake):
    nv0, nv1, blk = (os.path.join(fake, n) for n in ("nvidia0", "nvidia1", "blk0"))
    # THROUGH: past the cgroup (ENXIO: the kernel found no driver for 195:0).
    got = opened(starter("run", "--device", nv0, "--bind", f"{fake}:/tmp/elsewhere", "--",
                         "python3", "-c", OPEN, nv0, "/tmp/elsewhere/nvidia0", "/tmp/elsewhere/nvidia1",
                         "/tmp/elsewhere/blk0"))
    assert got == {nv0: THROUGH, "/tmp/elsewhere/nvidia0": THROUGH,   # the same node: allowed
                   "/tmp/elsewhere/nvidia1": "EPERM",                   # another minor
                   "/tmp/elsewhere/blk0": "EPERM"}                      # a block device of the same numbers
    # Access: r only; and a block device given is allowed as one.
    got = opened(starter("run", "--device", f"{nv0}:r", "--device", blk, "--",
                         "python3", "-c", OPEN, f"{nv0}@r", f"{nv0}@w", blk))
    assert got == {nv0: "EPERM", blk: "ENXIO"}       # the last open of nv0 (write) wins the key
    got = opened(starter("run", "--device", f"{nv0}:r", "--", "python3", "-c", OPEN, f"{nv0}@r"))
    assert got == {nv0: THROUGH}


def test_device_from_job_file(starter, fake, tmp_path):
    nv0 = os.path.join(fake, "nvidia0")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["python3", "-c", OPEN, nv0], "devices": [nv0 + ":rw"]}))
    assert opened(starter("run", "--job", str(job))) == {nv0: THROUGH}


@pytest.mark.parametrize("args, words", [
    (["--device", "/etc/passwd"], ["not a device node"]),
    (["--device", "/nonexistent/dev"], ["does not exist"]),
    (["--device", "/dev/null:rx"], ["access", "r, w and m"]),
    (["--gpus", "GPU-0000"], ["GPU"]),
    (["--gpus", "x"], ["not a GPU index"]),
])
def test_device_options_refused(starter, args, words):
    p = starter("run", *args, "--", "true")
    assert p.returncode == 125, p
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and all(w in line for w in words), line


def test_no_mknod(starter, fake):
    """Neither a uid-0 job (no CAP_MKNOD) nor a --userns-root one (a user
    namespace's root may not mknod) makes a node; were one made, the cgroup
    would still refuse to open it."""
    code = "import os, stat\ntry:\n    os.mknod('/tmp/n', stat.S_IFCHR | 0o666, os.makedev(1, 11))\n" \
           "    print('made')\nexcept OSError as e:\n    print(e.errno)\n"
    for args in (["--user", "root"], ["--userns-root"]):
        p = starter("run", *args, "--", "python3", "-c", code, check=0)
        assert p.stdout.strip() == "1", (args, p.stdout)       # EPERM


@pytest.fixture
def fake_dev_gpu():
    """/dev/nvidia0 as a fake node where the host has no NVIDIA driver (so
    --gpus 0 finds it by the /dev/nvidiaN fallback); removed after."""
    if os.path.exists("/proc/driver/nvidia") or os.path.lexists("/dev/nvidia0"):
        pytest.skip("the host has an NVIDIA driver or /dev/nvidia0: scripts/gpu-check tests real GPUs")
    path = "/dev/nvidia0"
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    try:
        os.chmod(path, 0o666)
        yield path
    finally:
        os.unlink(path)


def test_gpus_by_index(starter, fake_dev_gpu, tmp_path):
    report = tmp_path / "r.json"
    p = starter("run", "--gpus", "0", "--report", str(report), "--", "sh", "-c",
                f"echo $CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia; "
                f"python3 -c '{OPEN}' /dev/nvidia0", check=0)
    lines = p.stdout.splitlines()
    assert lines[:3] == ["0 0", "nvidia0", "/dev/nvidia0 ENXIO"], p.stdout
    r = json.loads(report.read_text())
    # No driver here: NVML cannot start; the job ran all the same.
    assert r["gpu"] is None and r["gpu_error"], r
    assert r["exit_code"] == 0
    # Without --gpus: no node, and a bind of it is refused.
    p = starter("run", "--bind", fake_dev_gpu, "--", "python3", "-c", OPEN, "/dev/nvidia0")
    assert opened(p) == {"/dev/nvidia0": "EPERM"}
    p = starter("run", "--", "sh", "-c", "ls /dev | grep -c nvidia", check=1)


def test_gpu_lookup_by_uuid(tmp_path):
    """Index (PCI bus order, nvidia-smi's) and UUID -> the device minor, from
    the driver's /proc files; the environment names the job's GPUs."""
    from starter.isolate import devices as D

    proc = tmp_path / "gpus"
    for bus, minor, uuid in (("0000:3b:00.0", 1, "GPU-bbbb"), ("0000:1a:00.0", 3, "GPU-aaaa")):
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(
            f"Model: \t\t NVIDIA Fake\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
    assert D.nvidia_gpus(str(proc)) == [(0, "GPU-aaaa", 3), (1, "GPU-bbbb", 1)]
    gpus = D.parse_gpus("gpus", "GPU-bbbb,0", str(proc))
    assert gpus == ((1, "GPU-bbbb", 1), (0, "GPU-aaaa", 3))
    assert D.gpu_env(gpus) == {"CUDA_VISIBLE_DEVICES": "0,1", "NVIDIA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa"}
    assert D.parse_gpus("gpus", [1], str(proc)) == ((1, "GPU-bbbb", 1),)
    assert D.parse_gpus("gpus", "all", str(proc)) == ((0, "GPU-aaaa", 3), (1, "GPU-bbbb", 1))
    from starter.errors import SpecError

    with pytest.raises(SpecError, match="no GPU"):
        D.parse_gpus("gpus", "2", str(proc))


def test_rules_and_access_parsing():
    from starter.isolate import devices as D, mounts as M

    assert D.split_access("d", "/dev/x") == ("/dev/x", "rw")
    assert D.split_access("d", "/dev/x:mr") == ("/dev/x", "rm")
    assert D.split_access("d", "/a:b/x") == ("/a:b/x", "rw")
    rules = M.dev_rules([("/dev/x", "c", 195, 0, "rw"), ("/dev/y", "b", 7, 0, "r"), ("/z", "c", 1, 3, "rwm")])
    assert rules[:len(M.DEV_RULES)] == list(M.DEV_RULES)
    assert rules[len(M.DEV_RULES):] == [("c", 195, 0, "rw"), ("b", 7, 0, "r")]


# ---------------------------------------------------------------- callers

def as_caller(*args, cwd):
    return subprocess.run(caller_argv(*args), capture_output=True, text=True, timeout=60 * SLOWDOWN, cwd=cwd)


def test_caller_devices_by_policy_only(policy, home, fake):
    nv0, nv1 = os.path.join(fake, "nvidia0"), os.path.join(fake, "nvidia1")
    p = as_caller("run", "--device", nv0, "--", "true", cwd=home)
    assert p.returncode == 125 and "callers.devices" in p.stderr, p
    p = as_caller("run", "--gpus", "0", "--", "true", cwd=home)
    assert p.returncode == 125 and "callers.gpus" in p.stderr, p
    policy(f'[callers]\ndevices = ["{os.path.dirname(fake)}/starter-fakegpu-*/nvidia0"]\n')
    got = opened(as_caller("run", "--device", nv0, "--", "python3", "-c", OPEN, nv0, cwd=home))
    assert got == {nv0: THROUGH}
    p = as_caller("run", "--device", nv1, "--", "true", cwd=home)
    assert p.returncode == 125 and "callers.devices" in p.stderr, p
    p = as_caller("run", "--gpus", "0", "--", "true", cwd=home)
    assert p.returncode == 125 and "callers.gpus" in p.stderr, p


@pytest.fixture
def step_with_gpu0():
    """A cgroup whose device rules let only GPU 0 (195:0) of the two through,
    as Slurm's ConstrainDevices does for a step given --gres=gpu:1: the v1
    devices controller where the host has one, else a cgroup2 device program
    (attached as the starter attaches its own).  -> its cgroup.procs."""
    from starter.isolate import mounts
    from starter.cgroups import hierarchy

    layout = hierarchy.detect_layout(open("/proc/self/mountinfo").read(), open("/proc/self/cgroup").read())
    if "devices" in layout.v1:
        m, own = layout.v1["devices"], layout.own["devices"]
    else:
        m, own = layout.unified, layout.own["unified"]
    d = os.path.join(m.mount_point, own.lstrip("/"), f"starter-step-{os.getpid()}")
    os.mkdir(d)
    try:
        if "devices" in layout.v1:
            with open(os.path.join(d, "devices.deny"), "w") as f:
                f.write("c 195:1 rwm")
        else:
            from starter.cgroups.unified import UnifiedTracking

            class _Cg(UnifiedTracking):
                id = "step"

                def clone_fd(self):
                    return fd

            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _Cg.set_devices(_Cg(), list(mounts.DEV_RULES) + [("c", 195, 0, "rwm"), ("c", 195, 255, "rwm")])
            finally:
                os.close(fd)
        yield os.path.join(d, "cgroup.procs")
    finally:
        for sub in sorted((e.path for e in os.scandir(d) if e.is_dir()), reverse=True):
            os.rmdir(sub)
        os.rmdir(d)


def test_gpus_slurm_are_the_steps(fake_dev_gpus, step_with_gpu0):
    """--gpus slurm: the GPUs the starter's own cgroup may open, as the kernel
    says (the step's device rules), not as any variable says; a GPU named
    that the step was not given is refused, for root too."""
    run = [STARTER, "run", "--gpus", "slurm", "--", "sh", "-c",
           f"echo $CUDA_VISIBLE_DEVICES; ls /dev | grep nvidia; python3 -c '{OPEN}' /dev/nvidia0"]
    p = subprocess.run(["sh", "-c", f'echo $$ > {step_with_gpu0} && exec "$@"', "sh", *run],
                       capture_output=True, text=True, timeout=60 * SLOWDOWN,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "0,1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["0", "nvidia0", "/dev/nvidia0 ENXIO"], p.stdout
    p = subprocess.run(["sh", "-c", f'echo $$ > {step_with_gpu0} && exec "$@"', "sh",
                        STARTER, "run", "--gpus", "1", "--", "true"], capture_output=True, text=True,
                       timeout=60 * SLOWDOWN)
    assert p.returncode == 125 and "/dev/nvidia1" in p.stderr and "do not allow it" in p.stderr, p
    assert len(p.stderr.strip().splitlines()) == 1
    # Outside the step: both.
    p = subprocess.run(run, capture_output=True, text=True, timeout=60 * SLOWDOWN)
    assert p.stdout.splitlines()[:2] == ["0,1", "nvidia0"], p.stdout


def test_caller_gpus_slurm_needs_no_policy_key(policy, home, fake_dev_gpus):
    """A caller's --gpus slurm only passes what its step has: callers.gpus
    (for naming GPUs) is not needed; a node default of "slurm" works too."""
    p = subprocess.run(caller_argv("run", "--gpus", "slurm", "--", "sh", "-c", "ls /dev | grep -c nvidia"),
                       capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)
    assert p.returncode == 0 and p.stdout.strip() == "2", p
    policy(defaults='gpus = "slurm"\n')
    p = subprocess.run(caller_argv("run", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"),
                       capture_output=True, text=True, cwd=home, timeout=60 * SLOWDOWN)
    assert p.returncode == 0 and p.stdout.strip() == "0,1", p
