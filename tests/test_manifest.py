"""Verified inputs: a signature file trusted by its digest, every listed file checked on copy."""

import hashlib
import os
import stat
import subprocess

import pytest

from starter.storage import manifest, scratch
from starter.errors import SpecError, StagingError

NOBODY = 65534


def sha(data):
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = {
        "run.sh": (b"#!/bin/sh\necho verified\n", 0o755),
        "input.dat": (os.urandom(300000), 0o644),
        "config": (b"x=1\n", 0o644),
    }
    for name, (data, mode) in files.items():
        (src / name).write_bytes(data)
        (src / name).chmod(mode)
    lines = [
        f"{sha(files['run.sh'][0])}  run.sh",
        f"{sha(files['input.dat'][0])} *input.dat",
        "",
        "# our extension: 'x' stages it executable",
        f"{sha(files['config'][0])} xconfig",
    ]
    sig = tmp_path / "signature.sha256"
    sig.write_text("\n".join(lines) + "\n")
    return src, sig, files


@pytest.fixture
def job_dir(tmp_path):
    parent = tmp_path / "execute"
    parent.mkdir()
    s = scratch.create(parent / "job-1", NOBODY, NOBODY)
    yield s
    s.remove()


def digest_of(path):
    return sha(open(path, "rb").read())


def test_stage_all(inputs, job_dir):
    src, sig, files = inputs
    staged = manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    assert sorted(staged) == ["config", "input.dat", "run.sh"]
    for name, path in staged.items():
        assert path == os.path.join(job_dir.path, name)
        assert open(path, "rb").read() == files[name][0]
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    assert stat.S_IMODE(os.stat(staged["run.sh"]).st_mode) == 0o755  # source had +x
    assert stat.S_IMODE(os.stat(staged["config"]).st_mode) == 0o755  # manifest says x
    assert stat.S_IMODE(os.stat(staged["input.dat"]).st_mode) == 0o644
    assert sorted(os.listdir(job_dir.path)) == ["config", "input.dat", "run.sh"]  # no temp files


def test_stage_into_fd_and_digest_prefix(inputs, job_dir):
    src, sig, _ = inputs
    staged = manifest.verify_and_stage(str(sig), "sha256:" + digest_of(sig).upper(), str(src), job_dir.fd, 0, 0)
    assert staged["run.sh"] == os.path.join(job_dir.path, "run.sh")


def test_one_byte_changed_in_a_listed_file(inputs, job_dir):
    src, sig, files = inputs
    data = bytearray(files["input.dat"][0])
    data[12345] ^= 1
    (src / "input.dat").write_bytes(bytes(data))
    with pytest.raises(StagingError) as ei:
        manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    msg = str(ei.value)
    assert msg.startswith("manifest: input.dat: sha256 mismatch (expected ")
    assert sha(files["input.dat"][0]) in msg and sha(bytes(data)) in msg
    assert os.listdir(job_dir.path) == []  # run.sh, staged before it, is gone too


def test_signature_file_not_matching_trusted_digest(inputs, job_dir):
    src, sig, _ = inputs
    good = digest_of(sig)
    sig.write_text(sig.read_text().replace("run.sh", "run.sh\n"))  # any change
    with pytest.raises(StagingError, match="trusted digest"):
        manifest.verify_and_stage(str(sig), good, str(src), job_dir.path, NOBODY, NOBODY)
    assert os.listdir(job_dir.path) == []


def test_bad_trusted_digest_is_a_spec_error(inputs, job_dir):
    src, sig, _ = inputs
    for bad in ("", "abc", "z" * 64, digest_of(sig) + "0"):
        with pytest.raises(SpecError, match="manifest-digest"):
            manifest.verify_and_stage(str(sig), bad, str(src), job_dir.path, NOBODY, NOBODY)


def test_symlinked_source_is_refused(inputs, job_dir, tmp_path):
    src, sig, files = inputs
    (tmp_path / "elsewhere").write_bytes(files["config"][0])
    (src / "config").unlink()
    (src / "config").symlink_to(tmp_path / "elsewhere")  # same content, still refused
    with pytest.raises(StagingError, match="config: is a symlink"):
        manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    assert os.listdir(job_dir.path) == []


def test_an_input_larger_than_the_users_free_space_is_not_copied(inputs, job_dir):
    # Not verified yet, and root copies it: neither quotas nor root's
    # reserved blocks would stop a sparse 100 TB file.
    src, sig, _ = inputs
    vfs = os.statvfs(job_dir.path)
    with open(src / "input.dat", "r+b") as f:
        f.truncate(vfs.f_bavail * vfs.f_frsize + (1 << 30))
    with pytest.raises(StagingError, match="input.dat: .* bytes, more than the .* bytes free for users"):
        manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    assert os.listdir(job_dir.path) == []


def test_an_input_that_grows_while_it_is_copied_is_refused(inputs, job_dir):
    # A file whose size says 0 but whose reads never end (a procfs file
    # bind-mounted over the input stands in for a file the user keeps
    # appending to): the copy stops at the size it had when opened.
    src, sig, _ = inputs
    target = src / "config"
    subprocess.run(["mount", "--bind", "/proc/cpuinfo", str(target)], check=True)
    try:
        with pytest.raises(StagingError, match="config: the file grew while it was copied"):
            manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert [n for n in os.listdir(job_dir.path) if n.startswith(".stage-")] == []


def test_missing_file_and_existing_destination(inputs, job_dir):
    src, sig, _ = inputs
    (src / "config").unlink()
    with pytest.raises(StagingError, match="config: No such file"):
        manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    assert os.listdir(job_dir.path) == []


def test_existing_name_in_destination_not_replaced(inputs, job_dir):
    src, sig, _ = inputs
    open(os.path.join(job_dir.path, "input.dat"), "w").write("mine")
    with pytest.raises(StagingError, match="input.dat: already exists"):
        manifest.verify_and_stage(str(sig), digest_of(sig), str(src), job_dir.path, NOBODY, NOBODY)
    assert os.listdir(job_dir.path) == ["input.dat"]
    assert open(os.path.join(job_dir.path, "input.dat")).read() == "mine"
