"""The job's scratch directory: made fresh for the job, removed without ever leaving it."""

import os
import stat
import subprocess

import pytest

from starter.storage import scratch
from starter.errors import SpecError, StagingError

NOBODY = 65534


def as_nobody(cwd_fd, fn):
    """Run fn() in a forked child as uid/gid 65534 with cwd = cwd_fd, as the job would.

    fn uses paths relative to its cwd (or fds opened before the fork), so the
    test needs no search permission on pytest's 0700 tmp directories.
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.fchdir(cwd_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException as e:  # noqa: BLE001 - report and exit the child
            os.write(2, f"as_nobody: {e!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def parent(tmp_path):
    d = tmp_path / "execute"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


def test_create_mode_owner_and_remove(parent):
    s = scratch.create(parent / "job-1", NOBODY, NOBODY)
    st = os.stat(s.path)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    assert os.fstat(s.fd).st_ino == st.st_ino
    as_nobody(s.fd, lambda: open("out.txt", "w").write("result"))
    report = s.remove()
    assert report.complete and report.files == 1
    assert not os.path.exists(s.path)
    assert s.fd is None


def test_create_refuses_existing(parent):
    (parent / "job-1").mkdir()
    with pytest.raises(StagingError, match="already exists"):
        scratch.create(parent / "job-1", NOBODY, NOBODY)


def test_create_refuses_job_writable_parent(tmp_path):
    for mode, owner in ((0o1777, 0), (0o755, NOBODY), (0o775, 0)):
        d = tmp_path / f"p{mode:o}{owner}"
        d.mkdir()
        d.chmod(mode)
        os.chown(d, owner, NOBODY if mode == 0o775 else 0)
        with pytest.raises(StagingError, match="writable by the job"):
            scratch.create(d / "job-1", NOBODY, NOBODY)
        assert os.listdir(d) == []


def _acl_giving_write(uid):
    """system.posix_acl_access: u::rwx u:UID:rwx g::r-x m::rwx o::r-x (setfacl is not installed)."""
    import struct

    entries = [(0x01, 7, 0xFFFFFFFF), (0x02, 7, uid), (0x04, 5, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF),
               (0x20, 5, 0xFFFFFFFF)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_create_refuses_a_parent_a_supplementary_group_or_an_acl_can_write(tmp_path):
    d = tmp_path / "grp"
    d.mkdir()
    d.chmod(0o775)
    os.chown(d, 0, 4242)                 # a group the job is in only as a supplementary one
    with pytest.raises(StagingError, match="writable by the job"):
        scratch.create(d / "job-1", NOBODY, NOBODY, groups=(100, 4242))
    scratch.create(d / "job-2", NOBODY, NOBODY, groups=(100,)).remove()   # not in it: fine
    a = tmp_path / "acl"
    a.mkdir()
    a.chmod(0o755)
    os.setxattr(a, "system.posix_acl_access", _acl_giving_write(NOBODY))
    with pytest.raises(StagingError, match="writable by the job"):
        scratch.create(a / "job-1", NOBODY, NOBODY)
    assert os.listdir(d) == [] and os.listdir(a) == []


def test_create_refuses_a_directory_put_in_place_of_the_new_one(parent, monkeypatch):
    # Between the mkdir and the open, someone who may write the parent swaps
    # in another user's directory: it must not be marked or given away.
    victim = parent / "victim"
    victim.mkdir(mode=0o700)
    os.chown(victim, 4243, 4243)
    real_open = os.open

    def swapping_open(name, flags, mode=0o777, *, dir_fd=None):
        if name == "job-x" and dir_fd is not None:
            os.rmdir(name, dir_fd=dir_fd)
            os.rename("victim", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return real_open(name, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(scratch.os, "open", swapping_open)
    with pytest.raises(StagingError, match="was replaced"):
        scratch.create(parent / "job-x", NOBODY, NOBODY, mark="x")
    monkeypatch.undo()
    st = os.stat(parent / "job-x")            # left alone: owner, mode, no mark
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (4243, 0o700)
    fd = os.open(parent / "job-x", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert scratch._get_mark(fd) is None
    finally:
        os.close(fd)


def test_removal_enters_only_the_jobs_own_directories(parent):
    # Another user's directory renamed into the tree (by a process of the
    # job's uid running elsewhere) is not entered: root would delete in it
    # what the job's uid could not.
    s = scratch.create(parent / "job-own", NOBODY, NOBODY)
    os.makedirs(os.path.join(s.path, "mine", "sub"))
    for d in ("mine", "mine/sub"):
        os.chown(os.path.join(s.path, d), NOBODY, NOBODY)
    foreign = os.path.join(s.path, "mine", "foreign")
    os.mkdir(foreign, 0o755)
    os.chown(foreign, 4243, 4243)
    open(os.path.join(foreign, "theirs"), "w").close()
    path = s.path
    with pytest.raises(StagingError, match="not of the job's uid"):
        s.remove()
    assert os.listdir(foreign) == ["theirs"]
    assert sorted(os.listdir(os.path.join(path, "mine"))) == ["foreign"]
    subprocess.run(["rm", "-rf", path], check=True)


def test_create_in_execute_dir(tmp_path, parent):
    s = scratch.create_in(tmp_path / "exec-new", "42.0", NOBODY, NOBODY)
    assert s.path == str(tmp_path / "exec-new" / "job-42.0")
    assert stat.S_IMODE(os.stat(tmp_path / "exec-new").st_mode) == 0o755
    s.remove()
    for bad in ("", ".", "..", "a/b", "x y", "a\0b"):
        with pytest.raises(SpecError, match="job_id"):
            scratch.create_in(parent, bad, NOBODY, NOBODY)


def test_keep(parent):
    s = scratch.create(parent / "job-k", NOBODY, NOBODY, keep=True)
    s.release()
    assert os.path.isdir(parent / "job-k")
    assert s.fd is None
    s2 = scratch.create(parent / "job-r", NOBODY, NOBODY)
    with s2:
        pass
    assert not os.path.exists(parent / "job-r")


def _etc_listing():
    return sorted(os.listdir("/etc"))


def test_hostile_contents_do_not_escape(tmp_path, parent):
    host = tmp_path / "host"
    host.mkdir()
    host_file = host / "precious"
    host_file.write_text("do not touch")
    os.chown(host_file, NOBODY, NOBODY)  # the job may own it: protected_hardlinks lets it link then
    host_dir = host / "dir"
    host_dir.mkdir()
    (host_dir / "inner").write_text("keep")
    os.chmod(host_file, 0o644)
    before_etc = _etc_listing()
    before_st = os.stat(host_file)

    s = scratch.create(parent / "job-evil", NOBODY, NOBODY)
    p = s.path
    host_fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY)

    def job():
        os.symlink("/etc", "etc")
        os.symlink(str(host_file), "precious-symlink")
        os.symlink(str(host_dir), "dir-symlink")
        os.link("precious", "precious-hardlink", src_dir_fd=host_fd)
        os.mkdir("loop")
        os.symlink("../loop", "loop/again")
        os.symlink("self", "loop/self")
        deep = "."
        for _ in range(300):  # deeper than a walk holding one fd per level would like
            deep += "/d"
            os.mkdir(deep)
        os.symlink("/", deep + "/root")
        os.mkfifo("fifo")
        os.chmod("loop", 0)  # the job tries to make removal fail

    try:
        as_nobody(s.fd, job)
    finally:
        os.close(host_fd)
    assert os.stat(host_file).st_nlink == 2
    report = s.remove()
    assert report.complete
    assert not os.path.exists(p)
    assert _etc_listing() == before_etc
    st = os.stat(host_file)
    assert host_file.read_text() == "do not touch"
    assert (st.st_nlink, st.st_uid, st.st_gid, st.st_mode) == (1, before_st.st_uid, before_st.st_gid, before_st.st_mode)
    assert (host_dir / "inner").read_text() == "keep"


def test_scratch_swapped_for_symlink_is_not_followed(tmp_path, parent):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_text("keep")
    s = scratch.create(parent / "job-swap", NOBODY, NOBODY)
    ident = (s.dev, s.ino)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename(s.path, str(parent / "moved"))  # as if the parent were writable by the job
        os.symlink(str(victim), s.path)
        with pytest.raises(StagingError, match="replaced"):
            s.remove()
        assert (victim / "file").read_text() == "keep"
        os.unlink(s.path)
        os.mkdir(s.path)  # another directory under the same name
        open(os.path.join(s.path, "other"), "w").close()
        with pytest.raises(StagingError, match="not the directory that was created"):
            scratch.remove_tree(pfd, "job-swap", expect=ident)
        assert os.path.exists(os.path.join(s.path, "other"))
        os.unlink(os.path.join(s.path, "other"))
        os.rmdir(s.path)
        os.rename(str(parent / "moved"), s.path)
        assert scratch.remove_tree(pfd, "job-swap", expect=ident).complete
    finally:
        os.close(pfd)
    assert not os.path.exists(s.path)


@pytest.fixture
def bind_mount(tmp_path):
    made = []

    def mount(src, target):
        subprocess.run(["mount", "--bind", str(src), str(target)], check=True)
        made.append(str(target))

    yield mount
    for t in reversed(made):
        subprocess.run(["umount", t], check=False, capture_output=True)  # may be unmounted already


def test_bind_mount_inside_is_not_crossed(tmp_path, parent, bind_mount):
    outside = tmp_path / "outside"  # same filesystem: st_dev alone would not see the mount
    outside.mkdir()
    (outside / "data").write_text("keep me")
    (outside / "sub").mkdir()
    (outside / "sub" / "more").write_text("keep me too")
    s = scratch.create(parent / "job-m", NOBODY, NOBODY)
    as_nobody(s.fd, lambda: (os.makedirs("a/m"), open("junk", "w").close()))
    target = os.path.join(s.path, "a", "m")
    bind_mount(outside, target)
    with pytest.raises(StagingError, match="mount point") as ei:
        s.remove()
    assert target in str(ei.value)
    assert (outside / "data").read_text() == "keep me"
    assert (outside / "sub" / "more").read_text() == "keep me too"
    assert not os.path.exists(os.path.join(parent, "job-m", "junk"))  # the rest went
    subprocess.run(["umount", target], check=True)
    # after the admin unmounts, a second pass finishes the job
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert scratch.remove_tree(pfd, "job-m").complete
    finally:
        os.close(pfd)
    assert not os.path.exists(parent / "job-m")


def test_file_bind_mount_inside_is_reported(tmp_path, parent, bind_mount):
    host_file = tmp_path / "hostfile"
    host_file.write_text("keep")
    s = scratch.create(parent / "job-f", NOBODY, NOBODY)
    target = os.path.join(s.path, "f")
    open(target, "w").close()
    bind_mount(host_file, target)
    with pytest.raises(StagingError, match="mount point"):
        s.remove()
    assert host_file.read_text() == "keep"
    subprocess.run(["umount", target], check=True)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        scratch.remove_tree(pfd, "job-f")
    finally:
        os.close(pfd)


def test_remove_tree_missing_is_fine(parent):
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert scratch.remove_tree(pfd, "nothing-here").complete
    finally:
        os.close(pfd)


# ---------------------------------------------------------------- --keep-scratch through the CLI
#
# --keep-scratch keeps the scratch of a job that ran (it exec'd).  A start that
# fails before that leaves nothing: exit 125 (the starter's failure, e.g. a bad
# --cwd) and 126/127 (the command could not be executed or found: the job did
# not run either).


@pytest.mark.parametrize("args, code, msg", [
    (["--cwd", "/nonexistent", "--", "true"], 125, "chdir"),
    (["--", "/nonexistent/command"], 127, "execve"),
    (["--", "/etc/passwd"], 126, "execve"),
], ids=["bad-cwd", "not-found", "not-executable"])
def test_keep_scratch_keeps_nothing_of_a_start_that_failed(starter, execute_dir, args, code, msg):
    p = starter("run", "--user", "nobody", "--execute-dir", execute_dir, "--keep-scratch", "--id", "ks1", *args,
                cwd="/")
    assert p.returncode == code, (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and msg in p.stderr, p.stderr
    assert os.listdir(execute_dir) == []


def test_keep_scratch_keeps_the_scratch_of_a_job_that_ran(starter, execute_dir):
    p = starter("run", "--user", "nobody", "--execute-dir", execute_dir, "--keep-scratch", "--id", "ks2", "--",
                "sh", "-c", "echo out > result; exit 3", cwd="/")
    assert p.returncode == 3, (p.stdout, p.stderr)
    kept = os.path.join(execute_dir, "job-ks2")
    with open(os.path.join(kept, "result")) as f:
        assert f.read() == "out\n"
    # and without --keep-scratch, a job that ran leaves nothing either
    starter("run", "--user", "nobody", "--execute-dir", execute_dir, "--id", "ks3", "--", "true", cwd="/", check=0)
    assert os.listdir(execute_dir) == ["job-ks2"]
