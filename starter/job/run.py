"""One job's lifetime: acquire in order, release in reverse, always.

Job.run() is the checklist; each line is one phase (a method below):

    the syscall filter, the report's and the events' destinations
    gc of dead starters' leftovers; the cgroup backend and its checks
    the job's uid (transient or named) and its escape check at the end
    state entry (lock held for the job's life)
    scratch / verified inputs
    cgroup (limits set before anything runs in it)
    clone into the cgroup; the child waits on the sync fd
    attach the v1 hierarchies; wire the network
    release; the child execs (or reports the step that failed)
    supervise until the main process is gone and the cgroup is empty
    measure (cgroup stats, network counters), report, then tear down

Each teardown is registered right after its resource exists, so any failure
on the way unwinds exactly what was made.  Measurements are taken before
anything is destroyed.
"""

import _signal  # not `signal`: it builds enums at import
import gc
import os
import sys
import time

from starter.job import trace, watchdog
from starter.errors import EXIT_STARTER_FAILED, StarterError, from_oserror, one_line
from starter.fileio import unlink_quiet
from starter.spec.options import NAT_MODES
from starter.state.store import JobState, fault, find_dead, write_atomic


class Undo:
    """A stack of teardowns; every one runs even when an earlier one fails.
    `label` names the step (for STARTER_FAULT=teardown-<label> and for what
    the kept state entry says is still held).

    Not contextlib.ExitStack, on purpose: importing contextlib pulls in
    collections, functools and types, which nothing else on the run path
    needs (a sizeable share of a `starter run`: docs/benchmarks.md).  And the
    job needs what ExitStack lacks: a label per step for fault injection and
    for the kept entry's "held" list, keep_only() for unkillable jobs, and the
    list of every failed step rather than one chained exception.
    tests/test_start_path.py keeps contextlib off the run path."""

    def __init__(self):
        self.steps = []
        self.failed = []      # "label: error" of each step that failed

    def push(self, fn, *args, label=None):
        self.steps.append((fn, args, label or getattr(fn, "__qualname__", str(fn))))

    def holds(self, *labels):
        """Is a step with one of these labels still to run?"""
        return any(step[2] in labels for step in self.steps)

    def keep_only(self, *fns):
        """Drop every teardown but these (closing our fds): what the job
        holds stays for `starter gc`."""
        self.steps = [step for step in self.steps if step[0] in fns]

    def run(self):
        err = None
        while self.steps:
            fn, args, label = self.steps.pop()
            try:
                fault("teardown-" + label)
                fn(*args)
            except Exception as e:  # keep unwinding; report the first failure
                sys.stderr.write(f"starter: teardown {label} failed: {one_line(e)}\n")
                self.failed.append(f"{label}: {one_line(e)}")
                err = err or e
        return err


def _root_rights(why=None):
    """What a root caller names is opened as root: paths.as_user with no
    one to switch to (a caller's own is Caller.rights)."""
    from starter.storage.paths import as_user

    return as_user(None)


def run(spec, caller=None, policy=None):
    """Run the job described by a checked JobSpec; -> the starter's exit code.
    caller: a starter.callers.caller.Caller when the caller is not root (its paths
    are opened with its rights, its relay's signals and hang-up are
    watched); policy: the node policy (its per-caller job count)."""
    return Job(spec, caller, policy).run()


class Job:
    """One `starter run`: what the phases share.  The report (a typed
    observe.report.Report, written at the end) gets its fields from the
    phases that know them, and from the teardown steps that measure."""

    def __init__(self, spec, caller, policy):
        from starter.observe.report import Events, Report
        from starter.job.supervisor import Signals

        self.spec, self.caller, self.policy = spec, caller, policy
        # A starter without root: its rootless/userns.Pilot, or None (root's
        # start never imports the module: sys.modules has it only if begun).
        self.pilot = getattr(sys.modules.get("starter.rootless.pilot"), "ACTIVE", None)
        self.t0 = time.time()
        self.undo = Undo()
        if spec.restore is not None:    # a checkpoint's images (a caller's private copy of them, too)
            self.undo.push(spec.restore.close, label="image")
        self.rights = caller.rights if caller is not None else _root_rights
        # Closed at the very end, after the report: a SIGTERM during teardown
        # must not kill the starter before it reports (Signals.close).
        self.signals = Signals(spec.on_signal)
        self.events = Events(None, spec.id)
        self.report = Report(job_id=spec.id, reason="starter_error", exit_code=EXIT_STARTER_FAILED,
                             signal=None, started_at=round(self.t0, 6))
        self.report_dest = None
        self.job_state = None
        self.image = spec.restore     # a checkpoint to restore (starter/checkpoint/criu.py), or None
        if self.image is not None:    # runs after the network's teardown (pushed later): its counters
            from starter.checkpoint import criu as checkpoint

            self.undo.push(checkpoint.segments, self.report, self.image.record["segments"], label="segments")
        self.sc_filter = self.backend = self.count_lock = None
        self.since = None               # the job's start time, once it runs (clock ticks)
        self.sc = None                  # the scratch directory
        self.cwd, self.argv, self.mounts = spec.cwd, list(spec.argv), []
        self.netcfg = self.lease = None
        self.net_tried = False          # a network setup was tried: its teardown has work to do
        self.net_end = None             # the teardown netd began (net.teardown_begin), once the job is gone
        self.net_fd = None              # a capped job's netns, kept open until its shaper is read
        self.part = None                # --net job: this task's hold on its part of the node (net/part.py)
        self.part_ns = {}               # --net job: the part's pid, net and ipc namespaces (fds; "recorded")
        self.pmix_bridge = None         # --net job under PMIx: net/bridge.py
        self.peers = None               # --net job, the part's owner: net/liveness.py's Watch
        self.holder = None              # --net job, the part's owner: the part's init (a Child)
        self.image_root = None          # --image: what the child makes its root (ChildSpec.image)
        self.stage_fd = None            # the scratch's root (a --disk file system's), once made
        self.cg = self.child = None
        self.reap_last = []             # children killed in the teardown, reaped after the report

    def run(self):
        watchdog.on_takeover(self._taken_over)
        try:
            self.load_filter()
            self.open_destinations()
            self.reclaim_dead()
            self.open_cgroups()
            self.check_checkpoint()
            self.take_uid()
            self.make_entry()
            code = self.start_and_supervise()
        except StarterError as e:
            sys.stderr.write(f"starter: {one_line(e)}\n")
            self.report.set(error=str(e), exit_code=e.exit_code)
            code = e.exit_code
        except OSError as e:
            # An errno nothing above turned into a precise message.
            e = from_oserror(e)
            sys.stderr.write(f"starter: {one_line(e)}\n")
            self.report.set(error=str(e), exit_code=EXIT_STARTER_FAILED)
            code = EXIT_STARTER_FAILED
        except Exception as e:
            # A bug or an unexpected kernel answer: still fail closed, unwind, report;
            # one line for the admin, the traceback with STARTER_DEBUG=1.
            if os.environ.get("STARTER_DEBUG"):
                import traceback

                traceback.print_exc()
            sys.stderr.write(f"starter: internal error: {one_line(repr(e))} (STARTER_DEBUG=1 shows where)\n")
            self.report.set(error=f"internal error: {e!r}", exit_code=EXIT_STARTER_FAILED)
            code = EXIT_STARTER_FAILED
        finally:
            watchdog.claim()    # the watchdog stays out: this thread unwinds
            self.end()
        return code

    def start_and_supervise(self):
        """From the entry on: what runs the job and measures it."""
        self.make_scratch()
        watchdog.check()
        self.plan_mounts()
        self.make_cgroup()
        self.add_resolv_conf()
        self.clone()
        self.attach()
        self.release()
        self.mark_running()
        self.share_part()
        out = self.supervise()
        return self.measure(out)

    # -- the end ------------------------------------------------------------
    def end(self, in_main=True):
        from starter.observe.report import write_report

        report = self.report
        trace.mark("measure")
        err = self.undo.run()
        if self.job_state is not None:
            # The entry lives until everything it names is gone: a failed
            # teardown keeps it, "reclaiming", for `starter gc`.
            try:
                if self.undo.failed:
                    self.job_state.keep(self.undo.failed)
                else:
                    self.job_state.remove()
            except OSError as e:
                sys.stderr.write(f"starter: teardown state entry failed: {one_line(e)}\n")
                self.job_state.keep([f"state entry: {e}"])
                err = err or e
        if err is not None and report.reason != "starter_error":
            report.teardown_error = str(err)
        trace.mark("teardown")
        report.ended_at = round(time.time(), 6)
        doc = report.as_dict()
        if self.report_dest is not None:
            try:
                with self.rights():      # the caller's file, made with its rights
                    write_report(self.report_dest, doc, self.spec.report_format)
            except (OSError, StarterError) as e:
                sys.stderr.write(f"starter: cannot write report {self.spec.report}: "
                                 f"{getattr(e, 'strerror', None) or one_line(e)}\n")
            self.report_dest.close()
        self.events.emit("exited", report=doc)
        self.events.close()
        if in_main:
            self.signals.close()
        trace.mark("report")
        trace.report()
        for pid in self.reap_last:      # what was killed at the end and need not have been waited for
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def _taken_over(self, msg):
        # Setup's watchdog (job/watchdog.py), while this thread waits in the
        # kernel on a path: the same end, then the watchdog exits 125.
        sys.stderr.write(f"starter: {one_line(msg)}\n")
        self.report.set(error=msg, exit_code=EXIT_STARTER_FAILED)
        self.end(in_main=False)

    # -- before the entry ----------------------------------------------------
    def load_filter(self):
        """The syscall filter first: a bad profile must create nothing."""
        from starter.isolate import seccomp

        spec = self.spec
        self.sc_filter = seccomp.load(spec.seccomp, spec.allow_userns, spec.state_dir,
                                      no_setid=spec.transient is not None)
        trace.mark("seccomp")

    def open_destinations(self):
        """The report's and the events' destinations, resolved (without
        following links) before anything runs; the report's directory fd is
        held until the end."""
        from starter.observe.report import Dest, Events

        spec = self.spec
        with self.rights():
            if spec.report:
                self.report_dest = Dest(spec.report, "report")
                if self.caller is not None:
                    self.report_dest.check_writable()
            try:
                self.events = Events(spec.events, spec.id)
            except OSError as e:
                raise StarterError(f"cannot open events destination {spec.events}: {e.strerror}") from None

    def reclaim_dead(self):
        dead = find_dead(self.spec.state_dir)     # reclaim's code loads only for one
        if dead is not None:
            from starter.admin.gc import reclaim_found

            reclaim_found(self.spec.state_dir, dead)

    def open_cgroups(self):
        """The backend, and what it must allow this job; the job's cgroup
        paths go into the entry's first write, before the cgroup exists, so
        a crash at any point leaves gc a record of them."""
        from starter import cgroups

        spec = self.spec
        if self.pilot is None:
            backend = self.backend = cgroups.open_backend(spec.cgroup_parent)
            if spec.require:
                from starter.rootless import pilot

                pilot.check_required(spec.require, pilot.not_enforced(None, backend.kind, spec.network.mode))
        else:   # a pilot's delegated cgroup, or none (the report says what that leaves out)
            from starter.rootless import pilot

            backend = self.backend = pilot.cgroup_backend(spec.cgroup_parent)
            missing = pilot.not_enforced(self.pilot, backend.kind, spec.network.mode)
            self.report.rootless = {"pilot_uid": self.pilot.uid, "subordinate_ids": self.pilot.mapped}
            self.report.not_enforced = {g: why for g, why in missing}
            pilot.check_required(spec.require, missing)
        if spec.limits.cpuset is not None or spec.limits.mems is not None:
            backend.add_cpuset()    # v1 layouts: the cpuset hierarchy too, for this job only
        if spec.delegate:   # refused before anything of the job exists
            backend.check_delegation()
        if self.caller is not None:
            # Its cgroups go inside the caller's own: root's all the way up,
            # and not a job's (a process inside a job cannot start one).
            backend.check_caller_parents()
            self.count_lock = self.caller.job_slot(spec.state_dir, self.policy)

    def check_checkpoint(self):
        spec = self.spec
        if self.image is not None:
            from starter.checkpoint import criu as checkpoint

            checkpoint.check_restore(spec, self.image, self.backend)
        if spec.on_vacate:
            from starter.checkpoint import criu as checkpoint

            checkpoint.check_dumpable(spec.id, {
                "net": spec.network.mode, "disk": spec.limits.disk, "delegate": spec.delegate,
                "userns_root": spec.userns_root, "asked": spec.asked})

    def take_uid(self):
        """The job's uid: its own (leased before the entry, which records
        it; the lease names the job, so gc finds it even if we die between),
        or a named one.  Its end, after the cgroup is gone (pushed first,
        runs last): processes of the uid outside the cgroup are escapes."""
        spec, caller = self.spec, self.caller
        if spec.transient is not None:
            from starter.callers import uids

            # A restored job's processes keep their uid: that one again, or none.
            want = (self.image.record["uid"],) * 2 if self.image is not None else spec.transient
            uid = uids.acquire(spec.state_dir, spec.id, *want)
            self.undo.push(_end_transient, spec.state_dir, uid, spec.id, spec.escape, self.report, label="uid")
            self.spec = spec = spec.replace(uid=uid, gid=uid if spec.gid is None else spec.gid, user=str(uid))
            fault("uid")
        elif spec.uid != 0:
            # The caller's relay is a process of the job's uid (its own): known, not an escape.
            relay = caller.relay if caller is not None and caller.uid == spec.uid else None
            self.undo.push(self._end_named, relay, label="escapes")
        self.report.uid = spec.uid

    def _end_named(self, relay):
        from starter.job import strays

        strays.end_named(self.spec.uid, self.since, self.spec.escape, self.report, relay)

    def make_entry(self):
        spec, backend, image, caller = self.spec, self.backend, self.image, self.caller
        self.job_state = JobState(spec.state_dir, spec.id).create(
            reclaim=_reclaim_for_start,
            state="starting", user=spec.user, uid=spec.uid, gid=spec.gid, groups=list(spec.groups),
            userns_root=spec.userns_root, seccomp=spec.seccomp, allow_userns=spec.allow_userns,
            argv=spec.argv, net=spec.network.mode, started_at=round(self.t0, 6),
            cgroup=backend.job_paths(spec.id), cgroup_parents=dict(backend.parents),
            cgroup_kind=backend.kind, cgroup_parent=spec.cgroup_parent, delegate=spec.delegate,
            caller=caller.uid if caller is not None else 0, transient=spec.transient is not None,
            escape=spec.escape, asked=spec.asked,
            **({"segments": image.record["segments"], "restored_from": image.path} if image is not None else {}))
        if self.count_lock is not None:      # the entry counts from here on
            os.close(self.count_lock)
        fault("state-entry")
        watchdog.check()
        self.events.emit("starting", argv=spec.argv, user=spec.uid)
        trace.mark("state")

    # -- the job's resources -------------------------------------------------
    def make_scratch(self):
        """Scratch directory and verified inputs, before anything can run."""
        from starter.isolate import mounts as M

        spec, job_state = self.spec, self.job_state
        # A transient uid's writable binds (and scratch, below) are nosuid in its view.
        self.mounts = list(spec.mounts) if spec.transient is None else M.nosuid_binds(spec.mounts)
        # The job's own /run, but for what the node policy passes through.
        self.run_through = self.policy.run_passthrough() if self.policy is not None else M.RUN_PASSTHROUGH
        self.private_run = M.RUN not in self.run_through
        if not (spec.scratch or spec.execute_dir):
            if spec.manifest:
                raise StarterError("--manifest needs a scratch directory to stage into",
                                   "add --scratch DIR or --execute-dir DIR")
            return
        from starter.storage import scratch

        # Recorded before it exists, so a crash at any point leaves gc a record.
        path = os.path.abspath(spec.scratch or os.path.join(spec.execute_dir, f"job-{spec.id}"))
        job_state.update(scratch=path, scratch_parent=os.path.dirname(path),
                         scratch_kind="scratch" if spec.scratch else "execute-dir")
        fault("scratch-record")
        if self.rights is not _root_rights:
            # A caller's execute directory (one of the policy's) must be one
            # it can reach itself: walked with its rights before root makes
            # anything there.
            from starter.storage import paths

            parent = os.path.dirname(path)
            with self.rights():
                fd = paths.open_dir(parent, "execute directory")
                try:    # O_PATH reached it; may the caller enter it?
                    if not os.access(f"/proc/self/fd/{fd}", os.X_OK, effective_ids=True):
                        raise paths.LinkError(f"execute directory {parent}: the caller may not enter it",
                                              "use an execute directory the job's user can reach")
                finally:
                    os.close(fd)
        if spec.scratch:
            sc = scratch.create(spec.scratch, spec.uid, spec.gid, mark=spec.id, groups=spec.groups)
        else:
            sc = scratch.create_in(spec.execute_dir, spec.id, spec.uid, spec.gid, groups=spec.groups)
        self.sc = sc
        # Removed unless the job runs: --keep-scratch counts from its exec on (below).
        self.undo.push(_release_scratch, sc, self.report, label="scratch")   # removes it, or when kept only closes its fd
        fault("scratch-create")
        job_state.update(scratch_id=[sc.dev, sc.ino])
        stage_fd = sc.fd
        if spec.limits.disk is not None:
            # The scratch becomes a file system of its own size (starter/storage/disk.py).
            from starter.storage import disk

            stage_fd = disk.setup(sc, spec, job_state, self.undo, self.report).root_fd
            trace.mark("disk")
        if self.image is not None:   # the dumped scratch's files, before CRIU restores fds naming them
            from starter.checkpoint import criu as checkpoint

            checkpoint.unpack_scratch(self.image, sc.path, spec.uid, spec.gid)
        self.cwd = self.cwd or sc.path
        self.stage_fd = stage_fd
        # Where the job's own /tmp or /run covers it, the scratch is shown at
        # the same path inside; a transient uid's always, nosuid; in an image
        # (which has none of the host's paths) always.
        self.mounts += M.scratch_binds(sc.path, spec.transient is not None, self.private_run,
                                       always=spec.image is not None)
        if spec.manifest:
            from starter.storage import manifest

            with self.rights():      # read with the caller's rights (the job's own uid then)
                staged = manifest.verify_and_stage(
                    spec.manifest, spec.manifest_digest, spec.inputs or os.path.dirname(spec.manifest),
                    stage_fd, spec.uid, spec.gid)
            # Run the verified copy, never the path that was checked.
            argv = self.argv
            name = argv[0][2:] if argv[0].startswith("./") else argv[0]
            if name in staged:
                argv[0] = staged[name]

    def plan_mounts(self):
        """The job's own cgroup tree, /dev/shm and temp dirs first (the
        spec's mounts may stack on them); the state directory and /proc/keys
        hidden last.  Planned before the cgroup is made: on layouts with v1
        hierarchies, making it waits for the warm-up's RCU grace period
        (cgroups.warm_up), and this work fills some of that wait.  The job's
        own /dev (only the nodes it was given; its own devpts) goes before
        /dev/shm and /dev/mqueue, which stack on it, and is made read-only
        after the spec's binds, which may add nodes to it."""
        from starter.isolate import mounts as M
        from starter.spec.jobspec import rlimit_table

        spec = self.spec
        self.first_mounts = (M.cgroup_view(self.backend.view(), writable=spec.delegate)
                             + M.dev(spec.ptys, bind_nodes=self.pilot is not None)
                             + M.private_dirs(spec.uid, spec.gid, spec.limits.memory, self.run_through)
                             + M.device_binds(d[0] for d in spec.devices))
        # A job that may make user namespaces (--allow-userns: a container
        # runtime, a pilot's own starter) keeps /proc/keys: the kernel lets a
        # user namespace mount a fresh /proc only where no file of the one it
        # sees is covered.
        self.last_mounts = M.seal_dev() + M.hide((spec.state_dir, M.DEFAULT_STATE_DIR),
                                                 () if spec.allow_userns else M.MASKED_FILES)
        if spec.image is not None:
            self.last_mounts = M.seal_dev()     # (the host's state directory is not in an image's view)
            self._image_root()
        self.rlimits = rlimit_table(spec.rlimits)
        self.cwd_fallbacks = () if self.cwd else default_cwds(spec)
        if spec.network.mode in NAT_MODES and self.pilot is None:
            from starter import net

            self.netcfg = net.config_for(spec)
            # Pushed before the cgroup's teardown, so it runs after it: the job
            # has ended, netd works on the network's teardown (asked in the
            # meantime, below) while we measure and remove the cgroup.  Also the
            # end of a failed start: it reads the counters into the report, then
            # removes the rules.
            if self.netcfg.overlay:
                self._take_part()       # (its end after the network's: pushed before it)
            self.undo.push(self._net_teardown, label="net")

    def _image_root(self):
        """--image: the image, from the node's cache (imported there first
        when a file is named, read with the caller's rights), mounted for
        the child to make its root (image/mount.py)."""
        from starter.image import cache as C, mount as IM

        spec = self.spec
        if self.image is not None:
            raise StarterError("--image: a restored job goes on in the root it was checkpointed in",
                               "leave out --image with --restore")
        cache = C.Cache(spec.image_cache)
        ref = spec.image
        if ref.startswith("sha256:"):
            hexd = C.check_digest(ref)
            if spec.image_digest is not None and spec.image_digest != ref:
                raise StarterError(f"--image {ref} is not the image pinned by --image-digest {spec.image_digest}",
                                   "the job names two images: give one")
        else:
            with self.rights():
                try:
                    fd = os.open(ref, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError as e:
                    raise StarterError(f"--image {ref}: {e.strerror}") from None
            try:
                # (an OCI layout's files opened with the caller's rights too)
                hexd = cache.import_(fd, ref, spec.image_digest,
                                     rights=self.rights if self.caller is not None else None)[0]
            finally:
                os.close(fd)
        fd = IM.squashfs(cache.path_of(hexd))
        self.undo.push(os.close, fd, label="image")
        IM.keep_warm(spec.state_dir, hexd, fd)
        # What the job writes: in its scratch where it has one (counted in
        # --disk; a directory of root's there, 0700: the job reaches its
        # files through the overlay only), else in a tmpfs of its own.
        upper = IM.upper_dir(self.stage_fd) if self.stage_fd is not None else None
        if upper is not None:
            self.undo.push(os.close, upper, label="image upper")
        self.image_root = (fd, spec.limits.memory, upper)
        self.report.image = {"digest": "sha256:" + hexd}
        self.job_state.stage(image="sha256:" + hexd)       # (the metrics' starter_job_image_info)

    def _take_part(self):
        """--net job: the node's part of the job network, made by this task
        (the first here: its init, /dev/shm and heartbeats; it holds the
        part's mutex until its job runs) or found; either way the job joins
        the part's PID, network and IPC namespaces and binds its /dev/shm
        (net/part.py)."""
        from starter.isolate import mounts as M
        from starter.net import part as P

        spec = self.spec
        part = self.part = P.Part(spec.state_dir, self.netcfg.overlay[0])
        # The part's files go after its network and init (pushed before
        # them): a task that finds them gone makes the part anew at once.
        self.undo.push(part.close, label="part")
        got = part.begin(lambda owner: _owner_namespaces(spec.state_dir, owner, spec.network.overlay.net_id,
                                                          self.caller.uid if self.caller is not None else 0))
        if got is None:
            part.make_shm(spec.limits.memory or M.SHM_SIZE_DEFAULT)
            got = self._part_init()
        self.part_ns = got
        self.undo.push(_close_all, self.part_ns, label="part namespaces")
        shm = os.path.realpath("/dev/shm")
        self.first_mounts = [m for m in self.first_mounts if m.dst != shm] + [M.Mount("bind", shm, part.shm)]
        trace.mark("part")

    def _part_init(self):
        """The owner: the part's PID 1, a process of the starter's (not of
        any task's cgroup) that holds the part's PID, network and IPC
        namespaces while its tasks come and go, and reaps their orphans:
        the shim in init mode over `sleep infinity`, root without
        capabilities.  Killed after the network's end (pushed before it).
        -> its namespaces, opened (ours: just made)."""
        from starter.isolate import ns
        from starter.isolate.nsidentity import identities
        from starter.spec.jobspec import DEFAULT_PATH

        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            holder = ns.spawn(ns.ChildSpec(
                argv=["sleep", "infinity"], env={"PATH": DEFAULT_PATH}, cwd="/", uid=0, gid=0,
                namespaces=frozenset({"pid", "net", "ipc"}), init=True, private_tmp=False,
                stdio=(null, null, null)))
        finally:
            os.close(null)
        self.holder = holder
        self.undo.push(self._end_part_init, holder, label="part init")
        holder.release()
        holder.wait_started()
        names = ("net", "ipc", "pid")
        fds = {n: os.open(f"/proc/{holder.pid}/ns/{n}", os.O_RDONLY | os.O_CLOEXEC) for n in names}
        fds["recorded"] = identities(holder.pid, names)
        # The heartbeats' socket, before the part's network exists: no peer's
        # heartbeat finds the part there without it (an ICMP error back).
        from starter.net import liveness, overlay

        self.peers = liveness.Watch(fds["net"], overlay.Plan.of(self.netcfg.overlay))
        return fds

    def _end_part_init(self, holder):
        """The part's PID 1 killed (and with it anything left in its PID
        namespace) and reaped; only then the heartbeats' socket closed: it
        keeps the part's network namespace, so no peer's late heartbeat
        finds the part there without it."""
        try:
            holder.send_signal(_signal.SIGKILL)
        except (OSError, StarterError):
            pass
        holder.wait()
        holder.close()
        if self.peers is not None:
            self.peers.close()

    def make_cgroup(self):
        """The cgroup, with its limits and device rules, before anything runs in it."""
        from starter import cgroups
        from starter.isolate import mounts as M

        spec = self.spec
        cg = self.cg = self.backend.create(spec.id, cgroups.Limits(  # removes what it made if a limit fails
            memory_bytes=spec.limits.memory, cpus=spec.limits.cpus,
            cpu_weight=spec.limits.cpu_weight, pids=spec.limits.pids,
            cpuset=spec.limits.cpuset, mems=spec.limits.mems, io_max=spec.limits.io_max))
        self.undo.push(cg.destroy, label="cgroup")
        fault("cgroup-create")
        # What the kernel lets the job open, by any path: before anything runs.
        if self.pilot is None:
            self.report.device_rules = cg.set_devices(M.dev_rules(spec.devices))
        else:   # (a cgroup device program needs the host's root: the job's own /dev only)
            self.report.device_rules = "none"
        self.oom_watch = cg.end_on_oom() if spec.oom_policy == "kill" else None
        trace.mark("cgroup")

    def add_resolv_conf(self):
        from starter.isolate import mounts as M

        spec = self.spec
        if self.netcfg is not None:
            from starter import net

            resolv = os.path.join(spec.state_dir, spec.id + ".resolv.conf")
            write_atomic(resolv, net.resolv_conf_text(self.netcfg), 0o644)
            self.undo.push(unlink_quiet, resolv, label="resolv")
            self.mounts += M.resolv_conf(resolv, self.private_run)
            if self.netcfg.overlay:
                from starter.net import overlay

                hosts = os.path.join(spec.state_dir, spec.id + ".hosts")
                write_atomic(hosts, overlay.Plan.of(self.netcfg.overlay).hosts_text(overlay.has_ipv6()), 0o644)
                self.undo.push(unlink_quiet, hosts, label="hosts")
                self.mounts.append(M.Mount("ro-bind", "/etc/hosts", hosts))
        elif spec.network.mode == "host" or self.pilot is not None and spec.network.mode in NAT_MODES:
            # the host's, where it lies in /run (a pilot's job reaches its servers through pasta)
            self.mounts += M.resolv_conf(None, self.private_run)

    # -- the job's process ---------------------------------------------------
    def clone(self):
        """The job's PID 1, cloned into the cgroup (or restored from its
        checkpoint); it waits for release()."""
        from starter.isolate import ns
        from starter.isolate.nsidentity import made_for

        spec = self.spec
        namespaces = {"pid", "mnt", "ipc", "cgroup"}
        if spec.network.mode != "host":
            namespaces.add("net")
        namespaces -= set(self.part_ns)     # --net job: the part's (joined)
        if spec.hostname:
            namespaces.add("uts")
        child_spec = self.child_spec = ns.ChildSpec(
            argv=self.argv, env=spec.env, cwd=self.cwd, cwd_fallbacks=self.cwd_fallbacks,
            uid=spec.uid, gid=spec.gid,
            groups=tuple(spec.groups), namespaces=frozenset(namespaces), hostname=spec.hostname,
            mounts=tuple(self.first_mounts + self.mounts + self.last_mounts), init=spec.init,
            cgroup_fd=self.cg.clone_fd(), seccomp=self.sc_filter,
            userns_root=spec.userns_root, rlimits=self.rlimits, cgroupns_at_clone=spec.delegate,
            join={k: fd for k, fd in self.part_ns.items() if k in ("net", "ipc", "pid")}, image=self.image_root,
            keep_groups=self.pilot is not None and not self.pilot.mapped)
        trace.mark("plan")
        if self.pilot is not None:
            from starter.rootless import userns

            userns.redump()
        if self.image is None:
            child = ns.spawn(child_spec)
        else:
            from starter.checkpoint import criu as checkpoint

            # A NAT job's tree goes into a namespace made and wired first.
            netns = checkpoint.new_netns() if self.netcfg is not None else None
            try:
                if netns is not None:
                    self._wire(netns)
                child = checkpoint.spawn(self.image, self.cg, spec.state_dir, spec.id, netns)
            finally:
                if netns is not None:
                    self._let_go(netns)
        self.child = child
        self.undo.push(child.close, label="child")
        # Which namespaces the starter made, for `starter enter` (admin/jobs.py),
        # read now: the child runs nothing of the job's before the release.  A
        # job with a user namespace of its own can later unshare its PID 1 into
        # namespaces of its own making; enter refuses those.
        self.job_namespaces = made_for(child.pid, child_spec)
        if self.part_ns:        # joined at release: the owner's, as its starter recorded them
            self.job_namespaces.update(self.part_ns["recorded"])
        if self.undo.holds("escapes"):      # what its escape check counts from
            from starter.state.store import process_start_time

            self.since = process_start_time(child.pid)
        trace.mark("clone")

    def attach(self):
        """The child into the v1 hierarchies (ns.spawn put it in clone_fd()'s
        cgroup: CLONE_INTO_CGROUP, or by pid), its delegated subtree, and its
        network."""
        from starter import cgroups

        spec, child, cg = self.spec, self.child, self.cg
        cg.add_pid(child.pid, cloned=self.child_spec.cgroup_fd is not None)
        cgroups.warm_up_done()
        if spec.delegate:
            # Before release: the job starts in job/, sees its cgroup as the root
            # and finds the subtree its own (the teardown above removes it all).
            cg.delegate(child.pid, spec.uid, spec.gid)
        fault("clone")
        trace.mark("attach")
        if self.part_ns and self.part.owner is None:
            # The owner: the part's network, in its init's namespace.
            fd = os.dup(self.part_ns["net"])
            try:
                self._wire(fd)
                self._bridge(fd)
            finally:
                self._let_go(fd)
        elif self.part_ns:
            from starter.net import overlay

            # The part's network is its owner's: its figures are in the owner's report.
            plan = overlay.Plan.of(self.netcfg.overlay)
            self.report.network = {"overlay": {"vni": plan.vni, "node": plan.node,
                                               "address": plan.address(plan.index), "part_of": self.part.owner}}
            self._bridge(self.part_ns["net"])
        elif self.netcfg is not None and self.image is None:
            fd = os.open(f"/proc/{child.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._wire(fd)
            finally:
                self._let_go(fd)
        elif self.pilot is not None and spec.network.mode in NAT_MODES:
            self._user_net()

    def _user_net(self):
        """A pilot's --net nat: the user-mode stack and the job's counters in
        its namespace (net/usermode.py); read into the report, then stopped,
        at the end (after the job, before its cgroup goes)."""
        from starter.net import usermode

        fd = os.open(f"/proc/{self.child.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            un = usermode.UserNet(self.spec.id, fd, self.spec.network.lan, self.spec.state_dir,
                                  self.spec.network.uplink)
        finally:
            os.close(fd)
        self.undo.push(self._user_net_end, un, label="net")
        self.job_state.update(pasta_pidfile=un.pidfile)
        un.start()
        fault("net-setup")
        trace.mark("net")

    def _user_net_end(self, un):
        try:
            if un.pid is not None:
                self.report.network = un.report()
        finally:
            pid = un.stop()
            if pid is not None:
                self.reap_last.append(pid)

    def _wire(self, fd):
        """The job's network, in the namespace fd (_let_go() after)."""
        from starter import net

        self.net_tried = True
        lease = self.lease = net.setup(self.spec.id, fd, self.netcfg)
        fault("net-setup")
        self.job_state.update(address=lease.address, host_ifname=lease.host_ifname, gateway=lease.gateway,
                              address6=lease.address6,
                              **({"net_rate": dict(self.netcfg.rate)} if self.netcfg.rate else {}),
                              **({"overlay": self.netcfg.overlay, "net_id": self.spec.network.overlay.net_id}
                                 if self.netcfg.overlay else {}))
        trace.mark("net")

    def _bridge(self, fd):
        """--net job under a PMIx launcher (Slurm's --mpi=pmix): its server,
        on the node's loopback, reached from the job's (net/bridge.py)."""
        from starter.net import bridge

        eps = bridge.endpoints(self.spec.env)
        if eps and self.caller is not None:
            # The URIs are the caller's word: a port of the node's loopback
            # is reached only where its own step's slurmstepd listens.
            import _socket

            from starter.callers import slurmstep
            from starter.errors import NetworkError

            stepd = self.caller.slurm_step().pid
            for fam, host, port in sorted(eps):
                if not slurmstep.listener_of(stepd, fam == _socket.AF_INET6, port):
                    raise NetworkError(f"$PMIX_SERVER_URI names {host}:{port}, which is not where the PMIx "
                                       f"server of Slurm step {self.caller.slurm_step().job} listens",
                                       "leave the PMIX_* variables as Slurm set them")
        if eps:
            b = self.pmix_bridge = bridge.Bridge(fd, eps)
            self.undo.push(b.close, label="pmix bridge")

    def _let_go(self, fd):
        """A capped job's namespace, or a --net job job's, stays open for its
        teardown (its shaper's and its job network's figures are read
        there), which closes it."""
        if self.netcfg.rate or self.netcfg.overlay:
            self.net_fd = fd
        else:
            os.close(fd)

    def release(self):
        """Let the child exec, and wait until it has (or has failed to)."""
        child, cg = self.child, self.cg
        watchdog.check()    # the last moment a start can fail without the job running
        child.release()
        fault("release")
        # While the job execs: the files its end reads, opened now (not after it).
        cg.keep_open()
        probe = child.exec_probe()
        try:
            # The child's chdir and exec may wait on a path too.  A signal that
            # comes once it has exec'd (the job may run, and print, before we
            # see it) is the job's: a vacate, not a failed start (the probe).
            with watchdog.region(f"the job's working directory {self.cwd or '(default)'} or command "
                                 f"{self.argv[0]}", probe, child.pid):
                child.wait_started()
        except StarterError as e:
            self.report.set(error=str(e), exit_code=e.exit_code)
            raise
        finally:
            if probe is not None:
                probe.close()
        watchdog.finish(self.signals.w)   # the job runs: signals are the supervisor's now
        trace.mark("exec")

    def mark_running(self):
        spec, child, lease = self.spec, self.child, self.lease
        # The job runs: only now is its scratch what --keep-scratch keeps (a
        # start that failed, exit 125, 126 or 127, leaves nothing).
        if self.sc is not None and spec.keep_scratch:
            self.sc.keep = True
            self.job_state.update(state="running", pid=child.pid, namespaces=self.job_namespaces,
                                  keep_scratch=True)
        else:
            self.job_state.update(state="running", pid=child.pid, namespaces=self.job_namespaces)
        fault("running")
        self.events.emit("running", pid=child.pid, cgroup=self.cg.paths,
                         address=lease.address if lease else None,
                         address6=lease.address6 if lease else None)
        trace.mark("running")
        # The job may run for days: collect cycles again where entry() turned
        # that off for the start, but never walk the start's objects (frozen).
        if not gc.isenabled():
            gc.freeze()
            gc.enable()

    def share_part(self):
        """--net job, the part's owner: its job runs, so other tasks of the
        job on this node may join it from now on."""
        if self.part is not None and self.part.owner is None:
            self.part.register(self.spec.id)

    def supervise(self):
        """Until the job's main process is gone and its cgroup is empty."""
        from starter.job.supervisor import Supervisor

        spec, cg = self.spec, self.cg
        gpu_usage = None
        if spec.gpus:
            from starter.observe.gpu import Usage

            gpu_usage = Usage(spec.gpus)
        sup = Supervisor(self.child, cg, self.signals, self.events, self.job_state, spec.limits.wall_time,
                         spec.grace, oom_watch=self.oom_watch, kill_timeout=spec.kill_timeout,
                         checkpoint=_checkpointer(spec, self.job_state, cg) if spec.on_vacate else None,
                         checkpoint_every=spec.checkpoint_every, watch_roles=cg.backend.watch_roles,
                         peers=self.peers)
        out = sup.run()
        self.supervised_since = sup.started
        if gpu_usage is not None:
            self.report.set(**gpu_usage.stop())
        trace.mark("job")
        if self.lease is not None and not out.unkillable:
            # The job is gone: its counters are final (once the tasks that
            # joined its part have ended).  netd tears down while we measure.
            from starter import net

            if self.part is not None:
                if out.peer_lost and self.holder is not None:
                    # The job network is broken: its other tasks here end too,
                    # with the part's PID namespace.
                    self.holder.send_signal(_signal.SIGKILL)
                # (the part lives on while they run: the heartbeats too)
                self.part.wait_members(self.peers.keep_up if self.peers is not None else None)
                if self.peers is not None:
                    self.peers.bye()        # the part ends as it should
                if self.pmix_bridge is not None:
                    self.pmix_bridge.close()

            try:
                self.net_end = net.teardown_begin(spec.id, self.netcfg, self.net_fd)
            except Exception:   # noqa: BLE001 - the teardown step tries again, and reports
                pass
        return out

    def measure(self, out):
        """Measure before anything is destroyed; -> the job's exit code."""
        from starter.job.supervisor import classify

        spec, cg, report, undo = self.spec, self.cg, self.report, self.undo
        stats = cg.stats()
        oom = stats.get("oom_kills")
        if spec.delegate and oom:
            # A payload that reached a limit the job set itself is the job's
            # business (payloads_oom names it); the job was OOM-killed only when
            # its own limit was reached or it was group-killed.
            oom = oom if cg.own_oom() else 0
        reason, code, sig = classify(out, oom, spec.oom_policy)
        if stats.get("oom_kills"):
            self.events.emit("oom", oom_kills=stats.get("oom_kills"))
        report.set(reason=reason, exit_code=code, signal=sig,
                      wall_s=round(time.monotonic() - self.supervised_since, 6),
                      cgroup=self.backend.kind, **stats)
        report.set(oom=None if oom is None else oom > 0, oom_policy=spec.oom_policy)
        if out.checkpoint_error:
            report.checkpoint_error = out.checkpoint_error
        if out.peer_lost:
            report.peer_lost = out.peer_lost
        elif reason == "checkpointed" and spec.on_vacate:
            report.checkpoint = spec.on_vacate
        if spec.delegate:
            from starter.cgroups.subtree import ran_out_of_memory

            payloads, left_out = cg.payload_stats()
            report.set(delegated=True, payloads=payloads, payloads_truncated=left_out,
                          payloads_oom=[p["name"] for p in payloads if ran_out_of_memory(p)])
        if out.unkillable:
            # Nothing the job holds may be reused while its processes live: the
            # cgroup, address, scratch and entry stay for `starter gc`.
            report.set(unkillable=out.unkillable, kill_reason=out.reason)
            undo.keep_only(self.child.close)
            stuck = ", ".join(f"{u['pid']} ({u['state']}, wchan {u['wchan']})" for u in out.unkillable)
            # run() keeps the entry "reclaiming" with this as what is still held.
            undo.failed.append(f"cgroup: {len(out.unkillable)} unkillable processes: {stuck}")
            sys.stderr.write(f"starter: job {spec.id}: unkillable processes survived the kill for "
                             f"{spec.kill_timeout:g}s: {stuck}; `starter gc` reclaims the job once they are gone\n")
            return code
        # The entry says "exited" while a teardown that can take a while runs
        # (netd's answer, removing a scratch directory).  Where only the cgroup
        # and the entry are left (well under a millisecond), the entry goes
        # without this write, which costs 0.4 ms where the state directory is
        # on a disk: a third of a killed job's teardown.
        if undo.holds("net", "scratch"):
            self.job_state.update(state="exited")
        return code

    def _net_teardown(self):
        """The network's end: nothing where no setup was tried, else the
        teardown netd began (or one now); its counters into the report.
        The netns fd kept for a capped job is closed here."""
        try:
            if not self.net_tried:
                return
            from starter import net

            counters = self.net_end() if self.net_end is not None else net.teardown(self.spec.id, self.netcfg)
            if counters:
                self.report.network = counters
        finally:
            if self.net_fd is not None:
                os.close(self.net_fd)


def _reclaim_for_start(state_dir, job_id, st):
    """JobState.create found a dead entry of this job's id: reclaim it."""
    from starter.admin.gc import reclaim_for_start

    return reclaim_for_start(state_dir, job_id, st)


def _checkpointer(spec, job_state, cg):
    """--on-vacate checkpoint:DIR: -> dump(leave_running, timeout) -> DIR.
    Each dump goes to DIR.new and replaces DIR only once it is whole, so
    the last good image is always there (--checkpoint-every)."""
    from starter.checkpoint import criu as checkpoint

    def dump(leave_running, timeout):
        # DIR.new made, and DIR.new and DIR.old cleared, by fd: never through
        # a link or across a mount the job's user put there (checkpoint_dir.Target).
        checkpoint.dump(spec.id, dict(job_state.data), cg, spec.on_vacate, leave_running, timeout,
                        spec.state_dir, replace=True)
        return spec.on_vacate

    return dump


def _end_transient(*args):
    """The transient uid's escapes at the job's end (strays.end_transient),
    imported only then."""
    from starter.job import strays

    strays.end_transient(*args)


def default_cwds(spec):
    """The job's working directory without --cwd (and without a scratch,
    which is then the cwd): the caller's, if the job's user can reach it in
    the job's view, else the user's home, else /.  Only the child can tell
    (after the uid switch, in its mount namespace: the caller's /tmp is not
    the job's), so the shim gets the list and takes the first that works."""
    out = []
    try:
        out.append(os.getcwd())
    except OSError:          # the caller's cwd was removed
        pass
    for d in (spec.home, "/"):
        if d and d.startswith("/") and d not in out:
            out.append(d)
    return tuple(out)


def _release_scratch(sc, report):
    removed = sc.release()
    if removed is not None:
        # What the job left there (HTCondor's DiskUsage), and what a --disk image held
        # (measured before its unmount: the removal saw only the directory under it).
        disk = report.get("disk") or {}
        report.scratch_bytes = removed.bytes + (disk.get("backend") == "image" and disk.get("used_bytes") or 0)


def _owner_namespaces(state_dir, owner, net_id, caller):
    """A joining task's view of its part: the PID, network and IPC
    namespaces the owner's starter recorded for its job (the part's), opened
    from that job's main process and checked against that record (as
    `starter enter` does) -> {"net": fd, "ipc": fd, "pid": fd, "recorded":
    {...}}; Gone where that job has ended.  Only a part of the same job
    network (net_id: two ids may share a VNI) that the same caller started
    (its uid; root: 0) is joined."""
    from starter.errors import NetworkError
    from starter.isolate import nsidentity
    from starter.net.part import Gone
    from starter.state import store as S

    names = ("net", "ipc", "pid")
    try:
        st = S.load(state_dir, owner)
        fds = nsidentity.open_recorded(st, names)
    except nsidentity.NamespacesChanged as e:
        raise NetworkError(f"joining the job network's part on this node (job {owner}) failed: {e}") from None
    except (StarterError, OSError, ValueError, TypeError, AttributeError):
        raise Gone(owner) from None     # its job ended meanwhile
    if st.get("net_id") != net_id or st.get("caller") != caller:
        _close_all(fds)
        raise NetworkError(f"the job network's part on this node with this VNI is another's (job {owner}: "
                           f"network {st.get('net_id')!r}, started by uid {st.get('caller')})",
                           "two job networks' ids map to one VNI here: start the job once that one ends")
    fds["recorded"] = {n: st["namespaces"][n] for n in names}
    return fds


def _close_all(fds):
    for k, fd in fds.items():
        if k != "recorded":
            try:
                os.close(fd)
            except OSError:
                pass
