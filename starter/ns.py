"""Spawn a child in fresh namespaces; enter a running job's namespaces.

The window between clone() and execve() belongs to the native shim (no Python
runs in the child).  The protocol, in short (the full picture is in native/shim_clone.c):

    starter                                child
    spawn(): clone3 ──────────────────►    blocks on sync
    (cgroups, network from the caller)
    release(): 1 byte ───── sync ──────►   mounts, setsid, creds, fds, exec
    wait_started(): ◄────── err ────────   EOF = exec'd; else {errno, step}
      --userns-root, before that:
      ◄── err: "map user namespace" ────   after unshare(USER); its pid comes
      writes /proc/PID/*_map                 with the message (SCM_CREDENTIALS)
      1 byte ─────── sync ──────────────►  setresuid(0) in it, goes on
    wait()/poll(): pidfd                   init mode: ◄── status ── raw status

PID 1.  By default the job itself is PID 1 of its namespace.  The kernel
delivers to a namespace's PID 1 only the signals it has a handler for (and
SIGKILL from an ancestor namespace), so a job without a SIGTERM handler
ignores SIGTERM; the starter escalates to SIGKILL.  With `init=True` the shim
stays PID 1 (tini-like): it forwards every signal but SIGCHLD to the job
(PID 2, default dispositions, so SIGTERM kills it), reaps orphans, and exits
with the job's code or 128+N; `Child.job_status()` then has the job's own
raw wait status ("killed by signal 9" rather than "exit 137").

die_with_parent uses PR_SET_PDEATHSIG, which fires when the *thread* that
called spawn() exits: call spawn() from the main thread (or one that lives as
long as the job).
"""

import errno
import os
import _signal  # not `signal`: it builds enums at import (~3 ms per job)
import struct

from starter import mounts as _mounts
from starter._native import cap_last_cap, check, ffi, lib
from starter.errors import SpawnError, SpecError, StarterError
from starter.mounts import Mount
from starter.values import MAX_NUMERIC_ID  # (uid_t)-1 means "unchanged" to setresuid

__all__ = ["Mount", "ChildSpec", "Child", "spawn", "enter", "setns", "decode_status",
           "NAMESPACES", "CLONE_NEWNS", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWPID",
           "CLONE_NEWNET", "CLONE_NEWCGROUP", "identities", "made_for", "open_namespaces", "close_namespaces",
           "NamespacesChanged"]

CLONE_NEWNS = lib.SHIM_NEWNS
CLONE_NEWUTS = lib.SHIM_NEWUTS
CLONE_NEWIPC = lib.SHIM_NEWIPC
CLONE_NEWPID = lib.SHIM_NEWPID
CLONE_NEWNET = lib.SHIM_NEWNET
CLONE_NEWCGROUP = lib.SHIM_NEWCGROUP
# "cgroup" is unshare()d by the child after the release byte, so that it is
# rooted at the job's cgroups in every hierarchy (see child_main in shim_clone.c).
NAMESPACES = {"pid": CLONE_NEWPID, "net": CLONE_NEWNET, "mnt": CLONE_NEWNS,
              "uts": CLONE_NEWUTS, "ipc": CLONE_NEWIPC, "cgroup": CLONE_NEWCGROUP}
DEFAULT_NAMESPACES = frozenset({"pid", "net", "mnt"})
# shim_spec.enter_ns_fds's slots
_NS_SLOTS = {"ipc": lib.SHIM_NS_IPC, "uts": lib.SHIM_NS_UTS, "net": lib.SHIM_NS_NET,
             "pid": lib.SHIM_NS_PID, "cgroup": lib.SHIM_NS_CGROUP, "mnt": lib.SHIM_NS_MNT}

_REPORT = struct.Struct(f"ii{lib.SHIM_STEP_MAX}s")
_CREDS = struct.Struct("iII")  # struct ucred
_USERNS_STEP = b"map user namespace"  # SHIM_STEP_USERNS in shim_internal.h: a request, not a failure
# fail_link() in shim_mountfd.c: a mount destination with a link on it
_LINK_STEP, _LINK_END = "mount destination ", " is a symlink (not followed)"


class ChildSpec:
    """What to run and how to isolate it.  Plain class (no dataclasses import
    on the hot path); fields as documented in the project brief."""

    __slots__ = ("argv", "env", "cwd", "uid", "gid", "groups", "namespaces", "hostname",
                 "mounts", "private_tmp", "keep_fds", "init", "cgroup_fd",
                 "die_with_parent", "drop_privileges", "stdio", "cwd_fallbacks", "seccomp",
                 "userns_root", "reset_inherited", "rlimits", "cgroupns_at_clone")

    def __init__(self, argv, env, cwd="/", uid=0, gid=0, groups=(),
                 namespaces=DEFAULT_NAMESPACES, hostname=None, mounts=(), private_tmp=True,
                 keep_fds=(), init=False, cgroup_fd=None, die_with_parent=True,
                 drop_privileges=True, stdio=(None, None, None), cwd_fallbacks=(), seccomp=None,
                 userns_root=False, reset_inherited=True, rlimits=None, cgroupns_at_clone=False):
        self.argv = argv              # list[str]; argv[0] searched in env["PATH"]
        self.env = env                # dict[str, str]: exactly the job's environment
        self.cwd = cwd
        self.uid = uid
        self.gid = gid
        self.groups = groups          # supplementary groups, exactly these
        self.namespaces = namespaces  # subset of NAMESPACES
        self.hostname = hostname      # needs "uts"
        self.mounts = mounts          # tuple[Mount]; needs "mnt"
        self.private_tmp = private_tmp  # fresh tmpfs /tmp; only with "mnt"
        self.keep_fds = keep_fds      # besides 0-2, open in the job (CLOEXEC cleared)
        self.init = init              # shim stays PID 1, job is PID 2
        self.cgroup_fd = cgroup_fd    # cgroup2 dir fd: CLONE_INTO_CGROUP
        self.die_with_parent = die_with_parent
        self.drop_privileges = drop_privileges  # False: keep uid 0 and caps (ns-exec)
        self.stdio = stdio            # fds to become the job's 0, 1, 2 (None: inherit)
        self.cwd_fallbacks = cwd_fallbacks  # cwd=None: the first of these the job can chdir to
        self.seccomp = seccomp        # starter.seccomp.Filter installed before execve, or None
        self.userns_root = userns_root  # uid/gid 0 in a new user namespace mapped to uid/gid
        self.reset_inherited = reset_inherited  # oom_score_adj, nice, sched, affinity, umask...
        self.rlimits = rlimits        # ((SHIM_RLIMIT index, soft, hard, asked), ...); None: keep
        # cgroup namespace made by clone3 itself, rooted at cgroup_fd's cgroup
        # (--delegate: the starter then moves the child into a leaf below it)
        self.cgroupns_at_clone = cgroupns_at_clone

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"ChildSpec({fields})"


def decode_status(status):
    """Raw wait status -> (shell-style code, signal or None): the exit code,
    or 128+N for signal N."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


class Child:
    """A cloned child: pid (in the starter's pid namespace) and a pidfd."""

    __slots__ = ("pid", "pidfd", "_sync", "_err", "_status_fd", "_released", "_started",
                 "_status", "_job_status", "_init", "_spec")

    def __init__(self, pid, pidfd, sync_fd, err_fd, status_fd, init, spec=None):
        self.pid = pid
        self.pidfd = pidfd
        self._sync = sync_fd
        self._err = err_fd
        self._status_fd = status_fd
        self._released = False
        self._started = False
        self._status = None
        self._job_status = None
        self._init = init
        self._spec = spec

    def __repr__(self):
        return f"<Child pid={self.pid} pidfd={self.pidfd}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def release(self):
        """The parent's side is done (cgroups, network): let the child go on."""
        if self._released:
            return
        if self._sync < 0:
            raise StarterError("release: the child's sync pipe is closed")
        os.write(self._sync, b"\1")
        self._released = True

    def wait_started(self):
        """Block until the job exec'd.  On a failure before exec, reap the child
        and raise SpawnError(step, errno) naming the step."""
        if self._started:
            return
        if not self._released:
            raise StarterError("wait_started() before release(): the child would wait forever")
        if self._spec is not None and self._spec.userns_root:
            data = self._serve_userns()
        else:
            data = _read_report(self._err)
        _close(self._err)
        self._err = -1
        if data:
            self.wait()
            self._close_fds()
            raise _spawn_error(data, self._spec)
        # The child no longer watches sync for the starter's death.
        _close(self._sync)
        self._sync = -1
        self._started = True

    def exec_probe(self):
        """A callable that says, without blocking or reading, whether the
        child has exec'd: its end of err closed with nothing left to read
        (for setup's watchdog, deadline.py, while wait_started() blocks; it
        holds a dup of err, so main may close its own meanwhile).  The
        caller closes the probe (probe.close())."""
        return _ExecProbe(os.dup(self._err)) if self._err >= 0 else None

    def _serve_userns(self):
        """--userns-root: the job's process asks for its user namespace's
        maps (a report with exit code 0 on err, a SOCK_SEQPACKET socket with
        SO_PASSCRED, so the kernel says which pid asks); write them, let it go
        on with a byte on sync, and return what comes next: b"" at exec, or
        the report of a failure.  The maps are written here, as root in the
        parent user namespace, so the child never makes itself dumpable."""
        while True:
            data, pid, uid = _recv_report(self._err)
            if len(data) != _REPORT.size:
                return data
            err, code, raw = _REPORT.unpack(data)
            if code != 0 or raw.split(b"\0", 1)[0] != _USERNS_STEP:
                return data
            try:
                self._write_maps(pid, uid)
            except OSError as e:
                _close(self._sync)  # EOF: it exits 125 instead of waiting for us
                self._sync = -1
                return _REPORT.pack(e.errno, 125, _USERNS_STEP)
            try:
                os.write(self._sync, b"\1")
            except BrokenPipeError:
                pass  # it died: EOF on err next, and wait() says how

    def _write_maps(self, pid, uid):
        """setgroups "deny", gid_map and uid_map "0 ID 1" of `pid`'s user
        namespace, through one /proc/PID directory fd.  `pid` must be the
        child (or, with --init, a process of its PID namespace: the init's
        job; nothing else can be there yet, and a pid reused after the job
        died is not), and it must run as the job's uid."""
        spec = self._spec
        if pid is None or uid != spec.uid:
            raise OSError(errno.EPERM, "the request is not from the job's process")
        dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if pid != self.pid:
                mine = os.stat(f"/proc/{self.pid}/ns/pid")
                theirs = os.stat("ns/pid", dir_fd=dfd)
                if not self._init or (theirs.st_dev, theirs.st_ino) != (mine.st_dev, mine.st_ino):
                    raise OSError(errno.EPERM, "the request is not from the job's process")
            for name, text in (("setgroups", "deny"), ("gid_map", f"0 {spec.gid} 1\n"),
                               ("uid_map", f"0 {spec.uid} 1\n")):
                fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    os.write(fd, text.encode())
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)

    def send_signal(self, sig):
        """pidfd_send_signal; a child that is already gone is not an error."""
        if self.pidfd < 0 or self._status is not None:
            return
        try:
            _signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def poll(self):
        """Raw wait status if the child has exited (reaping it), else None."""
        if self._status is None:
            self._waitid(os.WNOHANG)
        return self._status

    def wait(self):
        """Block until the child exits; its raw wait status (for init mode
        that is the init's: job code or 128+N, see job_status())."""
        while self._status is None:
            self._waitid(0)
        return self._status

    def job_status(self):
        """Init mode: the job's own raw wait status, once the init reported it."""
        if self._job_status is None and self._status_fd >= 0:
            try:
                data = os.read(self._status_fd, 4)
            except BlockingIOError:
                return None
            if len(data) == 4:
                self._job_status = int.from_bytes(data, "little", signed=True)
            _close(self._status_fd)
            self._status_fd = -1
        return self._job_status

    def close(self):
        """Close our fds.  A child that was never released is killed and reaped
        (it would only have exited at EOF on sync anyway)."""
        if not self._released and self._status is None and self.pidfd >= 0:
            self.send_signal(_signal.SIGKILL)
            self.wait()
        if self._status is not None:
            self.job_status()  # keep it: it is readable only until we close
        self._close_fds()
        if self.pidfd >= 0:
            _close(self.pidfd)
            self.pidfd = -1

    def _close_fds(self):
        for name in ("_sync", "_err", "_status_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                _close(fd)
                setattr(self, name, -1)

    def _waitid(self, flags):
        if self.pidfd < 0:
            raise StarterError(f"wait for pid {self.pid}: the child's pidfd is closed")
        r = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | flags)
        if r is None:
            return
        if r.si_code == os.CLD_EXITED:
            self._status = (r.si_status & 0xFF) << 8
        elif r.si_code == os.CLD_DUMPED:
            self._status = r.si_status | 0x80
        else:
            self._status = r.si_status


def spawn(spec):
    """Clone a child for `spec`; it waits for Child.release()."""
    keep = []
    src_fds = []  # bind sources, opened without following links
    try:
        c = _build(spec, keep, src_fds=src_fds)
        ns = c.nsflags
        out = ffi.new("struct shim_child *")
        try:
            check(lib.shim_spawn(c, out), "clone3")
        except OSError as e:
            raise StarterError(str(e), _clone_hint(e.errno, ns, spec.cgroup_fd)) from None
    finally:
        for fd in src_fds:
            _close(fd)
    child = Child(out.pid, out.pidfd, out.sync_fd, out.err_fd, out.status_fd, spec.init, spec)
    if out.status_fd >= 0:
        os.set_blocking(out.status_fd, False)
    if spec.cgroup_fd is not None and not out.cgroup_attached:
        _attach_by_pid(child, spec.cgroup_fd)
    return child


def enter(namespaces, argv, env, cwd="/", uid=0, gid=0, groups=(), cgroup_fd=None,
          *, released=True, drop_privileges=True, keep_fds=(), stdio=(None, None, None),
          seccomp=None, rlimits=None):
    """Run argv inside a running job: join `namespaces` (name -> fd, from
    open_namespaces()) in a short-lived helper, and clone the process into
    `cgroup_fd`.  Returns a Child, already released unless released=False
    (then attach it to v1 cgroups first, and call release())."""
    unknown = set(namespaces) - _NS_SLOTS.keys()
    if unknown:
        raise SpecError("namespaces", f"cannot enter {', '.join(sorted(unknown))}")
    for name, fd in namespaces.items():
        if not isinstance(fd, int) or fd < 0:
            raise SpecError("namespaces", f"{name}: {fd!r} is not a fd")
    spec = ChildSpec(argv, env, cwd=cwd, uid=uid, gid=gid, groups=groups,
                     namespaces=frozenset(namespaces), mounts=(), private_tmp=False,
                     keep_fds=keep_fds, cgroup_fd=cgroup_fd, drop_privileges=drop_privileges,
                     stdio=stdio, seccomp=seccomp, rlimits=rlimits)
    keep = []
    c = _build(spec, keep, entering=True)
    for name, fd in namespaces.items():
        c.enter_ns_fds[_NS_SLOTS[name]] = fd
    out = ffi.new("struct shim_child *")
    try:
        check(lib.shim_enter(c, out), "enter")
    except OSError as e:
        raise StarterError(str(e), _clone_hint(e.errno, c.nsflags, cgroup_fd)) from None
    if out.pid < 0:  # the helper failed (setns, clone3): its report is on err
        data = _read_report(out.err_fd)
        _close(out.err_fd)
        raise _spawn_error(data or _REPORT.pack(0, 125, b"enter"), spec)
    child = Child(out.pid, out.pidfd, out.sync_fd, out.err_fd, -1, False, spec)
    try:
        if cgroup_fd is not None and not out.cgroup_attached:
            _attach_by_pid(child, cgroup_fd)
        if released:
            child.release()
    except BaseException:
        child.close()
        raise
    return child


# ---- which namespaces a job is in ---------------------------------------------
#
# `starter enter` joins what the starter made for the job, never what the
# job's PID 1 is in now: a job with a user namespace of its own (--userns-root,
# --allow-userns) can unshare() its mount namespace and mount over /bin there,
# and an admin who joined that namespace would run the job's binaries as
# whoever they entered as.  So the starter records which namespaces it made
# (identities(), right after clone, before the child runs anything of the
# job's), and enter opens the PID 1's namespaces by path and joins them by
# those fds only if every one is the recorded one (open_namespaces()).
#
# The cgroup namespace is made by the child after the release byte (where
# the starter cannot read it before the job runs), so it has no identity on
# record; it is checked by its owner instead: the child makes it as root of
# the host's user namespace, before any --userns-root, so that namespace
# owns it; every namespace the job could make or join is owned by a user
# namespace of the job's (it has no capability in the host's).

NS_GET_USERNS = 0xb701      # _IO(0xb7, 0x1), <linux/nsfs.h>


class NamespacesChanged(StarterError):
    """The job's PID 1 is no longer in the namespaces the starter made."""

    def __init__(self, changed, message, hint=None):
        super().__init__(message, hint)
        self.changed = changed


def identities(pid, names):
    """name -> [st_dev, st_ino] of /proc/PID/ns/NAME: which namespace of that
    type the process is in.  For a process that cannot have changed them
    (the starter's child before the release byte)."""
    out = {}
    for name in names:
        st = os.stat(f"/proc/{pid}/ns/{name}")
        out[name] = [st.st_dev, st.st_ino]
    return out


def made_for(pid, spec):
    """The record of what the starter made for its child `pid` (ChildSpec
    `spec`), for open_namespaces(): identities() of the namespaces it was
    cloned into; its cgroup namespace, made after the release unless at
    clone, as None (checked by its owner)."""
    later = set() if spec.cgroupns_at_clone else {"cgroup"} & spec.namespaces
    out = identities(pid, spec.namespaces - later)
    out.update(dict.fromkeys(later))
    return out


def _owned_by_our_user_namespace(fd):
    import fcntl

    owner = fcntl.ioctl(fd, NS_GET_USERNS)
    try:
        st, ours = os.fstat(owner), os.stat("/proc/self/ns/user")
    finally:
        os.close(owner)
    return (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)


def open_namespaces(pidfd, recorded):
    """fds of the namespaces `recorded` names (name -> [st_dev, st_ino]; a
    cgroup namespace may be None: made after the release, checked by its
    owner), opened from the process of `pidfd`, each checked to be the
    recorded one.  The process is checked to be alive after the opens, so
    /proc/PID named it throughout (a pid is not reused before its process
    is reaped).  Raises NamespacesChanged if any differs, StarterError if
    the process is gone."""
    pid = _pid_of_pidfd(pidfd)
    fds = {}
    changed = []
    try:
        for name, ident in recorded.items():
            if name not in _NS_SLOTS:
                raise StarterError(f"cannot enter a {name} namespace")
            if ident is None and name != "cgroup":
                raise StarterError(f"no record of the job's {name} namespace")
            if pid <= 0:
                raise ProcessLookupError
            fd = fds[name] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            if ident is None:
                same = _owned_by_our_user_namespace(fd)
            else:
                st = os.fstat(fd)
                same = [st.st_dev, st.st_ino] == list(ident)
            if not same:
                changed.append(name)
        _signal.pidfd_send_signal(pidfd, 0)
    except (ProcessLookupError, FileNotFoundError):
        close_namespaces(fds)
        raise StarterError(f"the job's PID 1 (pid {pid}) is gone") from None
    except BaseException:
        close_namespaces(fds)
        raise
    if changed:
        close_namespaces(fds)
        raise NamespacesChanged(changed, f"the job's PID 1 (pid {pid}) left the "
                                f"{', '.join(sorted(changed))} namespace{'s' if len(changed) > 1 else ''} "
                                "the starter made for it")
    return fds


def close_namespaces(fds):
    for fd in fds.values():
        _close(fd)


def setns(fd, nstype=0):
    """setns(2) for the calling thread.  The starter itself should not move:
    use enter(), which does this in a helper process."""
    check(lib.shim_setns(fd, nstype), "setns")


# ---- building the C spec ----------------------------------------------------

def _build(spec, keep, entering=False, src_fds=None):
    """A `struct shim_spec` for `spec`; every buffer goes to `keep`."""
    argv = spec.argv
    if not argv or not isinstance(argv, (list, tuple)):
        raise SpecError("argv", "the command is empty")
    env = spec.env
    if not isinstance(env, dict):
        raise SpecError("env", "must be a dict of str to str")
    names = spec.namespaces
    unknown = set(names) - NAMESPACES.keys()
    if unknown:
        raise SpecError("namespaces", f"unknown {', '.join(sorted(unknown))}; "
                        f"choose from {', '.join(sorted(NAMESPACES))}")
    nsflags = 0
    for n in names:
        nsflags |= NAMESPACES[n]
    if spec.hostname is not None and "uts" not in names:
        raise SpecError("hostname", "needs the uts namespace")
    if spec.mounts and "mnt" not in names:
        raise SpecError("mounts", "need the mnt namespace (they would land on the host)")
    if len(spec.mounts) > lib.SHIM_MAX_MOUNTS:
        raise SpecError("mounts", f"at most {lib.SHIM_MAX_MOUNTS}")
    for field in ("uid", "gid"):
        v = getattr(spec, field)
        if not isinstance(v, int) or not 0 <= v <= MAX_NUMERIC_ID:
            raise SpecError(field, f"{v!r} is not a valid id")
    for g in spec.groups:
        if not isinstance(g, int) or not 0 <= g <= MAX_NUMERIC_ID:
            raise SpecError("groups", f"{g!r} is not a valid group id")
    if len(spec.groups) > 65536:
        raise SpecError("groups", "more than 65536 groups")
    kfds = sorted(set(spec.keep_fds))
    if len(kfds) > lib.SHIM_MAX_KEEP:
        raise SpecError("keep_fds", f"at most {lib.SHIM_MAX_KEEP}")
    for fd in kfds:
        if not isinstance(fd, int) or fd < 3:
            raise SpecError("keep_fds", f"{fd!r}: 0-2 are always kept; give fds >= 3")
        try:
            os.fstat(fd)
        except OSError:
            raise SpecError("keep_fds", f"fd {fd} is not open") from None
    stdio = tuple(spec.stdio)
    if len(stdio) != 3:
        raise SpecError("stdio", "give three fds (or None) for stdin, stdout, stderr")
    for fd in stdio:
        if fd is not None and (not isinstance(fd, int) or fd < 0):
            raise SpecError("stdio", f"{fd!r} is not a fd")
    if spec.cgroup_fd is not None and (not isinstance(spec.cgroup_fd, int) or spec.cgroup_fd < 0):
        raise SpecError("cgroup_fd", f"{spec.cgroup_fd!r} is not a fd")
    if spec.userns_root and (entering or not spec.drop_privileges or spec.uid == 0):
        raise SpecError("userns_root", "needs a job that drops privileges to a non-root uid")
    rlimits = tuple(spec.rlimits or ())
    if rlimits and not spec.reset_inherited:
        raise SpecError("rlimits", "are set with reset_inherited")
    for r in rlimits:
        if (len(r) != 4 or not all(isinstance(v, int) for v in r)
                or not 0 <= r[0] < lib.SHIM_NRLIMITS or not 0 <= r[1] <= r[2] < 2**64):
            raise SpecError("rlimits", f"{r!r} is not (resource, soft, hard, asked), soft <= hard")

    c = ffi.new("struct shim_spec *")
    keep.append(c)
    c.argv = _strv("argv", argv, keep)
    c.envp = _strv("env", [_env_item(k, v) for k, v in env.items()], keep)
    path = env.get("PATH")
    c.path = _cstr("env", path, keep) if path is not None else ffi.NULL
    c.cwd = _cstr("cwd", spec.cwd, keep) if spec.cwd else ffi.NULL
    c.uid = spec.uid
    c.gid = spec.gid
    groups = ffi.new("unsigned int[]", list(spec.groups) or [0])
    keep.append(groups)
    c.groups = groups
    c.ngroups = len(spec.groups)
    c.nsflags = nsflags
    c.hostname = _cstr("hostname", spec.hostname, keep) if spec.hostname is not None else ffi.NULL
    if not entering and "mnt" in names:
        c.private_tmp = 1 if spec.private_tmp else 0
        c.mounts = _mounts.to_c(ffi, spec.mounts, keep, src_fds)
        c.nmounts = len(spec.mounts)
    c.stdio = [-1 if fd is None else fd for fd in stdio]
    kf = ffi.new("int[]", kfds or [0])
    keep.append(kf)
    c.keep_fds = kf
    c.nkeep = len(kfds)
    c.init = 1 if spec.init else 0
    c.cgroup_fd = -1 if spec.cgroup_fd is None else spec.cgroup_fd
    c.die_with_parent = 1 if spec.die_with_parent else 0
    c.drop_privileges = 1 if spec.drop_privileges else 0
    c.cap_last_cap = cap_last_cap()
    c.enter_ns_fds = [-1] * lib.SHIM_NNS
    if not spec.cwd and spec.cwd_fallbacks:
        c.cwd_fallbacks = _strv("cwd", list(spec.cwd_fallbacks), keep)
        c.ncwd_fallbacks = len(spec.cwd_fallbacks)
    if spec.seccomp is not None:  # the job's process installs it last, before execve
        n = len(spec.seccomp.bpf)
        if not 0 < n <= lib.SHIM_SECCOMP_MAX_BYTES or n % 8:
            raise SpecError("seccomp", f"a BPF program of {n} bytes is not 1..4096 instructions")
        bpf = ffi.from_buffer(spec.seccomp.bpf)
        keep.append(bpf)
        c.seccomp_filter = bpf
        c.seccomp_len = len(spec.seccomp.bpf)
        c.seccomp_flags = spec.seccomp.flags
    c.userns_root = 1 if spec.userns_root else 0
    c.reset_inherited = 1 if spec.reset_inherited else 0
    c.cgroupns_at_clone = 1 if spec.cgroupns_at_clone else 0
    rl = ffi.new("struct shim_rlimit[]", max(len(rlimits), 1))
    keep.append(rl)
    for i, (res, soft, hard, asked) in enumerate(rlimits):
        rl[i].resource, rl[i].soft, rl[i].hard, rl[i].asked = res, soft, hard, 1 if asked else 0
    c.rlimits = rl
    c.nrlimits = len(rlimits)
    return c


def _cstr(field, s, keep):
    b = os.fsencode(s)
    if b"\0" in b:
        raise SpecError(field, f"{s!r} contains a NUL byte")
    p = ffi.new("char[]", b)
    keep.append(p)
    return p


def _env_item(k, v):
    if not isinstance(k, str) or not k or "=" in k:
        raise SpecError("env", f"bad variable name {k!r}")
    if not isinstance(v, str):
        raise SpecError("env", f"{k}: value must be a string")
    return f"{k}={v}"


def _strv(field, items, keep):
    ptrs = [_cstr(field, s, keep) for s in items]
    ptrs.append(ffi.NULL)
    arr = ffi.new("char *[]", ptrs)
    keep.append(arr)
    return arr


# ---- parent-side helpers ----------------------------------------------------

class _ExecProbe:
    __slots__ = ("fd",)
    _FIONREAD = 0x541B

    def __init__(self, fd):
        self.fd = fd

    def __call__(self):
        import fcntl
        import select

        try:
            p = select.poll()
            p.register(self.fd, select.POLLIN)
            events = p.poll(0)
            if not events or not events[0][1] & select.POLLHUP:
                return False            # the child still holds its end
            left = struct.unpack("i", fcntl.ioctl(self.fd, self._FIONREAD, b"\0\0\0\0"))[0]
            return left == 0            # closed at exec, no failure report
        except OSError:
            return False

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_report(fd):
    """The child's failure report, or b"" at EOF (execve succeeded)."""
    buf = b""
    while len(buf) < _REPORT.size:
        chunk = os.read(fd, _REPORT.size - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _recv_report(fd):
    """One message from a --userns-root child's err socket, and the pid and
    uid the kernel attached (SCM_CREDENTIALS; pid in our PID namespace), or
    (b"", None, None) at EOF.  _socket, not socket: the latter builds enums
    at import."""
    import _socket

    s = _socket.socket(fileno=fd)
    try:
        data, anc, _flags, _addr = s.recvmsg(_REPORT.size, _socket.CMSG_SPACE(_CREDS.size))
    finally:
        s.detach()
    pid = uid = None
    for level, kind, cdata in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_CREDENTIALS and len(cdata) >= _CREDS.size:
            pid, uid, _gid = _CREDS.unpack_from(cdata)
    return data, pid, uid


def _spawn_error(data, spec):
    if len(data) < _REPORT.size:
        return StarterError("the child died during setup without a report",
                            "see the kernel log (dmesg) for a killed process")
    err, _code, raw = _REPORT.unpack(data)
    step = raw.split(b"\0", 1)[0].decode(errors="replace")
    if step.startswith(_LINK_STEP) and step.endswith(_LINK_END):
        # The shim's walk of a mount destination met a link: the step is the
        # whole message ("mount destination /a/b/c: /a/b is a symlink (not followed)").
        return SpawnError(step, err, _step_hint(step, err, spec), message=step)
    return SpawnError(step, err, _step_hint(step, err, spec))


def _attach_by_pid(child, cgroup_fd):
    """clone() fallback (no clone3): put the child in the cgroup before it runs."""
    try:
        fd = os.open("cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=cgroup_fd)
        try:
            os.write(fd, str(child.pid).encode())
        finally:
            os.close(fd)
    except OSError as e:
        child.close()
        raise StarterError(f"attach pid {child.pid} to its cgroup failed: {os.strerror(e.errno)}",
                           "check that cgroup_fd is a cgroup2 directory the starter created") from None


def _pid_of_pidfd(pidfd):
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


# ---- hints: what the admin can do about it ------------------------------------

def _clone_hint(err, nsflags, cgroup_fd):
    import errno as E
    if err == E.EPERM:
        return "creating namespaces needs root (CAP_SYS_ADMIN): run the starter as root"
    if err == E.ENOSPC:
        return ("the namespace limit is reached: raise user.max_pid_namespaces, "
                "user.max_net_namespaces, user.max_mnt_namespaces (sysctl), or gc old jobs")
    if err == E.EBUSY and cgroup_fd is not None:
        return ("the target cgroup has controllers enabled for children "
                "(cgroup v2 no-internal-process rule): use a leaf cgroup")
    if err in (E.EINVAL, E.EOPNOTSUPP) and cgroup_fd is not None:
        return "cgroup_fd must be a directory fd of a cgroup2 (unified) hierarchy"
    if err == E.EAGAIN:
        return "process limit reached (pids cgroup, ulimit -u or kernel.pid_max)"
    if err == E.ENOMEM:
        return "the kernel is out of memory, or pid namespace init already exited"
    return None


def _step_hint(step, err, spec):
    import errno as E
    uid = getattr(spec, "uid", 0)
    if step.startswith("execve"):
        if err == E.ENOENT:
            path = spec.env.get("PATH") if spec is not None else None
            if "/" in step[7:]:
                return "no such file in the job's view of the filesystem"
            return f"not found in the job's PATH={path}" if path else "the job's env has no PATH: give an absolute path"
        if err == E.EACCES:
            return f"not executable for uid {uid}, or on a noexec mount"
        if err == E.ENOEXEC:
            return "not a binary this kernel can run; scripts need a #! line"
        return None
    if step.startswith("chdir"):
        return f"the working directory must exist in the job's view and be searchable by uid {uid}"
    if step.startswith(_LINK_STEP) and err == E.ELOOP:
        return ("mount destinations are resolved in the job's view without following links, "
                "the last component included: give the path the link leads to; a link a job or "
                "user made is refused on purpose")
    if step.startswith("bind source") and err == E.ENOENT:
        return "the source of the bind does not exist on the host"
    if step.startswith(_mounts.KINDS + ("mkdir",)):
        if err == E.ENOENT:
            return ("the source or the mount point does not exist; mount points are "
                    "created only inside a tmpfs the job mounts (e.g. the private /tmp)")
        if err == E.ENOTDIR:
            return "a directory can only be bound onto a directory, a file onto a file"
    if step.startswith("mount") and err == E.EPERM:
        return "mounting needs CAP_SYS_ADMIN; is the starter itself in a restricted container?"
    if step in ("setresuid", "setresgid", "setgroups", "capset") and err == E.EPERM:
        return "changing credentials needs root: run the starter as root"
    if step == "unshare cgroup namespace" and err == E.EINVAL:
        return "the kernel lacks cgroup namespaces (CONFIG_CGROUPS, Linux 4.6+)"
    if step.startswith("mount /sys/fs/cgroup") and err == E.EBUSY:
        return "the host's cgroup hierarchies changed since the starter probed them (mount options differ)"
    if step.startswith("keyctl") and err == E.EDQUOT:
        return "the job user's key quota is full (kernel.keys.maxkeys/maxbytes): old keys of that user remain"
    if step == "unshare user namespace" and err in (E.EPERM, E.ENOSPC, E.EACCES):
        return ("--userns-root needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0 "
                "(and kernel.unprivileged_userns_clone=1 where it exists)")
    if step.startswith("setrlimit") and err == E.EPERM:
        return ("--rlimit above what the starter may grant: raising a hard limit needs "
                "CAP_SYS_RESOURCE, and nofile cannot exceed the sysctl fs.nr_open")
    if step.startswith("setns") and err == E.EINVAL:
        return "not a namespace of that type: the namespaces given to enter are wrong"
    return None
