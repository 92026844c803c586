"""Checkpoint and restore of a whole job with CRIU (starter/checkpoint/criu.py, issue 26).

Where CRIU works (the v2 VM: Debian 12's kernel and CRIU 3.17), through the
real CLI: a job with a counter in memory, a file in its private /tmp, a SysV
shared memory segment and a child is dumped, ended ("checkpointed"), and
restored; everything goes on from where it was, PID 1 is still PID 1, the
exit code passes through and the report sums both segments.  Everywhere: a
restore checks the image's signature before CRIU sees a byte of it, and
refuses what a new job could not ask for; where CRIU does not work (this
host's 6.18 kernel: its vDSO check), a checkpoint is one line, exit 125,
and the job runs on.
"""

import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import SLOWDOWN, STARTER, caller_argv, wait_running

KEY = "/etc/starter/checkpoint.key"


def _criu_works():
    if not shutil.which("criu"):
        return False
    return subprocess.run(["criu", "check"], capture_output=True, timeout=60).returncode == 0


CRIU = _criu_works()


def make_key():
    """A node checkpoint key where there is none (root's, 0600)."""
    os.makedirs(os.path.dirname(KEY), 0o755, exist_ok=True)
    fd = os.open(KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)


@pytest.fixture
def key():
    """The node's checkpoint key, made for the test if there is none, and
    removed after (with /etc/starter, if the test made that too)."""
    made_dir = not os.path.isdir("/etc/starter")
    had = os.path.exists(KEY)
    if not had:
        make_key()
    yield KEY
    if not had and os.path.exists(KEY):
        os.unlink(KEY)
    if made_dir and os.path.isdir("/etc/starter") and not os.listdir("/etc/starter"):
        os.rmdir("/etc/starter")


def _one_line(p, *words):
    assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("starter"), p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def _end(*procs):
    """A test's starters killed if they still run, and what they left gc'd."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
    subprocess.run([STARTER, "gc"], capture_output=True, timeout=60)


def _fake_image(tmp_path, record=None, images=None):
    """A checkpoint directory signed with the node's key, whose images are
    not CRIU's: enough for the checks made before CRIU runs."""
    from starter.checkpoint import directory as checkpoint_dir

    d = tmp_path / "ck"
    (d / "images").mkdir(parents=True, mode=0o700)
    for name, data in (images or {"core-1.img": b"\0" * 64}).items():
        (d / "images" / name).write_bytes(data)
    rec = {"version": 1, "job_id": "x", "asked": {"command": ["true"], "user": "65534"}, "uid": 65534,
           "gid": 65534, "groups": [], "transient": False, "net": "none", "root_pid": 1, "stdio": {},
           "segments": []}
    rec.update(record or {})
    checkpoint_dir.write_signed(str(d), checkpoint_dir.node_key(), rec)
    return d


# ---------------------------------------------------------------- everywhere

def test_restore_refuses_a_changed_image(key, tmp_path):
    d = _fake_image(tmp_path)
    img = d / "images" / "core-1.img"
    img.write_bytes(b"\1" + img.read_bytes()[1:])
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "signature does not match")


def test_restore_refuses_a_changed_record(key, tmp_path):
    d = _fake_image(tmp_path)
    rec = d / "starter.json"
    rec.write_text(rec.read_text().replace('"uid": 65534', '"uid": 0'))
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "signature does not match")


def test_restore_refuses_another_nodes_key(key, tmp_path):
    d = _fake_image(tmp_path)
    sig = d / "starter.sig"
    sig.write_text(json.dumps({**json.loads(sig.read_text()), "key_id": "0" * 16}))
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "another node's checkpoint key")


def test_raw_memory_pages_are_signed_by_their_size(key, tmp_path):
    """pages-N.img is the job's memory, raw: another content of the same
    size loads (it can only change what the job's memory holds); another
    size does not.  Every other image is signed by its bytes (above)."""
    from starter.checkpoint import directory as checkpoint_dir

    d = _fake_image(tmp_path, images={"core-1.img": b"\0" * 64, "pages-1.img": b"\0" * 8192})
    pages = d / "images" / "pages-1.img"
    pages.write_bytes(b"\1" * 8192)
    checkpoint_dir.load(str(d), state_dir=str(tmp_path / "state")).close()
    pages.write_bytes(b"\1" * 8193)
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "signature does not match")


def test_a_root_restore_of_images_not_roots_alone_reads_a_private_copy(key, tmp_path):
    """Images whose directory or a file in it someone else may write (a
    checkpoint that came back through its user's hands) could be swapped
    between the digest check and CRIU's read: CRIU reads a copy of root's."""
    from starter.checkpoint import directory as checkpoint_dir

    state = str(tmp_path / "state")
    d = _fake_image(tmp_path)
    img = checkpoint_dir.load(str(d), state_dir=state)
    assert img.private is None
    img.close()
    for owned in (d / "images", d / "images" / "core-1.img"):
        os.chown(owned, 65534, 65534)
        img = checkpoint_dir.load(str(d), state_dir=state)
        private = img.private
        try:
            assert private is not None and os.listdir(private) == ["core-1.img"]
            st = os.fstat(img.images_fd)
            assert (st.st_uid, st.st_mode & 0o077) == (0, 0)
        finally:
            img.close()
        assert not os.path.exists(private)
        os.chown(owned, 0, 0)


def test_an_image_file_with_other_links_is_refused(key, tmp_path):
    """A hard link could be to a file the restorer may read and the job may
    not (the pages and the scratch's archive are signed by size only)."""
    d = _fake_image(tmp_path, images={"core-1.img": b"\0" * 64, "pages-1.img": b"\0" * 4096})
    os.link(d / "images" / "pages-1.img", tmp_path / "elsewhere")
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "images/pages-1.img has other links")


def test_images_that_do_not_fit_the_private_copy_are_refused_before_a_byte_is_copied(key, tmp_path):
    from starter.checkpoint import directory as checkpoint_dir

    d = _fake_image(tmp_path, images={"core-1.img": b"\0" * 64, "pages-1.img": b"\0" * (256 << 10)})
    os.chown(d / "images", 65534, 65534)        # not root's alone: a copy is made
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "starter-test", str(state)], check=True)
    try:
        with pytest.raises(checkpoint_dir.ImageError, match="do not fit in the state directory"):
            checkpoint_dir.load(str(d), state_dir=str(state))
        assert os.listdir(state) == []
    finally:
        subprocess.run(["umount", str(state)], check=True)


def test_restore_refuses_links_and_more_than_the_job_asked(key, tmp_path):
    d = _fake_image(tmp_path)
    # options beyond where the report goes: the job keeps what it had
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d), "--memory", "1G"], capture_output=True,
                             text=True, timeout=60), "--memory cannot be given with --restore")
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d), "--", "id"], capture_output=True, text=True,
                             timeout=60), "takes no command")
    # a link in the images is refused (the digests are of regular files only)
    os.symlink("/etc/shadow", d / "images" / "x.img")
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "symbolic link")


@pytest.fixture
def caller_dir():
    """A directory of the test caller's own (pytest's are root's 0700)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="starter-ck-caller-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _chown_tree(d, uid):
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, uid)
    os.lchown(d, uid, uid)


def test_restore_by_a_caller_that_is_not_root(key, policy, caller_dir):
    """Only its own job's checkpoint, read with its rights and copied to a
    private place before anything is checked; the copy is gone after."""
    from pathlib import Path

    from conftest import UID

    policy()
    theirs = _fake_image(Path(caller_dir) / "theirs", {"uid": 1234, "asked": {"command": ["true"], "user": "1234"}})
    mine = _fake_image(Path(caller_dir) / "mine")
    _chown_tree(caller_dir, UID)
    run = lambda d: subprocess.run(caller_argv("run", "--restore", str(d)), capture_output=True, text=True,  # noqa: E731
                                   timeout=60, cwd="/")
    _one_line(run(theirs), "restores only its own")
    img = mine / "images" / "core-1.img"
    good = img.read_bytes()
    img.write_bytes(b"\1" + good[1:])
    _one_line(run(mine), "signature does not match")
    img.write_bytes(good)
    p = run(mine)       # its own, whole: on to the restore (which fake images or this layout then end)
    _one_line(p)
    assert "signature" not in p.stderr and "own" not in p.stderr, p.stderr
    os.chmod(mine / "starter.json", 0o600)          # what the caller cannot read, root does not read for it
    os.lchown(mine / "starter.json", 0, 0)
    _one_line(run(mine), "starter.json")


def checkpoint_and_end(job_id, ck, job, report):
    """`starter checkpoint JOB --to ck`: the job's starter (`job`) then ends
    it, 137, its report's reason "checkpointed" -> that report."""
    p = subprocess.run([STARTER, "checkpoint", job_id, "--to", str(ck)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert job.wait(timeout=60) == 137, job.stderr.read()
    r = json.loads(report.read_text())
    assert r["reason"] == "checkpointed", r
    return r


def _hybrid():
    return os.path.isdir("/sys/fs/cgroup/unified")


@pytest.mark.skipif(not _hybrid(), reason="on pure v2 and v1 a restore goes on to CRIU (test_checkpoint_and_restore)")
def test_restore_onto_a_layout_it_does_not_support(key, tmp_path):
    d = _fake_image(tmp_path)
    _one_line(subprocess.run([STARTER, "run", "--restore", str(d)], capture_output=True, text=True, timeout=60),
              "pure cgroup v2 or v1")


@pytest.mark.skipif(CRIU, reason="CRIU works here: test_checkpoint_and_restore covers it")
def test_checkpoint_where_criu_fails_is_one_line_and_the_job_runs_on(tmp_path):
    job = subprocess.Popen([STARTER, "run", "--id", "ck-fail", "--grace", "1", "--", "sleep", "300"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_running(os.environ["STARTER_STATE_DIR"], "ck-fail", job, timeout=20)
        p = subprocess.run([STARTER, "checkpoint", "ck-fail", "--to", str(tmp_path / "ck")], capture_output=True,
                           text=True, timeout=120)
        _one_line(p, "ck-fail")
        assert "criu" in p.stderr
        assert not (tmp_path / "ck").exists()
        assert job.poll() is None           # it runs on, and the vacate still works
        subprocess.run([STARTER, "vacate", "ck-fail"], check=True, capture_output=True, timeout=30)
        assert job.wait(timeout=60 * SLOWDOWN) in (137, 143)
    finally:
        _end(job)


# ---------------------------------------------------------------- where CRIU works

JOB = r"""
i=0
ipcmk -M 4096 >/dev/null
sleep 1000 & child=$!
while [ $i -lt 40 ]; do
  i=$((i+1)); echo $i >> /tmp/cnt; echo "tick $i"; sleep 0.2
done
echo "view $(cut -d: -f3 /proc/self/cgroup | sort -u | tr '\n' ' ')$(ls -R /sys/fs/cgroup | grep -c -e starter -e init.scope)"
echo "done $i $(wc -l < /tmp/cnt) $(ipcs -m | grep -c 0x) $$ $(kill -0 $child && echo child)"
exit 7
"""


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
def test_checkpoint_and_restore(key, tmp_path):
    ck = tmp_path / "ck"
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    job = subprocess.Popen([STARTER, "run", "--id", "ck1", "--user", "65534", "--report", str(r1), "--",
                            "sh", "-c", JOB], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    restored = None
    try:
        before = []
        for line in job.stdout:
            before.append(line)
            if line.strip() == "tick 5":
                break
        checkpoint_and_end("ck1", ck, job, r1)
        before += job.stdout.read().splitlines()    # up to the image: the dump left it stopped, then the kill
        assert not [x for x in before if x.startswith("done")]
        last = max(int(x.split()[1]) for x in before if x.startswith("tick "))
        restored = subprocess.Popen([STARTER, "run", "--restore", str(ck), "--report", str(r2)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        out, err = restored.communicate(timeout=300)
        assert restored.returncode == 7, (out, err)
        ticks = [int(x.split()[1]) for x in out.splitlines() if x.startswith("tick ")]
        assert ticks == list(range(last + 1, 41)), (last, out)     # from exactly where the image was
        # its own cgroup, as the job saw it before (not the node's hierarchy)
        assert out.strip().splitlines()[-2] == "view / 0", out
        done = out.strip().splitlines()[-1].split()
        # the counter, the file in its /tmp, the shm segment, PID 1, the child
        assert done == ["done", "40", "40", "1", "1", "child"], out
        rep = json.loads(r2.read_text())
        assert rep["reason"] == "exited" and rep["exit_code"] == 7, rep
        assert len(rep["segments"]) == 2
        assert rep["total"]["wall_s"] == pytest.approx(sum(s["wall_s"] for s in rep["segments"]), abs=1e-3)
        assert rep["total"]["wall_s"] > rep["wall_s"]
    finally:
        _end(job, restored)


# A job in its scratch (its cwd): a file it holds open for appending, a
# sparse file and a subdirectory; it waits for a line on stdin (the dump
# comes then), appends through the fd it held, and shows what it finds.
SCRATCH_JOB = r"""
exec 3>>log
echo one >&3
mkdir -p sub && echo inner > sub/file
truncate -s 1G sparse
echo ready
read x
echo two >&3
echo "found $(cat log | tr '\n' ' ')$(cat sub/file) $(stat -c %s sparse) $(du -k sparse | cut -f1) $(pwd)"
"""


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
def test_a_jobs_scratch_goes_with_its_checkpoint(key, tmp_path):
    """The scratch is archived with the images (by tar, with the job's own
    ids, the tree stopped) and unpacked into the restored job's new scratch
    before CRIU runs: the file it held open goes on, a sparse file stays
    sparse, and what it left there is removed at its end as usual."""
    # root's, 0755, and outside the job's private /tmp and /var/tmp
    ck, execute = tmp_path / "ck", f"/var/lib/starter-test-ck-{os.getpid()}"
    os.mkdir(execute, 0o755)
    scratch = os.path.join(execute, "job-ck5")
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    job = subprocess.Popen([STARTER, "run", "--id", "ck5", "--user", "65534", "--execute-dir", execute, "--report",
                            str(r1), "--", "sh", "-c", SCRATCH_JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    restored = None
    try:
        assert job.stdout.readline().strip() == "ready", job.stderr.read() if job.poll() is not None else ""
        checkpoint_and_end("ck5", ck, job, r1)
        assert not os.path.exists(scratch)          # its starter removed it, as at any end
        assert os.path.getsize(ck / "images" / "scratch.tar") < 1 << 20     # the sparse GiB is not in it
        restored = subprocess.Popen([STARTER, "run", "--restore", str(ck), "--report", str(r2)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = restored.communicate("go\n", timeout=300)
        assert restored.returncode == 0, (out, err)
        found = out.split()
        assert found[:5] == ["found", "one", "two", "inner", str(1 << 30)], out
        assert int(found[5]) < 1024 and found[6] == scratch, out
        assert not os.path.exists(scratch)
    finally:
        _end(job, restored)
        subprocess.run(["rm", "-rf", "--one-file-system", execute], check=False)


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
def test_vacate_with_a_checkpoint_then_restore(key, tmp_path):
    ck = tmp_path / "vk"
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    job = subprocess.Popen([STARTER, "run", "--id", "ck2", "--user", "65534", "--report", str(r1),
                            "--on-vacate", f"checkpoint:{ck}", "--grace", "120", "--", "sh", "-c", JOB],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    restored = None
    try:
        for line in job.stdout:
            if line.strip() == "tick 3":
                break
        subprocess.run([STARTER, "vacate", "ck2"], check=True, capture_output=True, timeout=30)
        assert job.wait(timeout=300) == 137, job.stderr.read()
        r = json.loads(r1.read_text())
        assert r["reason"] == "checkpointed" and r["checkpoint"] == str(ck), r
        restored = subprocess.run([STARTER, "run", "--restore", str(ck), "--report", str(r2)],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        assert restored.returncode == 7, restored.stderr
        assert restored.stdout.strip().splitlines()[-1].split() == ["done", "40", "40", "1", "1", "child"]
        assert len(json.loads(r2.read_text())["segments"]) == 2
    finally:
        _end(job)


@pytest.mark.skipif(CRIU, reason="CRIU works here: test_vacate_with_a_checkpoint_then_restore covers it")
def test_vacate_whose_checkpoint_fails_vacates(tmp_path):
    r = tmp_path / "r.json"
    p = subprocess.Popen([STARTER, "run", "--report", str(r), "--on-vacate", f"checkpoint:{tmp_path}/ck",
                          "--grace", "5", "--", "sh", "-c", "trap 'exit 3' TERM; echo up; while :; do sleep 0.1; done"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "up\n"
    p.terminate()
    out, err = p.communicate(timeout=60 * SLOWDOWN)
    assert p.returncode == 3, err
    rep = json.loads(r.read_text())
    assert rep["reason"] == "vacated" and "criu" in rep["checkpoint_error"], rep
    assert "vacating without a checkpoint" in err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.new").exists()


def test_on_vacate_refuses_what_cannot_be_checkpointed(tmp_path):
    for args, words in ((["--net", "host"], "--net host"),
                        (["--scratch", str(tmp_path / "s"), "--disk", "10M"], "--disk"),
                        (["--checkpoint-every", "10"], None)):
        extra = [] if args[0] == "--checkpoint-every" else ["--on-vacate", f"checkpoint:{tmp_path}/ck"]
        p = subprocess.run([STARTER, "run", *extra, *args, "--", "true"], capture_output=True, text=True, timeout=60)
        _one_line(p, words or "needs --on-vacate")


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
def test_periodic_checkpoints_outlive_a_crash(key, tmp_path):
    """--checkpoint-every: the starter is killed (-9, the node's daemon gone
    mad) while it dumps every few seconds; the last whole image restores."""
    ck = tmp_path / "pk"
    job = subprocess.Popen([STARTER, "run", "--id", "ck3", "--user", "65534", "--on-vacate", f"checkpoint:{ck}",
                            "--checkpoint-every", "3", "--", "sh", "-c", JOB],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck / "starter.sig").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not (ck / "starter.sig").exists():
            job.kill()
            pytest.fail(f"no periodic checkpoint within 120 s: {job.communicate()[1]}")
        job.kill()              # the starter itself; its job dies with it (PR_SET_PDEATHSIG)
        job.wait()
        subprocess.run([STARTER, "gc"], capture_output=True, timeout=120)
        p = subprocess.run([STARTER, "run", "--restore", str(ck)], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 7, p.stderr
        assert p.stdout.strip().splitlines()[-1].split() == ["done", "40", "40", "1", "1", "child"], p.stdout
    finally:
        _end(job)


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
def test_a_caller_restores_its_own_checkpoint(key, policy, caller_dir):
    from conftest import UID

    policy()
    ck = os.path.join(caller_dir, "ck")
    job = subprocess.Popen([STARTER, "run", "--id", "ck4", "--user", str(UID), "--", "sh", "-c", JOB],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.strip() == "tick 3":
                break
        subprocess.run([STARTER, "checkpoint", "ck4", "--to", ck], check=True, capture_output=True, timeout=300)
        job.wait(timeout=60)
        _chown_tree(caller_dir, UID)      # the batch system hands the user its checkpoint
        p = subprocess.run(caller_argv("run", "--restore", ck), stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=300, cwd="/")
        assert p.returncode == 7, p.stderr
        assert p.stdout.strip().splitlines()[-1].split() == ["done", "40", "40", "1", "1", "child"], p.stdout
    finally:
        _end(job)
