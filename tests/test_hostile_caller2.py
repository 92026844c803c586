"""The hostile caller, second round: identities that outlive their job, the
policy's rlimit caps, same-uid helpers under /run.

  uid leases      a transient uid is leased only when nothing of it lives: a
                  process of it (real uid) makes the start skip it; one that
                  holds it as its saved uid (a set-id copy run by another
                  user) is killed before the uid is leased; a kept scratch
                  loses its set-id bits; a transient job's writable binds and
                  scratch are nosuid in its view
  rlimit caps     a caller's --rlimit is compared with the node's real hard
                  limit: "unlimited" never passes a finite one
  private /run    every job gets a /run of its own: a same-uid host helper's
                  socket in /run/<dir> is not reachable; what the policy's
                  defaults.run_passthrough lists is
"""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import GID, PYTHON, SLOWDOWN, STARTER, UID, caller_argv
from test_callers import refused

# A one-uid range of our own (starter/callers/uids.py), away from the other tests' pins.
LEASE_UID = 1879048192 + 40402


def _ids(pid):
    """(real, effective, saved) uid of pid, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return tuple(int(x) for x in line.split()[1:4])
    except OSError:
        return None


def _held(argv, want, comm="sleep"):
    """A host process (argv, ending in a long sleep) once it runs `comm` with the ids `want`."""
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10 * SLOWDOWN
    while _ids(p.pid) != want or _comm(p.pid) != comm:
        assert p.poll() is None and time.monotonic() < deadline, (argv, _ids(p.pid))
        time.sleep(0.005)
    return p


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _stop(p):
    if p.poll() is None:
        p.kill()
    p.wait(10)


# ---------------------------------------------------------------- uid leases

def test_a_uid_with_a_live_process_is_not_leased(policy, starter):
    """A process of the range's one uid lives on the host: the start skips
    the uid (none left: one line, 125) and leaves that process alone; once
    it is gone the uid is leased again."""
    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    p = _held(["setpriv", f"--reuid={u}", f"--regid={u}", "--clear-groups", "sleep", "300"], (u, u, u))
    try:
        r = starter("run", "--", "id", "-u")
        refused(r, f"{u}", "process")
        assert p.poll() is None, "the start killed a process it did not lease"
    finally:
        _stop(p)
    r = starter("run", "--", "id", "-u", check=0)
    assert r.stdout.strip() == str(u)


def test_a_set_id_holder_of_the_uid_is_killed_before_the_lease(policy, starter):
    """A local user ran a set-user-ID copy of the uid's (real uid nobody,
    effective and saved the transient uid): it could read a later job of
    that uid through /proc/PID/root.  It is killed before the uid is
    leased; the job runs."""
    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    p = _held(["setpriv", f"--ruid={UID}", f"--euid={u}", f"--rgid={GID}", f"--egid={u}", "--clear-groups",
               "sleep", "300"], (UID, u, u))
    try:
        r = starter("run", "--", "sh", "-c", "id -u", check=0)
        assert r.stdout.strip() == str(u)
        dead = p.poll() is not None
    finally:
        _stop(p)
    assert dead, "a process holding the job's uid outlived the lease"


def test_a_kept_scratch_loses_its_set_id_bits(policy, starter, execute_dir):
    """The job leaves set-user-ID and set-group-ID copies of a program in its
    kept scratch (and opens it to everyone): none keeps its set-id bits; the
    walk follows no link (a root-owned set-id file it points to keeps its
    bits) and leaves files' other bits alone."""
    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    outside = tempfile.mkdtemp(prefix="starter-h2-outside-", dir="/var/lib")
    try:
        target = os.path.join(outside, "root-setid")
        shutil.copy("/bin/true", target)
        os.chmod(target, 0o6755)
        os.chmod(outside, 0o755)
        script = ("cp /bin/true t && chmod 6755 t && mkdir -p d/e && cp /bin/true d/e/u && chmod 4711 d/e/u && "
                  f"cp /bin/true g && chmod 2755 g && ln -s {target} link && ln -s {outside} dlink && "
                  "chmod 755 . d d/e && stat -c '%a %n' t d/e/u g")
        # (--seccomp off: the default filter refuses a transient job any set-id file)
        r = starter("run", "--id", "h2-keep", "--seccomp", "off", "--execute-dir", execute_dir, "--keep-scratch", "--",
                    "sh", "-c", script, check=0)
        assert sorted(r.stdout.split()) == sorted("6755 t 4711 d/e/u 2755 g".split()), r.stdout
        sc = os.path.join(execute_dir, "job-h2-keep")
        modes = {n: stat.S_IMODE(os.lstat(os.path.join(sc, n)).st_mode) for n in ("t", "d/e/u", "g")}
        assert modes == {"t": 0o755, "d/e/u": 0o711, "g": 0o755}, {k: oct(v) for k, v in modes.items()}
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o6755
        assert os.path.islink(os.path.join(sc, "link"))
    finally:
        shutil.rmtree(outside)


def _mount_options(mountinfo, path):
    """The per-mount options of the topmost mount at `path` in a mountinfo text."""
    found = None
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) > 5 and f[4] == path:
            found = f[5].split(",")
    return found


def test_a_transient_jobs_writable_bind_and_scratch_are_nosuid(policy, starter, execute_dir):
    """In a transient-uid job's view its writable binds and its scratch are
    nosuid (a read-only bind keeps the source's flags)."""
    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    src = tempfile.mkdtemp(prefix="starter-h2-bind-", dir="/var/lib")
    try:
        os.chmod(src, 0o777)
        r = starter("run", "--id", "h2-nosuid", "--execute-dir", execute_dir, "--bind", src, "--",
                    "cat", "/proc/self/mountinfo", check=0)
        assert "nosuid" in (_mount_options(r.stdout, src) or ()), r.stdout
        assert "nosuid" in (_mount_options(r.stdout, os.path.join(execute_dir, "job-h2-nosuid")) or ()), r.stdout
    finally:
        shutil.rmtree(src)


# ---------------------------------------------------------------- rlimit caps

class _Caller:
    uid, gid = UID, GID

    def is_self(self, opt, value):
        return True


def _apply(text, rlimits):
    from starter.callers import gate, policy as P

    return gate.apply(P.parse(text.encode(), "<test>"), {"rlimit": list(rlimits)}, _Caller())


def _threads_half():
    with open("/proc/sys/kernel/threads-max") as f:
        return int(f.read()) // 2


@pytest.mark.parametrize("item", ["sigpending=unlimited", "sigpending=1:unlimited", "sigpending={over}"])
def test_rlimit_above_the_nodes_real_limit_is_refused(item):
    """No node policy value and no built-in number for sigpending: the
    node's limit is still a number (threads-max / 2, what every job gets),
    and neither "unlimited" nor a number above it passes."""
    from starter.callers.policy import PolicyError

    with pytest.raises(PolicyError, match="sigpending"):
        _apply("", [item.format(over=_threads_half() + 1)])


def test_rlimit_caps_compare_numbers():
    from starter.callers.policy import PolicyError

    _apply("", [f"sigpending={_threads_half()}", "sigpending=100", "nofile=1024:524288", "cpu=unlimited"])
    with pytest.raises(PolicyError, match="nofile"):
        _apply("", ["nofile=unlimited"])
    # The node's own value, finite: unlimited is above it; unlimited there lets it through.
    with pytest.raises(PolicyError, match="cpu"):
        _apply('[defaults]\nrlimits = { cpu = "3600" }\n', ["cpu=unlimited"])
    _apply('[defaults]\nrlimits = { sigpending = "unlimited" }\n', ["sigpending=unlimited"])


def test_caller_sigpending_unlimited_is_refused_by_the_policy(policy, home):
    p = subprocess.run(caller_argv("run", "--rlimit", "sigpending=unlimited", "--", "true"),
                       capture_output=True, text=True, timeout=60 * SLOWDOWN, cwd=home)
    refused(p, "sigpending", "node's hard limit", str(_threads_half()))
    p = subprocess.run(caller_argv("run", "--rlimit", "sigpending=100", "--", "grep", "pending", "/proc/self/limits"),
                       capture_output=True, text=True, timeout=60 * SLOWDOWN, cwd=home)
    assert p.returncode == 0 and p.stdout.split()[3:5] == ["100", "100"], (p.stdout, p.stderr)


# ---------------------------------------------------------------- private /run

# A same-uid helper: listens on DIR/sock as nobody and answers HELLO (tmux's,
# screen's, an agent's sockets live in such directories).
SERVER = ("import os, socket, sys\n"
          "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n"
          "os.chmod(sys.argv[1], 0o777); print('ready', flush=True)\n"
          "while True:\n"
          "    c, _ = s.accept(); c.sendall(b'HELLO\\n'); c.close()\n")
CLIENT = ("import socket, sys\n"
          "s = socket.socket(socket.AF_UNIX)\n"
          "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('NOT REACHED', e.errno); sys.exit(0)\n"
          "print(s.recv(16).decode().strip())\n")


@pytest.fixture
def helper():
    """A directory under the host's /run, nobody's, with a listening socket of nobody's: -> the socket's path."""
    d = tempfile.mkdtemp(prefix="starter-h2-run-", dir="/run")
    os.chmod(d, 0o755)
    os.chown(d, UID, GID)
    sock = os.path.join(d, "sock")
    p = subprocess.Popen(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", PYTHON, "-c", SERVER, sock],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield sock
    finally:
        _stop(p)
        shutil.rmtree(d)


def _client(sock):
    return ["/usr/bin/python3", "-c", CLIENT, sock]


def test_named_user_job_cannot_reach_a_same_uid_helper_under_run(policy, starter, helper):
    r = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", *_client(helper)],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "HELLO", r     # the host's own view: reachable
    r = starter("run", "--user", "nobody", "--", *_client(helper), check=0)
    assert r.stdout.startswith("NOT REACHED"), r.stdout
    r = starter("run", "--user", "nobody", "--", "sh", "-c", f"ls -A {os.path.dirname(helper)} || echo GONE", check=0)
    assert "GONE" in r.stdout and "sock" not in r.stdout, r.stdout


def test_callers_job_cannot_reach_a_same_uid_helper_under_run(policy, home, helper):
    p = subprocess.run(caller_argv("run", "--", *_client(helper)), capture_output=True, text=True,
                       timeout=60 * SLOWDOWN, cwd=home)
    assert p.returncode == 0 and p.stdout.startswith("NOT REACHED"), (p.stdout, p.stderr)


def test_run_passthrough_of_the_policy_is_reachable(policy, starter, home, helper):
    d = os.path.dirname(helper)
    policy(defaults=f'run_passthrough = ["{d}"]\n')
    r = starter("run", "--user", "nobody", "--", *_client(helper), check=0)
    assert r.stdout.strip() == "HELLO", r
    p = subprocess.run(caller_argv("run", "--", *_client(helper)), capture_output=True, text=True,
                       timeout=60 * SLOWDOWN, cwd=home)
    assert p.returncode == 0 and p.stdout.strip() == "HELLO", (p.stdout, p.stderr)
    r = starter("run", "--user", "nobody", "--", "sh", "-c", f"touch {d}/x 2>/dev/null && echo WROTE || echo RO",
                check=0)
    assert r.stdout.strip() == "RO" and not os.path.exists(f"{d}/x"), r.stdout


def test_the_jobs_run_is_its_own(policy, starter, state_dir):
    """/run is a tmpfs of the job's (nosuid, nodev, root's 0755); the job's
    own directories are still there; the node's leases and state are not."""
    script = ("grep ' /run ' /proc/self/mountinfo | tail -1; stat -c '%a %U' /run; echo LS; ls -A /run; echo END; "
              "test -d /run/lock && echo LOCK; ls -d /run/starter-uids 2>&1; true")
    r = starter("run", "--user", "nobody", "--", "sh", "-c", script, check=0)
    lines = r.stdout.splitlines()
    opts = lines[0].split()[5].split(",")
    assert "nosuid" in opts and "nodev" in opts and lines[0].split(" - ")[1].split()[0] == "tmpfs", lines[0]
    assert lines[1] == "755 root", r.stdout
    listed = lines[lines.index("LS") + 1:lines.index("END")]
    assert not {"starter-uids", "starter.policy-cache", "starter", "dbus", "systemd"} & set(listed), listed
    if os.path.isdir("/run/lock"):
        assert "LOCK" in lines
    assert "No such file" in lines[-1], r.stdout


def test_run_passthrough_keys():
    """Entries lie under /run (or are /run itself: no private /run); munge's
    socket directory passes by default."""
    from starter.callers import policy as P

    assert "/run/munge" in P.parse(b"").run_passthrough()
    assert P.parse(b'[defaults]\nrun_passthrough = ["/run/a", "/run/b/"]\n').run_passthrough() == ("/run/a", "/run/b")
    for bad in ('"/run/a"', '["/var/run/a"]', '["/run/../etc"]', '["run/a"]', '["/etc"]'):
        with pytest.raises(P.PolicyError, match="run_passthrough"):
            P.parse(f"[defaults]\nrun_passthrough = {bad}\n".encode())


@pytest.mark.parametrize("kernel", [(), ("shim_test_no_mount_setattr",), ("shim_test_no_open_tree",)],
                         ids=["new", "no-mount-setattr", "no-open-tree"])
def test_a_nosuid_bind_on_every_kernel_path(kernel):
    """The nosuid of a bind is set on the detached tree (mount_setattr), or
    by a remount that keeps the source's flags (kernels before 5.12, before
    5.2): the bind stays writable, a read-only bind beside it read-only."""
    from conftest import spawn_output
    from starter._native import lib
    from starter.isolate.mounts import Mount

    src = tempfile.mkdtemp(prefix="starter-h2-bind-", dir="/var/lib")
    os.chmod(src, 0o777)
    for t in kernel:
        getattr(lib, t)(1)
    try:
        status, out = spawn_output(["/bin/sh", "-c", f"touch {src}/w && echo WROTE; cat /proc/self/mountinfo"],
                                   mounts=(Mount("bind", src, src, flags=("nosuid",)),
                                           Mount("ro-bind", "/tmp/ro", "/usr/bin")))
    finally:
        for t in kernel:
            getattr(lib, t)(0)
        shutil.rmtree(src)
    text = out.decode()
    assert status == 0 and text.startswith("WROTE"), text
    opts = _mount_options(text, src)
    assert "nosuid" in opts and "rw" in opts, opts
    assert "ro" in _mount_options(text, "/tmp/ro"), text


def test_resolv_conf_links_into_run(tmp_path):
    """/etc/resolv.conf that links into /run (systemd-resolved's stub): a NAT
    job's own file goes to the link's end in its own /run (the shim follows
    no link on a destination); a --net host job gets the host's file there;
    a plain file, or no private /run: at the path itself, as before."""
    from starter.isolate import mounts as M

    link = tmp_path / "resolv.conf"
    target = "/run/starter-h2-no-such-dir/stub-resolv.conf"
    os.symlink(target, link)
    assert M.resolv_conf("/own", True, str(link)) == [M.Mount("ro-bind", target, "/own")]
    assert M.resolv_conf("/own", False, str(link)) == [M.Mount("ro-bind", str(link), "/own")]
    assert M.resolv_conf(None, True, str(link)) == []          # the host has no such file
    plain = tmp_path / "plain"
    plain.write_text("nameserver 10.0.0.1\n")
    assert M.resolv_conf("/own", True, str(plain)) == [M.Mount("ro-bind", str(plain), "/own")]
    assert M.resolv_conf(None, True, str(plain)) == []
    d = tempfile.mkdtemp(prefix="starter-h2-resolv-", dir="/run")
    try:
        real = os.path.join(d, "stub-resolv.conf")
        with open(real, "w") as f:
            f.write("nameserver 127.0.0.53\n")
        os.unlink(link)
        os.symlink(real, link)
        assert M.resolv_conf(None, True, str(link)) == [M.Mount("ro-bind", real, real)]
    finally:
        shutil.rmtree(d)


def test_gc_can_strip_a_kept_scratch_a_crashed_starter_left(execute_dir):
    """scratch.keep_recorded (for gc: a starter that died with its job's
    --keep-scratch): the recorded scratch, only if it carries the job's
    mark, loses its owner's set-id bits; a directory without the mark is
    left alone."""
    from starter.storage import scratch
    from starter.errors import StagingError

    u = LEASE_UID
    sc = scratch.create_in(execute_dir, "h2-gc", u, u)
    try:
        f = os.path.join(sc.path, "t")
        shutil.copy("/bin/true", f)
        os.chown(f, u, u)
        os.chmod(f, 0o6755)
        st = {"scratch": sc.path, "scratch_parent": execute_dir, "scratch_kind": "execute-dir",
              "scratch_id": [sc.dev, sc.ino]}
        with pytest.raises(StagingError, match="left alone"):
            scratch.keep_recorded(st, "h2-other")           # the path names another job: refused
        with pytest.raises(StagingError, match="not the one"):   # a --scratch of any name: the mark decides
            scratch.keep_recorded(dict(st, scratch_kind="scratch"), "h2-other")
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o6755
        assert scratch.keep_recorded(st, "h2-gc")
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o755
    finally:
        sc.remove()


def test_the_set_id_copy_attack_end_to_end(policy, starter):
    """The attack as reported: a default job leaves a set-user-ID/-GID copy
    of a program in a writable bind; a local user (nobody) runs it through
    the host's own mount and holds the uid; the uid's next job must not be
    reachable from it: the holder is killed before the lease."""
    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    d = tempfile.mkdtemp(prefix="starter-h2-attack-", dir="/var/lib")
    holder = None
    try:
        os.chmod(d, 0o777)
        # --seccomp off: the default filter would refuse the chmod itself (below)
        r = starter("run", "--seccomp", "off", "--bind", d, "--", "sh", "-c",
                    f"cp /bin/sleep {d}/s && chmod 6755 {d}/s && id -u", check=0)
        assert r.stdout.strip() == str(u)
        assert stat.S_IMODE(os.stat(f"{d}/s").st_mode) == 0o6755     # the host's view: set-id (nosuid is the job's)
        holder = _held(["setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", f"{d}/s", "300"],
                       (UID, u, u), comm="s")
        r = starter("run", "--", "sh", "-c", "echo secret > /tmp/s; id -u", check=0)
        assert r.stdout.strip() == str(u)
        assert holder.poll() is not None, "the holder of the uid outlived the next lease"
    finally:
        if holder is not None:
            _stop(holder)
        shutil.rmtree(d)


def test_gc_leaves_the_lease_of_a_start_in_progress(starter, state_dir):
    """A lease comes before its job's state entry: `starter gc` between the
    two must not give it back while the starter that made it runs (a second
    job would get the same uid), and gives it back once that starter died."""
    from starter.callers import uids

    code = ("import os, sys\n"
            "from starter.callers import uids\n"
            f"n = uids.lease(uids.LEASES, {state_dir!r}, 'between', {uids.DEFAULT_FIRST}, "
            f"{uids.DEFAULT_FIRST + uids.DEFAULT_COUNT - 1}, lambda n: True)\n"
            "print(n, flush=True)\n"
            "sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        n = int(p.stdout.readline())
        assert uids.maker_alive(n)
        starter("gc")
        assert uids.holder(n) == (os.path.abspath(state_dir), "between")
    finally:
        p.kill()
        p.wait(30)
    assert not uids.maker_alive(n)
    starter("gc")
    assert uids.holder(n) is None


def test_gc_clears_the_set_id_bits_a_crashed_transient_job_kept(policy, starter, execute_dir, state_dir):
    """The starter of a transient job with --keep-scratch dies (kill -9)
    after the job made a set-user-ID copy in the scratch: `starter gc`
    clears its bits before the uid's lease goes."""
    import signal

    from conftest import wait_running
    from starter.callers import uids

    u = LEASE_UID
    policy(defaults=f'job_uids = "{u}-{u}"\n')
    p = subprocess.Popen([STARTER, "run", "--id", "h2-crash", "--seccomp", "off", "--execute-dir", execute_dir,
                          "--keep-scratch", "--",
                          "sh", "-c", "cp /bin/true t && chmod 4755 t && chmod 755 . && sleep 60"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sc = os.path.join(execute_dir, "job-h2-crash")
    try:
        st = wait_running(state_dir, "h2-crash", p)
        deadline = time.monotonic() + 10 * SLOWDOWN
        while not (os.path.exists(os.path.join(sc, "t")) and os.stat(os.path.join(sc, "t")).st_mode & stat.S_ISUID):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(st["starter_pid"], signal.SIGKILL)
        p.wait(30)
        g = starter("gc", check=0)
        assert "set-id bits cleared" in g.stdout, g.stdout
        assert stat.S_IMODE(os.stat(os.path.join(sc, "t")).st_mode) == 0o755
        assert uids.holder(u) is None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        shutil.rmtree(sc, ignore_errors=True)


SETID_TRIES = r"""
import os, sys
for what, call in (("chmod u+s", lambda: os.chmod("f", 0o4755)), ("chmod g+s", lambda: os.chmod("f", 0o2755)),
                   ("fchmod", lambda: os.fchmod(os.open("f", os.O_RDONLY), 0o4755)),
                   ("open O_CREAT", lambda: os.close(os.open("g", os.O_CREAT | os.O_WRONLY, 0o4755))),
                   ("mknod", lambda: os.mknod("h", 0o100000 | 0o2755)),
                   ("chmod 0755", lambda: os.chmod("f", 0o755))):
    try:
        call()
        st = [os.stat(n).st_mode & 0o6000 for n in ("f", "g", "h") if os.path.exists(n)]
        print(what, "ok", max(st) if st else 0)
    except OSError as e:
        print(what, e.errno)
"""


def test_a_transient_job_makes_no_set_id_file(starter):
    """The default filter of a transient uid's job refuses every way to make
    a set-user-ID or set-group-ID file (EPERM): nothing of the uid can run
    as it once the job is over.  A named user's job may (its own uid)."""
    script = "cd /tmp && touch f && python3 -c '%s'" % SETID_TRIES.replace("'", "'\\''")
    p = starter("run", "--", "sh", "-c", script, check=0)
    got = dict(l.rsplit(" ", 1) if " ok " not in l else (l.split(" ok ")[0], "ok") for l in p.stdout.splitlines())
    assert got == {"chmod u+s": "1", "chmod g+s": "1", "fchmod": "1", "open O_CREAT": "1", "mknod": "1",
                   "chmod 0755": "ok"}, p.stdout
    p = starter("run", "--user", "nobody", "--", "sh", "-c", script, check=0)
    assert "chmod u+s ok" in p.stdout, p.stdout
