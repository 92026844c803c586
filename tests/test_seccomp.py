"""The syscall filter (starter/seccomp, native/seccomp.c): each denied call
returns its documented errno through the real CLI, for --user nobody and
--user root, through every ABI; what jobs need keeps working; --seccomp off,
FILE and --allow-userns; bad profiles fail before anything is made.  The
profile parser on fixture text: tests/unit/test_seccomp_profile.py."""

import errno
import json
import os
import shutil
import stat
import subprocess

import pytest

from conftest import REPO, STARTER

PROBE_SRC = os.path.join(REPO, "tests", "fixtures", "seccomp", "probe.c")
DEFAULT = os.path.join(REPO, "starter", "isolate", "seccomp", "default.json")

# The default profile's denials (docs/reference.md, "Syscall filter profiles").
DENIED = {
    "kexec_load": errno.EPERM, "kexec_file_load": errno.EPERM, "init_module": errno.EPERM,
    "finit_module": errno.EPERM, "delete_module": errno.EPERM, "open_by_handle_at": errno.EPERM,
    "bpf": errno.EPERM, "keyctl": errno.EPERM, "add_key": errno.EPERM, "request_key": errno.EPERM,
    "unshare_newuser": errno.EPERM, "clone_newuser": errno.EPERM, "setns": errno.EPERM,
    "clone3": errno.ENOSYS, "reboot": errno.EPERM, "swapon": errno.EPERM, "swapoff": errno.EPERM,
    "acct": errno.EPERM, "iopl": errno.EPERM, "ioperm": errno.EPERM,
    "lookup_dcookie": errno.EPERM, "uselib": errno.EPERM, "userfaultfd": errno.EPERM,
    # the same through the i386 (int 0x80) and x32 ABIs
    "i386_keyctl": errno.EPERM, "i386_unshare_newuser": errno.EPERM, "i386_bpf": errno.EPERM,
    "x32_keyctl": errno.EPERM, "x32_unshare_newuser": errno.EPERM,
    # io_uring: as on a kernel without it, so programs fall back
    "io_uring_setup": errno.ENOSYS, "io_uring_enter": errno.ENOSYS, "io_uring_register": errno.ENOSYS,
    "i386_io_uring_setup": errno.ENOSYS, "x32_io_uring_setup": errno.ENOSYS,
}
KEPT = ("fork", "thread", "ptrace", "perf_event_open", "unshare_newnet")
USERS = ("nobody", "root")


@pytest.fixture(scope="session")
def probe_dir(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the syscall probe (scripts/setup installs it)")
    d = tmp_path_factory.mktemp("seccomp-probe")
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(d / "probe"), PROBE_SRC], check=True)
    os.chmod(d, 0o755)
    return str(d)


def probe(starter, probe_dir, *opts, names=(), user="nobody"):
    """Run the probe as a job -> {call: int errno or 'sig:N'}."""
    p = starter("run", "--user", user, "--ro-bind", f"{probe_dir}:/tmp/probe", *opts, "--",
                "/tmp/probe/probe", *names)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    out = {}
    for line in p.stdout.splitlines():
        name, res = line.split()
        out[name] = int(res) if res.lstrip("-").isdigit() else res
    return out


def userns_possible():
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            return int(f.read()) > 0
    except OSError:
        return True


# ---------------------------------------------------------------- through the CLI

@pytest.mark.parametrize("user", USERS)
def test_default_profile_denies_with_documented_errno(starter, probe_dir, user):
    got = probe(starter, probe_dir, user=user)
    off = probe(starter, probe_dir, "--seccomp", "off", user=user)
    wrong = {n: (got.get(n), e) for n, e in DENIED.items() if got.get(n) != e}
    assert not wrong, f"call: (got, documented) {wrong}"
    # What jobs need: processes, threads, a debugger on their own children,
    # perf counters as far as kernel.perf_event_paranoid allows.
    assert {n: got[n] for n in KEPT} == {n: off[n] for n in KEPT}
    assert got["fork"] == got["thread"] == got["ptrace"] == 0


def test_every_rule_is_the_filter_not_the_kernel(starter, probe_dir, tmp_path):
    """Many denied calls fail with EPERM anyway for a job without
    capabilities: the default profile with distinctive errnos shows that
    each rule, through each ABI, is what answers."""
    prof = json.loads(open(DEFAULT).read())
    for rule in prof["syscalls"]:
        rule["errnoRet"] = 222 if rule["errnoRet"] == errno.EPERM else 223
    path = tmp_path / "marked.json"
    path.write_text(json.dumps(prof))
    got = probe(starter, probe_dir, "--seccomp", str(path))
    expect = {n: 223 if e == errno.ENOSYS else 222 for n, e in DENIED.items()}
    assert {n: got.get(n) for n in expect} == expect


IO_URING_SETUP = ("import ctypes, os\n"
                  "libc = ctypes.CDLL(None, use_errno=True)\n"
                  "params = ctypes.create_string_buffer(120)\n"
                  "fd = libc.syscall(425, 1, params)\n"
                  "print(fd if fd >= 0 else -ctypes.get_errno())\n")


def test_io_uring_is_refused_with_enosys_unless_a_profile_allows_it(starter, tmp_path):
    """A program's own io_uring_setup (here through ctypes) gets ENOSYS, as
    on a kernel without io_uring, and falls back; a site's profile without
    the rule lets it through where the kernel has io_uring on."""
    p = starter("run", "--", "/usr/bin/python3", "-c", IO_URING_SETUP, check=0)
    assert int(p.stdout) == -errno.ENOSYS
    prof = json.loads(open(DEFAULT).read())
    prof["syscalls"] = [r for r in prof["syscalls"] if "io_uring_setup" not in r["names"]]
    path = tmp_path / "io_uring.json"
    path.write_text(json.dumps(prof))
    p = starter("run", "--seccomp", str(path), "--", "/usr/bin/python3", "-c", IO_URING_SETUP, check=0)
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = int(f.read())
    except OSError:
        disabled = 0
    if disabled:
        assert int(p.stdout) == -errno.EPERM    # the kernel's own refusal (io_uring_disabled)
    else:
        assert int(p.stdout) >= 0, p.stdout


@pytest.mark.parametrize("user", USERS)
def test_off_lifts_everything(starter, probe_dir, user):
    got = probe(starter, probe_dir, "--seccomp", "off", user=user,
                names=("keyctl", "add_key", "clone3", "setns", "i386_keyctl", "unshare_newuser"))
    assert got["keyctl"] == got["add_key"] == got["clone3"] == got["i386_keyctl"] == 0, got
    assert got["setns"] == errno.EBADF
    if userns_possible():
        assert got["unshare_newuser"] == 0


@pytest.mark.parametrize("user", USERS)
def test_allow_userns(starter, probe_dir, user):
    if not userns_possible():
        pytest.skip("user.max_user_namespaces is 0 on this host")
    # `unshare -Ur` (map uid 0) for nobody; a uid 0 without CAP_SETFCAP may
    # not map uid 0 (kernel >= 5.12), so root gets the overflow uid.
    argv = ["unshare", "-Ur", "id", "-u"] if user == "nobody" else ["unshare", "-U", "id", "-u"]
    p = starter("run", "--user", user, "--", *argv)
    assert p.returncode != 0 and "Operation not permitted" in p.stderr, (p.returncode, p.stderr)
    p = starter("run", "--user", user, "--allow-userns", "--", *argv, check=0)
    assert p.stdout.strip() == ("0" if user == "nobody" else "65534")
    # Only the user-namespace rules go.
    got = probe(starter, probe_dir, "--allow-userns", user=user,
                names=("unshare_newuser", "clone_newuser", "i386_unshare_newuser", "keyctl", "clone3", "bpf"))
    assert got == {"unshare_newuser": 0, "clone_newuser": 0, "i386_unshare_newuser": 0,
                   "keyctl": errno.EPERM, "clone3": errno.ENOSYS, "bpf": errno.EPERM}


def test_job_file_keys(starter, probe_dir, tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"user": "nobody", "seccomp": "off", "allow_userns": True,
                               "mounts": [{"type": "ro-bind", "src": probe_dir, "dst": "/tmp/probe"}],
                               "command": ["/tmp/probe/probe", "keyctl"]}))
    assert starter("run", "--job", str(job), check=0).stdout.split() == ["keyctl", "0"]
    # the command line overrides the file
    assert starter("run", "--job", str(job), "--seccomp", "default", check=0).stdout.split() == ["keyctl", "1"]


def test_file_profile_is_honoured(starter, probe_dir, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSPC}],
    }))
    p = starter("run", "--user", "nobody", "--seccomp", str(path), "--", "mkdir", "/tmp/d")
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr
    # only that profile: the default's rules are not added to it
    assert probe(starter, probe_dir, "--seccomp", str(path), names=("keyctl", "clone3")) == {"keyctl": 0, "clone3": 0}


def test_threads_shell_and_init_mode(starter, probe_dir):
    code = "import threading as t; x = t.Thread(target=print, args=('thread ok',)); x.start(); x.join()"
    p = starter("run", "--user", "nobody", "--", "sh", "-c", f"python3 -c \"{code}\" && sh -c 'exit 3'")
    assert p.returncode == 3 and p.stdout == "thread ok\n", (p.returncode, p.stdout, p.stderr)
    # --init: the job (PID 2) is filtered, the init forwards its exit code
    p = starter("run", "--user", "nobody", "--init", "--ro-bind", f"{probe_dir}:/tmp/probe", "--",
                "sh", "-c", "/tmp/probe/probe keyctl fork; exit 5")
    assert p.returncode == 5 and p.stdout.split() == ["keyctl", "1", "fork", "0"], (p.stdout, p.stderr)


@pytest.mark.parametrize("mode", ["default", "off"])
def test_enter_gets_the_jobs_filter(starter, probe_dir, state_dir, mode):
    """A process entered into the job is as filtered as the job (else the job
    could ptrace it into making the denied calls)."""
    r, w = os.pipe()
    proc = subprocess.Popen([STARTER, "run", "--user", "nobody", "--id", f"sc-enter-{mode}",
                             "--seccomp", mode, "--events", f"fd:{w}",
                             "--ro-bind", f"{probe_dir}:/tmp/probe", "--", "sleep", "300"],
                            pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    try:
        with os.fdopen(r) as events:
            for line in events:
                if json.loads(line).get("event") == "running":
                    break
            else:
                pytest.fail(f"the job did not start: {proc.stderr.read()}")
            p = starter("enter", f"sc-enter-{mode}", "--", "/tmp/probe/probe", "keyctl", "clone3")
            assert p.returncode == 0, p.stderr
            want = "keyctl 1\nclone3 38\n" if mode == "default" else "keyctl 0\nclone3 0\n"
            assert p.stdout == want
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


BAD_PROFILES = [
    ("{", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ('{"syscalls": []}', "defaultAction: missing"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "bogus": 1}', "bogus: unknown key"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "defaultAction": "SCMP_ACT_ALLOW"}', "duplicate key"),
    ('{"defaultAction": "ALLOW"}', "defaultAction: 'ALLOW' is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["kexec_lod"], "action": "SCMP_ACT_ERRNO"}]}',
     "syscalls[0].names[0]: unknown syscall 'kexec_lod'"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_NOTIFY"}]}',
     "SCMP_ACT_NOTIFY is not supported"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": 0}]}',
     "errnoRet: 0 is not an errno"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"args": [{"index": 7, "value": 1, "op": "SCMP_CMP_EQ"}]}]}', "args[0].index: 7 is not an argument index"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO"}, '
     '{"names": ["bpf"], "action": "SCMP_ACT_KILL_PROCESS"}]}',
     "syscalls[1].names[0]: 'bpf' already has a rule without conditions in syscalls[0]"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "x": "' + "a" * (1 << 20) + '"}', "larger than 1 MiB"),
    # found by fuzzing: other JSON types where a name is expected, nesting, a lone surrogate
    ('{"defaultAction": ["SCMP_ACT_ALLOW"]}', "defaultAction: ['SCMP_ACT_ALLOW'] is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "flags": [{}]}', "flags[0]: {} is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": {"a": 1}}]}',
     "syscalls[0].action: {'a': 1} is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"args": [{"index": 0, "value": 1, "op": [1]}]}]}', "args[0].op: [1] is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["\\ud800"], "action": "SCMP_ACT_ERRNO"}]}',
     "is not a syscall name"),
    ('{"syscalls": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
]


@pytest.mark.parametrize("text,message", BAD_PROFILES, ids=range(len(BAD_PROFILES)))
def test_bad_profile_one_line_and_nothing_made(starter, tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    events = tmp_path / "events"
    p = starter("run", "--user", "nobody", "--seccomp", str(path), "--events", str(events), "--", "true")
    assert p.returncode == 125
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("starter: seccomp: "), p.stderr
    assert message in p.stderr, p.stderr
    assert not events.exists()  # nothing was made; the leak check sees the rest


def test_profile_path_must_be_a_plain_file(starter, tmp_path):
    real = tmp_path / "real.json"
    real.write_text('{"defaultAction": "SCMP_ACT_ALLOW"}')
    (tmp_path / "link.json").symlink_to(real)
    os.mkfifo(tmp_path / "fifo.json")
    cases = {str(tmp_path / "link.json"): "symbolic link", str(tmp_path / "fifo.json"): "not a regular file",
             str(tmp_path / "missing.json"): "No such file", "rel.json": "absolute path"}
    for arg, message in cases.items():
        p = starter("run", "--user", "nobody", "--seccomp", arg, "--", "true", timeout=20)
        assert p.returncode == 125 and p.stderr.count("\n") == 1 and message in p.stderr, (arg, p.stderr)
    starter("run", "--user", "nobody", "--seccomp", str(real), "--", "true", check=0)


def test_cache_is_root_only_and_a_foreign_file_is_ignored(starter, probe_dir, state_dir):
    probe(starter, probe_dir, names=("keyctl",))
    cache = state_dir.rstrip("/") + ".seccomp"
    st = os.stat(cache)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    files = os.listdir(cache)
    assert files and all(stat.S_IMODE(os.stat(os.path.join(cache, f)).st_mode) == 0o600 for f in files)
    # A cache file that is not root's own is not trusted: the job is still filtered.
    for f in files:
        path = os.path.join(cache, f)
        with open(path, "r+b") as fh:
            data = fh.read()
            body_at = data.index(b"\n") + 1 + 4
            # one instruction: return ALLOW
            fh.seek(0)
            fh.write(data[:body_at] + bytes.fromhex("060000000000ff7f"))
            fh.truncate()
        os.chown(path, 65534, 65534)
    try:
        assert probe(starter, probe_dir, names=("keyctl",)) == {"keyctl": errno.EPERM}
    finally:
        for f in os.listdir(cache):
            os.unlink(os.path.join(cache, f))
