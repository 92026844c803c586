"""Shared executables in the spool: refcounts by hard link, gc, link fallback (the
names' escaping: tests/unit/test_spoolname.py)."""

import hashlib
import logging
import multiprocessing
import os
import queue
import stat
import subprocess

import pytest

from starter.spool import store as sp
from starter.errors import SpecError, StagingError


@pytest.mark.parametrize("owner", ["", ".", "..", "a/b", "/", "a\0b", None])
def test_bad_owner_refused(owner, tmp_path):
    with pytest.raises(SpecError, match="owner"):
        sp.hash_name(owner, "K-V")
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    with pytest.raises(SpecError, match="owner"):
        s.add(owner, exe)


def test_bad_cmdhash_and_attr_refused(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    with pytest.raises(SpecError, match="cmdhash"):
        s.lookup("alice", "no/slash")
    with pytest.raises(SpecError, match="cmdhash"):
        s.lookup("alice", "odd-number-of")
    with pytest.raises(SpecError, match="hash_attrs"):
        s.add("alice", _exe(tmp_path), hash_attrs=("CmdHashCRC",))


# ---------------------------------------------------------------- spool on disk


def _exe(tmp_path, name="prog", data=None, mode=0o755):
    p = tmp_path / name
    if not p.exists():
        p.write_bytes(data if data is not None else b"#!/bin/sh\necho hi\n" + os.urandom(4096) * 16)
        p.chmod(mode)
    return str(p)


def _exe_names(spool_dir):
    return sorted(n for n in os.listdir(spool_dir) if n.startswith("exe-"))


def test_add_have_send_and_name(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    digest = hashlib.sha256(open(exe, "rb").read()).hexdigest()
    answer, path = s.add("de-smet", exe)
    assert answer == "send"
    assert os.path.basename(path) == f"exe-de%2Dsmet-CmdHashSHA256-{digest}"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o555 and st.st_uid == os.geteuid()
    assert open(path, "rb").read() == open(exe, "rb").read()
    assert s.add("de-smet", exe) == ("have", path)
    assert s.lookup("de-smet", f"CmdHashSHA256-{digest}") == path
    assert s.lookup("de-smet", f"CmdHashSHA256-{'0' * 64}") is None
    assert not [n for n in os.listdir(s.dir) if n.startswith(sp.TMP_PREFIX)]
    # MD5 (the shared-spool proposal's algorithm) and several attributes in order
    a, p2 = s.add("de-smet", exe, hash_attrs=("CmdHashMD5", "CmdHashSHA256"))
    md5 = hashlib.md5(open(exe, "rb").read()).hexdigest()
    assert a == "send" and os.path.basename(p2) == f"exe-de%2Dsmet-CmdHashMD5-{md5}-CmdHashSHA256-{digest}"


def test_non_executable_stored_0444(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    _, path = s.add("alice", _exe(tmp_path, "data", mode=0o644))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o444


def test_store_verifies_known_hash(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    with pytest.raises(StagingError, match="CmdHashSHA256 mismatch"):
        s.store("alice", "CmdHashSHA256-" + "0" * 64, exe)
    assert _exe_names(s.dir) == []
    assert not [n for n in os.listdir(s.dir) if n.startswith(sp.TMP_PREFIX)]
    # the two-step protocol: lookup says "send it", store writes it
    ch = sp.compute_cmdhash(exe)
    assert s.lookup("alice", ch) is None
    assert s.store("alice", ch, exe)[0] == "send"
    assert s.store("alice", ch, exe)[0] == "have"


def test_spool_dir_must_be_private(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(StagingError, match="plant executables"):
        sp.Spool(d)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "spool-real")
    (tmp_path / "spool-real").mkdir()
    with pytest.raises(StagingError, match="symlink"):
        sp.Spool(link)


def _blocks_of_distinct_inodes(paths):
    seen = {}
    for p in paths:
        st = os.lstat(p)
        seen[(st.st_dev, st.st_ino)] = st.st_blocks
    return sum(seen.values())


def test_fifty_jobs_one_file(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path, data=os.urandom(1 << 20))
    jobs = []
    for i in range(50):
        d = tmp_path / f"job{i}"
        d.mkdir()
        answer, hpath = s.add("alice", exe)
        assert answer == ("send" if i == 0 else "have")
        dest = s.link_into("alice", sp.compute_cmdhash(exe), str(d / "exe"))
        jobs.append(dest)
        if i == 0:
            one_job_blocks = _blocks_of_distinct_inodes([hpath] + jobs)
    assert len(_exe_names(s.dir)) == 1
    assert os.stat(hpath).st_nlink == 51
    assert _blocks_of_distinct_inodes([hpath] + jobs) == one_job_blocks
    for j in jobs:
        assert open(j, "rb").read(16) == open(exe, "rb").read(16)
        assert stat.S_IMODE(os.stat(j).st_mode) == 0o555
    (entry,) = s.ls()
    assert entry["owner"] == "alice" and entry["users"] == 50 and entry["cmdhash"].startswith("CmdHashSHA256-")
    ch = sp.compute_cmdhash(exe)
    for n, j in enumerate(jobs):
        removed = s.release(j, "alice", ch)
        assert removed == (n == 49)
        assert not os.path.exists(j)
    assert _exe_names(s.dir) == []


def test_two_owners_two_entries(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    a = s.add("alice", exe)
    b = s.add("bob", exe)
    assert a[0] == b[0] == "send" and a[1] != b[1]
    assert os.stat(a[1]).st_ino != os.stat(b[1]).st_ino
    assert sorted(e["owner"] for e in s.ls()) == ["alice", "bob"]


def test_invalid_means_private_copy(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    answer, path = s.add("alice", exe, hash_attrs=())
    assert (answer, path) == ("send", "invalid")
    assert s.lookup("alice", "invalid") is None
    dest = s.link_into("alice", "invalid", str(tmp_path / "job.exe"), src=exe)
    assert os.stat(dest).st_nlink == 1
    assert open(dest, "rb").read() == open(exe, "rb").read()
    assert _exe_names(s.dir) == []
    assert s.release(dest, "alice", "invalid") is False
    assert not os.path.exists(dest)
    with pytest.raises(StagingError, match="no source"):
        s.link_into("alice", "invalid", str(tmp_path / "x"))


def test_release_ignores_a_replaced_job_copy(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    _, hpath = s.add("alice", exe)
    ch = sp.compute_cmdhash(exe)
    job = tmp_path / "job.exe"
    s.link_into("alice", ch, str(job))
    job.unlink()  # the job swaps its copy for some other file with nlink 2
    (tmp_path / "other").write_text("x")
    os.link(tmp_path / "other", job)
    assert s.release(str(job), "alice", ch) is False
    assert os.path.exists(hpath)


def test_link_into_restores_a_lost_entry(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    _, hpath = s.add("alice", exe)
    ch = sp.compute_cmdhash(exe)
    os.unlink(hpath)  # "erroneously deleted": the system keeps working
    with pytest.raises(StagingError, match="add the executable first"):
        s.link_into("alice", ch, str(tmp_path / "j1"))
    s.link_into("alice", ch, str(tmp_path / "j1"), src=exe)
    assert os.stat(hpath).st_nlink == 2


def test_gc_removes_only_unused(tmp_path):
    s = sp.Spool(tmp_path / "spool")
    used = _exe(tmp_path, "used")
    unused = _exe(tmp_path, "unused")
    _, upath = s.add("alice", used, dest=str(tmp_path / "job.exe"))
    _, npath = s.add("alice", unused)
    assert s.gc() == []  # the fresh, not yet linked file is inside the grace period
    assert s.gc(min_age=0) == [os.path.basename(npath)]
    assert _exe_names(s.dir) == [os.path.basename(upath)]
    os.unlink(tmp_path / "job.exe")  # scratch removed without release: gc is the backstop
    assert s.gc(min_age=0) == [os.path.basename(upath)]
    # a temp file from a dead process goes too, one from a live process stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        open(os.path.join(s.dir, f"{sp.TMP_PREFIX}{pid}-abc"), "w").close()
    assert s.gc(min_age=0) == [f"{sp.TMP_PREFIX}{dead.pid}-abc"]
    os.unlink(os.path.join(s.dir, f"{sp.TMP_PREFIX}{os.getpid()}-abc"))


def _adder(spool_dir, src_dir, job_dir, n, q):
    s = sp.Spool(spool_dir)
    out = []
    for i in range(n):
        src = os.path.join(src_dir, f"p{i}")
        dest = os.path.join(job_dir, f"j{i}")
        _, path = s.add("alice", src, dest=dest)
        out.append((path, dest))
    q.put(out)


def _gcer(spool_dir, stop):
    s = sp.Spool(spool_dir)
    while not stop.is_set():
        s.gc(min_age=0)


def test_concurrent_add_and_gc_lose_nothing(tmp_path):
    spool_dir = str(tmp_path / "spool")
    sp.Spool(spool_dir)
    src_dir, job_dir = tmp_path / "src", tmp_path / "jobs"
    src_dir.mkdir()
    job_dir.mkdir()
    n = 150
    for i in range(n):
        (src_dir / f"p{i}").write_bytes(b"%d" % i * 100)
    ctx = multiprocessing.get_context("fork")
    stop, q = ctx.Event(), ctx.Queue()
    gcs = [ctx.Process(target=_gcer, args=(spool_dir, stop)) for _ in range(2)]
    for g in gcs:
        g.start()
    try:
        adder = ctx.Process(target=_adder, args=(spool_dir, str(src_dir), str(job_dir), n, q))
        adder.start()
        results = None
        while results is None:
            try:
                results = q.get(timeout=1)
            except queue.Empty:
                assert adder.is_alive(), f"adder died (exit {adder.exitcode})"
        adder.join(30)
        assert adder.exitcode == 0
    finally:
        stop.set()
        for g in gcs:
            g.join(30)
    for path, dest in results:
        st = os.stat(path)
        assert st.st_nlink == 2, path
        assert os.stat(dest).st_ino == st.st_ino


# ---------------------------------------------------------------- link() failures


@pytest.fixture
def other_fs(tmp_path):
    """A tmpfs mounted in tmp_path: a job dir where link() from the spool gets EXDEV."""
    mnt = tmp_path / "otherfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "starter-test", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_link_failure_copies_then_gives_up(tmp_path, other_fs, caplog):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    _, hpath = s.add("alice", exe)
    ch = sp.compute_cmdhash(exe)
    caplog.set_level(logging.WARNING, logger="starter.spool")
    for i in range(10):
        dest = s.link_into("alice", ch, str(other_fs / f"j{i}"))
        assert os.stat(dest).st_nlink == 1
        assert open(dest, "rb").read() == open(exe, "rb").read()
        assert stat.S_IMODE(os.stat(dest).st_mode) == 0o555
    assert s.link_state() == (False, 10)
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("private copy" in w for w in warnings) == 10
    assert any("copying from now on" in w for w in warnings)
    caplog.clear()
    # another process (a fresh Spool) sees the state: it does not even try, even on the same fs
    s2 = sp.Spool(tmp_path / "spool")
    dest = s2.link_into("alice", ch, str(tmp_path / "samefs"))
    assert os.stat(dest).st_nlink == 1
    assert s2.link_state() == (False, 10)
    assert not caplog.records
    assert os.stat(hpath).st_nlink == 1
    for i in range(10):
        assert s.release(str(other_fs / f"j{i}"), "alice", ch) is False
    assert os.path.exists(hpath)  # gc's job, not release's


def test_link_failure_after_success_keeps_trying(tmp_path, other_fs):
    s = sp.Spool(tmp_path / "spool")
    exe = _exe(tmp_path)
    ch = sp.compute_cmdhash(exe)
    s.add("alice", exe, dest=str(tmp_path / "first"))
    assert s.link_state() == (True, 0)
    for i in range(12):
        s.link_into("alice", ch, str(other_fs / f"j{i}"))
    assert s.link_state() == (True, 12)
    s.link_into("alice", ch, str(tmp_path / "again"))
    assert os.stat(tmp_path / "again").st_nlink == 3


# ---------------------------------------------------------------- command line


def test_cli_round_trip(tmp_path, starter):
    d = str(tmp_path / "spool")
    exe = _exe(tmp_path)
    p = starter("spool", "--spool", d, "add", "--owner", "de-smet", exe, check=0)
    answer, ch, path = p.stdout.split()
    assert answer == "send" and ch == sp.compute_cmdhash(exe)
    assert os.path.basename(path) == f"exe-de%2Dsmet-{ch}"
    assert starter("spool", "--spool", d, "add", "--owner", "de-smet", exe, check=0).stdout.split()[0] == "have"
    assert starter("spool", "--spool", d, "lookup", "--owner", "de-smet", "--cmdhash", ch, check=0).stdout.strip() == path
    starter("spool", "--spool", d, "lookup", "--owner", "bob", "--cmdhash", ch, check=1)
    job = str(tmp_path / "job.exe")
    assert starter("spool", "--spool", d, "link", "--owner", "de-smet", "--cmdhash", ch, job, check=0).stdout.startswith("linked")
    out = starter("spool", "--spool", d, "ls", "--json", check=0).stdout
    import json

    (entry,) = json.loads(out)
    assert (entry["owner"], entry["users"]) == ("de-smet", 1)
    assert "de-smet" in starter("spool", "--spool", d, "ls", check=0).stdout
    p = starter("spool", "--spool", d, "release", "--owner", "de-smet", "--cmdhash", ch, job, check=0)
    assert "entry removed" in p.stdout
    assert json.loads(starter("spool", "--spool", d, "gc", "--min-age", "0", "--json", check=0).stdout) == []
    # bad input: a clear error naming the field, exit 125
    p = starter("spool", "--spool", d, "add", "--owner", "a/b", exe)
    assert p.returncode == 125 and "owner" in p.stderr
    p = starter("spool", "--spool", d, "add", exe)
    assert p.returncode == 2 and "--owner" in p.stderr
    p = starter("spool", "--spool", d, "add", "--owner", "x", "--hash", "none", exe, check=0)
    assert p.stdout.split()[:3] == ["send", "invalid", "invalid"]
