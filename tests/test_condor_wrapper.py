"""The HTCondor job wrappers of docs/admin-guide.md ("Under HTCondor"), run as the
guide prints them, by an ordinary job owner.

HTCondor's condor_starter runs USER_JOB_WRAPPER as the job's owner, never as root:
the wrapper reaches the root starter only through the set-user-ID `starter`. Each
wrapper is taken from the guide's code block that names
/usr/local/libexec/starter-condor-wrapper in its second line (so the guide cannot
drift from what is tested), with one change: /usr/bin/starter, where the guide links
the command, is this checkout's .venv/bin/starter. It is installed root's 0755 in a
temporary directory and run as nobody (setpriv) with the job's argv appended, in the
job's scratch directory (nobody's, under a root-owned execute directory) and with the environment condor_starter
gives a job: _CONDOR_SCRATCH_DIR, _CONDOR_JOB_AD, _CONDOR_MACHINE_AD, _CONDOR_JOB_IWD,
_CONDOR_WRAPPER_ERROR_FILE, _CHIRP_CONFIG, TMPDIR, and a PATH. The node policy
(the `policy` fixture) gives the state directory.

condor_config_val and condor_chirp are stand-ins: HTCondor is not installed here.
condor_config_val answers LIBEXEC; condor_chirp writes its argv, one call a line, to
a file in the scratch directory. What the guide promises and is checked: the job's
exit code is the wrapper's; the report lands in the scratch directory, the caller's
file; SIGTERM (HTCondor's default KillSig) vacates; SIGUSR1/SIGUSR2 suspend and resume
through the starter; the ClassAd wrapper publishes the Network* and Starter* lines of
the report with `condor_chirp set_job_attr NAME VALUE` and nothing else, and forwards
the signals; and the job gets the wrapper's stdin (HTCondor's `input =` file).
"""

import json
import os
import re
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import GID, REPO, SLOWDOWN, STARTER, UID

GUIDE = os.path.join(REPO, "docs", "admin-guide.md")
INSTALLED = "/usr/local/libexec/starter-condor-wrapper"
# PID 1 of the job's PID namespace gets no default action for SIGTERM: the job says
# what TERM does (as a job that wants to be vacated cleanly would).
TRAP = "trap 'exit 143' TERM; "


def guide_wrappers():
    """The guide's wrappers: the sh code blocks under "## Under HTCondor" whose second
    line is the `# /usr/local/libexec/starter-condor-wrapper...` comment."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Under HTCondor\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.S | re.M)
    return [b for b in blocks if b.split("\n")[1].startswith("# " + INSTALLED)]


def wrapper(kind):
    """'exec': the plain wrapper (starter is exec'd); 'classad': the one that
    publishes the report with condor_chirp."""
    found = [b for b in guide_wrappers() if ("condor_chirp" in b) == (kind == "classad")]
    assert len(found) == 1, (kind, found)
    return found[0]


def test_the_guide_has_both_wrappers():
    blocks = guide_wrappers()
    assert len(blocks) == 2, blocks
    for b in blocks:
        assert b.startswith("#!/bin/sh\n") and "/usr/bin/starter run " in b, b
        # A job owner's wrapper: nothing only root may ask for.
        for opt in ("--user", "--group", "--state-dir", "--cgroup-parent"):
            assert opt not in b, (opt, b)


@pytest.fixture
def condor(policy):
    """install(kind) -> argv of the installed wrapper; run(...) starts it as the job
    owner with condor_starter's environment. Stand-ins for condor_config_val and
    condor_chirp in a root-owned bin directory. The scratch directory is laid out as
    HTCondor's: EXECUTE root's 0755, dir_N the owner's 0700, outside /tmp and /var/tmp
    (a job gets private ones, so a scratch there would not be its working directory)."""
    root = tempfile.mkdtemp(prefix="starter-condor-", dir="/var/lib")
    os.chmod(root, 0o755)
    bindir, libexec = os.path.join(root, "bin"), os.path.join(root, "libexec")
    os.mkdir(bindir, 0o755)
    os.mkdir(libexec, 0o755)
    os.mkdir(os.path.join(root, "execute"), 0o755)
    scratch = os.path.join(root, "execute", "dir_4242")
    os.mkdir(scratch, 0o700)
    os.chown(scratch, UID, GID)
    chirp_log = os.path.join(scratch, ".chirp-calls")

    def put(path, text):
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)

    put(os.path.join(bindir, "condor_config_val"),
        '#!/bin/sh\n[ "$1" = LIBEXEC ] && echo %s\n' % libexec)
    put(os.path.join(libexec, "condor_chirp"),
        '#!/bin/sh\nprintf "%%s\\t" "$@" >> %s\necho >> %s\n' % (chirp_log, chirp_log))
    with open(os.path.join(scratch, ".job.ad"), "w") as f:
        f.write('ClusterId = 42\nProcId = 0\nOwner = "nobody"\nCmd = "/bin/sh"\n'
                'KillSig = "SIGTERM"\nWantIOProxy = true\n')
    with open(os.path.join(scratch, ".machine.ad"), "w") as f:
        f.write('Name = "slot1@node"\nCpus = 1\nMemory = 1024\n')
    with open(os.path.join(scratch, ".chirp.config"), "w") as f:
        f.write("127.0.0.1 9618 cookie\n")
    for n in (".job.ad", ".machine.ad", ".chirp.config"):
        os.chown(os.path.join(scratch, n), UID, GID)

    class Condor:
        pass

    c = Condor()
    c.scratch, c.chirp_log, c.procs = scratch, chirp_log, []
    c.env = {
        "PATH": bindir + ":/usr/local/bin:/usr/bin:/bin",
        "_CONDOR_SCRATCH_DIR": scratch,
        "_CONDOR_JOB_AD": os.path.join(scratch, ".job.ad"),
        "_CONDOR_MACHINE_AD": os.path.join(scratch, ".machine.ad"),
        "_CONDOR_JOB_IWD": scratch,
        "_CONDOR_WRAPPER_ERROR_FILE": os.path.join(scratch, ".job_wrapper_failure"),
        "_CHIRP_CONFIG": os.path.join(scratch, ".chirp.config"),
        "TMPDIR": scratch,
        "BATCH_SYSTEM": "HTCondor",
    }

    def install(kind):
        text = wrapper(kind)
        assert text.count("/usr/bin/starter") == 1, text
        path = os.path.join(libexec, "starter-condor-wrapper-" + kind)
        put(path, text.replace("/usr/bin/starter", STARTER))
        return path

    def start(kind, *job, stdin=subprocess.DEVNULL):
        argv = ["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", install(kind), *job]
        p = subprocess.Popen(argv, cwd=scratch, env=c.env, stdin=stdin, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        c.procs.append(p)
        return p

    def run(kind, *job, timeout=60, stdin=subprocess.DEVNULL):
        p = start(kind, *job, stdin=stdin)
        out, err = p.communicate(timeout=timeout * SLOWDOWN)
        return p.returncode, out, err

    c.install, c.start, c.run = install, start, run
    yield c
    for p in c.procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for fh in (p.stdout, p.stderr):
            if fh:
                fh.close()
    subprocess.run(["rm", "-rf", "--one-file-system", root], check=True)


def owned_by_caller(path):
    st = os.stat(path)
    assert (st.st_uid, st.st_gid) == (UID, GID), path


def wait_entry_state(state_dir, want, timeout=10):
    deadline = time.monotonic() + timeout * SLOWDOWN
    entry = {}
    while time.monotonic() < deadline:
        ids = [n[:-5] for n in os.listdir(state_dir) if n.endswith(".json")] if os.path.isdir(state_dir) else []
        try:
            entry = json.loads(open(os.path.join(state_dir, ids[0] + ".json")).read()) if ids else {}
        except (OSError, ValueError):
            entry = {}
        if entry.get("state") == want:
            return entry
        time.sleep(0.05)
    pytest.fail(f"the job's state did not become {want!r}: {entry}")


def wait_line(p, want):
    line = p.stdout.readline().strip()
    assert line == want, (line, p.stderr.read() if p.poll() is not None else "")


# ---------------------------------------------------------------- the exec wrapper

def test_exec_wrapper_exit_code_and_report(condor):
    rc, out, err = condor.run("exec", "sh", "-c", "id -u; pwd; exit 7")
    assert rc == 7, (out, err)
    uid, cwd = out.split()
    assert uid == str(UID) and cwd == condor.scratch, out
    report = os.path.join(condor.scratch, ".starter-report.json")
    owned_by_caller(report)
    r = json.loads(open(report).read())
    assert (r["reason"], r["exit_code"]) == ("exited", 7), r
    assert re.fullmatch(r"condor-[\w.-]+-\d+", r["job_id"]), r["job_id"]


@pytest.mark.parametrize("wrapper", ["exec", "classad"])
def test_wrapper_stdin_reaches_the_job(condor, wrapper):
    """HTCondor's `input =` file: the ClassAd wrapper runs the starter in
    the background, where sh would give it /dev/null (the guide passes
    stdin through fd 3)."""
    with open(os.path.join(condor.scratch, "in.txt"), "w") as f:
        f.write("from the input file\n")
    with open(os.path.join(condor.scratch, "in.txt")) as f:
        rc, out, err = condor.run(wrapper, "cat", stdin=f)
    assert (rc, out) == (0, "from the input file\n"), err


def test_exec_wrapper_sigterm_vacates(condor, state_dir):
    p = condor.start("exec", "sh", "-c", TRAP + "echo up; sleep 60 & wait")
    wait_line(p, "up")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30 * SLOWDOWN) == 143, p.stderr.read()
    r = json.loads(open(os.path.join(condor.scratch, ".starter-report.json")).read())
    assert r["reason"] == "vacated", r


def suspend_resume_vacate(condor, state_dir, wrapper):
    """USR1 suspends the job through the wrapper, USR2 resumes it, TERM
    vacates it (143, the job's trap)."""
    p = condor.start(wrapper, "sh", "-c", TRAP + "echo up; sleep 60 & wait")
    wait_line(p, "up")
    p.send_signal(signal.SIGUSR1)
    wait_entry_state(state_dir, "suspended")
    p.send_signal(signal.SIGUSR2)
    wait_entry_state(state_dir, "running")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30 * SLOWDOWN) == 143, p.stderr.read()


def test_exec_wrapper_usr1_usr2_suspend_and_resume(condor, state_dir):
    suspend_resume_vacate(condor, state_dir, "exec")


# ---------------------------------------------------------------- the ClassAd wrapper

def chirp_calls(condor):
    try:
        with open(condor.chirp_log) as f:
            return [line.rstrip("\n").rstrip("\t").split("\t") for line in f if line.strip()]
    except FileNotFoundError:
        return []


def test_classad_wrapper_publishes_network_and_starter_attributes(condor):
    rc, out, err = condor.run("classad", "sh", "-c", "echo hi; exit 3")
    assert (rc, out) == (3, "hi\n"), err
    ad = os.path.join(condor.scratch, ".starter-report.ad")
    owned_by_caller(ad)
    lines = dict(line.split(" = ", 1) for line in open(ad).read().splitlines())
    assert lines["ExitCode"] == "3", lines
    want = [["set_job_attr", k, v] for k, v in lines.items() if k.startswith(("Network", "Starter"))]
    assert any(k.startswith("Starter") for _, k, _ in want), lines
    assert chirp_calls(condor) == want


def test_classad_wrapper_forwards_signals(condor, state_dir):
    suspend_resume_vacate(condor, state_dir, "classad")
    ad = open(os.path.join(condor.scratch, ".starter-report.ad")).read()
    assert 'StarterReason = "vacated"' in ad, ad
    assert ["set_job_attr", "StarterReason", '"vacated"'] in chirp_calls(condor)
