"""starter under a real Slurm: a private single-node cluster per test (tests/slurm.py).

The `plain` tests check the harness itself with ordinary commands, so a starter failure
is never confused with a broken Slurm: root submits, once with proctrack/linuxproc and
once with proctrack/cgroup (v1 freezer and cpuset, task/cgroup ConstrainCores).

Each starter scenario runs four times: those two proctrack kinds, each with root
submitting (`starter run --state-dir ...` as root) and with an ordinary user submitting:
nobody (65534), whose batch scripts and steps run the set-user-ID `starter` (the relay
and the root starter of native/launcher.c). nobody works with Slurm as it is (slurmctld
takes its jobs, slurmstepd runs them as 65534), so no test account is made. The user
runs sbatch, srun and scancel (through setpriv); scontrol suspend/resume stays root's,
an operator's command. Its starter gets the state directory from the node policy (the
`policy` fixture, written before any job starts) and writes its report into a
directory it owns (`home`).

How starter is meant to be used under Slurm (and what these tests hold it to):
  srun starter run ... -- CMD          the step's exit code is the job's
  sbatch: `exec starter run ... -- CMD` starter IS the batch shell (for a user: the
                                        relay is), so `scancel --batch -s SIG`
                                        reaches it alone
  scancel JOBID                         SIGTERM to every process of the step -> vacate
  scontrol suspend/resume               SIGTSTP, then SIGSTOP (freezer with
                                        proctrack/cgroup) / SIGCONT: the job must stop
                                        and go on; starter's cgroups nest under the step's

What reaches a user's job, as run here (Slurm 22.05, this hybrid host). The batch shell
is the relay (uid 65534, in Slurm's session), its child the root starter (setsid: a
session of its own), and its children the job's processes (sessions of their own, in a
PID namespace).

  proctrack/linuxproc finds a step's processes by their parent links in /proc, not by
  session or process group, and slurmstepd signals as root: every signal it sends
  reaches the relay, the root starter and each job process alike.
  - scancel: SIGTERM to all. The root starter vacates on its own SIGTERM (the relay's
    forwarded copy is the same vacate); the job's processes get Slurm's SIGTERM
    directly too, as under a root starter. After KillWait, SIGKILL to all.
  - scontrol suspend: the SIGTSTP changes nothing. The relay forwards it as a byte the
    starter has no action for; the root starter's and the job's process groups are
    orphaned (their session leaders' parents are in other sessions), and the kernel
    discards SIGTSTP for those. 2 s later SIGSTOP stops the relay, the root starter and
    every job process (state T), the job's PID 1 too (a SIGSTOP from an ancestor PID
    namespace is always delivered). resume: SIGCONT to all, and everything goes on.
  - what linuxproc cannot do: suspend the job *through* the starter. It stops the
    starter itself with the job: `starter ps` still says running, no "suspended"
    event is written, and nothing the starter does (the caller's relayed signals, the
    wall-time check) happens until resume. To have the starter suspend the job itself
    (its freezer, state "suspended"), signal the batch shell: `scancel --batch -s USR1`
    (USR1 suspends, USR2 resumes, unless --on-signal maps them otherwise).
  proctrack/pgid (not in this suite; run by hand the same way): Slurm signals only the
  batch shell's process group, which the root starter left (setsid). scontrol suspend
  then stops the relay alone and the job runs on (root's starter: it stops the starter,
  not the job); scancel still vacates through the relay. Use linuxproc or cgroup.

  proctrack/cgroup freezes the step's freezer cgroup: the relay, the root starter and
  the job stop together (the job stays in the step's freezer and cpuset cgroups; the
  starter nests its own only in the hierarchies it uses), as with linuxproc's SIGSTOP.
  Slurm 22.05's cgroup/v1 gives the step's directory (.../uid_U/job_J/step_S) to the
  job's user (the files inside stay root's). The starter refuses a caller whose cgroup
  is such a directory in a hierarchy it uses (its user could make a cgroup there and
  move the job's processes into it, out of the job's limits and kill): exit 125, "the
  caller's cgroup ... is not root's alone". On this hybrid host the starter uses
  cgroup2 and the memory, pids, cpu, cpuacct and blkio hierarchies, not freezer or
  cpuset, so proctrack/cgroup with ConstrainCores serves users, and ConstrainRAMSpace
  (a memory cgroup of the user's) refuses every user's job
  (test_user_refused_where_slurm_gives_the_step_cgroup_away). On a cgroup v1-only node
  the starter uses the freezer hierarchy too, so proctrack/cgroup alone refuses users
  (from the code; no Slurm runs in the test VMs).
"""

import json
import os
import random
import re
import shlex
import signal
import time

import pytest

from conftest import GID, UID
from slurm import SlurmCluster, parse_exit_code, parse_scontrol_record, skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTER = os.path.join(REPO, ".venv", "bin", "starter")

# Vacate grace (SIGTERM -> SIGKILL inside starter); well under the cluster's KillWait,
# so starter always finishes its report before Slurm's own SIGKILL.
GRACE = "3"
KILL_WAIT = 10


PROCTRACKS = ["linuxproc", "cgroup"]


@pytest.fixture(params=PROCTRACKS)
def slurm(request, tmp_path):
    """The harness checks: root submits."""
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", proctrack=request.param, kill_wait=KILL_WAIT) as cluster:
        yield cluster


class Site:
    """A private Slurm and who submits to it: root, or an ordinary user (nobody)
    whose batch scripts and steps run the set-user-ID `starter`.

    The user's starter gets its state directory from the node policy (the `policy`
    fixture, written before any job starts: a caller's environment is emptied and
    --state-dir is root's alone), and writes its report into a directory the user
    owns (`home`); root's gets --state-dir and pytest's tmp dir."""

    def __init__(self, slurm, who, reports, state_dir):
        self.slurm, self.who, self.reports, self.state_dir = slurm, who, reports, state_dir

    def report(self, name="report.json"):
        return os.path.join(self.reports, name)

    def starter_run(self, report, *options):
        """argv prefix: starter run with the state dir and a report file, then `--`."""
        state = ["--state-dir", str(self.state_dir)] if self.who == "root" else []
        return [STARTER, "run", *state, "--report", str(report), *options, "--"]


@pytest.fixture(params=[(p, w) for w in ("root", "user") for p in PROCTRACKS],
                ids=lambda pw: "%s-%s" % pw)
def site(request, tmp_path, state_dir):
    proctrack, who = request.param
    reason = skip_reason(proctrack)
    if reason:
        pytest.skip(reason)
    if who == "root":
        with SlurmCluster(tmp_path / "slurm", proctrack=proctrack,
                          kill_wait=KILL_WAIT) as cluster:
            yield Site(cluster, who, str(tmp_path), state_dir)
        return
    # Set up before the cluster, so torn down after it: the policy outlives every job.
    request.getfixturevalue("policy")
    home = request.getfixturevalue("home")
    with SlurmCluster(None, proctrack=proctrack, kill_wait=KILL_WAIT,
                      user=(UID, GID)) as cluster:
        yield Site(cluster, who, home, state_dir)


# ---------------------------------------------------------------- helpers


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


@pytest.mark.fast
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


@pytest.mark.fast
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
def test_srun_exit_code_and_report(site):
    slurm, report = site.slurm, site.report()
    r = slurm.srun(site.starter_run(report) + ["sh", "-c", "exit 7"], timeout=60)
    assert r.returncode == 7, (r.stdout, r.stderr)
    rep = read_report(report, slurm)
    assert rep["exit_code"] == 7
    assert rep["reason"] == "exited"
    assert rep["signal"] is None


@pytest.mark.slurm
def test_sbatch_exec_exit_code_and_report(site):
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--id", "slurm-$SLURM_JOB_ID") + ["sh", "-c", "exit 7"]))
    state, code = slurm.wait_job(jobid, timeout=60)
    assert (state, code) == ("FAILED", 7), slurm.logs(jobid)
    assert slurm.job_info(jobid)["ExitCode"] == "7:0"
    rep = read_report(report, slurm, jobid)
    assert rep["exit_code"] == 7
    assert rep["reason"] == "exited"
    assert rep["job_id"] == "slurm-%s" % jobid


@pytest.mark.slurm
def test_scancel_vacates_with_report(site):
    """scancel: SIGCONT+SIGTERM to every process of the step, SIGKILL after KillWait.
    starter takes the SIGTERM as vacate and writes its report before the SIGKILL."""
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE)
        + ["sh", "-c", "echo started; exec sleep 300"]))
    wait_for(lambda: "started" in output_lines(slurm, jobid), "the job to start", 30,
             slurm, jobid)
    slurm.scancel(jobid)
    state, _ = slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    assert state == "CANCELLED"
    rep = read_report(report, slurm, jobid)
    assert rep["reason"] == "vacated", rep


@pytest.mark.slurm
def test_scancel_batch_usr1_vacates(site):
    """`scancel --batch -s USR1` signals the batch shell only: starter (exec'd) maps
    USR1 to vacate; the job itself never sees USR1 (it would die of it: 'signaled')."""
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE, "--on-signal", "USR1=vacate")
        + ["sh", "-c", "echo started; exec sleep 300"]))
    wait_for(lambda: "started" in output_lines(slurm, jobid), "the job to start", 30,
             slurm, jobid)
    slurm.scancel(jobid, signal="USR1", batch=True)
    state, _ = slurm.wait_job(jobid, timeout=30)
    rep = read_report(report, slurm, jobid)
    assert rep["reason"] == "vacated", (state, rep)


@pytest.mark.slurm
def test_suspend_resume_through_starter(site):
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE) + ["sh", "-c", COUNTER]))
    assert_suspends_and_resumes(slurm, jobid)
    slurm.scancel(jobid)
    slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    read_report(report, slurm, jobid)


@pytest.mark.slurm
def test_double_forked_daemon_is_cleaned_up(site):
    """A setsid daemon that double-forks away from the job (which plain Slurm with
    proctrack/linuxproc loses track of) must be gone once the job ends."""
    slurm, report = site.slurm, site.report()
    tok = token()
    daemon = "(setsid sh -c 'echo daemon $$; exec sleep %s' </dev/null &); sleep 4" % tok
    jobid = slurm.sbatch(batch_script(site.starter_run(report) + ["sh", "-c", daemon]))
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
def test_steps_finish_promptly(site):
    """Nothing starter does (its own cgroups nested in Slurm's, with proctrack/cgroup)
    may keep a step from ending: each srun and the batch job end within bounds."""
    slurm = site.slurm
    for i in range(3):
        report = site.report("srun-%d.json" % i)
        r = slurm.srun(site.starter_run(report) + ["/bin/true"], timeout=30)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert read_report(report, slurm)["exit_code"] == 0
    report = site.report("batch.json")
    jobid = slurm.sbatch(batch_script(site.starter_run(report) + ["/bin/true"]))
    assert slurm.wait_job(jobid, timeout=30) == ("COMPLETED", 0), slurm.logs(jobid)
    assert read_report(report, slurm, jobid)["exit_code"] == 0


@pytest.mark.slurm
def test_job_stays_inside_the_steps_cgroups(site):
    """With proctrack/cgroup, Slurm tracks, freezes and kills the step through its
    freezer cgroup: starter must nest its cgroups below the step's, never move the job
    out of them."""
    slurm, report = site.slurm, site.report()
    if slurm.proctrack != "cgroup":
        pytest.skip("only proctrack/cgroup puts the step in cgroups of its own")
    tok = token()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE) + ["sleep", tok]))
    try:
        pid = wait_for(lambda: pids_with_argv("sleep", tok), "the job to run", 30,
                       slurm, jobid)[0]
        with open("/proc/%d/cgroup" % pid) as f:
            paths = dict(re.match(r"\d+:([^:]*):(.*)", l).groups() for l in f.read().splitlines())
        step = "/slurm_%s/uid_%d/job_%s/step_batch" % (slurm.node, slurm.uid, jobid)
        for ctrl in ("freezer", "cpuset"):
            assert (paths[ctrl] + "/").startswith(step + "/"), (ctrl, paths[ctrl], step)
    finally:
        slurm.scancel(jobid)
        slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
        kill_pids(pids_with_argv("sleep", tok))
    assert read_report(report, slurm, jobid)["reason"] == "vacated"


@pytest.mark.slurm
def test_user_refused_where_slurm_gives_the_step_cgroup_away(policy, home):
    """task/cgroup ConstrainRAMSpace puts the step in a memory cgroup whose directory
    Slurm (cgroup/v1) gives to the job's user: a user's starter refuses to nest the
    job's cgroups there (one line, exit 125, a report that says starter_error),
    before the job starts."""
    reason = skip_reason("cgroup")
    if reason:
        pytest.skip(reason)
    with SlurmCluster(None, proctrack="cgroup", kill_wait=KILL_WAIT, constrain_ram=True,
                      user=(UID, GID)) as slurm:
        report = os.path.join(home, "report.json")
        jobid = slurm.sbatch(batch_script(
            [STARTER, "run", "--report", report, "--", "sh", "-c", "echo job ran"]))
        assert slurm.wait_job(jobid, timeout=30) == ("FAILED", 125), slurm.logs(jobid)
        out = slurm.job_output(jobid)
        step = "/sys/fs/cgroup/memory/slurm_%s/uid_%d/job_%s/step_batch" % (slurm.node, UID, jobid)
        assert "the caller's cgroup %s is not root's alone (owner uid %d" % (step, UID) in out, out
        assert "job ran" not in out
        rep = read_report(report, slurm, jobid)
        assert rep["reason"] == "starter_error" and rep["exit_code"] == 125, rep
