"""A checkpointed job whose stdout and stderr are a regular file restores
when that file is no longer the one it had (starter/checkpoint/criu.py).

Slurm reopens the batch output file when it requeues a job, by default
truncating it (the same inode, now shorter than the offset the job had
reached), or it is a new file (a new inode).  The restore gives the job
the stdio it was itself given, as they are: CRIU does not reopen the file
the job had by its path, nor check its size, nor seek to the old offset.
Where CRIU works (the v2 VM), through the real CLI: a job writes a counter
line every 0.2 s to stdout, a regular file F, and is checkpointed by a
vacate; F is replaced by a new file, or truncated in place; `--restore`
with F, as the requeued batch script has it, as stdout and stderr: the
counter goes on from where the image was, its lines after what F already
held, with no hole before them.
"""

import json
import os
import subprocess
import time

import pytest

from conftest import SLOWDOWN, STARTER
from test_checkpoint import CRIU, _end, _hybrid, key  # noqa: F401 (key: the node's checkpoint key, a fixture)

COUNTER = r"""
i=0
while [ $i -lt 40 ]; do
  i=$((i+1)); echo "count $i"; sleep 0.2
done
echo "done $i" >&2
exit 7
"""


def _counts(text):
    return [int(x.split()[1]) for x in text.splitlines() if x.startswith("count ")]


def _wait_for(path, line, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in path.read_text().splitlines():
            return
        assert proc.poll() is None, (proc.returncode, path.read_text())
        time.sleep(0.05)
    pytest.fail(f"no {line!r} in {path} within {timeout:g} s: {path.read_text()!r}")


@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test [--cgroup v1] -- python -m pytest tests/test_checkpoint.py")
@pytest.mark.parametrize("requeue", ["replaced", "truncated"])
def test_a_job_whose_output_file_was_reopened_restores_into_the_new_one(key, tmp_path, requeue):
    out, ck = tmp_path / "slurm-1.out", tmp_path / "ck"
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    job_id = f"ckio-{requeue}"
    # Slurm's first open of the batch output file: stdout and stderr, one description
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        job = subprocess.Popen([STARTER, "run", "--id", job_id, "--user", "65534", "--report", str(r1),
                                "--on-vacate", f"checkpoint:{ck}", "--grace", "120", "--", "sh", "-c", COUNTER],
                               stdin=subprocess.DEVNULL, stdout=fd, stderr=fd)
    finally:
        os.close(fd)
    restored = None
    try:
        _wait_for(out, "count 5", job, 60 * SLOWDOWN)
        subprocess.run([STARTER, "vacate", job_id], check=True, capture_output=True, timeout=30)
        assert job.wait(timeout=300) == 137, out.read_text()
        assert json.loads(r1.read_text())["reason"] == "checkpointed", out.read_text()
        before = out.read_text()            # up to the image: the dump left the job stopped, then the kill
        assert "done" not in before, before
        last = max(_counts(before))
        assert last >= 5 and _counts(before) == list(range(1, last + 1)), before
        ino = os.stat(out).st_ino
        if requeue == "replaced":           # a new, empty file in its place: another inode
            new = tmp_path / "slurm-1.out.new"
            new.write_bytes(b"")
            os.rename(new, out)
            assert os.stat(out).st_ino != ino
            flags = os.O_WRONLY | os.O_APPEND       # --open-mode=append
        else:                               # the same inode, cut below the offset the job had reached
            flags = os.O_WRONLY | os.O_TRUNC        # Slurm's default open mode
        fd = os.open(out, flags | os.O_CLOEXEC)
        try:
            assert (os.stat(out).st_ino == ino) == (requeue == "truncated")
            assert os.fstat(fd).st_size == 0
            os.write(fd, b"requeued\n")     # what the batch script says before it restores
            restored = subprocess.Popen([STARTER, "run", "--restore", str(ck), "--report", str(r2)],
                                        stdin=subprocess.DEVNULL, stdout=fd, stderr=fd)
        finally:
            os.close(fd)
        assert restored.wait(timeout=300 * SLOWDOWN) == 7, out.read_text()
        after = out.read_text()
        assert "\0" not in after, after         # no hole where the old offset was
        lines = after.splitlines()
        assert lines[0] == "requeued", after
        # the counter goes on from exactly where the image was, into the new file
        assert _counts(after) == list(range(last + 1, 41)), (last, after)
        assert lines[-1] == "done 40", after
        rep = json.loads(r2.read_text())
        assert rep["reason"] == "exited" and rep["exit_code"] == 7 and len(rep["segments"]) == 2, rep
    finally:
        _end(job, restored)


def test_the_restore_hands_criu_its_own_stdio_as_they_are():
    """Where the job's fds 0-2 were files of the host, CRIU is given the
    restore's own fd under both of the names it may look one up by: its
    name as a restored file (the record's less its first character), which
    it takes as it is, and the external name, which it would reopen.
    Where stdin and stdout or stderr were the same file (each its own
    open), one fd cannot stand for both: only the external name, and CRIU
    reopens the restore's stdin for each."""
    from starter.checkpoint import criu as checkpoint

    slurm = {"0": "file[1a:4]", "1": "file[2b:9f]", "2": "file[2b:9f]"}
    assert checkpoint.inherited_stdio(slurm) == [("0", "file[1a:4]"), ("0", "ile[1a:4]"), ("1", "file[2b:9f]"),
                                                 ("1", "ile[2b:9f]"), ("2", "file[2b:9f]")]
    pipes = {"0": "file[1a:4]", "1": "pipe:[77]", "2": "pipe:[78]"}
    assert checkpoint.inherited_stdio(pipes) == [("0", "file[1a:4]"), ("0", "ile[1a:4]"), ("1", "pipe:[77]"),
                                                 ("2", "pipe:[78]")]
    nulls = {"0": "file[1a:4]", "1": "file[1a:4]", "2": "pipe:[78]"}
    assert checkpoint.inherited_stdio(nulls) == [("0", "file[1a:4]"), ("1", "file[1a:4]"), ("2", "pipe:[78]")]
