"""starter under a real Slurm: a private single-node cluster per test (tests/slurm.py).

The `plain` tests check the harness itself with ordinary commands, so a starter failure
is never confused with a broken Slurm: root submits, once with proctrack/linuxproc and
once with proctrack/cgroup and every constraint on (`constrained` below), where a job
past its --mem ends OUT_OF_MEMORY.

Slurm's cgroups follow the host's layout (tests/slurmhost.py): CgroupPlugin=cgroup/v1
on this hybrid host and in the v1 VM, cgroup/v2 with IgnoreSystemd=yes in the pure v2 VM
(scripts/vm-test; scripts/test runs this file in both VMs).

Each starter scenario runs six times: three Slurm configurations (`linuxproc`:
proctrack/linuxproc, task/none; `cgroup`: proctrack/cgroup, task/cgroup, every
constraint off; `constrained`: proctrack/cgroup, task/cgroup with ConstrainRAMSpace,
ConstrainCores and ConstrainDevices, as sites run it), each with root submitting
(`starter run --state-dir ...` as root) and with an ordinary user submitting: nobody
(65534), whose batch scripts and steps run the set-user-ID `starter` (the relay and the
root starter of native/launcher.c). nobody works with Slurm as it is (slurmctld takes
its jobs, slurmstepd runs them as 65534), so no test account is made. The user runs
sbatch, srun and scancel (through setpriv); scontrol suspend/resume stays root's, an
operator's command. Its starter gets the state directory from the node policy (the
`policy` fixture, written before any job starts) and writes its report into a
directory it owns (`home`). After each job nothing of it may be left: no cgroup in
Slurm's trees but Slurm's own (and the job's gone once slurmstepd is done), no job
cgroup of the starter's anywhere, no entry in the state directory.

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

  proctrack/cgroup freezes the step's freezer cgroup (cgroup.freeze on v2): the relay,
  the root starter and the job stop together (the job stays in the step's cgroups; the
  starter nests its own below them), as with linuxproc's SIGSTOP.

  Where Slurm puts a step, and whose it is (Slurm 22.05):
  - cgroup/v1: <ctrl>/slurm_<node>/uid_U/job_J/step_S (freezer; cpuset, memory and
    devices with the constraints on). The step's directory is given to the job's user
    (the files inside stay root's).
  - cgroup/v2 (IgnoreSystemd=yes): system.slice/<node>_slurmstepd.scope/job_J/step_S,
    its slurmstepd in `slurm` and its tasks in user/task_special (constraints off) or
    user/task_0 (on); the batch shell is step_batch's task. Everything is root's 0755
    but task_0 with the constraints on, which is the user's (its cgroup.procs and
    cgroup.subtree_control stay root's). The task cgroup holds the step's processes,
    the relay among them for a user's job, so the no-internal-processes rule stands
    between it and the starter's controller-enabled cgroups.
  These tests assert what a user's job must get on every layout, with the constraints
  on and off: its exit code, report, vacate, suspend, cleanup, and Slurm's --mem
  enforced (test_oom_past_slurms_mem).
"""

import json
import os
import random
import re
import shlex
import signal
import subprocess
import time

import pytest

from conftest import GID, SHARED_NODE, SLOWDOWN, UID
from test_checkpoint import CRIU, key  # noqa: F401 (key: the node's checkpoint key, a fixture)
from test_devices import OPEN          # the open of each path: "PATH ok" or "PATH ERRNO"
from slurm import FINAL_STATES, SlurmCluster, skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTER = os.path.join(REPO, ".venv", "bin", "starter")

# Vacate grace (SIGTERM -> SIGKILL inside starter); well under the cluster's KillWait,
# so starter always finishes its report before Slurm's own SIGKILL.
GRACE = "3"
KILL_WAIT = 10


# The Slurm configurations each scenario runs under: (proctrack, constrain).
CONFIGS = {"linuxproc": ("linuxproc", False), "cgroup": ("cgroup", False),
           "constrained": ("cgroup", True)}


@pytest.fixture(params=["linuxproc", "constrained"])
def slurm(request, tmp_path):
    """The harness checks: root submits, without cgroups and with all of Slurm's."""
    proctrack, constrain = CONFIGS[request.param]
    reason = skip_reason(proctrack)
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", proctrack=proctrack, constrain=constrain,
                      kill_wait=KILL_WAIT) as cluster:
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
        self.cgroups_before = starter_cgroups()
        self.state_before = state_entries(state_dir)

    def assert_nothing_left(self, jobid=None):
        """Nothing of the ended job on the node: its Slurm cgroups gone (slurmstepd
        removes them once the step's processes are gone, which a cgroup of the
        starter's left inside would prevent), no cgroup in Slurm's trees but
        Slurm's, no job cgroup of the starter's anywhere, no state entry."""
        slurm = self.slurm
        # Another process's cleanup, with no event we can wait on: polled, with a deadline.
        deadline = time.monotonic() + 15 * SLOWDOWN
        while jobid is not None and slurm.job_cgroups(jobid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {
            "Slurm's cgroups of the job": slurm.job_cgroups(jobid) if jobid is not None else [],
            "cgroups in Slurm's trees": slurm.leftover_cgroups(),
            # node-wide: not while other test runs share the node (conftest.SHARED_NODE)
            "the starter's job cgroups": [] if SHARED_NODE else
            sorted(starter_cgroups() - self.cgroups_before),
            "state entries": sorted(state_entries(self.state_dir) - self.state_before),
        }
        left = {k: v for k, v in left.items() if v}
        assert not left, "left after job %s: %s\n%s" % (jobid, left, slurm.logs(jobid))

    def report(self, name="report.json"):
        return os.path.join(self.reports, name)

    def starter_run(self, report, *options):
        """argv prefix: starter run with the state dir and a report file, then `--`."""
        state = ["--state-dir", str(self.state_dir)] if self.who == "root" else []
        return [STARTER, "run", *state, "--report", str(report), *options, "--"]


SITES = [(c, w) for w in ("root", "user") for c in CONFIGS]


def site_id(cw):
    return "%s-%s" % cw


def sites(*configs, who=("root", "user")):
    """Parametrize a test over the sites of these configurations (and submitters) only."""
    return pytest.mark.parametrize("site", [s for s in SITES if s[0] in configs and s[1] in who],
                                   indirect=True, ids=site_id)


@pytest.fixture(params=SITES, ids=site_id)
def site(request, tmp_path, state_dir):
    config, who = request.param
    proctrack, constrain = CONFIGS[config]
    reason = skip_reason(proctrack)
    if reason:
        pytest.skip(reason)
    # stand_in_gpus: two GPU device nodes (conftest.fake_dev_gpus) as the node's GPU GRES.
    gpus = request.getfixturevalue("fake_dev_gpus") if request.node.get_closest_marker("stand_in_gpus") else ()
    if who == "root":
        with SlurmCluster(tmp_path / "slurm", proctrack=proctrack, constrain=constrain,
                          kill_wait=KILL_WAIT, gpus=gpus) as cluster:
            yield Site(cluster, who, str(tmp_path), state_dir)
        return
    # Set up before the cluster, so torn down after it: the policy outlives every job.
    request.getfixturevalue("policy")
    home = request.getfixturevalue("home")
    with SlurmCluster(None, proctrack=proctrack, constrain=constrain, kill_wait=KILL_WAIT,
                      user=(UID, GID), gpus=gpus) as cluster:
        yield Site(cluster, who, home, state_dir)


# ---------------------------------------------------------------- helpers


def starter_cgroups():
    """Every job cgroup of the starter's (job-<id>) on the node, in any hierarchy."""
    found = set()
    for root, dirs, _files in os.walk("/sys/fs/cgroup"):
        for d in dirs:
            if d.startswith("job-"):
                found.add(os.path.join(root, d))
        dirs[:] = [d for d in dirs if not d.startswith("job-")]
    return found


def state_entries(state_dir):
    """What a state directory holds (one level, and the uid leases below it)."""
    found = set()
    for base in (state_dir, os.path.join(state_dir, "uids")):
        try:
            found |= {os.path.join(base, n) for n in os.listdir(base)}
        except (FileNotFoundError, NotADirectoryError):
            pass
    return found


def batch_script(argv):
    """A batch script whose shell becomes `argv` (exec), so starter is the batch shell."""
    return "#!/bin/sh\nexec %s\n" % " ".join(_sh(a) for a in argv)


def _sh(arg):
    # $SLURM_JOB_ID is the one thing the batch shell expands for us.
    if "$SLURM_JOB_ID" in arg:
        return '"%s"' % arg.replace('"', '\\"')
    return shlex.quote(arg)


def wait_for(cond, what, timeout, slurm=None, jobid=None, interval=0.1, running=True):
    """cond() polled until true (Slurm's and the job's doings have no event we can
    wait on), within timeout * SLOWDOWN. With a job and `running`, what is awaited
    needs the job running: a job that ended first fails at once, with its output."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        value = cond()
        if value:
            return value
        if running and jobid is not None:
            state = slurm.job_state(jobid)
            if state in FINAL_STATES:
                value = cond()
                if value:
                    return value
                pytest.fail("job %s ended (%s) before %s\n%s"
                            % (jobid, state, what, slurm.logs(jobid)))
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
    return wait_for(load, "the report %s" % path, timeout, slurm, jobid, running=False)


def output_lines(slurm, jobid):
    return slurm.job_output(jobid).splitlines()


def counter_lines(slurm, jobid):
    return sum(1 for l in output_lines(slurm, jobid) if l.isdigit())


COUNTER = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"
# Touches every page it allocates, 16 MiB at a time, until the OOM killer comes.
HOG = "b = []\nwhile True:\n    b.append(b'x' * (16 << 20))\n"


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
def test_plain_oom_past_mem(tmp_path):
    """ConstrainRAMSpace: a plain job past --mem=200M is OOM-killed, OUT_OF_MEMORY."""
    reason = skip_reason("cgroup")
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path / "slurm", proctrack="cgroup", constrain=True,
                      kill_wait=KILL_WAIT) as slurm:
        jobid = slurm.sbatch("#!/bin/sh\nexec /usr/bin/python3 -c %s\n" % shlex.quote(HOG),
                             args=["--mem=200M"])
        assert slurm.wait_job(jobid, timeout=60)[0] == "OUT_OF_MEMORY", slurm.logs(jobid)


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
    site.assert_nothing_left()


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
    site.assert_nothing_left(jobid)


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
    site.assert_nothing_left(jobid)


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
    site.assert_nothing_left(jobid)


@pytest.mark.slurm
def test_suspend_resume_through_starter(site):
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE) + ["sh", "-c", COUNTER]))
    assert_suspends_and_resumes(slurm, jobid)
    slurm.scancel(jobid)
    slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
    read_report(report, slurm, jobid)
    site.assert_nothing_left(jobid)


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
        deadline = time.monotonic() + 10 * SLOWDOWN
        while pids_with_argv("sleep", tok) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = pids_with_argv("sleep", tok)
        assert not left, "the job's daemon outlived the job: pids %s" % left
    finally:
        kill_pids(pids_with_argv("sleep", tok))
    read_report(report, slurm, jobid)
    site.assert_nothing_left(jobid)


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
    site.assert_nothing_left(jobid)


@pytest.mark.slurm
@sites("cgroup", "constrained")
def test_job_stays_inside_the_steps_cgroups(site):
    """With proctrack/cgroup, Slurm tracks, freezes and kills the step through its
    cgroups (cgroup/v1: freezer, and cpuset, memory and devices for the constraints on;
    cgroup/v2: the step's one cgroup): starter must nest its cgroups below the step's,
    never move the job out of them."""
    slurm, report = site.slurm, site.report()
    tok = token()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report, "--grace", GRACE) + ["sleep", tok]))
    try:
        pid = wait_for(lambda: pids_with_argv("sleep", tok), "the job to run", 30,
                       slurm, jobid)[0]
        with open("/proc/%d/cgroup" % pid) as f:
            paths = dict(re.match(r"\d+:([^:]*):(.*)", l).groups() for l in f.read().splitlines())
        if slurm.cgroup_plugin == "cgroup/v2":
            step = "/system.slice/%s_slurmstepd.scope/job_%s/step_batch" % (slurm.node, jobid)
            wanted = {"": step}
        else:
            step = "/slurm_%s/uid_%d/job_%s/step_batch" % (slurm.node, slurm.uid, jobid)
            ctrls = ["freezer"] * (slurm.proctrack == "cgroup") + [c for c, on in (("cpuset", slurm.constrain_cores),
                                                  ("memory", slurm.constrain_ram),
                                                  ("devices", slurm.constrain_devices)) if on]
            wanted = {c: step for c in ctrls}
        for ctrl, prefix in wanted.items():
            assert (paths[ctrl] + "/").startswith(prefix + "/"), (ctrl, paths[ctrl], prefix)
    finally:
        slurm.scancel(jobid)
        slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
        kill_pids(pids_with_argv("sleep", tok))
    assert read_report(report, slurm, jobid)["reason"] == "vacated"
    site.assert_nothing_left(jobid)


@pytest.mark.slurm
@sites("constrained")
def test_oom_past_slurms_mem(site):
    """ConstrainRAMSpace makes --mem the step's memory limit: a job that allocates
    past --mem=200M is killed by the kernel, and both Slurm (OUT_OF_MEMORY; FAILED
    under cgroup/v1, below) and the report (oom: true) say so."""
    slurm, report = site.slurm, site.report()
    jobid = slurm.sbatch(batch_script(
        site.starter_run(report) + ["/usr/bin/python3", "-c", HOG]), args=["--mem=200M"])
    state, _code = slurm.wait_job(jobid, timeout=60)
    rep = read_report(report, slurm, jobid)
    assert rep["oom"] is True and rep["reason"] == "oom", rep
    site.assert_nothing_left(jobid)
    if slurm.cgroup_plugin == "cgroup/v1":
        # On cgroup v1 the kernel counts an OOM kill (memory.oom_control's
        # oom_kill) in the victim's own memory cgroup only, not in its
        # ancestors: here the starter's job cgroup.  Slurm 22.05's cgroup/v1
        # plugin reads that counter in its step and task cgroups, finds 0 and
        # says FAILED; its log still says the step hit its limit.
        with open(os.path.join(slurm.dir, "log", "slurmd.log"), errors="replace") as f:
            log = f.read()
        assert state == "FAILED" and "StepId=%s.batch hit memory limit" % jobid in log, \
            (state, rep, slurm.logs(jobid))
        return
    assert state == "OUT_OF_MEMORY", (state, rep, slurm.logs(jobid))


@pytest.mark.slurm
@pytest.mark.stand_in_gpus
@sites("constrained")
def test_gres_gpu_and_cores_are_what_slurm_gave(site):
    """ConstrainDevices and ConstrainCores, --gres=gpu:1 of the node's two GPUs
    (stand-in nodes where the host has none) and --cpus-per-task=1: with
    --gpus slurm the job sees the one GPU Slurm allocated, named by nothing but
    the step's device rules, and may open it (ENXIO: no driver behind a
    stand-in; the rules would give EPERM); nproc and the thread variables say
    1.  A caller that names both GPUs is refused: it cannot widen what Slurm
    gave."""
    slurm, report = site.slurm, site.report()
    show = 'ls /dev | grep nvidia; echo "$CUDA_VISIBLE_DEVICES"; nproc; echo "$OMP_NUM_THREADS"; ' \
           'exec /usr/bin/python3 -c "$0" /dev/nvidia*[0-9]'
    r = slurm.srun(["--gres=gpu:1", "--cpus-per-task=1"] + site.starter_run(report, "--gpus", "slurm")
                   + ["sh", "-c", show, OPEN], timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr, slurm.logs())
    lines = r.stdout.splitlines()
    assert len(lines) == 5 and re.fullmatch(r"nvidia[01]", lines[0]), lines
    assert lines[1:] == ["0", "1", "1", "/dev/%s ENXIO" % lines[0]], lines
    r = slurm.srun(["--gres=gpu:1"] + site.starter_run(site.report("wide.json"), "--gpus", "0,1") + ["true"],
                   timeout=60)
    # root: the step's rules refuse GPU 1; a user: also the policy (no callers.gpus).
    refusal = "do not allow it" if site.who == "root" else "callers.gpus"
    ours = [l for l in r.stderr.splitlines() if not l.startswith("srun: ")]
    assert r.returncode == 125 and len(ours) == 1 and refusal in ours[0], (r.stdout, r.stderr)
    site.assert_nothing_left()


@pytest.mark.slurm
@sites("constrained", who=("user",))
def test_a_move_out_of_the_starters_cgroups_fails_or_is_caught(site):
    """A process of the job's user outside the job (another step, a login
    shell) writes the job's pid into every cgroup.procs and tasks file of the
    job's Slurm cgroups: the kernel refuses each move, or the starter finds the
    job moved within seconds and kills it, reason "escaped" (on cgroup v1,
    where Slurm gives the step's memory directory to the user)."""
    slurm, report = site.slurm, site.report()
    tok = token()
    jobid = slurm.sbatch(batch_script(site.starter_run(report, "--grace", GRACE) + ["sleep", tok]))
    moved = []
    try:
        pid = wait_for(lambda: pids_with_argv("sleep", tok), "the job to run", 30, slurm, jobid)[0]
        targets = [os.path.join(root, f) for top in slurm.job_cgroups(jobid) for root, _d, files in os.walk(top)
                   for f in files if f in ("cgroup.procs", "tasks")]
        assert targets, slurm.job_cgroups(jobid)
        for t in targets:
            w = subprocess.run(slurm.as_submitter(["sh", "-c", 'echo "$1" > "$2"', "sh", str(pid), t]),
                               capture_output=True, text=True)
            if w.returncode == 0:
                moved.append(t)
        if moved:
            state, _code = slurm.wait_job(jobid, timeout=15)
            assert not pids_with_argv("sleep", tok), "the moved job still runs (%s)" % moved
            assert read_report(report, slurm, jobid)["reason"] == "escaped", moved
    finally:
        if not moved:
            slurm.scancel(jobid)
        slurm.wait_job(jobid, timeout=KILL_WAIT + 20)
        kill_pids(pids_with_argv("sleep", tok))
    if not moved:       # scancel's (cgroup/v2: Slurm signals the job's processes too)
        assert read_report(report, slurm, jobid)["reason"] in ("vacated", "signaled")
    site.assert_nothing_left(jobid)


def _guide_requeue_script(ck_dir, reports, counter):
    """The admin guide's checkpoint-and-requeue batch script, as written, with
    the test's directories for its checkpoint and report directories, nobody
    for alice, this checkout's starter and a counter for ./simulate."""
    guide = open(os.path.join(REPO, "docs", "admin-guide.md")).read()
    section = guide.split("### Checkpoint and requeue", 1)[1]
    script = section.split("```sh\n", 1)[1].split("```", 1)[0]
    for old, new in (("/var/lib/starter-checkpoints", ck_dir), ("/var/log/jobs", reports),
                     ("--user alice", "--user 65534"), ("exec starter ", "exec %s " % STARTER),
                     ("./simulate --in data", "sh -c %s" % shlex.quote(counter))):
        assert old in script, (old, script)
        script = script.replace(old, new)
    return script


REQUEUE_COUNTER = """i=0
while [ $i -lt 100 ]; do i=$((i+1)); echo "count $i"; sleep 0.2; done
echo "done $i"; exit 7
"""


@pytest.mark.slurm
@pytest.mark.skipif(not CRIU or os.path.isdir("/sys/fs/cgroup/unified"),
                    reason="needs CRIU working and a pure cgroup v2 or v1 layout (the VMs): "
                           "scripts/vm-test -- python -m pytest tests/test_slurm.py -k requeue")
def test_requeue_resumes_from_its_checkpoint(key, tmp_path, state_dir):
    """The admin guide's batch script, as written: USR1 to the batch shell
    vacates the job into its checkpoint (report: checkpointed); `scontrol
    requeue` runs the script again, which restores it: the counter goes on
    from the image, its lines in the batch output file Slurm reopened
    (--open-mode=append: after the first run's), ending with exit 7 and the
    restore's report."""
    ck_dir, reports = tmp_path / "ck", tmp_path / "reports"
    ck_dir.mkdir(mode=0o700)
    reports.mkdir()
    with SlurmCluster(tmp_path / "slurm", proctrack="cgroup", constrain=True, kill_wait=KILL_WAIT,
                      cred_expire=15) as slurm:
        site = Site(slurm, "root", str(reports), state_dir)
        jobid = slurm.sbatch(_guide_requeue_script(str(ck_dir), str(reports), REQUEUE_COUNTER))
        report = reports / ("%s.json" % jobid)
        wait_for(lambda: "count 5" in output_lines(slurm, jobid), "the job to count", 60, slurm, jobid)
        slurm.scancel(jobid, signal="USR1", batch=True)
        wait_for(lambda: report.exists() and read_report(str(report), slurm)["reason"] == "checkpointed",
                 "the checkpoint's report", 300, slurm, jobid, running=False)
        first = output_lines(slurm, jobid)
        assert "done 100" not in first, first
        wait_for(lambda: slurm.job_state(jobid) in FINAL_STATES, "the first run to end", 60, slurm, jobid,
                 running=False)
        report.unlink()
        slurm.scontrol("requeue", jobid)
        state, code = slurm.wait_job(jobid, timeout=300)
        assert (state, code) == ("FAILED", 7), slurm.logs(jobid)
        lines = output_lines(slurm, jobid)
        counts = [int(l.split()[1]) for l in lines if l.startswith("count ")]
        assert counts == list(range(1, 101)) and lines[-1] == "done 100", lines
        rep = read_report(str(report), slurm, jobid)
        assert rep["exit_code"] == 7 and rep["reason"] == "exited", rep
        site.assert_nothing_left(jobid)
