"""Checkpoint and restore of a whole job with CRIU (issue 26).

    starter checkpoint JOB --to DIR [--leave-running]
    starter run --restore DIR [--report F] [--events F] [--id ID]

A job is PID 1 of its own PID namespace, with its own mount, IPC and network
namespaces and its own cgroup: exactly what lets CRIU dump the tree and bring
it back without pid collisions.  What DIR holds:

    images/        CRIU's images (`criu dump`): every process and thread, its
                   namespaces, private mounts and tmpfs contents, SysV IPC,
                   the seccomp filter
    starter.json   the starter's record: what the job asked for (the options
                   it was started with, before the node policy), its uid,
                   the stdio it had, and its usage so far, one segment per
                   run (the report sums them, as HTCondor's cumulative wall
                   clock does)
    starter.sig    HMAC-SHA256, keyed with the node's checkpoint key, over
                   the record and the SHA-256 of every image file

Every byte of an image is the job's data, and the directory may travel
through the job's user's hands to another node.  So a restore checks the
signature first (the key is root's, /etc/starter/checkpoint.key, the same
on every node that restores another's images, as munge's key is), and then
builds the job from the record exactly as a new job is built: the same
policy checks, the same uid (a transient uid is leased again, the same one,
or the restore is refused).  An image cannot ask for more than a new job
could.

CRIU is run as root with these options (found on Debian 12's kernel and
CRIU 3.17, docs/design.md "Checkpoint and restore"):
  * the job's mount namespace is a copy of the host's with private tmpfs on
    top: --ext-mount-map auto (host mounts are bound again from the
    restoring node), --enable-external-sharing/-masters; its root is the
    host's /, so restore needs --root at a bind of / (without it CRIU 3.17
    crashes cleaning the mount namespace);
  * the job's stdio are fds the starter passed through from its caller:
    files of the host (--external file[MNT:INO]) or pipes; a restore hands
    over its own stdio in their place (--inherit-fd);
  * --network-lock nftables (there may be no iptables); the lock's table
    is left in the job's network namespace by CRIU 3.17, and removed here;
  * the restored tree is a child of the restoring starter
    (--restore-sibling -d), so its PID 1's parent-death signal still
    points at the starter, which supervises it as any job;
  * --cgroup-root: into the new job cgroup, whose limits are set first.
"""

import hashlib
import hmac
import json
import os
import shutil
import stat
import subprocess
import time

from starter.errors import StarterError, one_line

KEY = "/etc/starter/checkpoint.key"
RECORD, SIG, IMAGES = "starter.json", "starter.sig", "images"
VERSION = 1
MAX_RECORD = 1 << 20
DUMP_TIMEOUT = 600.0
# Options that a restore takes from its own command line, not the record:
# where its report goes, what it is called, how it is signalled.
RESTORE_OWN = ("id", "report", "report-format", "events", "grace", "on-signal", "state-dir",
               "cgroup-parent", "kill-timeout")


class ImageError(StarterError):
    def __init__(self, msg, hint="make a new checkpoint, or restore an untouched copy of the directory"):
        super().__init__(msg, hint)


def criu():
    path = shutil.which("criu", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        raise StarterError("criu is not installed", "install Debian's package: apt install criu")
    return path


# ---------------------------------------------------------------- the key

def _key(create=False):
    """The node's checkpoint key: root's, mode 0600, at least 32 bytes.
    Made (random) by the first checkpoint on a node that has none."""
    try:
        fd = os.open(KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise ImageError(f"{KEY} does not exist: this node cannot check a checkpoint's signature",
                             f"copy {KEY} from the node that made the checkpoint (root's, mode 0600)") from None
        os.makedirs(os.path.dirname(KEY), 0o755, exist_ok=True)
        fd = os.open(KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, os.urandom(32).hex().encode() + b"\n")
        finally:
            os.close(fd)
        return _key()
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise StarterError(f"{KEY} must be a regular file of root's, mode 0600",
                               f"chown root:root {KEY}; chmod 600 {KEY}")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 32:
        raise StarterError(f"{KEY} holds fewer than 32 bytes", "remove it; the next checkpoint makes a new one")
    return data


def _signature(key, record, digests):
    msg = record + b"\0" + json.dumps(digests, sort_keys=True).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _key_id(key):
    return hashlib.sha256(b"starter-checkpoint-key\0" + key).hexdigest()[:16]


def _digest_images(images_fd):
    """{name: sha256} of every file of the images directory; anything but a
    regular file there (a link, a directory) is refused."""
    out = {}
    for name in sorted(os.listdir(images_fd)):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=images_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageError(f"images/{name} is not a regular file")
            h = hashlib.sha256()
            while True:
                buf = os.read(fd, 1 << 20)
                if not buf:
                    break
                h.update(buf)
            out[name] = h.hexdigest()
        finally:
            os.close(fd)
    return out


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


def _criu_version(path):
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.split("\n", 1)[0].replace("Version: ", "").strip() or None


def check_dumpable(job_id, st):
    """Refuse, in one line, a job this version does not checkpoint."""
    for what, why in ((st.get("net") not in ("none", None), f"--net {st.get('net')}"),
                      (st.get("scratch") is not None, "a scratch directory"),
                      (st.get("delegate"), "--delegate"), (st.get("userns_root"), "--userns-root")):
        if what:
            raise StarterError(f"job {job_id!r} has {why}: this starter checkpoints only jobs with --net none "
                               "and no scratch, delegation or user namespace yet",
                               "docs/reference.md, \"Checkpoint and restore\"")
    if st.get("asked") is None:
        raise StarterError(f"job {job_id!r} was started by a starter that keeps no record of its options",
                           "only jobs started by this version can be checkpointed")


def dump_argv(exe, pid, images, log, stdio, leave_running):
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
    return argv


def dump(job_id, st, cg, to, leave_running=False, timeout=DUMP_TIMEOUT):
    """Dump the job whose state entry is `st` (its cgroup `cg`) into the new
    directory `to` (root's, 0700), signed.  The tree is left running, or
    stopped (for its starter to end).  A failure removes `to`, leaves the
    job running and raises StarterError (one line: CRIU's own words)."""
    check_dumpable(job_id, st)
    exe = criu()
    pid = st["pid"]
    stdio = _externals(pid, cg.pids())
    os.mkdir(to, 0o700)         # a new directory: nothing of anyone else's in it
    ok = False
    try:
        images = os.path.join(to, IMAGES)
        os.mkdir(images, 0o700)
        log = os.path.join(to, "dump.log")
        argv = dump_argv(exe, pid, images, log, stdio, leave_running)
        before = cg.stats()
        t0 = time.time()
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:
            # subprocess killed CRIU: a tree it had seized goes on (ptrace ends with it)
            raise StarterError(f"checkpoint of job {job_id!r}: criu dump ran past {timeout:g} s",
                               "the job runs on") from None
        if r.returncode != 0:
            raise StarterError(f"checkpoint of job {job_id!r}: criu dump failed: {_criu_error(log)}",
                               "the job runs on; `criu check` says what this kernel lacks")
        took = time.time() - t0
        segment = {"started_at": st.get("started_at"), "ended_at": round(t0, 6),
                   "wall_s": round(t0 - (st.get("started_at") or t0), 6),
                   "cpu_user_s": before.get("cpu_user_s"), "cpu_system_s": before.get("cpu_system_s"),
                   "node": os.uname().nodename}
        record = {"version": VERSION, "job_id": job_id, "asked": st["asked"], "uid": st.get("uid"),
                  "gid": st.get("gid"), "groups": st.get("groups") or [], "user": st.get("user"),
                  "transient": bool(st.get("transient")), "net": st.get("net") or "none",
                  "root_pid": pid, "stdio": stdio, "segments": list(st.get("segments") or []) + [segment],
                  "cgroup_kind": st.get("cgroup_kind"), "kernel": os.uname().release,
                  "criu": _criu_version(exe), "dump_s": round(took, 3)}
        _write_signed(to, _key(create=True), record)
        ok = True
        return record
    finally:
        if not ok:     # (a tree it failed to dump, CRIU resumes itself)
            shutil.rmtree(to, ignore_errors=True)


def checkpoint(state_dir, job_id, to, leave_running=False):
    """`starter checkpoint`: dump a running job to `to`; unless leave_running,
    its starter then ends it, reason "checkpointed"."""
    from starter import admin
    from starter import state as S
    from starter.supervisor import ACTION_SIGNALS

    st = admin._entry(state_dir, job_id)
    if not S.is_live(state_dir, job_id) or st.get("state") not in ("running", "suspended"):
        raise StarterError(f"job {job_id!r} is not running (state {st.get('state')!r})")
    dump(job_id, st, admin.job_cgroup(st, job_id), to, leave_running)
    if not leave_running:
        # The tree is stopped (--leave-stopped): its starter kills it through
        # the cgroup and reports "checkpointed"; wait for that.
        os.kill(st["starter_pid"], ACTION_SIGNALS["checkpointed"])
        deadline = time.monotonic() + 30
        while S.is_live(state_dir, job_id) and time.monotonic() < deadline:
            time.sleep(0.02)
    print(f"{job_id}: checkpointed to {to}" + (" (left running)" if leave_running else ""))
    return 0


def _write_signed(to, key, record):
    images_fd = os.open(os.path.join(to, IMAGES), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        digests = _digest_images(images_fd)
    finally:
        os.close(images_fd)
    data = json.dumps(record, sort_keys=True, indent=1).encode() + b"\n"
    sig = {"key_id": _key_id(key), "hmac_sha256": _signature(key, data, digests), "images": digests}
    for name, blob in ((RECORD, data), (SIG, json.dumps(sig, sort_keys=True, indent=1).encode() + b"\n")):
        fd = os.open(os.path.join(to, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, blob)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- restore

class Image:
    """A checked checkpoint directory: its record, and an fd of its images
    (for a caller that is not root, of a private copy, removed by close())."""

    def __init__(self, path, record, images_fd, private=None):
        self.path, self.record, self.images_fd, self.private = path, record, images_fd, private

    def close(self):
        if self.images_fd >= 0:
            os.close(self.images_fd)
            self.images_fd = -1
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None


def _read_small(dir_fd, name):
    from starter.fileio import read_regular

    try:
        return read_regular(name, MAX_RECORD, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ImageError(f"no {name}: not a checkpoint directory of starter's") from None


def _private_copy(src_fds, state_dir):
    """Copy the caller's image files (fds opened with its rights) into a
    directory of root's, hashing the bytes written: CRIU reads the copy, so
    the caller cannot change a file between its check and CRIU's read.
    -> (path, dir fd, {name: sha256})."""
    import tempfile

    from starter import state
    from starter.fileio import copy_hashing, sized_to_fit

    state.ensure_dir(state_dir)
    priv = tempfile.mkdtemp(prefix=".restore-", dir=state_dir)
    dfd = os.open(priv, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    digests = {}
    try:
        for name, fd in src_fds.items():
            size = sized_to_fit(fd, dfd)
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)
            try:
                digests[name] = copy_hashing(fd, out, ("sha256",), limit=size)["sha256"]
            finally:
                os.close(out)
    except BaseException:
        os.close(dfd)
        shutil.rmtree(priv, ignore_errors=True)
        raise
    return priv, dfd, digests


def load(path, caller=None, state_dir=None):
    """Open and check a checkpoint directory: signature, every image's
    digest, the record's form.  -> Image.  A caller that is not root names
    a directory of its own: it is read with the caller's rights, its images
    copied to a private place first, and only its own job's image restores."""
    from starter import paths

    # (a root caller's: paths.as_user with no one to switch to, as job.py's)
    rights = caller.rights("to read the caller's checkpoint") if caller is not None else paths.as_user(None)
    src_fds = {}
    images_fd = -1
    private = None
    try:
        with rights:
            dfd = paths.open_dir(path, "checkpoint directory")
            try:
                d = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                data = _read_small(d, RECORD)
                sig_data = _read_small(d, SIG)
                images_fd = os.open(IMAGES, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
                if caller is not None:
                    for name in sorted(os.listdir(images_fd)):
                        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                     dir_fd=images_fd)
                        src_fds[name] = fd
                        if not stat.S_ISREG(os.fstat(fd).st_mode):
                            raise ImageError(f"images/{name} is not a regular file")
            finally:
                os.close(d)
        try:
            sig = json.loads(sig_data)
        except ValueError:
            raise ImageError(f"{SIG} is not JSON") from None
        key = _key()
        if not isinstance(sig, dict) or sig.get("key_id") != _key_id(key):
            raise ImageError(f"{path} was signed with another node's checkpoint key",
                             f"give every node that restores another's checkpoints the same {KEY}")
        if caller is not None:
            os.close(images_fd)
            images_fd = -1
            private, images_fd, digests = _private_copy(src_fds, state_dir)
        else:
            digests = _digest_images(images_fd)
        if not hmac.compare_digest(str(sig.get("hmac_sha256", "")), _signature(key, data, digests)):
            raise ImageError(f"{path}: the signature does not match its record and images "
                             "(changed since the checkpoint)")
        try:
            record = json.loads(data)
        except ValueError:
            raise ImageError(f"{RECORD} is not JSON") from None
        if not isinstance(record, dict) or record.get("version") != VERSION or not isinstance(record.get("asked"),
                                                                                            dict):
            raise ImageError(f"{RECORD}: not a version {VERSION} record")
        if caller is not None and (record.get("uid") != caller.uid or record.get("transient")):
            raise StarterError(f"{path} is the checkpoint of uid {record.get('uid')}'s job: a caller that is not "
                               f"root restores only its own", "ask the node's admin to restore it")
        return Image(path, record, images_fd, private)
    except BaseException:
        if images_fd >= 0:
            os.close(images_fd)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        raise
    finally:
        for fd in src_fds.values():
            os.close(fd)


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
    what job.py's supervision needs of ns.Child."""

    def __init__(self, pid, pidfd):
        from starter.ns import Child

        self._c = Child(pid, pidfd, -1, -1, -1, False)
        self.pid, self.pidfd = pid, pidfd

    def release(self):
        pass

    def wait_started(self):
        pass

    def exec_probe(self):
        return None

    def __getattr__(self, name):
        return getattr(self._c, name)


def spawn(image, cg, state_dir, job_id):
    """`criu restore` of the image into the job cgroup `cg`, in fresh
    namespaces, the tree a child of ours, with our stdio for its outside
    fds; then the mounts CRIU 3.17 gets wrong made right.  -> Restored.

    CRIU itself runs through the shim, cloned into the job cgroup with a
    cgroup namespace rooted there and a mount namespace of its own (slave:
    nothing it mounts reaches the host), as root with its capabilities,
    like `starter ns-exec`; with --manage-cgroups=ignore the tree it
    restores stays where CRIU is: in the job cgroup, whose limits the
    starter set (CRIU 3.17's own cgroup handling fails to mount its yard
    in a mount namespace of its own)."""
    from starter import ns
    from starter.spec import DEFAULT_PATH

    exe = criu()
    rec = image.record
    work = os.path.join(state_dir, f"{job_id}.restore")
    os.mkdir(work, 0o700)
    root = os.path.join(work, "root")
    os.mkdir(root, 0o700)
    mounted = False
    fds = []
    try:
        # --root: a bind of / (the job's root is the host's); CRIU's
        # namespace gets a copy, and ours loses it at the end.
        subprocess.run(["mount", "--bind", "/", root], check=True, capture_output=True, timeout=30)
        mounted = True
        subprocess.run(["mount", "--make-private", root], check=True, capture_output=True, timeout=30)
        log, pidfile = os.path.join(work, "restore.log"), os.path.join(work, "pid")
        argv = [exe, "restore", "-D", f"/proc/self/fd/{image.images_fd}", "-o", log, "--restore-sibling", "-d",
                "--pidfile", pidfile, "--ext-mount-map", "auto", "--enable-external-sharing",
                "--enable-external-masters", "--root", root, "--manage-cgroups=ignore"]
        for fd, key in sorted(rec.get("stdio", {}).items()):
            mine = os.dup(int(fd))
            fds.append(mine)
            argv += ["--inherit-fd", f"fd[{mine}]:{key}"]
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)     # CRIU says what it has to say in its log
        fds.append(null)
        child = ns.spawn(ns.ChildSpec(
            argv=argv, env={"PATH": DEFAULT_PATH}, cwd=work, uid=0, gid=0, namespaces=frozenset({"mnt", "cgroup"}),
            private_tmp=False, drop_privileges=False, reset_inherited=False, keep_fds=tuple(fds) + (image.images_fd,),
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
        return Restored(pid, pidfd)
    finally:
        for fd in fds:
            os.close(fd)
        if mounted:
            subprocess.run(["umount", "-l", root], capture_output=True, timeout=30)
        shutil.rmtree(work, ignore_errors=True)


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
    from starter.cgroups.files import unescape_mountinfo

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
