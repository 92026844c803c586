"""A private single-node Slurm for tests: munged, slurmctld and slurmd on 127.0.0.1.

    with SlurmCluster(tmp_path, proctrack="cgroup") as slurm:
        slurm.srun(["/bin/true"])                      # CompletedProcess
        jobid = slurm.sbatch("#!/bin/sh\\nexec sleep 60\\n")
        slurm.scancel(jobid)
        state, code = slurm.wait_job(jobid, timeout=30)

Everything lives in the given directory (config, key, state, logs, pids), except the
unix sockets (munged's, slurmd's spool), which need a short path and get a private
/tmp/slurm-t-* removed at stop. Daemons run in the foreground as our children and are
stopped by pid (SIGTERM, bounded wait, SIGKILL). Clients find the cluster
through SLURM_CONF in `slurm.env`. Nothing listens beyond 127.0.0.1 (NoInAddrAny,
NoCtldInAddrAny: the daemons and srun listen on the address of the host's name, which
must be 127.0.0.1: slurmhost.hostname_not_on_127001), nothing goes through systemd,
and the distribution's munge key and config in /etc are never read.

proctrack="cgroup" makes Slurm track steps in cgroups of its own, through the cgroup
plugin a site sets for the host's layout (slurmhost.cgroup_plugin):
  cgroup/v1 (hybrid and v1-only hosts): /sys/fs/cgroup/<ctrl>/slurm_<node>/uid_U/
    job_N/step_M (freezer; cpuset, memory, devices for the constraints on);
  cgroup/v2 (pure cgroup v2, IgnoreSystemd=yes: no systemd or dbus is asked):
    /sys/fs/cgroup/system.slice/<node>_slurmstepd.scope, holding slurmd in `slurmd`
    and each step as job_N/step_M/{slurm (its slurmstepd), user/task_T (its tasks)}.
    system.slice (with +cpuset +cpu +io +memory +pids in its subtree_control) is the
    node's, made by systemd (scripts/vm/vm-init in the test VM), never ours.
The node name is random per cluster, so those trees are ours alone; we refuse to
start if they already exist, and remove them, deepest first, at stop, after killing
by pid anything still inside.

constrain=True is what sites run: task/cgroup with ConstrainRAMSpace, ConstrainCores
and ConstrainDevices (proctrack/cgroup); constrain=False turns all three off (task/cgroup
still places the tasks). Unset, proctrack/cgroup gets ConstrainCores alone.

user=(UID, GID) makes an ordinary account the submitter: sbatch, srun and scancel run
as it (through setpriv, groups cleared), as a user at a site would run them; scontrol
(suspend, resume) stays root's, as at a site (an operator's command). The user must
reach what its clients and its jobs read: the cluster then lives in a fresh
/tmp/slurm-c-* of mode 0755 (pytest's tmp dirs are root's 0700), removed at stop,
with the config, the batch scripts and the socket directory readable by all, and the
jobs' output in `out/`, owned by the user (slurmstepd opens it with the user's rights).
The munge key stays root's 0400. Slurm's cgroups are then .../uid_<UID>/job_N/step_M
on cgroup/v1 (cgroup/v2 has no uid level).

Every wait is bounded (each bound stretched by SLOWDOWN in the test VMs): a Slurm that
does not come up, or a job that does not end, fails with the daemon logs in the message
instead of hanging the test run.
"""

import os
import random
import re
import shutil
import signal as _signal
import string
import subprocess
import tempfile
import time


# Terminal job states as `scontrol show job` prints them (JobState=...).
FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
})

# Directory names Slurm's cgroup plugins make below their root: cgroup/v1's
# <ctrl>/slurm_<node>/uid_U/job_N/step_M/task_T (and `system`, slurmd's), cgroup/v2's
# <node>_slurmstepd.scope/job_N/step_M/{slurm,user/task_T|task_special} (and `system`,
# `slurmd`).
_SLURM_CGROUP = re.compile(r"^(uid_\d+|job_\d+|step_(\d+|batch|extern|interactive)|"
                           r"task_(\d+|special)|system|slurm|slurmd|user)$")

from slurmhost import (CGROUP_ROOT, SLOWDOWN, SYSTEM_SLICE, SlurmError, _cgroup_v1_controllers,  # noqa: E402,F401
                       _free_ports, _which, cgroup_layout, cgroup_plugin, missing_binaries,
                       skip_reason)
from slurmparse import parse_exit_code, parse_scontrol_record  # noqa: E402


class SlurmCluster:
    """A private single-node Slurm; use as a context manager.

    base_dir: where the cluster lives; None: a fresh /tmp/slurm-c-* (0755), removed at
    stop (what a `user` cluster needs: the user must read the config).
    proctrack: "linuxproc", "pgid" or "cgroup".
    kill_wait: seconds between SIGTERM and SIGKILL on scancel/time limit (KillWait).
    user: (uid, gid) of the account that submits (sbatch, srun, scancel); None: root.
    constrain: True: ConstrainRAMSpace, ConstrainCores and ConstrainDevices (as sites
    run Slurm); False: none of them; None: ConstrainCores alone with proctrack/cgroup.
    constrain_cores, constrain_ram, constrain_devices: one constraint, over `constrain`.
    gpus: device nodes the node offers as GPU GRES (gres.conf `File=`), one per GPU.
    cred_expire: AuthInfo's cred_expire (seconds), which is also how long a requeued
    job waits before it starts again (Slurm's default: 120).
    """

    def __init__(self, base_dir=None, proctrack="linuxproc", cpus=None, real_memory_mb=1024,
                 kill_wait=10, start_timeout=30.0, debug="info", constrain=None,
                 constrain_cores=None, constrain_ram=None, constrain_devices=None, user=None, gpus=(),
                 cred_expire=None):
        if proctrack not in ("linuxproc", "pgid", "cgroup"):
            raise ValueError("proctrack must be linuxproc, pgid or cgroup, not %r" % proctrack)
        if constrain and proctrack != "cgroup":
            raise ValueError("constrain needs proctrack='cgroup' (task/cgroup)")
        self.user = tuple(user) if user is not None else None
        self.uid = self.user[0] if self.user else 0
        if base_dir is None:
            self.dir = None       # made at start (a fresh /tmp/slurm-c-*), removed at stop
        elif self.user is not None:
            raise ValueError("a user cluster makes its own directory (base_dir=None): "
                             "the user must reach its config")
        else:
            self.dir = os.path.abspath(os.fspath(base_dir))
        self._own_dir = False
        self.proctrack = proctrack
        self.cpus = cpus or os.cpu_count() or 1
        self.gpus = tuple(gpus)
        self.cred_expire = cred_expire
        self.real_memory_mb = real_memory_mb
        self.kill_wait = kill_wait
        self.start_timeout = start_timeout
        self.debug = debug
        self.constrain = constrain
        # ConstrainCores: each step in a cpuset cgroup of Slurm's. ConstrainRAMSpace: in a
        # memory cgroup of Slurm's too (--mem is its limit; on cgroup v1 Slurm gives the
        # step's directory to the job's user). ConstrainDevices: the devices controller
        # (v1) or a BPF device program (v2) on the step. Unset, proctrack/cgroup has
        # ConstrainCores alone.
        self.constrain_cores = ((proctrack == "cgroup") if constrain is None else bool(constrain)) \
            if constrain_cores is None else constrain_cores
        self.constrain_ram = bool(constrain) if constrain_ram is None else constrain_ram
        self.constrain_devices = bool(constrain) if constrain_devices is None else constrain_devices
        for name in ("constrain_cores", "constrain_ram", "constrain_devices"):
            if getattr(self, name) and proctrack != "cgroup":
                raise ValueError("%s needs proctrack='cgroup' (task/cgroup)" % name)
        # task/cgroup whenever Slurm tracks steps in cgroups (it places the tasks even
        # with every constraint off, as sites configure it); task/none otherwise.
        self.task_cgroup = proctrack == "cgroup"
        self.cgroup_plugin = cgroup_plugin()
        self.conf = None
        self.sockdir = None        # short private dir for unix sockets, made at start
        self.munge_socket = None
        # Unique per cluster (and letters only, so hostlist syntax never splits it):
        # it names Slurm's cgroup directories, so concurrent clusters never share them.
        self.node = "starter" + "".join(random.choice(string.ascii_lowercase) for _ in range(6))
        self.env = None
        self.startup_s = None
        self._procs = {}          # name -> Popen, started in order, stopped in reverse
        self._cgroup_dirs = []    # <ctrl>/slurm_<node> or <node>_slurmstepd.scope: removed at stop
        self.foreign_cgroups = [] # cgroups found in Slurm's tree that Slurm did not make

    # ---- lifecycle -------------------------------------------------------------

    def __enter__(self):
        reason = skip_reason(self.proctrack)
        if reason:
            raise SlurmError(reason)
        t0 = time.monotonic()
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="slurm-c-", dir="/tmp")
            self._own_dir = True
            os.chmod(self.dir, 0o755)
        self.conf = os.path.join(self.dir, "slurm.conf")
        try:
            self._prepare_dirs()
            self._claim_cgroups()
            self._start_munged()
            self._write_config()
            self._start_slurmctld()
            self._start_slurmd()
            self._wait_node_idle()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        if exc_type is None and self.foreign_cgroups:
            raise SlurmError("cgroups left in Slurm's tree after the jobs ended (removed "
                             "now): %s" % ", ".join(self.foreign_cgroups))
        return False

    def stop(self):
        """Cancel leftover jobs, stop the daemons by pid (reverse order), remove cgroups."""
        if "slurmctld" in self._procs and self._alive("slurmctld"):
            # Give running steps a chance to end through Slurm so slurmstepd cleans
            # its own cgroups; bounded, and harmless when nothing is queued.
            try:
                for uid in sorted({0, self.uid}):
                    self._run([_which("scancel"), "--full", "--user=%d" % uid], check=False,
                              timeout=10)
                self._wait_queue_empty(timeout=self.kill_wait + 15)
            except Exception:
                pass
        for name in reversed(list(self._procs)):
            self._stop_proc(name)
        self._procs.clear()
        self._reap_stepds()
        self._remove_cgroups()
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)
            self.sockdir = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._own_dir = False

    def _alive(self, name):
        p = self._procs.get(name)
        return p is not None and p.poll() is None

    def _stop_proc(self, name, term_timeout=10.0):
        p = self._procs[name]
        if p.poll() is None:
            p.send_signal(_signal.SIGTERM)
            try:
                p.wait(term_timeout * SLOWDOWN)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for fh in (p.stdout, p.stderr):
            if fh:
                fh.close()

    def _reap_stepds(self, timeout=10.0):
        """slurmstepd processes are slurmd's detached grandchildren; they exit on their
        own once their step is done. Wait for ours (bounded); then SIGKILL, by pid, any
        that remain together with their descendants and whatever is left in our cgroups
        (all of them processes this cluster started), so nothing of ours survives."""
        deadline = time.monotonic() + timeout * SLOWDOWN
        while self._our_stepds() and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(20):
            stepds = self._our_stepds()
            pids = set(stepds) | _descendants(stepds) | self._pids_in_cgroups()
            if not pids:
                return
            self._thaw_cgroups()
            for top in self._cgroup_dirs:
                # cgroup v2: one write kills the whole tree (our scope alone).
                try:
                    with open(os.path.join(top, "cgroup.kill"), "w") as f:
                        f.write("1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, _signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def _pids_in_cgroups(self):
        pids = set()
        for top in self._cgroup_dirs:
            for root, _dirs, files in os.walk(top):
                if "cgroup.procs" in files:
                    try:
                        with open(os.path.join(root, "cgroup.procs")) as f:
                            pids.update(int(x) for x in f.read().split())
                    except OSError:
                        pass
        return pids

    def _thaw_cgroups(self):
        for top in self._cgroup_dirs:
            for root, _dirs, files in os.walk(top):
                for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                    if name in files:
                        try:
                            with open(os.path.join(root, name), "w") as f:
                                f.write(value)
                        except OSError:
                            pass

    def _our_stepds(self):
        """Pids of slurmstepd processes whose environment points at our slurm.conf."""
        found = []
        needle = ("SLURM_CONF=" + self.conf).encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/comm" % entry) as f:
                    if f.read().strip() != "slurmstepd":
                        continue
                with open("/proc/%s/environ" % entry, "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    # ---- setup steps -----------------------------------------------------------

    def _prepare_dirs(self):
        for sub in ("munge", "state", "log", "run", "tmp", "out"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        os.chmod(os.path.join(self.dir, "munge"), 0o700)
        if self.user is not None:
            # The user's clients read the config and scripts; its jobs write their
            # output (slurmstepd opens it as the user) and start in `out`.
            for sub in ("tmp", "out"):
                os.chmod(os.path.join(self.dir, sub), 0o755)
            os.chown(os.path.join(self.dir, "out"), *self.user)
        # Unix socket paths are limited to 108 bytes; pytest's tmp paths can be long, so
        # munged's socket and slurmd's spool (which holds one socket per step) live in a
        # short private directory of their own, removed at stop.
        self.sockdir = tempfile.mkdtemp(prefix="slurm-t-")
        os.mkdir(os.path.join(self.sockdir, "spool"))
        if self.user is not None:
            os.chmod(self.sockdir, 0o755)   # the user's clients talk to munged
        self.munge_socket = os.path.join(self.sockdir, "munge.sock")

    def _claim_cgroups(self):
        if self.proctrack != "cgroup":
            return
        # Debian builds Slurm with multiple-slurmd support: its cgroup roots carry the
        # node name (v1: <ctrl>/slurm_<node>; v2: system.slice/<node>_slurmstepd.scope),
        # unique per cluster, so they are ours alone.
        if self.cgroup_plugin == "cgroup/v2":
            dirs = [os.path.join(SYSTEM_SLICE, self.node + "_slurmstepd.scope")]
        else:
            ctrls = _cgroup_v1_controllers()
            if not ctrls:
                raise SlurmError("proctrack/cgroup with cgroup/v1 needs cgroup v1 "
                                 "controllers under %s" % CGROUP_ROOT)
            dirs = [os.path.join(c, "slurm_" + self.node) for c in ctrls]
        taken = [d for d in dirs if os.path.isdir(d)]
        if taken:
            raise SlurmError("%s already exist (another slurmd with this node name?); "
                             "refusing to share them" % ", ".join(taken))
        self._cgroup_dirs = dirs

    def _start_munged(self):
        key = os.path.join(self.dir, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        mdir = os.path.join(self.dir, "munge")
        # --force: munged insists every directory on the socket path is world-searchable,
        # which a private 0700 pytest tmp dir is not; the key stays private either way.
        self._spawn("munged", [
            _which("munged"), "--foreground", "--force",
            "--key-file=" + key, "--socket=" + self.munge_socket,
            "--pid-file=" + os.path.join(mdir, "munged.pid"),
            "--log-file=" + os.path.join(mdir, "munged.log"),
            "--seed-file=" + os.path.join(mdir, "munged.seed"),
        ])
        self._wait_for(lambda: os.path.exists(self.munge_socket), "munged socket", "munged")

    def _write_config(self):
        ctld_port, slurmd_port = _free_ports(2)
        d = self.dir
        plugstack = os.path.join(d, "plugstack.conf")
        with open(plugstack, "w") as f:
            f.write("# empty: keep /etc/slurm/plugstack.conf.d out of the test cluster\n")
        lines = [
            "ClusterName=startertest",
            "SlurmctldHost=localhost(127.0.0.1)",
            "SlurmctldPort=%d" % ctld_port,
            "SlurmdPort=%d" % slurmd_port,
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "AuthInfo=socket=%s%s" % (self.munge_socket,
                                      ",cred_expire=%d" % self.cred_expire if self.cred_expire else ""),
            "StateSaveLocation=%s/state" % d,
            "SlurmdSpoolDir=%s/spool" % self.sockdir,
            "SlurmctldPidFile=%s/run/slurmctld.pid" % d,
            "SlurmdPidFile=%s/run/slurmd.pid" % d,
            "SlurmctldLogFile=%s/log/slurmctld.log" % d,
            "SlurmdLogFile=%s/log/slurmd.log" % d,
            "SlurmctldDebug=%s" % self.debug,
            "SlurmdDebug=%s" % self.debug,
            "PlugStackConfig=%s" % plugstack,
            "TmpFS=%s/tmp" % d,
            "MailProg=/bin/true",
            "ProctrackType=proctrack/%s" % self.proctrack,
            "TaskPlugin=%s" % ("task/cgroup" if self.task_cgroup else "task/none"),
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            # Start batch jobs at once instead of on the next 3 s scheduling pass.
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            # Memory a consumable resource with ConstrainRAMSpace, as sites have it:
            # only then is --mem the job's allocation, and so its cgroup's limit (a job
            # without --mem gets the node's RealMemory).
            "SelectTypeParameters=%s" % ("CR_Core_Memory" if self.constrain_ram else "CR_Core"),
            "ReturnToService=2",
            # Hardware differences (a VM with other core counts) must not drain the node.
            "SlurmdParameters=config_overrides",
            "KillWait=%d" % self.kill_wait,
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
            "SlurmctldTimeout=300",
            "NodeName=%s NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=%d RealMemory=%d%s "
            "State=UNKNOWN" % (self.node, self.cpus, self.real_memory_mb,
                               " Gres=gpu:%d" % len(self.gpus) if self.gpus else ""),
            "PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP" % self.node,
        ]
        if self.gpus:
            lines.insert(0, "GresTypes=gpu")
            # slurmd reads gres.conf beside slurm.conf; no AutoDetect: the File=
            # nodes are the GPUs (stand-ins where the host has none).
            with open(os.path.join(d, "gres.conf"), "w") as f:
                f.write("".join("Name=gpu File=%s\n" % g for g in self.gpus))
            os.chmod(os.path.join(d, "gres.conf"), 0o644)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(self.conf, 0o644)
        os.chmod(plugstack, 0o644)
        yes = {True: "yes", False: "no"}
        cgroup_conf = [
            # cgroup/v1 on hybrid hosts (v1 controllers at /sys/fs/cgroup/<ctrl>, a
            # controller-less cgroup2 at /sys/fs/cgroup/unified) and v1-only ones;
            # cgroup/v2 on a pure cgroup v2 host.
            "CgroupPlugin=%s" % self.cgroup_plugin,
            "CgroupMountpoint=%s" % CGROUP_ROOT,
            "ConstrainCores=%s" % yes[bool(self.constrain_cores)],
            "ConstrainDevices=%s" % yes[bool(self.constrain_devices)],
            "ConstrainRAMSpace=%s" % yes[bool(self.constrain_ram)],
            "ConstrainSwapSpace=no",
        ]
        if self.cgroup_plugin == "cgroup/v2":
            # No systemd (or none of ours): slurmd makes its scope in system.slice
            # itself instead of asking systemd over dbus for one.
            cgroup_conf.append("IgnoreSystemd=yes")
        else:
            cgroup_conf.append("CgroupAutomount=no")
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("\n".join(cgroup_conf) + "\n")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):
            # A caller inside a Slurm job must not leak its job's context into ours.
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SCANCEL_")) \
                    and k != "SLURM_CONF":
                del self.env[k]

    def _start_slurmctld(self):
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._wait_for(self._ctld_answers, "slurmctld to answer `scontrol ping`", "slurmctld")

    def _start_slurmd(self):
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node, "-f", self.conf])

    def _ctld_answers(self):
        r = self._run([_which("scontrol"), "ping"], check=False, timeout=10)
        return r.returncode == 0 and "UP" in r.stdout

    def _wait_node_idle(self):
        def idle():
            r = self._run([_which("sinfo"), "-h", "-N", "-o", "%T"], check=False, timeout=10)
            return r.returncode == 0 and r.stdout.strip().rstrip("*") == "idle"
        self._wait_for(idle, "node %s to become idle" % self.node, "slurmd")

    def _spawn(self, name, argv):
        log = open(os.path.join(self.dir, "log", name + ".out"), "wb")
        try:
            self._procs[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(self.env or os.environ, SLURM_CONF=self.conf), cwd=self.dir,
                start_new_session=True)
        finally:
            log.close()

    def _wait_for(self, cond, what, daemon, timeout=None):
        deadline = time.monotonic() + (timeout or self.start_timeout) * SLOWDOWN
        while True:
            p = self._procs.get(daemon)
            if p is not None and p.poll() is not None:
                raise SlurmError("%s exited with %s while waiting for %s\n%s"
                                 % (daemon, p.returncode, what, self.logs()))
            if cond():
                return
            if time.monotonic() > deadline:
                raise SlurmError("timed out waiting for %s\n%s" % (what, self.logs()))
            time.sleep(0.05)

    def job_cgroups(self, jobid):
        """Slurm's cgroups of one job (its job_<jobid> directories) in this cluster's
        trees: gone once slurmstepd cleaned up after the job."""
        found = []
        name = "job_%s" % jobid
        for top in self._cgroup_dirs:
            for root, dirs, _files in os.walk(top):
                found.extend(os.path.join(root, d) for d in dirs if d == name)
        return found

    def leftover_cgroups(self):
        """Cgroups in this cluster's Slurm trees that Slurm does not make (see
        _SLURM_CGROUP): what ran in the jobs made them. Empty once every job is over
        and the starter removed its own."""
        found = []
        for top in self._cgroup_dirs:
            for root, dirs, _files in os.walk(top):
                found.extend(os.path.join(root, d) for d in dirs if not _SLURM_CGROUP.match(d))
        return found

    def _remove_cgroups(self):
        """rmdir everything below our Slurm roots (<ctrl>/slurm_<node> on v1,
        system.slice/<node>_slurmstepd.scope on v2), deepest first, and the roots.

        Directories Slurm does not make were made by what ran in the jobs: they are
        removed too, and listed in `foreign_cgroups` so the caller can fail a test that
        leaked them."""
        self.foreign_cgroups.extend(self.leftover_cgroups())
        for top in self._cgroup_dirs:
            if not os.path.isdir(top):
                continue
            for _ in range(50):  # a just-exited task can keep a cgroup busy briefly
                busy = []
                for root, dirs, _files in os.walk(top, topdown=False):
                    for d in dirs:
                        _rmdir(os.path.join(root, d), busy)
                _rmdir(top, busy)
                if not busy:
                    break
                time.sleep(0.1)
            else:
                raise SlurmError("could not remove Slurm cgroups (still in use): %s"
                                 % ", ".join(busy))
        self._cgroup_dirs = []

    # ---- client commands -------------------------------------------------------

    def as_submitter(self, argv):
        """argv run as the submitting user (unchanged for root)."""
        if self.user is None:
            return list(argv)
        # Without the tests' own STARTER_* variables: Slurm hands the
        # submitter's environment to the job, and a user's starter refuses them.
        unset = [a for k in (self.env or os.environ) if k.startswith("STARTER_") for a in ("-u", k)]
        return ["setpriv", "--reuid=%d" % self.user[0], "--regid=%d" % self.user[1],
                "--clear-groups", "env", *unset] + list(argv)

    def _run(self, argv, check=True, timeout=60, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        r = subprocess.run(argv, env=self.env, timeout=timeout * SLOWDOWN, text=True, **kw)
        if check and r.returncode != 0:
            raise SlurmError("%s failed (exit %d): %s" % (" ".join(argv), r.returncode,
                                                          (r.stderr or "").strip()))
        return r

    def srun(self, args, timeout=60, check=False, **kw):
        """srun ARGS as the submitter, in `out/`; returns CompletedProcess (stdout/stderr
        captured as text)."""
        kw.setdefault("cwd", os.path.join(self.dir, "out"))
        return self._run(self.as_submitter([_which("srun"), "--quiet"] + list(args)),
                         check=check, timeout=timeout, **kw)

    def sbatch(self, script_text, args=(), timeout=30):
        """Submit a batch script (text) as the submitter; returns the job id as a string."""
        path = os.path.join(self.dir, "tmp", "job-%d.sh" % time.monotonic_ns())
        with open(path, "w") as f:
            f.write(script_text)
        os.chmod(path, 0o755)
        out = os.path.join(self.dir, "out")
        r = self._run(self.as_submitter(
            [_which("sbatch"), "--parsable", "--chdir=" + out,
             "--output=" + os.path.join(out, "job-%j.out")] + list(args) + [path]),
            timeout=timeout, cwd=out)
        return r.stdout.strip().split(";")[0]

    def job_output(self, jobid):
        """What the batch script printed (stdout+stderr)."""
        try:
            with open(os.path.join(self.dir, "out", "job-%s.out" % jobid)) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def scancel(self, jobid, signal=None, batch=False, full=False):
        """scancel as the submitter (a user cancels and signals its own jobs)."""
        argv = [_which("scancel")]
        if signal is not None:
            argv.append("--signal=%s" % signal)
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        return self._run(self.as_submitter(argv + [str(jobid)]), timeout=30)

    def scontrol(self, *args, check=True, timeout=30):
        return self._run([_which("scontrol")] + [str(a) for a in args], check=check,
                         timeout=timeout)

    def job_info(self, jobid):
        """`scontrol show job -o JOBID` as a dict (empty once the record is purged)."""
        r = self.scontrol("show", "job", "-o", jobid, check=False)
        if r.returncode != 0 or not r.stdout.strip():
            return {}
        return parse_scontrol_record(r.stdout.splitlines()[0])

    def job_state(self, jobid):
        return self.job_info(jobid).get("JobState")

    def wait_state(self, jobid, states, timeout=30.0):
        """Wait until the job's state is one of `states`; returns it."""
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout * SLOWDOWN
        while True:
            state = self.job_state(jobid)
            if state in states:
                return state
            if state in FINAL_STATES or time.monotonic() > deadline:
                raise SlurmError("job %s is %s, expected %s within %.0fs\n%s"
                                 % (jobid, state, "/".join(sorted(states)), timeout,
                                    self.logs(jobid)))
            time.sleep(0.1)

    def wait_job(self, jobid, timeout=60.0):
        """Wait for the job to end; returns (state, exit_code).

        exit_code is Slurm's ExitCode status part (ExitCode=7:0 -> 7); the signal part
        is in job_info(jobid)["ExitCode"] / parse_exit_code().
        """
        deadline = time.monotonic() + timeout * SLOWDOWN
        while True:
            info = self.job_info(jobid)
            state = info.get("JobState")
            if state in FINAL_STATES:
                return state, parse_exit_code(info.get("ExitCode", "0:0"))[0]
            if time.monotonic() > deadline:
                raise SlurmError("job %s still %s after %.0fs\n%s"
                                 % (jobid, state, timeout, self.logs(jobid)))
            time.sleep(0.1)

    def _wait_queue_empty(self, timeout):
        deadline = time.monotonic() + timeout * SLOWDOWN
        while time.monotonic() < deadline:
            r = self._run([_which("squeue"), "-h", "-o", "%i"], check=False, timeout=10)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.2)

    def logs(self, jobid=None, tail=40):
        """Last lines of each daemon log (and the job output), for failure messages."""
        parts = []
        names = ["munged.out", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"]
        for name in names:
            path = os.path.join(self.dir, "log", name)
            try:
                with open(path, errors="replace") as f:
                    lines = f.readlines()[-tail:]
            except OSError:
                continue
            parts.append("---- %s ----\n%s" % (name, "".join(lines)))
        if jobid is not None:
            parts.append("---- job %s output ----\n%s" % (jobid, self.job_output(jobid)))
        return "\n".join(parts)


def _descendants(pids):
    """All descendants of `pids`, from the parent links in /proc/<pid>/stat."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces and parentheses: the ppid follows the last ')'.
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _rmdir(path, busy):
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        busy.append(path)
