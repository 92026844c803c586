"""What the privilege-boundary tests share (tests/test_privilege.py,
tests/test_inherited.py): the job's user for each case, the one-line error
check, a job held running while a probe looks at it."""

import os
import pwd
import subprocess

import pytest

from conftest import STARTER, wait_running

USERS = {"default": [], "nobody": ["--user", "nobody"]}
JOB_ACCOUNT = "starter-job"
# The default job's own (transient) uid, pinned by a one-uid range in the
# node policy so that a test knows it in advance (starter/callers/uids.py).
TRANSIENT_UID = 1879048192 + 4242


@pytest.fixture(params=sorted(USERS))
def who(request):
    """(options, host uid, host gid) of the job's user."""
    if request.param == "default":
        request.getfixturevalue("policy")(defaults=f'job_uids = "{TRANSIENT_UID}-{TRANSIENT_UID}"\n')
        return USERS["default"], TRANSIENT_UID, TRANSIENT_UID
    pw = pwd.getpwnam(request.param)
    return USERS[request.param], pw.pw_uid, pw.pw_gid


def _one_line_error(p, *words):
    assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("starter: "), p.stderr
    for w in words:
        assert w in lines[0], p.stderr


def _running(job_id, opts, script, state_dir, starter, probe=lambda entry: None):
    """Start a job whose script prints lines and then "DONE"; -> (lines before
    DONE, probe(its state entry) called while it still runs, the stderr), the
    job killed and waited for."""
    proc = subprocess.Popen([STARTER, "run", "--id", job_id, *opts, "--", "sh", "-c",
                             script + "\necho DONE; exec sleep 300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, entry, seen, err = [], None, None, ""
    try:
        for line in proc.stdout:  # the job says when it is done: no sleeps
            if line.strip() == "DONE":
                # The job may print before its starter records "running".
                entry = wait_running(state_dir, job_id, proc)
                seen = probe(entry)
                break
            out.append(line.rstrip("\n"))
    finally:
        if proc.poll() is None and entry is not None:
            starter("kill", job_id)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    return out, seen, err
