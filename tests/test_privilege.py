"""The privilege boundary (issue 10), through the real CLI: a job is never
host root unless asked (--user root), --userns-root is root only inside its
own user namespace, and nothing the node daemon set on the starter (limits,
oom_score_adj, nice, affinity, ...) reaches the job.

Each check runs for a default job (the starter-job account) and a `--user
nobody` job.  Jobs that make a user namespace (`unshare -U`) run with
`--allow-userns`: the default seccomp profile refuses new user namespaces
(tests/test_seccomp.py), and these tests show the boundary holds even when
the job gets one.
"""

import json
import os
import pwd
import shlex
import socket
import subprocess

import pytest

from conftest import REPO, STARTER, wait_running
from privhelp import JOB_ACCOUNT, _one_line_error, _running, who  # noqa: F401 (who: a fixture)

def _root_tree(tmp_path):
    """A root-owned 0755 directory holding a root-owned 0644 file."""
    d = tmp_path / "rootdir"
    d.mkdir()
    os.chmod(d, 0o755)
    f = d / "file"
    f.write_text("root's\n")
    os.chmod(f, 0o644)
    return d, f


# Opens each argument for writing (O_APPEND, nothing written: the open is the
# permission check, so the starter's own files are never changed) and tries
# truncating and creating where asked; prints what succeeded.
_PROBE = r"""
for p in "$@"; do
  case "$p" in
    trunc:*) p=${p#trunc:}; if ( : > "$p" ) 2>/dev/null; then echo "TRUNCATED $p"; fi ;;
    new:*) p=${p#new:}; if ( : > "$p" ) 2>/dev/null; then echo "CREATED $p"; fi ;;
    *) if ( : >> "$p" ) 2>/dev/null; then echo "OPENED $p"; fi ;;
  esac
done
echo probed
"""


def test_root_owned_files_not_writable(starter, tmp_path, who):
    opts, _, _ = who
    d, f = _root_tree(tmp_path)
    own = [os.path.join(REPO, "starter", n) for n in sorted(os.listdir(os.path.join(REPO, "starter")))
           if n.endswith(".py")]
    own += [STARTER, os.path.join(REPO, "native", "shim_clone.c")]
    before = {p: os.stat(p) for p in own}
    p = starter("run", *opts, "--bind", f"{d}:/mnt", "--", "sh", "-c", _PROBE, "probe",
                "/mnt/file", "trunc:/mnt/file", "new:/mnt/new", *own)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "probed\n", p.stdout
    assert f.read_text() == "root's\n" and not (d / "new").exists()
    for path, st in before.items():
        now = os.stat(path)
        assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns), path


def test_root_job_only_on_request(starter, tmp_path):
    # The probe above does see a write where there is one: host root, named.
    d, f = _root_tree(tmp_path)
    for opts in (["--user", "root"], ["--user", "0"]):
        p = starter("run", *opts, "--bind", f"{d}:/mnt", "--", "sh", "-c", "id -u; " + _PROBE,
                    "probe", "/mnt/file", check=0)
        assert p.stdout == "0\nOPENED /mnt/file\nprobed\n", p.stdout


def _enter_when_running(starter, state_dir, job_id, *argv):
    wait_running(state_dir, job_id)
    return starter("enter", job_id, "--", *argv)


def test_default_user_is_a_transient_uid(starter, state_dir):
    """No --user: a uid and gid of the job's own from the default range, no
    account, no supplementary groups, HOME /; given back at the end."""
    out, entry, err = _running("priv-default", [], "id -u; id -g; id -G; echo $HOME ${USER-unset}", state_dir,
                               starter, probe=lambda entry: entry)
    uid = int(out[0])
    assert 0x70000000 <= uid < 0x70010000, out
    assert out[1:] == [str(uid), str(uid), "/ unset"], (out, err)
    assert (entry["uid"], entry["gid"], entry["transient"]) == (uid, uid, True)
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    from conftest import leases

    assert uid not in leases(state_dir)      # given back


def test_default_user_can_be_the_job_account(starter, state_dir, policy):
    """job_uids = "none" in the node policy: the shared starter-job account, as before."""
    policy(defaults='job_uids = "none"\n')
    pw = pwd.getpwnam(JOB_ACCOUNT)
    assert pw.pw_uid != 0 and pw.pw_gid != 0 and pw.pw_shell.endswith("nologin")
    assert pw.pw_dir == "/nonexistent" and not os.path.exists(pw.pw_dir)
    out, entry, err = _running("priv-default", [], "id -u; id -g; id -G; echo $HOME $USER", state_dir, starter,
                               probe=lambda entry: entry)
    assert out == [str(pw.pw_uid), str(pw.pw_gid), str(pw.pw_gid), f"/nonexistent {JOB_ACCOUNT}"], err
    assert (entry["user"], entry["uid"], entry["gid"]) == (JOB_ACCOUNT, pw.pw_uid, pw.pw_gid)


def test_missing_job_account_is_one_clear_error(tmp_path, state_dir, policy):
    policy(defaults='job_uids = "none"\n')
    # A private mount namespace whose /etc/passwd and /etc/group lack the
    # account: the node's own files stay as they are.
    for name in ("passwd", "group"):
        with open(f"/etc/{name}") as src:
            kept = [l for l in src if not l.startswith(JOB_ACCOUNT + ":")]
        (tmp_path / name).write_text("".join(kept))
    script = ('mount --bind "$1/passwd" /etc/passwd && mount --bind "$1/group" /etc/group && '
              'exec "$2" run -- true')
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                        str(tmp_path), STARTER], capture_output=True, text=True, timeout=60)
    _one_line_error(p, JOB_ACCOUNT, "--user", "useradd")


# ---------------------------------------------------------------- cgroups

# In a user namespace of its own (and a cgroup and mount namespace owned by
# it), mount the pids and memory v1 hierarchies and cgroup2, and try to lift
# the limits of the job's own cgroup at their roots.
_CGROUP_ESCAPE = r"""
echo in-userns $(id -u)
mount -t tmpfs none /mnt || exit 3
for t in pids memory unified; do
  mkdir /mnt/$t
  if [ $t = unified ]; then mount -t cgroup2 none /mnt/$t; else mount -t cgroup -o $t none /mnt/$t; fi 2>/dev/null ||
    { echo "no-mount $t"; continue; }
  echo "mounted $t"
  for f in pids.max memory.max memory.limit_in_bytes memory.memsw.limit_in_bytes; do
    [ -e /mnt/$t/$f ] || continue
    if ( echo max > /mnt/$t/$f ) 2>/dev/null || ( echo -1 > /mnt/$t/$f ) 2>/dev/null; then
      echo "RAISED $t/$f"
    else
      echo "refused $t/$f"
    fi
  done
done
"""


def _limits_on_host(paths):
    found = {}
    for path in paths.values():
        for name in ("pids.max", "memory.max", "memory.limit_in_bytes"):
            try:
                with open(os.path.join(path, name)) as f:
                    found[name] = f.read().strip()
            except FileNotFoundError:
                pass
    return found


def test_userns_cgroup_mount_cannot_raise_limits(state_dir, starter, who):
    opts, _, _ = who
    job_id = "priv-cg-" + ("nobody" if opts else "default")
    out, host, err = _running(job_id, [*opts, "--allow-userns", "--pids", "50", "--memory", "64M"],
                              "unshare -UrmC --propagation private sh -c " + shlex.quote(_CGROUP_ESCAPE),
                              state_dir, starter, probe=lambda entry: _limits_on_host(entry["cgroup"]))
    if not any(l.startswith("in-userns") for l in out):
        pytest.skip(f"unprivileged user namespaces are not available here: {err.strip()}")
    assert "in-userns 0" in out, out
    assert not [l for l in out if l.startswith("RAISED")], out
    assert any(l.startswith(("refused", "no-mount")) for l in out), out
    assert host.get("pids.max") == "50", host
    assert (host.get("memory.max") or host.get("memory.limit_in_bytes")) == str(64 << 20), host


def test_enter_never_writes_through_the_jobs_mount_namespace(starter, tmp_path, state_dir, who):
    # The job's PID 1 moves into a mount namespace of its own whose /proc is
    # a tmpfs: /proc/self/oom_score_adj there is a link to a root-owned file.
    # `starter enter` resets the entering process's oom_score_adj as root,
    # so it must do that before it joins the job's namespaces; and it does
    # not join a mount namespace the job made at all (see below).
    opts, _, _ = who
    d, f = _root_tree(tmp_path)
    job_id = "priv-enter-" + ("nobody" if opts else "default")
    trap = ("mount -t tmpfs none /proc && mkdir /proc/self /proc/1 && ln -s /mnt/file /proc/self/oom_score_adj "
            "&& ln -s /mnt/file /proc/1/oom_score_adj && echo trapped")
    entered = []

    def enter(entry):
        entered.append(_enter_when_running(starter, state_dir, job_id, "sh", "-c",
                                           "cat /proc/self/oom_score_adj; id -u"))

    out, _, err = _running(job_id, [*opts, "--allow-userns", "--bind", f"{d}:/mnt"],
                           "exec unshare -Urm --propagation private sh -c " + shlex.quote(trap + "; echo DONE; exec sleep 300"),
                           state_dir, starter, probe=enter)
    if out != ["trapped"]:
        pytest.skip(f"unprivileged user namespaces are not available here: {out} {err.strip()}")
    assert f.read_text() == "root's\n"
    assert entered, entered
    _one_line_error(entered[0], "changed its namespaces (mnt)")


# The job's PID 1 makes a mount namespace of its own (root of its own user
# namespace, it may) and binds a script of its own over /bin/sh there (a
# link to dash: the bind lands on /bin/dash).  An admin who joined that
# namespace and ran /bin/sh would run the job's script as host root (with
# --user root) or as the job's user.
_OVERMOUNT = r"""cp /bin/dash /tmp/realsh && printf '#!/tmp/realsh
echo PWNED $(id -u)
' > /tmp/evil &&
chmod 755 /tmp/evil && mount --bind /tmp/evil /bin/sh && /bin/sh -c true | grep -q PWNED && echo trapped
echo DONE; exec sleep 300"""
_UNSHARE = {"userns-root": (["--userns-root"], "unshare -m"),
            "allow-userns": (["--allow-userns"], "unshare -Urm")}


@pytest.mark.parametrize("mode", sorted(_UNSHARE))
def test_enter_refuses_a_mount_namespace_the_job_made(starter, state_dir, who, mode):
    """`starter enter` joins only the namespaces the starter made for the job
    (recorded at clone, before the job ran): a PID 1 that moved into a mount
    namespace of its own making is refused, one line, exit 125, for the
    job's user and for root alike; what the job mounted never runs."""
    opts, _, _ = who
    extra, unshare = _UNSHARE[mode]
    job_id = f"priv-enter-mnt-{mode}-" + ("nobody" if opts else "default")
    entered = []

    def enter(entry):
        wait_running(state_dir, job_id)
        for user in ([], ["--user", "root"]):
            entered.append(starter("enter", job_id, *user, "--", "/bin/sh", "-c", "echo entered"))

    # exec: the PID 1 itself unshares (unshare(1) does not fork without -f).
    out, _, err = _running(job_id, [*opts, *extra, "--net", "none"],
                           f"exec {unshare} --propagation private sh -c " + shlex.quote(_OVERMOUNT),
                           state_dir, starter, probe=enter)
    if out != ["trapped"]:
        pytest.skip(f"unprivileged user namespaces are not available here: {out} {err.strip()}")
    assert len(entered) == 2, entered
    for p in entered:
        _one_line_error(p, f"job '{job_id}' changed its namespaces (mnt)",
                        "only the namespaces the starter made")
        assert "PWNED" not in p.stdout and "entered" not in p.stdout, p.stdout


def test_enter_refuses_other_namespaces_the_job_made(starter, state_dir):
    """The same for the net, ipc, uts (the starter made one: --hostname) and
    cgroup namespaces (made after the release, so checked by its owner: the
    host's user namespace, never the job's).  A namespace type the job
    shares with the host (uts without --hostname) is not joined at all: the
    job's own one is never what the entering process gets."""
    job_id = "priv-enter-other"
    entered = []
    out, _, err = _running(job_id, ["--user", "nobody", "--allow-userns", "--hostname", "job-host",
                                    "--net", "none"],
                           "exec unshare -UrniuC sh -c 'hostname job-made; echo DONE; exec sleep 300'",
                           state_dir, starter, probe=lambda e: entered.append(_enter_when_running(starter, state_dir, job_id, "hostname")))
    if not entered:
        pytest.skip(f"unprivileged user namespaces are not available here: {err.strip()}")
    _one_line_error(entered[0], "changed its namespaces (cgroup, ipc, net, uts)")
    assert entered[0].stdout == ""
    entered.clear()
    out, _, err = _running(job_id, ["--user", "nobody", "--userns-root", "--net", "none"],
                           "exec unshare -u sh -c 'hostname job-made; echo DONE; exec sleep 300'",
                           state_dir, starter, probe=lambda e: entered.append(_enter_when_running(starter, state_dir, job_id, "hostname")))
    assert entered[0].returncode == 0, (entered, err)
    assert entered[0].stdout == socket.gethostname() + "\n"


def test_enter_a_userns_root_job_as_its_host_uid(starter, state_dir, who):
    """enter never joins the job's user namespace: the entering process has
    the job's host uid (not uid 0 of the job's namespace) and its mount
    namespace, pid namespace and cgroup.  With --init the job (PID 2) may
    make namespaces of its own: PID 1 is the starter's init, and enter
    joins its namespaces, which are the starter's."""
    opts, uid, _ = who
    job_id = "priv-enter-userns-" + ("nobody" if opts else "default")
    entered = []

    def enter(entry):
        wait_running(state_dir, job_id)
        entered.append(starter("enter", job_id, "--", "sh", "-c",
                               "id -u; tr -s ' ' < /proc/self/uid_map; /bin/sh -c 'echo real'"))

    out, _, err = _running(job_id, [*opts, "--userns-root", "--init", "--net", "none"],
                           "unshare -m --propagation private sh -c " + shlex.quote(_OVERMOUNT),
                           state_dir, starter, probe=enter)
    if out != ["trapped"]:
        pytest.skip(f"unprivileged user namespaces are not available here: {out} {err.strip()}")
    p = entered[0]
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert p.stdout.splitlines() == [str(uid), " 0 0 4294967295", "real"], p.stdout


def test_enter_refuses_an_entry_it_cannot_trust(starter, state_dir):
    """An entry without the uid (enter never falls back to root), without
    the namespaces the starter made (a job started by an older starter), or
    whose pid is not in the job's cgroup (a reused pid): refused."""
    job_id = "priv-enter-entry"
    path = os.path.join(state_dir, job_id + ".json")
    seen = []

    def enter(entry):
        # (else the starter's "running" write would undo the changes below)
        entry = wait_running(state_dir, job_id)

        def tampered(**change):
            doc = dict(entry, **change)
            doc = {k: v for k, v in doc.items() if v is not None}
            with open(path + ".test", "w") as f:
                json.dump(doc, f)
            os.rename(path + ".test", path)
            return starter("enter", job_id, "--", "id", "-u")

        seen.append(tampered(uid=None))
        seen.append(tampered(namespaces=None))
        seen.append(tampered(pid=os.getpid()))
        seen.append(tampered())
        return entry

    _running(job_id, ["--user", "nobody", "--net", "none"], "true", state_dir, starter, probe=enter)
    _one_line_error(seen[0], "records no uid")
    _one_line_error(seen[1], "no record of the namespaces")
    _one_line_error(seen[2], f"pid {os.getpid()} is not in the job's cgroup")
    assert seen[3].returncode == 0 and seen[3].stdout == "65534\n", seen[3]


# ---------------------------------------------------------------- sockets

def test_root_only_unix_socket_refused(starter, tmp_path, who):
    opts, _, _ = who
    d = tmp_path / "sockdir"
    d.mkdir()
    os.chmod(d, 0o755)
    os.chmod(tmp_path, 0o755)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(d / "root.sock"))
        os.chmod(d / "root.sock", 0o600)
        srv.listen(4)
        code = ("import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n    s.connect('/mnt/root.sock')\nexcept PermissionError:\n    print('refused')\n"
                "else:\n    print('CONNECTED')\n")
        p = starter("run", *opts, "--bind", f"{d}:/mnt", "--", "/usr/bin/python3", "-c", code, check=0)
        assert p.stdout == "refused\n", (p.stdout, p.stderr)
        # The probe would see a connection where there is one: host root, named.
        p = starter("run", "--user", "root", "--bind", f"{d}:/mnt", "--", "/usr/bin/python3", "-c", code,
                    check=0)
        assert p.stdout == "CONNECTED\n", (p.stdout, p.stderr)
    finally:
        srv.close()


# ---------------------------------------------------------------- --userns-root

def test_userns_root(starter, tmp_path, who):
    opts, uid, gid = who
    d, f = _root_tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, uid, gid)
    script = ("id -u; id -g; stat -c %u:%g /mnt/file; " + _PROBE.replace("echo probed", "") +
              "echo hi > /tmp/out/made && chown 0:0 /tmp/out/made && stat -c %u:%g /tmp/out/made; "
              "chown 1 /tmp/out/made 2>/dev/null && echo CHOWNED-TO-1; "
              "cat /proc/self/uid_map /proc/self/gid_map | tr -s ' ' ")
    p = starter("run", *opts, "--userns-root", "--bind", f"{d}:/mnt", "--bind", f"{out}:/tmp/out", "--",
                "sh", "-c", script, "probe", "/mnt/file", "trunc:/mnt/file", "new:/mnt/new", check=0)
    lines = p.stdout.splitlines()
    # root inside; host root's files show as the overflow id and stay out of reach
    assert lines[:3] == ["0", "0", "65534:65534"], p.stdout
    assert lines[3] == "0:0", p.stdout  # its own file, chowned to (its) root
    assert not [l for l in lines if l.startswith(("OPENED", "TRUNCATED", "CREATED", "CHOWNED"))], p.stdout
    assert lines[4:] == [f" 0 {uid} 1", f" 0 {gid} 1"], p.stdout
    assert f.read_text() == "root's\n"
    st = os.stat(out / "made")
    assert (st.st_uid, st.st_gid) == (uid, gid)


def test_userns_root_refuses_host_root(starter):
    _one_line_error(starter("run", "--user", "root", "--userns-root", "--", "true"), "userns-root")


def test_userns_root_from_job_file(starter, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"command": ["id", "-u"], "user": "nobody", "userns_root": True}))
    assert starter("run", "--job", str(job), check=0).stdout == "0\n"
    job.write_text(json.dumps({"command": ["id", "-u"], "userns_root": "yes"}))
    _one_line_error(starter("run", "--job", str(job)), "userns")


@pytest.mark.parametrize("init", [False, True], ids=["no-init", "init"])
def test_userns_root_child_never_makes_itself_dumpable(tmp_path, who, init):
    """The maps are written by the starter, as newuidmap does: the child
    (with --init, the job) never makes itself dumpable, which would let any
    process of the job's uid ptrace it before its seccomp filter, and never
    opens its own /proc/self/uid_map.  strace -f sees every prctl and open of
    the whole start."""
    import shutil

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (scripts/setup --test installs it)")
    opts, _uid, _gid = who
    trace = tmp_path / "trace"
    p = subprocess.run([strace, "-f", "-qq", "-e", "trace=prctl,unshare,open,openat", "-o", str(trace),
                        STARTER, "run", *opts, "--userns-root", *(["--init"] if init else []),
                        "--", "id", "-u"], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (0, "0\n"), (p.returncode, p.stdout, p.stderr)
    lines = trace.read_text().splitlines()
    starter_pid = lines[0].split()[0]
    assert any("unshare(CLONE_NEWUSER)" in l for l in lines), lines   # the trace saw the setup
    assert not [l for l in lines if "SUID_DUMP_USER" in l], [l for l in lines if "DUMPABLE" in l]
    assert not [l for l in lines if "/proc/self/uid_map" in l or "/proc/self/setgroups" in l]
    writers = {l.split()[0] for l in lines if '"uid_map"' in l or '"gid_map"' in l}
    assert writers == {starter_pid}, [l for l in lines if "_map" in l]


def _spawn_userns(init):
    from conftest import spawn_output

    return spawn_output(["id", "-u"], userns_root=True, init=init)


@pytest.mark.parametrize("init", [False, True], ids=["no-init", "init"])
def test_userns_root_maps_are_written_while_the_child_waits_not_dumpable(monkeypatch, init):
    """When the starter writes the maps, the process asking is already in
    its new user namespace, as the job's uid, and not dumpable (the files in
    its /proc/PID belong to root: the kernel's sign of it); with --init it is the job, not
    the init, and the starter learnt its pid from the message."""
    from starter.isolate import ns

    seen = []
    real = ns.Child._write_maps

    def spy(self, pid, uid):
        # a non-dumpable process's /proc/PID files (not the directory) are root's
        seen.append((pid, self.pid, os.stat(f"/proc/{pid}/status").st_uid,
                     os.readlink(f"/proc/{pid}/ns/user"), uid))
        return real(self, pid, uid)

    monkeypatch.setattr(ns.Child, "_write_maps", spy)
    status, out = _spawn_userns(init)
    assert (status, out) == (0, b"0\n")
    [(pid, child_pid, owner, userns, uid)] = seen
    assert owner == 0 and uid == 65534, seen
    assert userns != os.readlink("/proc/self/ns/user"), seen
    assert (pid != child_pid) == init, seen


@pytest.mark.parametrize("init", [False, True], ids=["no-init", "init"])
def test_userns_root_maps_that_cannot_be_written_fail_the_start(monkeypatch, init):
    from starter.isolate import ns
    from starter.errors import SpawnError

    def refuse(self, pid, uid):
        raise OSError(1, "planted")

    monkeypatch.setattr(ns.Child, "_write_maps", refuse)
    with pytest.raises(SpawnError) as e:
        _spawn_userns(init)
    assert e.value.step == "map user namespace" and e.value.exit_code == 125, e.value
