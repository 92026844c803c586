"""The command line as admins meet it: one line on stderr and exit 125 for
every error (never a traceback), --help on every subcommand, the job's
default working directory; and a fuzz of the job-file parser and the run
options.  The value classes and relative paths in a spec, on their own:
tests/unit/test_cli_values.py.

The fuzz runs cli.main() in-process with job.run replaced by a stub (a dry
run: spec building is all that is fuzzed), seeded, so it is fast and the
same on every run.  The cases that need the real process (tracebacks at
interpreter level, state directories, non-root) run the real CLI.
"""

import json
import os
import random
import subprocess
import tempfile

import pytest

from conftest import STARTER
from starter.cli import main as cli

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def one_error_line(p):
    """A failed command: exactly one line on stderr, no traceback."""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


# ------------------------------------------------------------ never a traceback

@pytest.mark.parametrize("args", [
    ["--memory", "inf"], ["--memory", "nan"], ["--memory", "1e400"], ["--user", "²"], ["--user", "١"],
    ["--group", "١"], ["--cpus", "inf"], ["--pids", "1e400"], ["--wall-time", "nan"], ["--id", "../x"],
    ["--id", "$(id)"], ["--user", "a/b"], ["--hostname", "a\nb"], ["--uplink", "x" * 16, "--net", "nat"],
    ["--lan", "١٠.0.0.0/8", "--net", "nat"], ["--bind", "/nonexistent-src:/x"], ["--nope"],
])
def test_bad_run_options_are_one_line(starter, args):
    p = starter("run", *args, "--", "true")
    assert p.returncode == 125
    one_error_line(p)


def test_user_digits_are_not_uids(starter):
    for u in ("²", "١"):
        line = one_error_line(starter("run", "--user", u, "--", "true", check=125))
        assert "user" in line


def test_deeply_nested_job_file(starter, tmp_path):
    for name, text in (("deep.json", '{"env": ' + "[" * 200000 + "]" * 200000 + "}"),
                       ("deep.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n")):
        f = tmp_path / name
        f.write_text(text)
        line = one_error_line(starter("run", "--job", str(f), check=125))
        assert "job" in line


@pytest.mark.parametrize("name, text, args", [
    ("surrogate.json", '{"command": ["/bin/true"], "cwd": "/\\ud800"}', ()),
    ("surrogate-env.json", '{"command": ["/bin/true"], "env": {"A": "\\udbff"}}', ()),
    ("bigint.toml", "command = ['/bin/true']\ngrace = 1" + "0" * 5000 + "\n", ()),
    ("merge.json", '{"command": ["/bin/true"], "on_signal": 5}', ("--on-signal", "USR1=vacate")),
    ("merge-str.json", '{"command": ["/bin/true"], "lan": "10.0.0.0/8"}', ("--lan", "10.1.0.0/16")),
    ("neg-inf.json", '{"command": ["/bin/true"], "limits": {"memory": "-1e309"}}', ()),
])
def test_job_files_found_by_fuzzing_get_one_line(starter, tmp_path, name, text, args):
    f = tmp_path / name
    f.write_text(text)
    line = one_error_line(starter("run", "--net", "none", "--job", str(f), *args, check=125))
    assert "internal error" not in line, line


def test_a_job_files_user_may_be_a_number(starter, tmp_path):
    f = tmp_path / "job.json"
    f.write_text('{"command": ["id", "-u"], "user": 65534}')
    p = starter("run", "--net", "none", "--job", str(f), check=0)
    assert p.stdout.strip() == "65534"


def test_numbers_found_by_fuzzing_get_one_line(starter):
    for args in (("--memory", "-1e309"), ("--user", "9" * 5000), ("--group", "1" * 30)):
        line = one_error_line(starter("run", "--net", "none", *args, "--", "true", check=125))
        assert "internal error" not in line, (args, line)


def test_a_job_file_that_is_a_fifo_or_a_device_is_refused_unopened(starter, tmp_path):
    fifo = tmp_path / "job.json"
    os.mkfifo(fifo)          # no writer: an open() for reading would block the start
    for path in (fifo, "/dev/null", tmp_path):
        line = one_error_line(starter("run", "--job", str(path), "--", "true", check=125, timeout=10))
        assert line.startswith("starter: job: ") and "not a regular file" in line, line


def test_unusable_state_directory(starter, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    line = one_error_line(starter("run", "--user", "nobody", "--state-dir", str(f), "--", "true", check=125))
    assert str(f) in line


@pytest.mark.parametrize("how", ["ro", "full"])
def test_state_directory_read_only_or_full(tmp_path, how):
    """A tmpfs in a private mount namespace (nothing reaches the host's mounts)."""
    d = tmp_path / "mnt"
    d.mkdir()
    prep = (f"mount -t tmpfs -o size=64k,ro none {d}" if how == "ro" else
            f"mount -t tmpfs -o size=64k none {d} && mkdir {d}/state && "
            f"(dd if=/dev/zero of={d}/fill bs=4k 2>/dev/null || true)")
    p = subprocess.run(["unshare", "-m", "sh", "-c",
                        f'{prep} && exec "$0" run --user nobody --state-dir {d}/state -- true', STARTER],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 125, p
    line = one_error_line(p)
    assert "state" in line and ("Read-only" in line or "No space" in line), line


@pytest.mark.parametrize("cmd", [["ps"], ["ps", "--json"], ["status", "x"], ["gc"], ["vacate", "x"],
                                 ["enter", "x"], ["run", "--", "true"]])
def test_admin_commands_as_non_root(cmd, state_dir):
    p = subprocess.run([*NOBODY, STARTER, *cmd], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, STARTER_STATE_DIR=state_dir))
    assert p.returncode == 125, p
    assert "root" in one_error_line(p)


@pytest.fixture(autouse=True)
def no_setup_watchdog(monkeypatch):
    """`starter run` in this process (cli.main): no setup watchdog.
    watchdog.start() blocks the ending signals in the calling thread, and
    every process pytest starts afterwards would inherit that (a netd that
    never sees its SIGTERM; the leak check looks)."""
    import starter.job.watchdog

    monkeypatch.setattr(starter.job.watchdog, "start", lambda timeout=None: None)


def test_internal_error_is_one_line(tmp_path, monkeypatch, capsys):
    """A bug inside job.run: one line (the traceback only with STARTER_DEBUG)."""
    from starter import cgroups

    def broken(*a, **kw):
        raise RuntimeError("planted bug\nsecond line")

    monkeypatch.setattr(cgroups, "open_backend", broken)
    monkeypatch.delenv("STARTER_DEBUG", raising=False)
    rc = cli.main(["run", "--user", "nobody", "--state-dir", str(tmp_path / "st"), "--", "true"])
    err = capsys.readouterr().err
    assert rc == 125 and err.count("\n") == 1 and "internal error" in err and "planted bug" in err, err
    monkeypatch.setenv("STARTER_DEBUG", "1")
    cli.main(["run", "--user", "nobody", "--state-dir", str(tmp_path / "st"), "--", "true"])
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nan", "inf", "١", "-5", "1e400"])
def test_spool_min_age(starter, tmp_path, bad):
    p = starter("spool", "--spool", str(tmp_path / "spool"), "gc", "--min-age", bad, check=125)
    assert "min-age" in one_error_line(p)


def test_reader_gone_is_quiet():
    """`starter ps | head -1`: a closed pipe ends the command without a message."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([STARTER, "run", "--help"], stdout=w, stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", p


def test_control_characters_are_escaped(starter):
    line = one_error_line(starter("run", "--id", "a\x1b[2Jb\nc", "--", "true", check=125))
    assert "\x1b" not in line and "\\x1b" in line


# ------------------------------------------------------------ --help

HELP = [["run"], ["ns-exec"], ["enter"], ["ps"], ["status"], ["vacate"], ["suspend"], ["resume"],
        ["kill"], ["gc"], ["netd"], ["spool"], ["spool", "add"], ["spool", "lookup"], ["spool", "store"],
        ["spool", "link"], ["spool", "release"], ["spool", "ls"], ["spool", "gc"]]


@pytest.mark.parametrize("cmd", HELP, ids=" ".join)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_everywhere(starter, cmd, flag):
    p = starter(*cmd, flag, check=0)
    assert p.stdout.startswith("usage: starter " + cmd[0]) and not p.stderr, p
    if len(cmd) > 1:
        assert p.stdout.startswith(f"usage: starter spool [--spool DIR] {cmd[1]}"), p.stdout


# ------------------------------------------------------------ the job's working directory

def test_default_cwd(starter, tmp_path):
    """The caller's cwd if the job's user can reach it there, else home, else /."""
    d = tempfile.mkdtemp(prefix="starter-cwd-", dir="/var/lib")
    try:
        os.chmod(d, 0o755)
        with open(os.path.join(d, "analysis"), "w") as f:
            f.write("#!/bin/sh\npwd\n")
        os.chmod(os.path.join(d, "analysis"), 0o755)
        assert starter("run", "--user", "nobody", "--", "./analysis", cwd=d, check=0).stdout == d + "\n"
        os.chmod(d, 0o700)             # nobody cannot reach it: home (/nonexistent), then /
        assert starter("run", "--user", "nobody", "--", "pwd", cwd=d, check=0).stdout == "/\n"
        assert starter("run", "--user", "root", "--", "pwd", cwd=d, check=0).stdout == d + "\n"
        assert starter("run", "--user", "nobody", "--init", "--", "pwd", cwd=d, check=0).stdout == "/\n"
        # An explicit --cwd is the only candidate: failing it is an error.
        p = starter("run", "--user", "nobody", "--cwd", d, "--", "pwd", cwd=d, check=125)
        assert "chdir" in one_error_line(p)
    finally:
        subprocess.run(["rm", "-rf", d], check=True)
    # The caller's /tmp/x is not in the job's private /tmp.
    assert starter("run", "--user", "root", "--", "pwd", cwd=str(tmp_path), check=0).stdout == "/root\n"


def test_scratch_is_the_default_cwd(starter, tmp_path):
    parent = tempfile.mkdtemp(prefix="starter-exec-", dir="/var/lib")
    try:
        os.chmod(parent, 0o755)
        p = starter("run", "--user", "nobody", "--execute-dir", parent, "--id", "cwdjob", "--", "pwd",
                    cwd="/", check=0)
        assert p.stdout == os.path.join(parent, "job-cwdjob") + "\n"
    finally:
        subprocess.run(["rm", "-rf", parent], check=True)


# ------------------------------------------------------------ fuzz

HOSTILE = ["", " ", "../x", "a/b", "$(id)", "`id`", "x;rm -rf /", "a\0b", "a\nb", "\x1b[2J", "²", "١",
           "١٢٣", "１２", "-1", "0", "1e400", "inf", "nan", "Infinity", "-", "--", "..", ".", "x" * 5000,
           "/", "/etc/passwd", "/x/../y", "fd:", "fd:-1", "fd:99999999999", "tcp:0", "udp:70000",
           "10.0.0.0/33", "::1/129", "USR1=explode", "K", "=v", "1=2", "é", "\udcff", "512M", "2G",
           "nobody", "root", "none", "nat", "host", "bind", "tmpfs"]
NUMBERS = [0, -1, 1, 2**31, 2**63, 10**400, 1.5, 1e308, float("inf"), float("-inf"), float("nan"),
           True, False, None]

FILE_KEYS = ["id", "command", "user", "group", "cwd", "env", "hostname", "init", "limits", "network",
             "mounts", "report", "events", "grace", "on_signal", "state_dir", "cgroup_parent",
             "scratch", "execute_dir", "keep_scratch", "manifest", "manifest_digest", "inputs",
             "bogus", "", "\0"]
SUB_KEYS = {"limits": ["memory", "cpus", "cpu_weight", "pids", "wall_time", "swap"],
            "network": ["mode", "lan", "pool", "uplink", "allow_host_ports", "resolver", "x"]}


def _value(rng, depth=0):
    r = rng.random()
    if r < 0.35:
        return rng.choice(HOSTILE)
    if r < 0.55:
        return rng.choice(NUMBERS)
    if r < 0.7 or depth > 3:
        return [rng.choice(HOSTILE + NUMBERS) for _ in range(rng.randrange(4))]
    if r < 0.85:
        keys = rng.choice([FILE_KEYS, SUB_KEYS["limits"], SUB_KEYS["network"], ["type", "src", "dst", "options"]])
        return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_value(rng, depth + 1)]


def _job(rng):
    doc = {"command": ["true"]} if rng.random() < 0.7 else {}
    for _ in range(rng.randrange(1, 5)):
        key = rng.choice(FILE_KEYS)
        if key in SUB_KEYS and rng.random() < 0.7:
            doc[key] = {rng.choice(SUB_KEYS[key]): _value(rng) for _ in range(rng.randrange(1, 4))}
        elif key == "mounts" and rng.random() < 0.7:
            doc[key] = [{"type": rng.choice(["bind", "ro-bind", "tmpfs", "x"]), "src": rng.choice(HOSTILE),
                         "dst": rng.choice(HOSTILE), **({"options": rng.choice(HOSTILE)} if rng.random() < .3 else {})}]
        else:
            doc[key] = _value(rng)
    return doc


def _text(rng, doc):
    r = rng.random()
    text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, allow_nan=True) if r < 0.8 else None
    if text is None:                       # structurally broken input
        text = rng.choice(['{"id": ', "[" * 3000, "{" * 3000, '{"id": "a", "id": "b"}', "\ufeff{}",
                           '{"command": ["true"]}' + "x", "null", "1e400", '"x"', "[]"])
    if rng.random() < 0.05:
        return text.encode("utf-8", "surrogatepass")[: rng.randrange(1, 20)] + b"\xff\xfe"
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture
def dry_run(monkeypatch, capsys, tmp_path):
    """cli.main with job.run stubbed: -> (rc, stdout, stderr)."""
    import starter.job.run

    monkeypatch.setattr(starter.job.run, "run", lambda spec, *a: 0)
    monkeypatch.chdir(tmp_path)

    def call(argv):
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        return rc, out, err

    return call


def _check(rc, err, what):
    assert rc in (0, 125), (rc, what, err)
    if rc == 0:
        assert err == "", (what, err)
    else:
        assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, (what, err)
        assert len(err) < 600, (what, err)        # a huge hostile value makes a short line


def test_fuzz_job_file(dry_run, tmp_path):
    rng = random.Random(12)
    seen = {0: 0, 125: 0}
    for i in range(1500):
        doc = _job(rng)
        f = tmp_path / ("job.toml" if rng.random() < 0.05 else "job.json")
        f.write_bytes(_text(rng, doc))
        rc, _, err = dry_run(["run", "--job", str(f)])
        _check(rc, err, (i, f.read_bytes()[:300]))
        seen[rc] += 1
    assert seen[0] > 20 and seen[125] > 500, seen      # both paths are exercised


def _fuzz_run_argv(rng, counts, spellings=True):
    """`run` with hostile options drawn by rng: randrange(*counts) of them,
    values from HOSTILE and NUMBERS; spellings: also --name=value and junk
    after a flag, and a hostile command (or none); else a plain `-- true`."""
    opts = [o for o in cli.RUN_OPTIONS if o != "--job"]
    argv = ["run"]
    for _ in range(rng.randrange(*counts)):
        o = rng.choice(opts)
        if cli.RUN_OPTIONS[o][1] == "flag":
            argv.append(o if not spellings or rng.random() < 0.9 else o + "=" + rng.choice(HOSTILE))
        else:
            v = rng.choice(HOSTILE + [str(n) for n in NUMBERS])
            argv += [o, v] if not spellings or rng.random() < 0.5 else [f"{o}={v}"]
    if not spellings:
        argv += ["--", "true"]
    elif rng.random() < 0.9:
        argv += ["--"] + [rng.choice(HOSTILE) or "true" for _ in range(rng.randrange(1, 3))]
    return [a.replace("\0", "") for a in argv]      # execve cannot pass a NUL


def test_fuzz_run_options(dry_run):
    rng = random.Random(7)
    seen = {0: 0, 125: 0}
    for i in range(1500):
        argv = _fuzz_run_argv(rng, (1, 4))
        rc, _, err = dry_run(argv)
        _check(rc, err, argv)
        seen[rc] += 1
    assert seen[0] > 20 and seen[125] > 500, seen


def test_fuzz_run_options_as_a_caller(dry_run, monkeypatch):
    """The same hostile options from a caller that is not root (the
    launcher's variables set by hand, policy checks and its rights in
    force): 0 or one line, and the test process is root again after each."""
    rng = random.Random(9)
    seen = {0: 0, 125: 0}
    for i in range(600):
        argv = _fuzz_run_argv(rng, (0, 3), spellings=False)
        monkeypatch.setenv("STARTER_CALLER", "65534:65534:65534")
        monkeypatch.setenv("STARTER_POLICY", "/nonexistent/starter.toml")
        rc, _, err = dry_run(argv)
        assert (os.geteuid(), os.getegid()) == (0, 0)
        _check(rc, err, argv)
        seen[rc] += 1
    assert seen[0] > 20 and seen[125] > 200, seen


def test_fuzz_admin_commands(dry_run, tmp_path, state_dir):
    rng = random.Random(3)
    cmds = ["ps", "status", "vacate", "suspend", "resume", "kill", "enter", "spool", "ns-exec", "netd"]
    for i in range(300):
        argv = [rng.choice(cmds)] + [rng.choice(HOSTILE + ["--json", "--user", "ls", "gc", "add", "--owner",
                                                           "-x", "-p", "--help", "-h"])
                                     for _ in range(rng.randrange(0, 4))]
        if argv[0] in ("ns-exec", "netd", "enter") and not {"--help", "-h"} & set(argv):
            continue   # would really spawn, or serve forever
        if argv[0] == "spool":
            argv[1:1] = ["--spool", str(tmp_path / "spool")]
        rc, out, err = dry_run(argv)
        assert rc in (0, 1, 2, 125), (argv, rc, err)
        if rc in (2, 125) and not (rc == 2 and not err and out.startswith("usage:")):
            assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
