"""The spool against a hostile job user: paths the job's user controls are
walked without links and read with its rights, and root's copies are
bounded (the store itself: tests/test_spool.py)."""

import os
import stat
import subprocess
import sys
import time

import pytest

from starter.spool import store as sp
from starter.errors import StagingError, StarterError
from test_spool import _exe, _exe_names, other_fs  # noqa: F401 (other_fs: a fixture)


# ---------------------------------------------------------------- paths the job's user controls
#
# The batch system runs `spool` as root on FILE (the user's executable), DEST and
# JOBCOPY (in the job's directory): no link on the way is followed, a source that
# is not a regular file is never opened, and root reads only what the owner could.


def _secret(tmp_path):
    """A root-only file, like /etc/shadow."""
    p = tmp_path / "secret"
    p.write_bytes(b"root:$6$not-for-the-job\n")
    p.chmod(0o600)
    return p


def _nothing_stored(s):
    assert _exe_names(s.dir) == []
    assert not [n for n in os.listdir(s.dir) if n.startswith(sp.TMP_PREFIX)]


def _local_account(name="nobody"):
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"needs the local account {name!r} (the owner whose rights bound what root reads)")


def test_symlinked_source_is_refused_and_nothing_stored(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    secret = _secret(tmp_path)
    link = tmp_path / "analysis"
    link.symlink_to(secret)
    job = tmp_path / "job"
    job.mkdir()
    for owner in ("alice", "root"):  # even an owner who may read the target: a link is not the file
        with pytest.raises(StagingError, match=r"analysis is a symlink \(not followed\)"):
            s.add(owner, str(link), dest=str(job / "analysis"))
        with pytest.raises(StagingError, match="is a symlink"):
            s.store(owner, "CmdHashSHA256-" + "0" * 64, str(link))
        with pytest.raises(StagingError, match="is a symlink"):
            s.link_into(owner, sp.INVALID, str(job / "private"), src=str(link))
    _nothing_stored(s)
    assert os.listdir(job) == []


def test_source_under_a_symlinked_directory_is_refused(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    real = tmp_path / "real"
    real.mkdir()
    _exe(real)
    (tmp_path / "bin").symlink_to(real)
    with pytest.raises(StagingError, match=f"{tmp_path}/bin is a symlink"):
        s.add("alice", str(tmp_path / "bin" / "prog"))
    _nothing_stored(s)
    assert s.add("alice", str(real / "prog"))[0] == "send"  # the same file by its real path


def test_relative_source_is_walked_from_the_cwd(tmp_path, monkeypatch):
    s = sp.Spool(tmp_path / "spool")
    _exe(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "prog")
    monkeypatch.chdir(tmp_path)
    assert s.add("alice", "./prog")[0] == "send"  # the documented `spool add --owner alice ./analysis`
    with pytest.raises(StagingError, match="is a symlink"):
        s.add("alice", "./link")
    with pytest.raises(StagingError, match="'..'"):
        s.add("alice", "../" + tmp_path.name + "/prog")


def test_fifo_and_device_sources_are_never_opened(tmp_path, monkeypatch):
    s = sp.Spool(tmp_path / "spool")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a blocking open would hang here
    dev = tmp_path / "watchdog"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # stands for /dev/watchdog: opening it has effects
    (tmp_path / "devlink").symlink_to("/dev/null")
    opened = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        opened.append((os.fspath(path), flags))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    for src, what in ((fifo, "is a FIFO"), (dev, "is a character device"), ("/dev/null", "is a character device"),
                      (tmp_path / "devlink", "is a symlink")):
        t0 = time.monotonic()
        with pytest.raises(StagingError, match=what):
            s.add("alice", str(src), dest=str(tmp_path / "job.exe"))
        assert time.monotonic() - t0 < 2
    monkeypatch.undo()
    names = {"fifo", "watchdog", "null", "devlink"}
    read_opens = [(p, f) for p, f in opened if os.path.basename(p) in names and not f & os.O_PATH]
    assert read_opens == []
    _nothing_stored(s)
    assert not os.path.lexists(tmp_path / "job.exe")


def test_source_is_read_with_the_owners_rights(tmp_path):
    nobody = _local_account()
    s = sp.Spool(tmp_path / "spool")
    ids = (os.geteuid(), os.getegid(), os.getgroups())
    secret = _secret(tmp_path)
    with pytest.raises(StagingError, match="'nobody' may not read it"):
        s.add("nobody", str(secret))
    # a hard link is the file itself: no link to follow, but still not nobody's to read
    hard = tmp_path / "analysis"
    os.link(secret, hard)
    with pytest.raises(StagingError, match="may not read it"):
        s.link_into("nobody", sp.INVALID, str(tmp_path / "job.exe"), src=str(hard))
    assert not os.path.lexists(tmp_path / "job.exe")
    # the directories on the way are the batch system's (tmp_path is root-only): only the file counts
    mine = _exe(tmp_path, "mine", mode=0o700)
    os.chown(mine, nobody.pw_uid, nobody.pw_gid)
    answer, path = s.add("nobody", mine)
    assert answer == "send" and open(path, "rb").read() == open(mine, "rb").read()
    assert not [n for n in os.listdir(s.dir) if n.startswith(sp.TMP_PREFIX)]
    assert s.add("root", str(secret))[0] == "send"  # root's own job may read root's files
    assert (os.geteuid(), os.getegid(), os.getgroups()) == ids


def test_no_rights_to_switch_to_is_its_own_error(tmp_path, monkeypatch):
    _local_account()
    s = sp.Spool(tmp_path / "spool")
    ids = (os.geteuid(), os.getegid(), os.getgroups())
    from starter.storage import paths

    real = paths._switch

    def no_cap_setuid(uid, gid, groups):  # root without CAP_SETUID (a container): not "nobody may not read it"
        if uid != 0:
            raise PermissionError(1, "Operation not permitted")
        real(uid, gid, groups)

    monkeypatch.setattr(paths, "_switch", no_cap_setuid)
    with pytest.raises(StarterError, match="cannot take uid .* CAP_SETUID"):
        s.add("nobody", _exe(tmp_path))
    monkeypatch.undo()
    assert (os.geteuid(), os.getegid(), os.getgroups()) == ids
    _nothing_stored(s)


def test_owner_without_local_account_gets_only_world_readable_files(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    owner = "no-such-account-x9"
    secret = _secret(tmp_path)
    with pytest.raises(StagingError, match="not a local account.*mode 0600"):
        s.add(owner, str(secret))
    _nothing_stored(s)
    secret.chmod(0o604)
    assert s.add(owner, str(secret))[0] == "send"


def test_dest_under_a_symlinked_directory_is_refused(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    victim = tmp_path / "cron.d"  # root would plant the user's bytes there as a root-owned file
    victim.mkdir()
    job = tmp_path / "job"
    job.mkdir()
    (job / "bin").symlink_to(victim)
    with pytest.raises(StagingError, match=f"{job}/bin is a symlink"):
        s.add("alice", exe, dest=str(job / "bin" / "analysis"))
    _nothing_stored(s)  # refused before anything was stored
    _, hpath = s.add("alice", exe)
    ch = sp.compute_cmdhash(exe)
    for src in (None, exe):
        with pytest.raises(StagingError, match="is a symlink"):
            s.link_into("alice", ch, str(job / "bin" / "analysis"), src=src)
    with pytest.raises(StagingError, match="is a symlink"):
        s.link_into("alice", sp.INVALID, str(job / "bin" / "analysis"), src=exe)
    assert os.listdir(victim) == []
    assert os.stat(hpath).st_nlink == 1
    (job / "analysis").symlink_to(victim / "planted")  # a link as the last component is not followed either
    with pytest.raises(StagingError, match="File exists"):
        s.link_into("alice", ch, str(job / "analysis"))
    assert os.listdir(victim) == []


def test_release_through_a_symlinked_directory_unlinks_nothing_outside(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    ch = sp.compute_cmdhash(exe)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "analysis").write_text("precious")
    job = tmp_path / "job"
    (job / "bin").mkdir(parents=True)
    _, hpath = s.add("alice", exe, dest=str(job / "bin" / "analysis"))
    os.rename(job / "bin", job / "moved")  # the job swaps its directory for a link
    (job / "bin").symlink_to(victim)
    with pytest.raises(StagingError, match=f"{job}/bin is a symlink"):
        s.release(str(job / "bin" / "analysis"), "alice", ch)
    assert (victim / "analysis").read_text() == "precious"
    assert os.stat(hpath).st_nlink == 2  # the entry stays for gc
    # JOBCOPY itself a link: the link goes, not what it names
    (job / "moved" / "analysis").unlink()
    (job / "moved" / "analysis").symlink_to(victim / "analysis")
    assert s.release(str(job / "moved" / "analysis"), "alice", ch) is False
    assert not os.path.lexists(job / "moved" / "analysis")
    assert (victim / "analysis").read_text() == "precious"
    # a job directory that is gone already: nothing to do
    assert s.release(str(tmp_path / "gone" / "analysis"), "alice", ch) is False


def test_cli_refusals_are_one_line_exit_125(tmp_path, starter):
    d = str(tmp_path / "spool")
    secret = _secret(tmp_path)
    (tmp_path / "analysis").symlink_to(secret)
    job = tmp_path / "job"
    job.mkdir()
    os.mkfifo(tmp_path / "fifo")
    runs = [
        (["add", "--owner", "alice", "analysis", "--dest", str(job / "analysis")], "is a symlink"),
        (["link", "--owner", "alice", "--cmdhash", "invalid", "--src", "analysis", str(job / "p")], "is a symlink"),
        (["add", "--owner", "alice", "fifo"], "is a FIFO"),
        (["add", "--owner", "alice", str(secret)], "not readable by everyone"),
        (["release", "--owner", "alice", "--cmdhash", "invalid", str(tmp_path / "analysis" / "x")],
         "analysis is a symlink"),
    ]
    for args, msg in runs:
        p = starter("spool", "--spool", d, *args, cwd=tmp_path, timeout=20)
        assert p.returncode == 125, (args, p.stdout, p.stderr)
        assert p.stdout == "" and p.stderr.count("\n") == 1 and msg in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
    assert os.listdir(job) == []
    assert not [n for n in os.listdir(d) if n.startswith(("exe-", sp.TMP_PREFIX))]


# ---------------------------------------------------------------- bounded copies
#
# Root copies a file the job's user controls: neither quotas nor root's
# reserved blocks would stop it.  The same bounds as the manifest's
# (fileio.sized_to_fit + copy_hashing's limit): larger than the room left for
# users where it goes -> refused before a byte is read; growing during the
# copy -> the copy fails and is removed.


def _nothing_copied(spool_dir, job):
    assert not [n for n in os.listdir(spool_dir) if n.startswith(("exe-", sp.TMP_PREFIX))]
    assert os.listdir(job) == []


def test_cli_refuses_a_file_larger_than_the_room_before_reading_it(tmp_path, other_fs, starter):
    d = str(tmp_path / "spool")
    big = other_fs / "big"               # on a tmpfs: ext4 ends at 16 TiB
    big.touch()
    big.chmod(0o644)
    os.truncate(big, 100 << 40)          # 100 TB, sparse: hashing it alone would take hours
    job = tmp_path / "job"
    job.mkdir()
    runs = [
        ["add", "--owner", "root", str(big)],
        ["add", "--owner", "root", "--hash", "none", str(big), "--dest", str(job / "a")],
        ["store", "--owner", "root", "--cmdhash", f"CmdHashSHA256-{'0' * 64}", str(big)],
        ["link", "--owner", "root", "--cmdhash", "invalid", "--src", str(big), str(job / "b")],
    ]
    for args in runs:
        t0 = time.monotonic()
        p = starter("spool", "--spool", d, *args, timeout=30)
        took = time.monotonic() - t0
        assert p.returncode == 125, (args, p.stdout, p.stderr)
        assert p.stdout == "" and p.stderr.count("\n") == 1, (args, p.stderr)
        assert f"{100 << 40} bytes, more than the" in p.stderr and "free for users" in p.stderr, p.stderr
        assert str(big) in p.stderr and "Traceback" not in p.stderr
        assert took < 5, (args, took)       # refused, not read
        _nothing_copied(d, job)


_GROWER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
chunk = b"g" * 65536
os.write(1, b"ready\\n")
for _ in range(5000):          # at most ~330 MB, ~30 MB/s: slower than any copy, never stops during one
    os.write(fd, chunk)
    time.sleep(0.002)
"""


def test_cli_a_file_that_grows_during_the_copy_fails(tmp_path, starter):
    d = str(tmp_path / "spool")
    job = tmp_path / "job"
    job.mkdir()
    for args in (["link", "--owner", "root", "--cmdhash", "invalid", "--src", "{f}", str(job / "copy")],
                 ["add", "--owner", "root", "{f}"],
                 ["add", "--owner", "root", "--hash", "none", "{f}", "--dest", str(job / "copy2")]):
        f = tmp_path / "growing"
        f.write_bytes(os.urandom(1 << 20) * 64)        # 64 MiB to start with
        writer = subprocess.Popen([sys.executable, "-c", _GROWER, str(f)], stdout=subprocess.PIPE)
        try:
            assert writer.stdout.readline() == b"ready\n"
            p = starter("spool", "--spool", d, *[a.format(f=f) for a in args], timeout=60)
        finally:
            writer.kill()
            writer.wait()
            writer.stdout.close()
        assert p.returncode == 125, (args, p.stdout, p.stderr)
        assert p.stdout == "" and p.stderr.count("\n") == 1, (args, p.stderr)
        assert f"spool: {f}: grew past the" in p.stderr and "Traceback" not in p.stderr, p.stderr
        _nothing_copied(d, job)
        f.unlink()
