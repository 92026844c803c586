"""Spawn a child in fresh namespaces; enter a running job's namespaces: the
Child's lifecycle (release, wait_started, signals, wait, close) around the
shim.  Beside it: childspec.py (ChildSpec and its marshalling for the shim),
nsidentity.py (which namespaces a job is in, checked before enter), nshints.py
(errno -> hint, loaded only when a spawn fails).

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
from _struct import Struct  # not `struct`: a module of its own to find and load (~0.15 ms per job)

from starter._native import check, ffi, lib
# ChildSpec, Mount and the flags are re-exported: callers build a spec through ns.
from starter.isolate.childspec import CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUTS, NAMESPACES, NS_SLOTS, ChildSpec, build
from starter.errors import SpawnError, SpecError, StarterError
from starter.isolate.mounts import Mount

__all__ = ["Mount", "ChildSpec", "Child", "spawn", "enter", "setns", "decode_status",
           "NAMESPACES", "CLONE_NEWNS", "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWPID",
           "CLONE_NEWNET", "CLONE_NEWCGROUP"]

_REPORT = Struct(f"ii{lib.SHIM_STEP_MAX}s")
_CREDS = Struct("iII")  # struct ucred
_INT = Struct("i")
_USERNS_STEP = b"map user namespace"  # SHIM_STEP_USERNS in shim_internal.h: a request, not a failure


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
        (for setup's watchdog, job/watchdog.py, while wait_started() blocks; it
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
        c = build(spec, keep, src_fds=src_fds)
        ns = c.nsflags
        out = ffi.new("struct shim_child *")
        try:
            check(lib.shim_spawn(c, out), "clone3")
        except OSError as e:
            from starter.isolate.nshints import clone_hint

            raise StarterError(str(e), clone_hint(e.errno, ns, spec.cgroup_fd)) from None
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
    unknown = set(namespaces) - NS_SLOTS.keys()
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
    c = build(spec, keep, entering=True)
    for name, fd in namespaces.items():
        c.enter_ns_fds[NS_SLOTS[name]] = fd
    out = ffi.new("struct shim_child *")
    try:
        check(lib.shim_enter(c, out), "enter")
    except OSError as e:
        from starter.isolate.nshints import clone_hint

        raise StarterError(str(e), clone_hint(e.errno, c.nsflags, cgroup_fd)) from None
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


def setns(fd, nstype=0):
    """setns(2) for the calling thread.  The starter itself should not move:
    use enter(), which does this in a helper process."""
    check(lib.shim_setns(fd, nstype), "setns")


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
            left = _INT.unpack(fcntl.ioctl(self.fd, self._FIONREAD, b"\0\0\0\0"))[0]
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
    from starter.isolate.nshints import LINK_END, LINK_STEP, step_hint

    err, _code, raw = _REPORT.unpack(data)
    step = raw.split(b"\0", 1)[0].decode(errors="replace")
    if step.startswith(LINK_STEP) and step.endswith(LINK_END):
        # The shim's walk of a mount destination met a link: the step is the
        # whole message ("mount destination /a/b/c: /a/b is a symlink (not followed)").
        return SpawnError(step, err, step_hint(step, err, spec), message=step)
    return SpawnError(step, err, step_hint(step, err, spec))


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


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass
