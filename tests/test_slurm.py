"""starter under a real Slurm: a private single-node cluster per test (tests/slurm.py).

Each test runs once with proctrack/linuxproc and once with proctrack/cgroup (v1 freezer
and cpuset, task/cgroup ConstrainCores). The `plain` tests check the harness itself with
ordinary commands, so a starter failure is never confused with a broken Slurm.

How starter is meant to be used under Slurm (and what these tests hold it to):
  srun starter run ... -- CMD          the step's exit code is the job's
  sbatch: `exec starter run ... -- CMD` starter IS the batch shell, so
                                        `scancel --batch -s SIG` reaches it alone
  scancel JOBID                         SIGTERM to every process of the step -> vacate
  scontrol suspend/resume               SIGTSTP, then SIGSTOP (freezer with
                                        proctrack/cgroup) / SIGCONT: the job must stop
                                        and go on; starter's cgroups nest under the step's
"""

import json
import os
import random
import re
import shlex
import signal
import time

import pytest

from slurm import SlurmCluster, parse_exit_code, parse_scontrol_record, skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTER = os.path.join(REPO, ".venv", "bin", "starter")

# Vacate grace (SIGTERM -> SIGKILL inside starter); well under the cluster's KillWait,
# so starter always finishes its report before Slurm's own SIGKILL.
GRACE = "3"
KILL_WAIT = 10


@pytest.fixture(params=["linuxproc", "cgroup"])
def slurm(request, tmp_path):
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", proctrack=request.param, kill_wait=KILL_WAIT) as cluster:
        yield cluster


# ---------------------------------------------------------------- helpers

def starter_run(state_dir, report, *options):
    """argv prefix: starter run with a private state dir and a report file, then `--`."""
    return [STARTER, "run", "--state-dir", str(state_dir), "--report", str(report),
            *options, "--"]


def batch_script(argv):
    """A batch script whose shell becomes `argv` (exec), so starter is the batch shell."""
    return "#!/bin/sh\nexec %s\n" % " ".join(_sh(a) for a in argv)


def _sh(arg):
    # $SLURM_JOB_ID is the one thing the batch shell expands for us.
    if "$SLURM_JOB_ID" in arg:
        return '"%s"' % arg.replace('"', '\\"')
    return shlex.quote(arg)


def wait_for(cond, what, timeout, slurm=None, jobid=None, interval=0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail("timed out after %ss waiting for %s\n%s"
                        % (timeout, what, slurm.logs(jobid) if slurm else ""))
        time.sleep(interval)


def read_report(path, slurm, jobid=None, timeout=15):
    def load():
        try:
            with open(path) as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None
    return wait_for(load, "the report %s" % path, timeout, slurm, jobid)


def output_lines(slurm, jobid):
    return slurm.job_output(jobid).splitlines()


def counter_lines(slurm, jobid):
    return sum(1 for l in output_lines(slurm, jobid) if l.isdigit())


COUNTER = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"


def token():
    """A unique sleep duration: finds the process on the host by its argv, whatever
    pid namespace it runs in."""
    return "1000.%08d" % random.randrange(10 ** 8)


def pids_with_argv(*argv):
    """Host pids whose argv is exactly `argv`. comm is checked first: reading another
    process's cmdline takes its mmap lock and can stall on a process someone froze."""
    want = ("\0".join(argv) + "\0").encode()
    comm = os.path.basename(argv[0])[:15]
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/comm" % entry) as f:
                    if f.read().rstrip("\n") != comm:
                        continue
                with open("/proc/%s/cmdline" % entry, "rb") as f:
                    if f.read() == want:
                        found.append(int(entry))
            except OSError:
                pass
    return found


def kill_pids(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_suspends_and_resumes(slurm, jobid):
    """The job prints a counter; suspended it must stop, resumed it must go on."""
    wait_for(lambda: counter_lines(slurm, jobid) >= 3, "the job to start counting", 30,
             slurm, jobid)
    slurm.scontrol("suspend", jobid)
    slurm.wait_state(jobid, "SUSPENDED", timeout=10)

    # Slurm sends SIGTSTP, waits 2 s, then SIGSTOP (a freezer freeze with
    # proctrack/cgroup): wait for the count to settle, then check it stays put.
    def settled():
        before = counter_lines(slurm, jobid)
        time.sleep(1.0)
        return counter_lines(slurm, jobid) == before
    wait_for(settled, "the suspended job to stop counting", 15, slurm, jobid, interval=0)
    frozen = counter_lines(slurm, jobid)
    time.sleep(1.5)
    assert counter_lines(slurm, jobid) == frozen, "the job made progress while suspended"

    slurm.scontrol("resume", jobid)
    slurm.wait_state(jobid, "RUNNING", timeout=10)
    wait_for(lambda: counter_lines(slurm, jobid) > frozen + 2,
             "the resumed job to count on", 10, slurm, jobid)


# ---------------------------------------------------------------- parsers (no Slurm)

SCONTROL_JOB = (
    "JobId=1 JobName=exit seven UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "JobState=FAILED Reason=NonZeroExitCode Dependency=(null) ExitCode=7:0 "
    "RunTime=00:00:00 AllocNode:Sid=localhost:6689 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,node=1,billing=1 CPUs/Task=1 Command=/tmp/a dir/job.sh Power= \n")


def test_parse_scontrol_record():
    rec = parse_scontrol_record(SCONTROL_JOB)
    assert rec["JobState"] == "FAILED"
    assert rec["ExitCode"] == "7:0"
    assert rec["JobName"] == "exit seven"
    assert rec["AllocNode:Sid"] == "localhost:6689"
    assert rec["TRES"] == "cpu=1,node=1,billing=1"
    assert rec["CPUs/Task"] == "1"
    assert rec["Command"] == "/tmp/a dir/job.sh"
    assert rec["Power"] == ""


def test_parse_exit_code():
    assert parse_exit_code("7:0") == (7, 0)
    assert parse_exit_code("0:15") == (0, 15)
    assert parse_exit_code("3") == (3, 0)


# ---------------------------------------------------------------- the harness itself

@pytest.mark.slurm
def test_plain_srun_exit_codes(slurm):
    assert slurm.srun(["/bin/true"]).returncode == 0
    assert slurm.srun(["sh", "-c", "exit 3"]).returncode == 3


@pytest.mark.slurm
def test_plain_sbatch_exit_code_and_file(slurm, tmp_path):
    out = tmp_path / "written"
    jobid = slurm.sbatch("#!/bin/sh\necho hello > %s\nexit 5\n" % shlex.quote(str(out)))
    assert slurm.wait_job(jobid, timeout=30) == ("FAILED", 5)
    assert slurm.job_info(jobid)["ExitCode"] == "5:0"
    assert out.read_text() == "hello\n"


@pytest.mark.slurm
def test_plain_scancel(slurm):
    jobid = slurm.sbatch("#!/bin/sh\necho started\nexec sleep 300\n")
    wait_for(lambda: "started" in output_lines(slurm, jobid), "the job to start", 30,
             slurm, jobid)
    slurm.scancel(jobid)
    state, _ = slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    assert state == "CANCELLED"


@pytest.mark.slurm
def test_plain_suspend_resume(slurm):
    jobid = slurm.sbatch("#!/bin/sh\n%s\n" % COUNTER)
    assert_suspends_and_resumes(slurm, jobid)
    slurm.scancel(jobid)
    slurm.wait_job(jobid, timeout=KILL_WAIT + 20)


# ---------------------------------------------------------------- starter under Slurm

@pytest.mark.slurm
def test_srun_exit_code_and_report(slurm, tmp_path, state_dir):
    report = tmp_path / "report.json"
    r = slurm.srun(starter_run(state_dir, report) + ["sh", "-c", "exit 7"], timeout=60)
    assert r.returncode == 7, (r.stdout, r.stderr)
    rep = read_report(report, slurm)
    assert rep["exit_code"] == 7
    assert rep["reason"] == "exited"
    assert rep["signal"] is None


@pytest.mark.slurm
def test_sbatch_exec_exit_code_and_report(slurm, tmp_path, state_dir):
    report = tmp_path / "report.json"
    jobid = slurm.sbatch(batch_script(
        starter_run(state_dir, report, "--id", "slurm-$SLURM_JOB_ID") + ["sh", "-c", "exit 7"]))
    state, code = slurm.wait_job(jobid, timeout=60)
    assert (state, code) == ("FAILED", 7), slurm.logs(jobid)
    assert slurm.job_info(jobid)["ExitCode"] == "7:0"
    rep = read_report(report, slurm, jobid)
    assert rep["exit_code"] == 7
    assert rep["reason"] == "exited"
    assert rep["job_id"] == "slurm-%s" % jobid


@pytest.mark.slurm
def test_scancel_vacates_with_report(slurm, tmp_path, state_dir):
    """scancel: SIGCONT+SIGTERM to every process of the step, SIGKILL after KillWait.
    starter takes the SIGTERM as vacate and writes its report before the SIGKILL."""
    report = tmp_path / "report.json"
    jobid = slurm.sbatch(batch_script(
        starter_run(state_dir, report, "--grace", GRACE)
        + ["sh", "-c", "echo started; exec sleep 300"]))
    wait_for(lambda: "started" in output_lines(slurm, jobid), "the job to start", 30,
             slurm, jobid)
    slurm.scancel(jobid)
    state, _ = slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    assert state == "CANCELLED"
    rep = read_report(report, slurm, jobid)
    assert rep["reason"] == "vacated", rep


@pytest.mark.slurm
def test_scancel_batch_usr1_vacates(slurm, tmp_path, state_dir):
    """`scancel --batch -s USR1` signals the batch shell only: starter (exec'd) maps
    USR1 to vacate; the job itself never sees USR1 (it would die of it: 'signaled')."""
    report = tmp_path / "report.json"
    jobid = slurm.sbatch(batch_script(
        starter_run(state_dir, report, "--grace", GRACE, "--on-signal", "USR1=vacate")
        + ["sh", "-c", "echo started; exec sleep 300"]))
    wait_for(lambda: "started" in output_lines(slurm, jobid), "the job to start", 30,
             slurm, jobid)
    slurm.scancel(jobid, signal="USR1", batch=True)
    state, _ = slurm.wait_job(jobid, timeout=30)
    rep = read_report(report, slurm, jobid)
    assert rep["reason"] == "vacated", (state, rep)


@pytest.mark.slurm
def test_suspend_resume_through_starter(slurm, tmp_path, state_dir):
    report = tmp_path / "report.json"
    jobid = slurm.sbatch(batch_script(
        starter_run(state_dir, report, "--grace", GRACE) + ["sh", "-c", COUNTER]))
    assert_suspends_and_resumes(slurm, jobid)
    slurm.scancel(jobid)
    slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    read_report(report, slurm, jobid)


@pytest.mark.slurm
def test_double_forked_daemon_is_cleaned_up(slurm, tmp_path, state_dir):
    """A setsid daemon that double-forks away from the job (which plain Slurm with
    proctrack/linuxproc loses track of) must be gone once the job ends."""
    report = tmp_path / "report.json"
    tok = token()
    daemon = "(setsid sh -c 'echo daemon $$; exec sleep %s' </dev/null &); sleep 4" % tok
    jobid = slurm.sbatch(batch_script(starter_run(state_dir, report) + ["sh", "-c", daemon]))
    try:
        wait_for(lambda: pids_with_argv("sleep", tok), "the daemon to run", 30, slurm, jobid)
        state, code = slurm.wait_job(jobid, timeout=60)
        assert (state, code) == ("COMPLETED", 0), slurm.logs(jobid)
        deadline = time.monotonic() + 10
        while pids_with_argv("sleep", tok) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = pids_with_argv("sleep", tok)
        assert not left, "the job's daemon outlived the job: pids %s" % left
    finally:
        kill_pids(pids_with_argv("sleep", tok))
    read_report(report, slurm, jobid)


@pytest.mark.slurm
def test_steps_finish_promptly(slurm, tmp_path, state_dir):
    """Nothing starter does (its own cgroups nested in Slurm's, with proctrack/cgroup)
    may keep a step from ending: each srun and the batch job end within bounds."""
    for i in range(3):
        report = tmp_path / ("srun-%d.json" % i)
        r = slurm.srun(starter_run(state_dir, report) + ["/bin/true"], timeout=30)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert read_report(report, slurm)["exit_code"] == 0
    report = tmp_path / "batch.json"
    jobid = slurm.sbatch(batch_script(starter_run(state_dir, report) + ["/bin/true"]))
    assert slurm.wait_job(jobid, timeout=30) == ("COMPLETED", 0), slurm.logs(jobid)
    assert read_report(report, slurm, jobid)["exit_code"] == 0


@pytest.mark.slurm
def test_job_stays_inside_the_steps_cgroups(slurm, tmp_path, state_dir):
    """With proctrack/cgroup, Slurm tracks, freezes and kills the step through its
    freezer cgroup: starter must nest its cgroups below the step's, never move the job
    out of them."""
    if slurm.proctrack != "cgroup":
        pytest.skip("only proctrack/cgroup puts the step in cgroups of its own")
    report = tmp_path / "report.json"
    tok = token()
    jobid = slurm.sbatch(batch_script(
        starter_run(state_dir, report, "--grace", GRACE) + ["sleep", tok]))
    try:
        pid = wait_for(lambda: pids_with_argv("sleep", tok), "the job to run", 30,
                       slurm, jobid)[0]
        with open("/proc/%d/cgroup" % pid) as f:
            paths = dict(re.match(r"\d+:([^:]*):(.*)", l).groups() for l in f.read().splitlines())
        step = "/slurm_%s/uid_0/job_%s/step_batch" % (slurm.node, jobid)
        for ctrl in ("freezer", "cpuset"):
            assert (paths[ctrl] + "/").startswith(step + "/"), (ctrl, paths[ctrl], step)
    finally:
        slurm.scancel(jobid)
        slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
        kill_pids(pids_with_argv("sleep", tok))
    assert read_report(report, slurm, jobid)["reason"] == "vacated"
