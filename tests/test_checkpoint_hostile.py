"""A checkpoint directory in hostile hands (starter/checkpoint/directory.py,
starter/checkpoint/criu.py).

Where a dump goes: a job's user who owns a component of DIR chooses, by a
symlink, where root would make DIR (or DIR.new) and where CRIU would write
the job's memory; and what root removes as DIR.new and DIR.old.  The
directory is walked without following links, everything after is done
relative to its fds, and a removal never follows a link nor crosses a
mount.  A restore's bind of / is unmounted and checked gone before its
work directory is removed, and that removal never crosses a mount either.

What a restore copies: the signature (over the record and every image
file's size and digest) is checked before a byte is copied, and files
whose sizes are not the signed ones are refused up front, so the private
copy is bounded by the signed sizes.

CRIU does not run on this project's 6.18 host (tests/test_checkpoint.py):
the directory handling is tested directly (checkpoint_dir.Target, the
function that makes DIR.new and replaces DIR; checkpoint._end_work, the
restore's cleanup) with planted symlinks and bind mounts, and through the
real CLI where the refusal comes before CRIU.
"""

import json
import os
import subprocess

import pytest

from conftest import SLOWDOWN, STARTER, UID, caller_argv, wait_running
from test_checkpoint import _chown_tree, _end, _fake_image, _one_line, caller_dir, key  # noqa: F401

PRECIOUS = b"root's, not the job's\n"


def _victim(tmp_path, *names):
    """A directory of root's outside the job's reach, holding `names` (each a
    directory with a file in it) -> its path."""
    v = tmp_path / "victim"
    v.mkdir(mode=0o700)
    for n in names:
        (v / n).mkdir()
        (v / n / "precious").write_bytes(PRECIOUS)
    return v


def _intact(v, *names):
    for n in names:
        assert (v / n / "precious").read_bytes() == PRECIOUS, f"{v}/{n}/precious was touched"


def _users_dir(home, name="d"):
    """A directory of the job's user (nobody) in its home -> its path."""
    d = os.path.join(home, name)
    os.mkdir(d, 0o755)
    os.chown(d, UID, UID)
    return d


def _swap_for_link(d, target):
    """What the job's user can do to its own directory at any time: put a
    symlink in its place."""
    os.rename(d, d + ".moved")
    os.symlink(str(target), d)


def _mounted(path):
    return subprocess.run(["mountpoint", "-q", str(path)]).returncode == 0


def _umount_all(path):
    while _mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=True)


# ---------------------------------------------------------------- the dump's directory

def test_the_dumps_directory_is_never_made_through_a_link(tmp_path, home):
    """`starter checkpoint JOB --to DIR` where the job's user swapped a
    component of DIR for a link to a directory of root's: refused in one
    line, before CRIU; nothing made there; the job runs on."""
    victim = _victim(tmp_path)
    d = _users_dir(home)
    job = subprocess.Popen([STARTER, "run", "--id", "ckhostile-1", "--user", str(UID), "--", "sleep", "300"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_running(os.environ["STARTER_STATE_DIR"], "ckhostile-1", job, timeout=20)
        _swap_for_link(d, victim)
        p = subprocess.run([STARTER, "checkpoint", "ckhostile-1", "--to", f"{d}/ck"], capture_output=True,
                           text=True, timeout=120)
        _one_line(p, "symlink")
        assert os.listdir(victim) == []
        assert job.poll() is None
    finally:
        _end(job)


def test_replacing_dir_never_removes_through_a_link_in_its_path(tmp_path):
    """DIR.new and DIR.old are removed (and DIR renamed) relative to DIR's
    parent, opened without following links: a component swapped for a
    link is refused before anything is removed or made."""
    from starter.checkpoint import directory as checkpoint_dir
    from starter.errors import StarterError

    victim = _victim(tmp_path, "ck", "ck.new", "ck.old")
    users = tmp_path / "users"
    users.mkdir()
    (users / "d").mkdir()
    _swap_for_link(str(users / "d"), victim)
    with pytest.raises(StarterError, match="symlink"):
        t = checkpoint_dir.Target(str(users / "d" / "ck"), replace=True)
        try:
            t.commit()
        finally:
            t.close()
    _intact(victim, "ck", "ck.new", "ck.old")
    assert sorted(os.listdir(victim)) == ["ck", "ck.new", "ck.old"]


def test_replacing_dir_removes_links_never_what_they_lead_to(tmp_path):
    """DIR.new a link to a directory of root's, DIR.old a directory with
    links to others in it: the links go, what they lead to stays; the new
    directory is root's, 0700, and becomes DIR."""
    from starter.checkpoint import directory as checkpoint_dir

    victim = _victim(tmp_path, "a", "b")
    top = tmp_path / "top"
    top.mkdir()
    (top / "ck").mkdir()
    (top / "ck" / "old-image").write_bytes(b"x")
    os.symlink(victim / "a", top / "ck.new")
    (top / "ck.old").mkdir()
    os.symlink(victim / "b", top / "ck.old" / "link")
    os.symlink(victim, top / "ck.old" / "up")
    t = checkpoint_dir.Target(str(top / "ck"), replace=True)
    try:
        st = os.fstat(t.fd)
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
        os.mkdir("mine", 0o700, dir_fd=t.fd)
        t.commit()
    finally:
        t.close()
    _intact(victim, "a", "b")
    assert sorted(os.listdir(top)) == ["ck"] and os.listdir(top / "ck") == ["mine"]


@pytest.fixture
def mounts():
    """mount(src, dst, *opts) for a test; all unmounted after."""
    made = []

    def mount(src, dst, *opts):
        subprocess.run(["mount", *opts, str(src), str(dst)], check=True)
        made.append(dst)

    yield mount
    for dst in reversed(made):
        _umount_all(dst)


def test_replacing_dir_never_removes_through_a_mount(tmp_path, mounts):
    """A bind mount of a directory of the same file system (same st_dev: only
    its mount id tells) and a tmpfs inside DIR.old, and a bind mount at
    DIR.new itself: nothing below a mount point is removed; the dump is
    refused in one line naming them, and DIR (the last good image) stays."""
    from starter.checkpoint import directory as checkpoint_dir
    from starter.errors import StarterError

    victim = _victim(tmp_path, "a", "b")
    top = tmp_path / "top"
    top.mkdir()
    (top / "ck").mkdir()
    (top / "ck" / "old-image").write_bytes(b"x")
    for sub in ("bind", "tmp"):
        (top / "ck.old" / sub).mkdir(parents=True)
    mounts(victim / "a", top / "ck.old" / "bind", "--bind")
    mounts("starter-test", top / "ck.old" / "tmp", "-t", "tmpfs", "-o", "size=64k")
    (top / "ck.old" / "tmp" / "precious").write_bytes(PRECIOUS)
    with pytest.raises(StarterError, match="mount point") as e:
        t = checkpoint_dir.Target(str(top / "ck"), replace=True)
        try:
            t.commit()
        finally:
            t.close()
    assert len(str(e.value).splitlines()) == 1
    assert "ck.old/bind" in str(e.value) and "ck.old/tmp" in str(e.value)
    _intact(victim, "a")
    assert (top / "ck.old" / "tmp" / "precious").read_bytes() == PRECIOUS
    assert (top / "ck" / "old-image").read_bytes() == b"x"
    assert not (top / "ck.new").exists()

    (top / "ck.new").mkdir()
    _umount_all(top / "ck.old" / "bind")
    _umount_all(top / "ck.old" / "tmp")
    mounts(victim / "b", top / "ck.new", "--bind")
    with pytest.raises(StarterError, match="mount point"):
        checkpoint_dir.Target(str(top / "ck"), replace=True).close()
    _intact(victim, "b")


def test_replacing_dir_never_enters_a_directory_of_another_owner(tmp_path):
    """DIR.old that is the user's (it put its own there) with a directory of
    root's moved into it: the user's files go, root's directory is not
    entered, and the dump is refused naming it."""
    from starter.checkpoint import directory as checkpoint_dir
    from starter.errors import StarterError

    top = tmp_path / "top"
    top.mkdir()
    (top / "ck").mkdir()
    (top / "ck.old").mkdir()
    (top / "ck.old" / "junk").write_bytes(b"x")
    (top / "ck.old" / "roots").mkdir()
    (top / "ck.old" / "roots" / "precious").write_bytes(PRECIOUS)
    for p in (top / "ck.old", top / "ck.old" / "junk"):
        os.lchown(p, UID, UID)
    with pytest.raises(StarterError, match="ck.old/roots is a directory of uid 0's, not entered"):
        checkpoint_dir.Target(str(top / "ck"), replace=True).close()
    assert (top / "ck.old" / "roots" / "precious").read_bytes() == PRECIOUS
    assert not (top / "ck.old" / "junk").exists()


def test_a_vacate_never_removes_through_a_link_the_jobs_user_made(key, tmp_path, home):
    """--on-vacate checkpoint:DIR with DIR in the job user's directory, which
    the user swaps for a link to root's: the vacate's dump is refused (the
    report says why), the job is vacated, nothing of root's is removed."""
    victim = _victim(tmp_path, "ck", "ck.new", "ck.old")
    d = _users_dir(home)
    r = tmp_path / "r.json"
    p = subprocess.Popen([STARTER, "run", "--user", str(UID), "--report", str(r), "--on-vacate", f"checkpoint:{d}/ck",
                          "--grace", "5", "--", "sh", "-c", "trap 'exit 3' TERM; echo up; while :; do sleep 0.1; done"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "up\n"
        _swap_for_link(d, victim)
        p.terminate()
        out, err = p.communicate(timeout=60 * SLOWDOWN)
        assert p.returncode == 3, err
        rep = json.loads(r.read_text())
        assert rep["reason"] == "vacated" and "symlink" in rep["checkpoint_error"], rep
        _intact(victim, "ck", "ck.new", "ck.old")
        assert sorted(os.listdir(victim)) == ["ck", "ck.new", "ck.old"]
    finally:
        _end(p)


# ---------------------------------------------------------------- the restore's work directory

def _work(tmp_path):
    state = tmp_path / "state"
    (state / "j.restore" / "root").mkdir(parents=True)
    (state / "j.restore" / "restore.log").write_text("log\n")
    return state / "j.restore"


def test_the_restores_cleanup_never_removes_through_what_is_still_mounted(tmp_path, mounts):
    """The restore's bind at work/root: after its unmount something is still
    mounted there (two stacked binds: umount -l takes one): the work
    directory is left, and said so, never removed through the mount."""
    from starter.checkpoint import criu as checkpoint

    victim = _victim(tmp_path, "a")
    work = _work(tmp_path)
    mounts(victim, work / "root", "--bind")
    mounts(victim, work / "root", "--bind")
    left = checkpoint._end_work(str(work), True)
    _intact(victim, "a")
    assert left and "still mounted" in left and str(work) in left, left
    assert len(left.splitlines()) == 1
    assert work.is_dir()
    gc = subprocess.run([STARTER, "gc", "--state-dir", str(work.parent)], capture_output=True, text=True, timeout=60)
    assert "j.restore" in gc.stdout + gc.stderr, gc


def test_the_restores_cleanup_removes_its_work_once_unmounted_and_never_crosses_a_mount(tmp_path, mounts):
    from starter.checkpoint import criu as checkpoint

    victim = _victim(tmp_path, "a", "b")
    work = _work(tmp_path)
    mounts(victim / "a", work / "root", "--bind")
    assert checkpoint._end_work(str(work), True) is None
    assert not _mounted(work / "root") and not work.exists()
    _intact(victim, "a")
    # something else mounted in it (not at root): left, and said so
    work = _work(tmp_path)
    (work / "other").mkdir()
    mounts(victim / "b", work / "other", "--bind")
    left = checkpoint._end_work(str(work), False)
    _intact(victim, "b")
    assert left and "mount point" in left and "other" in left, left
    assert (work / "other").is_dir()


# ---------------------------------------------------------------- what a restore copies

@pytest.fixture
def ro_state(tmp_path, mounts):
    """A state directory no copy can be written to: what is refused before a
    copy never meets EROFS."""
    s = tmp_path / "ro-state"
    s.mkdir(mode=0o700)
    mounts("starter-test", s, "-t", "tmpfs", "-o", "ro,size=1m,mode=0700")
    return str(s)


def test_a_restore_refuses_what_was_not_signed_before_a_byte_is_copied(key, tmp_path, ro_state):
    """Images someone else may write (so a copy is made): a changed record,
    a file larger or smaller than signed (hashed or raw pages), a file
    that is not in the signature, one that is missing: each refused, in one
    line, before a copy is begun (the state directory is read-only here)."""
    from starter.checkpoint import directory as checkpoint_dir

    def fresh(name):
        d = _fake_image(tmp_path / name, images={"core-1.img": b"\0" * 64, "pages-1.img": b"\0" * 8192})
        os.chown(d / "images", UID, UID)        # not root's alone: a copy would be made
        return d

    def refused(d, words):
        with pytest.raises(checkpoint_dir.ImageError, match=words) as e:
            checkpoint_dir.load(str(d), state_dir=ro_state)
        assert len(str(e.value).splitlines()) == 1

    d = fresh("record")
    (d / "starter.json").write_text((d / "starter.json").read_text().replace('"uid": 65534', '"uid": 0'))
    refused(d, "signature does not match")
    d = fresh("pages")
    os.truncate(d / "images" / "pages-1.img", 1 << 20)
    refused(d, "images/pages-1.img: 1048576 bytes, signed as 8192")
    d = fresh("core")
    os.truncate(d / "images" / "core-1.img", 65)
    refused(d, "images/core-1.img: 65 bytes, signed as 64")
    d = fresh("short")
    os.truncate(d / "images" / "core-1.img", 1)
    refused(d, "signed as 64")
    d = fresh("extra")
    (d / "images" / "extra.img").write_bytes(b"\0" * 1000)
    refused(d, "images/extra.img is not in the signature")
    d = fresh("missing")
    os.unlink(d / "images" / "core-1.img")
    refused(d, "images/core-1.img: it is missing")
    # an untouched image goes on to its copy, which this state directory refuses
    with pytest.raises(OSError):
        checkpoint_dir.load(str(fresh("whole")), state_dir=ro_state)


def _resign(d):
    from starter.checkpoint import directory as checkpoint_dir

    rec = json.loads((d / "starter.json").read_text())
    os.unlink(d / "starter.json")
    os.unlink(d / "starter.sig")
    checkpoint_dir.write_signed(str(d), checkpoint_dir.node_key(), rec)


def test_a_callers_restore_checks_the_signature_before_the_room_for_its_copy(key, policy, caller_dir):
    """A caller's own checkpoint with a changed record and 1 TiB of (sparse,
    signed) pages, and one whose pages grew to 1 TiB after signing: the
    signature and the signed sizes are checked first, one line, exit 125."""
    from pathlib import Path

    policy()
    big = _fake_image(Path(caller_dir) / "big", images={"core-1.img": b"\0" * 64, "pages-1.img": b""})
    os.truncate(big / "images" / "pages-1.img", 1 << 40)      # signed at that size (raw pages: by size)
    _resign(big)
    (big / "starter.json").write_text((big / "starter.json").read_text().replace('"job_id": "x"', '"job_id": "y"'))
    grown = _fake_image(Path(caller_dir) / "grown", images={"core-1.img": b"\0" * 64, "pages-1.img": b"\0" * 8192})
    os.truncate(grown / "images" / "pages-1.img", 1 << 40)
    _chown_tree(caller_dir, UID)
    run = lambda d: subprocess.run(caller_argv("run", "--restore", str(d)), capture_output=True, text=True,  # noqa: E731
                                   timeout=60, cwd="/")
    _one_line(run(big), "signature does not match")
    _one_line(run(grown), f"{1 << 40} bytes, signed as 8192")
