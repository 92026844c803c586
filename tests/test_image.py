"""The node's image cache (starter image import|ls|rm|gc, starter/image/):
real squashfs files made by mksquashfs and SIF files around them; the
kernel mounts what the cache stores; every bad input is one line, exit 125,
and leaves nothing in the cache.  The formats' checks on fixture bytes are
unit/test_image_formats.py's."""

import json
import os
import shutil
import subprocess
import time

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
        (IF.write(tmp_path / "text", b"hello\n" * 100), (), "is neither a squashfs, a SIF file"),
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


# ---------------------------------------------------------------- jobs in images

@pytest.fixture
def rootfs(tmp_path_factory):
    if shutil.which("mksquashfs") is None:
        pytest.fail("mksquashfs is missing: scripts/setup --test installs squashfs-tools")
    d = tmp_path_factory.mktemp("rootfs")
    return IF.rootfs(d / "tree", d / "root.sqfs")


def run_in(cache, *args, **kw):
    env = dict(os.environ, STARTER_IMAGE_CACHE=cache)
    return subprocess.run([STARTER, "run", *args], capture_output=True, text=True, timeout=120, env=env, **kw)


def host_mounts():
    with open("/proc/self/mountinfo") as f:
        return [l for l in f if " - squashfs " in l or " - overlay " in l]


def loops_of(path):
    return subprocess.run(["losetup", "-j", path], capture_output=True, text=True).stdout.splitlines()


def test_a_job_runs_in_its_image_and_leaves_it_as_it_was(cache, rootfs, tmp_path):
    """--image: the image's files, nothing of the host's file systems in
    the job's view, the digest in the report; what a job writes (into the
    image's /opt) is gone for the next job; the same through a SIF file and
    by digest; nothing mounted on the host or left bound after."""
    before = host_mounts()
    report = tmp_path / "r.json"
    r = run_in(cache, "--report", str(report), "--image", rootfs, "--", "sh", "-c",
               "cat /etc/os-release; ls /; cat /proc/self/mountinfo; echo kept > /opt/mine && cat /opt/mine; id -u")
    assert r.returncode == 0, r.stderr
    assert 'PRETTY_NAME="Starter Test Image"' in r.stdout and "kept" in r.stdout, r.stdout
    listing = r.stdout.split("\n")
    assert "work" not in listing and "root" not in listing, r.stdout       # the host's top directories
    mountinfo = [l for l in r.stdout.splitlines() if " - " in l]
    assert mountinfo[0].split()[4] == "/" and " - overlay " in mountinfo[0], mountinfo
    host_root = next(l for l in open("/proc/1/mountinfo") if l.split()[4] == "/").split(" - ")[1].split()[1]
    assert not [l for l in mountinfo if l.split(" - ")[1].split()[1] == host_root], mountinfo
    with open(report) as f:
        image = json.load(f)["image"]
    # the metrics name a running job's image
    job = subprocess.Popen([STARTER, "run", "--id", "img-metrics", "--image", image["digest"], "--", "sleep", "30"],
                           env=dict(os.environ, STARTER_IMAGE_CACHE=cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        from conftest import wait_running

        wait_running(os.environ["STARTER_STATE_DIR"], "img-metrics", job)
        m = subprocess.run([STARTER, "metrics"], capture_output=True, text=True, timeout=60).stdout
        assert any(l.startswith("starter_job_image_info{") and 'job_id="img-metrics"' in l and image["digest"] in l
                   and l.endswith(" 1") for l in m.splitlines()), m
    finally:
        job.terminate()
        job.wait(timeout=60)
    assert image["digest"].startswith("sha256:") and len(image["digest"]) == 71
    # the next job: the image as it was; by digest; through a SIF file
    with open(rootfs, "rb") as f:
        sif = IF.write(tmp_path / "root.sif", IF.sif([(f.read(), 1, 2)]))
    for ref in (image["digest"], sif):
        r = run_in(cache, "--image", ref, "--image-digest", image["digest"], "--", "ls", "/opt")
        assert r.returncode == 0 and r.stdout == "", (ref, r.stdout, r.stderr)
    # a pinned digest the image does not have refuses the job, from a job file too
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"image": sif, "image_digest": "sha256:" + "0" * 64, "command": ["true"]}))
    for args in (["--image", sif, "--image-digest", "sha256:" + "0" * 64, "--", "true"], ["--job", str(job), "--", "true"]):
        r = run_in(cache, *args)
        assert r.returncode == 125 and "not the sha256:" + "0" * 64 in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert host_mounts() == before and loops_of(os.path.join(cache, "sha256-" + image["digest"][7:] + ".sqfs")) == []


def test_twenty_jobs_share_one_image(cache, rootfs, state_root):
    """Twenty jobs on one image at once: one cache entry, one loop device
    (one squashfs, one page cache), nothing of it after."""
    before = host_mounts()
    digest = json.loads(image(cache, "import", rootfs, "--json").stdout)["digest"]
    path = os.path.join(cache, "sha256-" + digest[7:] + ".sqfs")
    env = dict(os.environ, STARTER_IMAGE_CACHE=cache)
    procs = [subprocess.Popen([STARTER, "run", "--image", digest, "--", "sh", "-c", "cat /etc/os-release; sleep 3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(20)]
    try:
        seen = set()
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            seen.update(l.split(":")[0] for l in loops_of(path))
            time.sleep(0.2)
    finally:
        outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 and "Starter Test Image" in o for p, (o, _e) in zip(procs, outs)), outs
    assert len(seen) == 1, seen
    assert [e for e in os.listdir(cache) if e.endswith(".sqfs")] == [os.path.basename(path)]
    assert loops_of(path) == [] and host_mounts() == before


def test_kill_9_of_a_starter_in_an_image_and_gc_leave_nothing(cache, rootfs, state_root):
    before = host_mounts()
    env = dict(os.environ, STARTER_IMAGE_CACHE=cache)
    p = subprocess.Popen([STARTER, "run", "--id", "img-k9", "--image", rootfs, "--", "sleep", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    from conftest import wait_running

    wait_running(state_root, "img-k9", p)
    digest = json.loads(image(cache, "ls", "--json").stdout)[0]["digest"]
    path = os.path.join(cache, "sha256-" + digest[7:] + ".sqfs")
    assert len(loops_of(path)) == 1
    p.kill()
    p.wait()
    r = subprocess.run([STARTER, "gc"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while loops_of(path) and time.monotonic() < deadline:     # (the kernel detaches it once the job's gone)
        time.sleep(0.1)
    assert loops_of(path) == [] and host_mounts() == before


def test_bad_images_at_the_start_are_one_line_and_leave_nothing(cache, tmp_path, state_root):
    before = host_mounts()
    half = IF.write(tmp_path / "half.sqfs", b"hsqs" + b"\0" * 200)
    cases = [(half, "is squashfs 0.0"), (str(tmp_path / "none.sqfs"), "No such file"),
             ("sha256:" + "ab" * 32, "is not in the cache"), ("sha256:xyz", "is not an image digest")]
    for ref, what in cases:
        r = run_in(cache, "--image", ref, "--", "true")
        assert r.returncode == 125 and r.stderr.count("\n") == 1 and what in r.stderr, (ref, r.stderr)
        assert leftovers(cache) == [], ref
    from starter.state import store

    assert store.list_ids(state_root) == [] and host_mounts() == before


def test_a_jobs_writes_in_its_image_count_in_its_disk(cache, rootfs, tmp_path):
    """With a scratch, what the job writes into its image (its overlay's
    upper directory, in the scratch) counts in --disk: 50 MB into the
    image's /opt stop at --disk 20M; the scratch goes at the end."""
    exe = tmp_path / "execute"
    exe.mkdir(mode=0o755)
    report = tmp_path / "r.json"
    r = run_in(cache, "--execute-dir", str(exe), "--disk", "20M", "--report", str(report), "--image", rootfs, "--",
               "sh", "-c", 'dd if=/dev/zero of=/opt/big bs=1M count=50; echo "dd $?"; ls -a "$PWD"')
    assert r.returncode == 0 and "dd 1" in r.stdout and "No space left on device" in r.stderr, (r.stdout, r.stderr)
    assert ".image" in r.stdout.split()           # (root's, 0700: the job's writes reach it through / only)
    with open(report) as f:
        assert json.load(f)["disk"]["full"] is True
    assert os.listdir(exe) in ([], [".starter-images"])
    assert run_in(cache, "--image", rootfs, "--", "ls", "/opt").stdout == ""


def test_a_caller_runs_the_images_the_policy_allows(cache, rootfs, home, policy, tmp_path):
    """A caller that is not root: --image of a file under [callers] images
    (read with its rights) or of a listed digest; anything else refused."""
    import shutil as sh

    from conftest import caller_argv

    mine = os.path.join(home, "root.sqfs")
    sh.copy(rootfs, mine)
    os.chmod(mine, 0o644)
    digest = json.loads(image(cache, "import", rootfs, "--json").stdout)["digest"]
    policy(f'[callers]\nallow = true\nimages = ["{home}", "{digest}"]\n', defaults=f'image_cache = "{cache}"')
    env = dict(os.environ, STARTER_IMAGE_CACHE=cache)
    env.pop("STARTER_STATE_DIR", None)

    def caller(*args):
        # (the cache comes from root's environment only: a caller's is emptied)
        return subprocess.run(caller_argv("run", *args), capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in env.items() if not k.startswith("STARTER_")})
    for ref in (mine, digest):
        r = caller("--image", ref, "--", "sh", "-c", "cat /etc/os-release; id -u")
        assert r.returncode == 0 and "Starter Test Image" in r.stdout and r.stdout.split()[-1] == str(UID), \
            (ref, r.stdout, r.stderr)
    for ref in (rootfs, "sha256:" + "ab" * 32):
        r = caller("--image", ref, "--", "true")
        assert r.returncode == 125 and "callers.images" in r.stderr and r.stderr.count("\n") == 1, (ref, r.stderr)
    # An OCI layout of its own, every file opened with its rights: one it
    # may not read (a blob of root's, 0600) refuses the image.
    tree = os.path.join(os.path.dirname(rootfs), "tree")
    layout = IF.oci_layout(os.path.join(home, "layout"), [IF.layer([(".", "tree", tree)]),
                                                          IF.layer([("etc/os-release", "file", b"PRETTY_NAME=\"Users\"\n")])])
    r = caller("--image", layout, "--", "cat", "/etc/os-release")
    assert r.returncode == 0 and "Users" in r.stdout, r.stderr
    blobs = os.path.join(layout, "blobs", "sha256")
    for b in os.listdir(blobs):
        os.chmod(os.path.join(blobs, b), 0o600)
    r = caller("--image", layout, "--", "true")
    assert r.returncode == 125 and "Permission denied" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = caller("--image-cache", str(tmp_path), "--image", mine, "--", "true")
    assert r.returncode == 125 and "only root sets it" in r.stderr, r.stderr
    assert len([e for e in os.listdir(cache) if e.endswith(".sqfs")]) == 2 and not os.path.exists(
        "/var/lib/starter/images")


def test_netd_keeps_an_image_warm_between_jobs_and_lets_go(cache, rootfs, tmp_path):
    """Where netd runs, a job hands it the image's squashfs: after the job,
    the image stays mounted (on no path: its loop device stays bound) for
    the next one; netd's end lets go of it."""
    sd = str(tmp_path / "state")
    os.makedirs(sd, mode=0o700)
    env = dict(os.environ, STARTER_IMAGE_CACHE=cache, STARTER_STATE_DIR=sd)
    netd = subprocess.Popen([STARTER, "netd", "--state-dir", sd], env=env)
    try:
        from conftest import wait_for

        wait_for(lambda: os.path.exists(os.path.join(sd, "netd.sock")), "netd's socket")
        before = host_mounts()
        r = run_in(cache, "--state-dir", sd, "--image", rootfs, "--", "cat", "/etc/os-release")
        assert r.returncode == 0 and "Starter Test Image" in r.stdout, r.stderr
        path = os.path.join(cache, [e for e in os.listdir(cache) if e.endswith(".sqfs")][0])
        assert len(loops_of(path)) == 1 and host_mounts() == before      # held, mounted nowhere
    finally:
        netd.terminate()
        netd.wait(timeout=30)
    wait_for(lambda: loops_of(path) == [], "the image's loop device to go")


# ---------------------------------------------------------------- OCI images

@pytest.fixture
def base_layer(rootfs, tmp_path_factory):
    """A layer of the test root file system's tree (rootfs's)."""
    tree = os.path.join(os.path.dirname(rootfs), "tree")
    return IF.layer([(".", "tree", tree)])


def test_oci_layouts_and_docker_archives_are_unpacked_once_and_run(cache, base_layer, tmp_path):
    """Two layers: the second replaces /etc/os-release, removes a file
    (a whiteout) and empties a directory (an opaque whiteout); the job sees
    the result.  The same through a docker-archive."""
    top = IF.layer([("etc/os-release", "file", b'PRETTY_NAME="From OCI"\n'), ("bin/.wh.ls", "file", b""),
                    ("opt/.wh..wh..opq", "file", b""), ("opt/new", "file", b"fresh\n"),
                    ("lib/link-abs", "symlink", "/etc/os-release")])
    layout = IF.oci_layout(tmp_path / "layout", [base_layer, top])
    r = image(cache, "import", layout, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["format"] == "oci" and got["answer"] == "stored"
    r = run_in(cache, "--image", got["digest"], "--", "sh", "-c",
               "cat /etc/os-release /lib/link-abs /opt/new; test -e /bin/ls || echo no-ls; test -e /opt/x || echo no-x")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('PRETTY_NAME="From OCI"') == 2 and "fresh" in r.stdout and "no-ls" in r.stdout, r.stdout
    import gzip

    archive = IF.docker_archive(tmp_path / "image.tar", [gzip.decompress(base_layer), gzip.decompress(top)])
    r = run_in(cache, "--image", archive, "--", "cat", "/opt/new")
    assert r.returncode == 0 and r.stdout == "fresh\n", r.stderr
    formats = sorted(e["format"] for e in json.loads(image(cache, "ls", "--json").stdout))
    assert formats == ["oci"]         # the same file system both ways: one image
    assert leftovers(cache) == []


def test_hostile_oci_images_are_refused_in_one_line_with_nothing_left(cache, base_layer, tmp_path):
    f = ("etc/x", "file", b"x")
    cases = [
        (dict(layers=[base_layer], drop_blob=0), "has no blob"),
        (dict(layers=[base_layer], corrupt_blob=0), "does not have its digest"),
        (dict(layers=[IF.layer([("../escape", "file", b"x")])]), "climbs out"),
        (dict(layers=[IF.layer([("/abs", "file", b"x")])]), "climbs out"),
        (dict(layers=[IF.layer([("dev/null", "chr", None)])]), "device node"),
        (dict(layers=[IF.layer([("evil", "symlink", "/etc"), f]), IF.layer([("evil/passwd", "file", b"x")])]),
         "through a symlink to outside"),
        (dict(layers=[IF.layer([("evil", "hardlink", "../../etc/passwd")])]), "climbs out"),
        (dict(layers=[b"not a tar at all" * 10]), "not a tar archive"),
    ]
    for i, (kw, what) in enumerate(cases):
        layout = IF.oci_layout(tmp_path / f"bad{i}", **kw)
        r = image(cache, "import", layout)
        assert r.returncode == 125 and r.stderr.count("\n") == 1 and what in r.stderr, (i, r.stderr)
        assert leftovers(cache) == [] and image(cache, "ls").stdout == "", i
    assert not os.path.exists("/etc/passwd.x") and not os.path.exists(tmp_path / "escape")
