"""Checkpoint and restore of a whole job with CRIU.

    starter checkpoint JOB --to DIR [--leave-running]
    starter run --restore DIR [--report F] [--events F] [--id ID]

A job is PID 1 of its own PID namespace, with its own mount, IPC and network
namespaces and its own cgroup: exactly what lets CRIU dump the tree and bring
it back without pid collisions.  What DIR holds, and how a restore checks
it before CRIU reads a byte: starter/checkpoint/directory.py.

CRIU is run as root with these options (found on Debian 12's kernel and
CRIU 3.17, docs/design.md "Checkpoint and restore"):
  * the job's mount namespace is a copy of the host's with private tmpfs on
    top: --ext-mount-map auto (host mounts are bound again from the
    restoring node), --enable-external-sharing/-masters; its root is the
    host's /, so restore needs --root at a bind of / (without it CRIU 3.17
    crashes cleaning the mount namespace);
  * the job's stdio are fds the starter passed through from its caller:
    files of the host (--external file[MNT:INO]) or pipes; a restore hands
    over its own stdio in their place (--inherit-fd), which CRIU installs
    as they are (inherited_stdio): a regular file is not reopened by its
    path, so the batch output file a requeue reopened restores;
  * --network-lock nftables (there may be no iptables); the lock's table
    is left in the job's network namespace by CRIU 3.17, and removed here;
  * the restored tree is a child of the restoring starter
    (--restore-sibling -d), so its PID 1's parent-death signal still
    points at the starter, which supervises it as any job;
  * --cgroup-root: into the new job cgroup, whose limits are set first.
"""

import os
import shutil
import subprocess
import sys
import time

from starter.checkpoint.directory import IMAGES, SCRATCH, VERSION, ImageError, Target, node_key, write_signed
from starter.errors import StarterError, one_line

DUMP_TIMEOUT = 600.0
# Options that a restore takes from its own command line, not the record:
# where its report goes, what it is called, how it is signalled.
RESTORE_OWN = ("id", "report", "report-format", "events", "grace", "on-signal", "state-dir",
               "cgroup-parent", "kill-timeout")


def criu():
    path = shutil.which("criu", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise StarterError("criu is not installed", "install Debian's package: apt install criu")
    return path


# ---------------------------------------------------------------- dump

def _mount_ids(pid):
    with open(f"/proc/{pid}/mountinfo") as f:
        return {int(line.split(None, 1)[0]) for line in f}


def _fd_key(pid, fd, job_mounts):
    """CRIU's name for what fd `fd` of `pid` is, when it lies outside the job
    (an fd the starter passed through): "pipe:[INO]" or "file[MNT:INO]" (hex);
    None for what the job made itself."""
    target = os.readlink(f"/proc/{pid}/fd/{fd}")
    if target.startswith("pipe:["):
        return target
    if target.startswith(("socket:[", "anon_inode:")):
        return None
    mnt = None
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                mnt = int(line.split()[1])
    if mnt is None or mnt in job_mounts:
        return None
    ino = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    return f"file[{mnt:x}:{ino:x}]"


def _externals(pid, pids):
    """The stdio of the job's PID 1 ({fd: key}) and every fd of the job that
    lies outside it; an outside fd that is not one of PID 1's stdio (a host
    file the job could only have been handed) is refused."""
    job_mounts = _mount_ids(pid)
    stdio = {}
    for fd in (0, 1, 2):
        try:
            key = _fd_key(pid, fd, job_mounts)
        except FileNotFoundError:
            continue
        if key is not None:
            stdio[str(fd)] = key
    known = set(stdio.values())
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                key = _fd_key(p, int(fd), job_mounts)
            except (FileNotFoundError, ProcessLookupError):
                continue
            if key is not None and key not in known and not key.startswith("pipe:"):
                raise StarterError(f"process {p} of the job holds fd {fd}, {os.readlink(f'/proc/{p}/fd/{fd}')}, "
                                   "a file outside the job that is none of its stdio: CRIU cannot restore it "
                                   "elsewhere")
    return stdio


def _criu_error(log):
    """What CRIU's log says went wrong, in its own words: its first error
    (the cause) and its last (what it gave up on), without file:line."""
    import re

    try:
        with open(log, errors="replace") as f:
            lines = [m.group(1).strip() for m in map(re.compile(r".*?Error \([^)]*\): (.*)").match, f) if m]
    except OSError:
        return "it left no log"
    lines = [x for x in lines if not x.startswith("exited, status=")]
    if not lines:
        return "its log names no error"
    return lines[0] if len(lines) == 1 or lines[0] == lines[-1] else f"{lines[0]}; {lines[-1]}"


def _criu_version(proc):
    """What `criu --version` (started beside the dump: a process start is
    ~0.1 s in the TCG VM, where the dump is timed) printed, or None."""
    try:
        out = proc.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        return None
    return out.split("\n", 1)[0].replace("Version: ", "").strip() or None


def check_dumpable(job_id, st):
    """Refuse, in one line, a job this version does not checkpoint."""
    for what, why in ((st.get("net") not in ("none", "nat", None), f"--net {st.get('net')}"),
                      (st.get("disk") or st.get("disk_image") or st.get("disk_project"), "--disk"),
                      (st.get("delegate"), "--delegate"), (st.get("userns_root"), "--userns-root")):
        if what:
            raise StarterError(f"job {job_id!r} has {why}: this starter checkpoints only jobs with --net none "
                               "or nat and no --disk, delegation or user namespace yet",
                               "docs/reference.md, \"Checkpoint and restore\"")
    if st.get("asked") is None:
        raise StarterError(f"job {job_id!r} was started by a starter that keeps no record of its options",
                           "only jobs started by this version can be checkpointed")


# A NAT job's network namespace is not in its image: the veth's other end,
# the rules and the counters are the node's.  The dump names it external
# under this key; a restore hands CRIU a fresh namespace, wired as a new
# job's, under the same key.  Its TCP connections cannot follow to another
# address: --tcp-close at both ends (not dumped; restored closed).
NETNS_KEY = "starter-net"


def dump_argv(exe, pid, images, log, stdio, leave_running, netns_ino=None):
    """The dump's command line (scripts/bench.d/checkpoint.py runs the same
    by hand).  CRIU in the job's cgroup namespace (the job's cgroups are "/"
    in the image, for the restore's new one; its cgroup2 mount there does
    not re-set the host's cgroup2 options, which a mount in the initial
    cgroup namespace does) and a private mount namespace of its own."""
    argv = ["nsenter", "-t", str(pid), "-C", "--", "unshare", "--mount", "--propagation", "private", "--",
            exe, "dump", "-t", str(pid), "-D", images, "-o", log,
            "--ext-mount-map", "auto", "--enable-external-sharing", "--enable-external-masters",
            "--network-lock", "nftables", "--leave-running" if leave_running else "--leave-stopped"]
    for key in sorted(set(stdio.values())):
        if key.startswith("file["):
            argv += ["--external", key]
    if netns_ino is not None:
        argv += ["--external", f"net[{netns_ino}]:{NETNS_KEY}", "--tcp-close"]
    return argv


def dump(job_id, st, cg, to, leave_running=False, timeout=DUMP_TIMEOUT, state_dir=None, replace=False):
    """Dump the job whose state entry is `st` (its cgroup `cg`) into the new
    directory `to` (root's, 0700), signed; with `replace` (--on-vacate)
    into `to`.new, which then replaces `to` (checkpoint_dir.Target: by fd,
    no link followed, no mount crossed).  The tree is left running, or
    stopped (for its starter to end).  A failure removes the new directory,
    leaves the job running and raises StarterError (one line: CRIU's own
    words).  A NAT job's counters (in state_dir's network) go into its
    segment."""
    check_dumpable(job_id, st)
    exe = criu()
    pid = st["pid"]
    stdio = _externals(pid, cg.pids())
    nat = st.get("net") == "nat"
    netns_ino = os.stat(f"/proc/{pid}/ns/net").st_ino if nat else None
    scratch = st.get("scratch")     # archived with the tree stopped, even if it is to run on
    target = Target(to, replace)    # a new directory: nothing of anyone else's in it
    ok = dumped = False
    version = None
    try:
        # CRIU and we reach it through our fd (passed on), never by its name again.
        where = target.where
        images = os.path.join(where, IMAGES)
        os.mkdir(IMAGES, 0o700, dir_fd=target.fd)
        log = os.path.join(where, "dump.log")
        argv = dump_argv(exe, pid, images, log, stdio, leave_running and scratch is None, netns_ino)
        before = cg.stats()
        version = subprocess.Popen([exe, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        t0 = time.time()
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=timeout, pass_fds=(target.fd,))
        except subprocess.TimeoutExpired:
            # subprocess killed CRIU: a tree it had seized goes on (ptrace ends with it)
            raise StarterError(f"checkpoint of job {job_id!r}: criu dump ran past {timeout:g} s",
                               "the job runs on") from None
        if r.returncode != 0:
            raise StarterError(f"checkpoint of job {job_id!r}: criu dump failed: {_criu_error(log)}",
                               "the job runs on; `criu check` says what this kernel lacks")
        dumped = True
        if scratch is not None:
            _pack_scratch(scratch, st, images, max(1.0, timeout - (time.time() - t0)))
            if leave_running:
                continue_all(cg)
        took = time.time() - t0
        segment = {"started_at": st.get("started_at"), "ended_at": round(t0, 6),
                   "wall_s": round(t0 - (st.get("started_at") or t0), 6),
                   "cpu_user_s": before.get("cpu_user_s"), "cpu_system_s": before.get("cpu_system_s"),
                   "node": os.uname().nodename}
        if nat:     # read with the tree stopped and its network locked: what it sent and got
            from starter import net

            counters = net.counters(job_id, net.NetConfig(state_dir=state_dir))
            segment["network"] = _zones(counters) if counters else None
        record = {"version": VERSION, "job_id": job_id, "asked": st["asked"], "uid": st.get("uid"),
                  "gid": st.get("gid"), "groups": st.get("groups") or [], "user": st.get("user"),
                  "transient": bool(st.get("transient")), "net": st.get("net") or "none",
                  "root_pid": pid, "stdio": stdio, "segments": list(st.get("segments") or []) + [segment],
                  "cgroup_kind": st.get("cgroup_kind"), "kernel": os.uname().release,
                  "criu": _criu_version(version), "dump_s": round(took, 3)}
        write_signed(where, node_key(create=True), record)
        left = target.commit()
        ok = True
        if left:        # the new image is in place; what is left of the one before is said
            sys.stderr.write(f"starter: checkpoint: {one_line(left)}\n")
        return record
    finally:
        if version is not None and version.poll() is None:
            version.kill()
            version.wait()
        try:
            if not ok:          # (a tree it failed to dump, CRIU resumes itself)
                if dumped:      # one it dumped and left stopped runs on, as after any failed dump
                    continue_all(cg)
                target.abort()
        finally:
            target.close()


def _tar_as_job(uid, gid, args, stdin, stdout, timeout=None):
    """tar with the job's ids and no capabilities (it reads and makes only
    what the job could) -> its CompletedProcess (stderr as text)."""
    from starter.spec.jobspec import DEFAULT_PATH

    return subprocess.run(["setpriv", f"--reuid={int(uid)}", f"--regid={int(gid)}", "--clear-groups",
                           "--inh-caps=-all", "--", "tar", *args], stdin=stdin, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, env={"PATH": DEFAULT_PATH})


def _pack_scratch(path, st, images, timeout):
    """The job's scratch as images/scratch.tar, by tar with the job's own
    ids (it reads only what the job could; the tree is stopped), sparse
    files kept sparse."""
    fd = os.open(os.path.join(images, SCRATCH), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        r = _tar_as_job(st["uid"], st["gid"], ["--create", "--sparse", "--one-file-system", "--numeric-owner",
                                               "--file=-", f"--directory={path}", "."], subprocess.DEVNULL, fd, timeout)
    except subprocess.TimeoutExpired:
        raise StarterError(f"checkpoint: archiving the scratch {path} ran past the dump's time") from None
    finally:
        os.close(fd)
    if r.returncode != 0:
        raise StarterError(f"checkpoint: cannot archive the scratch {path}: {one_line(r.stderr) or r.returncode}")


def unpack_scratch(image, path, uid, gid):
    """Before CRIU: the dumped scratch's files back in the new job's scratch
    `path` (made as a new job's), where the fds CRIU restores name them;
    unpacked by tar with the job's own ids, so it makes only what the job
    could."""
    try:
        fd = os.open(SCRATCH, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=image.images_fd)
    except FileNotFoundError:
        raise ImageError(f"{image.path} holds no scratch, and the job has one") from None
    try:
        r = _tar_as_job(uid, gid, ["--extract", "--preserve-permissions", "--no-same-owner",
                                   "--delay-directory-restore", "--file=-", f"--directory={path}"],
                        fd, subprocess.DEVNULL)
    finally:
        os.close(fd)
    if r.returncode != 0:
        raise StarterError(f"restore of {image.path}: cannot unpack its scratch into {path}: "
                           f"{one_line(r.stderr) or r.returncode}")


def continue_all(cg):
    """SIGCONT to every process of the job's cgroup (a tree CRIU left stopped)."""
    import _signal

    from starter.cgroups.kill import kill_pids

    kill_pids(cg.pids(), _signal.SIGCONT)


def checkpoint(state_dir, job_id, to, leave_running=False):
    """`starter checkpoint`: dump a running job to `to`; unless leave_running,
    its starter then ends it, reason "checkpointed"."""
    from starter.admin import live
    from starter.state import store as S
    from starter.job.supervisor import ACTION_SIGNALS

    st = live.entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id) or st.get("state") not in ("running", "suspended"):
        raise StarterError(f"job {job_id!r} is not running (state {st.get('state')!r})")
    dump(job_id, st, live.job_cgroup(st, job_id), to, leave_running, state_dir=state_dir)
    if not leave_running:
        # The tree is stopped (--leave-stopped): its starter kills it through
        # the cgroup and reports "checkpointed"; wait for that.
        os.kill(st["starter_pid"], ACTION_SIGNALS["checkpointed"])
        deadline = time.monotonic() + 30
        while S.is_live(state_dir, job_id) and time.monotonic() < deadline:
            time.sleep(0.02)
    print(f"{job_id}: checkpointed to {to}" + (" (left running)" if leave_running else ""))
    return 0


def check_restore(spec, image, backend):
    """A restore goes where this version brings one back, as the uid its
    processes have."""
    rec = image.record
    if backend.kind not in ("v2", "v1"):
        raise StarterError(f"restore of {image.path}: this starter restores onto pure cgroup v2 or v1 nodes only "
                           f"(this one is {backend.kind}: untested)")
    if bool(rec.get("transient")) != (spec.transient is not None) or (
            spec.transient is None and spec.uid != rec.get("uid")):
        raise StarterError(f"restore of {image.path}: its processes run as uid {rec.get('uid')}, "
                           f"and the job would now run as {spec.user or spec.uid}",
                           "restore it where its user resolves to the same uid")
    if spec.transient is not None and not spec.transient[0] <= rec.get("uid", -1) <= spec.transient[1]:
        raise StarterError(f"restore of {image.path}: its uid {rec.get('uid')} is outside this node's "
                           f"job uids {spec.transient[0]}-{spec.transient[1]}")


NET_TOTALS = ("lan_in", "lan_out", "wan_in", "wan_out", "dropped")


def _zones(counters):
    """A NAT job's counters as a segment keeps them: bytes and packets per zone."""
    return {z: counters[z] for z in NET_TOTALS if z in counters}


def segments(report, before):
    """The report of a restored job, once its teardown is done (its network
    counters read): each run a segment, and their sums.  Nothing for a
    restore that did not run.  A NAT job's counters start at zero in each
    run's namespace and its dump read them with the tree stopped, so each
    byte is in one segment."""
    if "wall_s" not in report:
        return
    now = {k: report.get(k) for k in ("started_at", "ended_at", "wall_s", "cpu_user_s", "cpu_system_s")}
    now["ended_at"] = now["ended_at"] or round(time.time(), 6)
    now["node"] = os.uname().nodename
    segs = list(before) + [now]
    total = {k: round(sum(s.get(k) or 0 for s in segs), 6) for k in ("wall_s", "cpu_user_s", "cpu_system_s")}
    report.set(segments=segs, total=total)
    if any("network" in s for s in before):
        now["network"] = _zones(report.get("network") or {})
        total["network"] = {
            z: {k: sum(((s.get("network") or {}).get(z) or {}).get(k, 0) for s in segs) for k in ("bytes", "packets")}
            for z in NET_TOTALS}


def new_netns():
    """A fresh network namespace (its loopback up), held by the fd returned:
    made by a child that exits at once.  A NAT job's restore wires it as a
    new job's, and CRIU puts the restored tree in it."""
    from starter.isolate import ns
    from starter.spec.jobspec import DEFAULT_PATH

    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        child = ns.spawn(ns.ChildSpec(argv=["true"], env={"PATH": DEFAULT_PATH}, namespaces=frozenset({"net"}),
                                      private_tmp=False, stdio=(null, null, null)))
        try:
            fd = os.open(f"/proc/{child.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            child.release()
            child.wait_started()
            child.wait()
        finally:
            child.close()
    finally:
        os.close(null)
    return fd


def restore_values(image, values):
    """The option values of the restored job: what the job asked for at its
    first start (its id too, unless the restore gives one), but for where
    this restore's own report and events go and how it is signalled
    (RESTORE_OWN); built and checked like a new job's (spec.build)."""
    asked = dict(image.record["asked"])
    for k in RESTORE_OWN:
        if k != "id":           # the job keeps its id unless the restore names another
            asked.pop(k, None)
    for k, v in values.items():
        if k in RESTORE_OWN:
            asked[k] = v
        elif k != "restore":
            raise StarterError(f"--{k} cannot be given with --restore: the job keeps what it was started with",
                               f"only {', '.join('--' + o for o in RESTORE_OWN)} go with --restore")
    return asked


class Restored:
    """The restored job's PID 1, the starter's child (CRIU's --restore-sibling):
    what job/run.py's supervision needs of ns.Child.  CRIU leaves the tree
    stopped (--leave-stopped); release() lets every process of the job's
    cgroup go on, once the starter has recorded and wired what it needs
    (a job that ended at once would leave nothing to read)."""

    def __init__(self, pid, pidfd, cg):
        from starter.isolate.ns import Child

        self._c = Child(pid, pidfd, -1, -1, -1, False)
        self.pid, self.pidfd, self._cg = pid, pidfd, cg

    def release(self):
        continue_all(self._cg)

    def wait_started(self):
        pass

    def exec_probe(self):
        return None

    def __getattr__(self, name):
        return getattr(self._c, name)


def inherited_stdio(stdio):
    """[(fd, name)]: which of the restoring starter's own fds 0-2 CRIU is
    given (--inherit-fd) under which name, to put them in place of the
    job's.  stdio: the record's {fd: CRIU's name of what the job had there}.

    A pipe (pipe:[INO]) CRIU takes as it is.  A file of the host the dump
    named external (file[MNT:INO]: a regular file, /dev/null) CRIU restores
    under the external name by opening our fd again through /proc, with the
    flags and at the offset the job had, refusing it if its size or mode is
    not what the dump saw: the batch output file that Slurm reopened for a
    requeued job (truncated, or a new inode) would not restore, or would
    get a hole up to the old offset.  Before that, CRIU looks every restored
    regular file up among the inherited fds by its path, which is its
    recorded name less the first character (the leading "/"): ile[MNT:INO]
    for an external one; found there, our fd is installed as it is, nothing
    reopened or checked, and the job's later output goes where ours goes,
    at our fd's offset.  Both names are given: the external one stays what
    CRIU reopens should it not find the other.  One fd stands for every
    file of the job with the same name, so where stdin and stdout or
    stderr were the same file each opened on its own (/dev/null for both),
    only the external name is given, and CRIU reopens our fd with each
    one's flags."""
    names = []
    fds_of = {}
    for fd, key in stdio.items():
        fds_of.setdefault(key, set()).add(fd)
    given = set()
    for fd, key in sorted(stdio.items()):
        names.append((fd, key))
        ours = fds_of[key]
        if key.startswith("file[") and key not in given and not ("0" in ours and len(ours) > 1):
            names.append((fd, key[1:]))
            given.add(key)
    return names


def spawn(image, cg, state_dir, job_id, netns=None):
    """`criu restore` of the image into the job cgroup `cg`, in fresh
    namespaces, the tree a child of ours, with our stdio for its outside
    fds; then the mounts CRIU 3.17 gets wrong made right.  -> Restored.
    netns: a NAT job's network namespace (an fd; new_netns()), wired.

    CRIU itself runs through the shim, cloned into the job cgroup with a
    cgroup namespace rooted there and a mount namespace of its own (slave:
    nothing it mounts reaches the host), as root with its capabilities,
    like `starter ns-exec`; with --manage-cgroups=ignore the tree it
    restores stays where CRIU is: in the job cgroup, whose limits the
    starter set (CRIU 3.17's own cgroup handling fails to mount its yard
    in a mount namespace of its own)."""
    from starter.isolate import ns
    from starter.spec.jobspec import DEFAULT_PATH

    exe = criu()
    rec = image.record
    work = os.path.join(state_dir, f"{job_id}.restore")
    os.mkdir(work, 0o700)
    root = os.path.join(work, "root")
    mounted = False
    fds = []
    try:
        os.mkdir(root, 0o700)
        # --root: a bind of / (the job's root is the host's); CRIU's
        # namespace gets a copy, and ours loses it at the end (_end_work).
        _mount(["--bind", "/", root])
        mounted = True
        _mount(["--make-private", root])
        log, pidfile = os.path.join(work, "restore.log"), os.path.join(work, "pid")
        argv = [exe, "restore", "-D", f"/proc/self/fd/{image.images_fd}", "-o", log, "--restore-sibling", "-d",
                "--pidfile", pidfile, "--ext-mount-map", "auto", "--enable-external-sharing",
                "--enable-external-masters", "--root", root, "--manage-cgroups=ignore", "--leave-stopped"]
        for fd, name in inherited_stdio(rec.get("stdio", {})):
            mine = os.dup(int(fd))      # one for each name: CRIU closes each after storing it
            fds.append(mine)
            argv += ["--inherit-fd", f"fd[{mine}]:{name}"]
        if netns is not None:
            argv += ["--inherit-fd", f"fd[{netns}]:{NETNS_KEY}", "--tcp-close"]
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)     # CRIU says what it has to say in its log
        fds.append(null)
        child = ns.spawn(ns.ChildSpec(
            argv=argv, env={"PATH": DEFAULT_PATH}, cwd=work, uid=0, gid=0, namespaces=frozenset({"mnt", "cgroup"}),
            private_tmp=False, drop_privileges=False, reset_inherited=False,
            keep_fds=tuple(fds) + (image.images_fd,) + ((netns,) if netns is not None else ()),
            cgroup_fd=cg.clone_fd(), stdio=(null, null, null)))
        try:
            # In every hierarchy of the job before it runs (v1: by pid; its
            # cgroup namespace is made after the release, rooted there).
            cg.add_pid(child.pid, cloned=cg.clone_fd() is not None)
            child.release()
            child.wait_started()
            status = child.wait()
        finally:
            child.close()
        if status != 0:
            raise StarterError(f"restore of {image.path}: criu restore failed: {_criu_error(log)}",
                               "the job was not restored; nothing of it runs")
        with open(pidfile) as f:
            pid = int(f.read().strip())
        pidfd = os.pidfd_open(pid)
        try:
            if _ppid(pid) != os.getpid():
                raise StarterError(f"restore of {image.path}: the restored process {pid} is not the starter's child")
            _fix_mounts(pid, rec)
        except BaseException:
            import signal

            signal.pidfd_send_signal(pidfd, signal.SIGKILL)     # its PID namespace goes with it
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
            os.close(pidfd)
            raise
        restored = Restored(pid, pidfd, cg)
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        left = _end_work(work, mounted)
        if left and isinstance(e, StarterError):    # one line: why the restore failed, and what it left
            raise StarterError(f"{one_line(e)}; and {left}") from None
        if left:
            sys.stderr.write(f"starter: restore: {left}\n")
        raise
    for fd in fds:
        os.close(fd)
    left = _end_work(work, mounted)
    if left:        # the job is restored and runs on; what its restore left on the node is said
        sys.stderr.write(f"starter: restore: {left}\n")
    return restored


def _mount(args):
    r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise StarterError(f"restore: mount {' '.join(args)} failed: {one_line(r.stderr) or r.returncode}")


MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8


def _end_work(work, mounted):
    """The restore's work directory (state_dir/<id>.restore) removed once
    CRIU is done.  `mounted`: its bind of / at root/ is unmounted first
    (detached: CRIU's namespace may hold a copy) and must then be gone
    (root/ on the work directory's own mount again); the rest goes by
    checkpoint_dir.remove_tree(), which never crosses a mount.  -> None,
    or one line saying what was left in place and why: a work directory
    with anything still mounted in it is never removed through the mount
    (and `starter gc` names it: it is no entry of the state directory)."""
    from starter.checkpoint.directory import Left, mount_id, remove_tree
    from starter.fileio import libc_handle

    parent, name = os.path.split(work)
    try:
        pfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return one_line(f"{work} left in place: {e.strerror}")
    try:
        if mounted:
            ctypes, libc = libc_handle()
            said = ""
            if libc.umount2(os.fsencode(os.path.join(work, "root")), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
                said = f" ({os.strerror(ctypes.get_errno())})"
            wfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                rfd = os.open("root", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
                try:
                    still = mount_id(rfd) != mount_id(wfd)
                finally:
                    os.close(rfd)
            finally:
                os.close(wfd)
            if still:
                return one_line(f"{work}/root is still mounted after its unmount{said}: {work} left in place, "
                                "not removed through it (unmount it, then remove it)")
        remove_tree(pfd, name, work)
        return None
    except Left as e:
        return one_line(e)
    except OSError as e:
        return one_line(f"{work} left in place: {e.strerror or e}")
    finally:
        os.close(pfd)


def _ppid(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[1])


def _nsenter(pid, flags, *argv, check=True, what=""):
    r = subprocess.run(["nsenter", "-t", str(pid), *flags, "-r", "-w", "--", *argv], capture_output=True, text=True,
                       timeout=30)
    if check and r.returncode != 0:
        raise StarterError(f"after the restore, {' '.join(argv)} in the job ({what}) failed: "
                           f"{one_line(r.stderr) or r.returncode}")


def _fix_mounts(pid, rec):
    """CRIU 3.17 brings the job's cgroup mounts back as binds of the host's
    hierarchies at the old job's paths (more than the job's own cgroup), and
    leaves its network lock's table in the job's network namespace: both
    put right.  Each such mount gets a fresh one of its hierarchy on top,
    made in the job's cgroup namespace (so it shows the job's cgroup as its
    root), read-only; the kernel refuses a file system on itself at the
    same place, so a tiny tmpfs goes between.  The job, without
    CAP_SYS_ADMIN, cannot take them off."""
    from starter.cgroups.hierarchy import unescape_mountinfo

    wrong = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            lf = line.split()
            sep = lf.index("-")
            fstype, where = lf[sep + 1], unescape_mountinfo(lf[4])
            if fstype in ("cgroup", "cgroup2") and where.startswith("/sys/fs/cgroup"):
                opts = [o for o in lf[sep + 3].split(",") if o not in ("rw", "ro")]
                if fstype == "cgroup2":
                    opts = []       # its options are the host's, node-wide
                # the last mount at a place is what the job sees
                wrong[where] = (fstype, opts) if unescape_mountinfo(lf[3]) != "/" else None
    for where, fix in wrong.items():
        if fix is None:
            continue
        fstype, opts = fix
        what = f"its {fstype} mount at {where} showed another cgroup"
        _nsenter(pid, ["-m", "-C"], "mount", "-n", "-t", "tmpfs", "-o", "ro,nosuid,nodev,noexec,size=4k,mode=0555",
                 "none", where, what=what)
        _nsenter(pid, ["-m", "-C"], "mount", "-n", "-t", fstype, "-o", ",".join(["ro", "nosuid", "nodev", "noexec"]
                                                                                 + opts), fstype, where, what=what)
    _nsenter(pid, ["-n"], "nft", "delete", "table", "inet", f"CRIU-{int(rec.get('root_pid', 0))}", check=False)
