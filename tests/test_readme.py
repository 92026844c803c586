"""Every command line of the README's "Usage" section runs as written, so the
README cannot drift from the code.

The lines are taken from the first code block under "## Usage", continuation
lines joined, comments cut, `;` separating commands; each command is split
into argv by shlex (no shell runs) with `starter` mapped to this checkout's
CLI.  Placeholders: JOB is a job the test keeps running, SHA256 the digest of
the sig.sha256 fixture.  The fixtures the lines name (./analysis,
./spawns-daemons, job.json, run.sh + input.dat + sig.sha256) are made in a
fresh directory the commands run from; fd 3 is a file for `--events fd:3`.
Directories the lines name on the host (/var/lib/jobs,
/var/lib/starter/execute) are made if missing and removed again.
"""

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile

import pytest

from conftest import REPO, STARTER

# The NAT example goes out through eth0 to a host named `mirror`: the tests
# never reach outside addresses, and test_run_nat.py covers --net nat
# against namespace hosts.
SKIP = {"--uplink": "needs eth0 and a host outside (covered by test_run_nat.py against namespace hosts)"}


def usage_lines():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n((?:    .*\n)+)", section).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line.strip())
        out += [c.strip() for c in line.split(";") if c.strip()]
    return out


def test_usage_section_is_found():
    lines = usage_lines()
    assert lines[0].startswith("starter run") and len(lines) >= 12, lines
    assert all(l.startswith("starter ") for l in lines), lines


FIXTURES = {
    "analysis": "#!/bin/sh\necho \"analysis $*\" in \"$(pwd)\"\n",
    "spawns-daemons": "#!/bin/sh\nsetsid sleep 0.2 &\n(sleep 0.2 &)\necho spawned\n",
    "run.sh": "#!/bin/sh\nexec cat input.dat\n",
}


@pytest.fixture
def readme_env(tmp_path):
    if os.path.exists("/var/lib/jobs/42.json"):
        pytest.skip("/var/lib/jobs/42.json exists on this node; the README's line would overwrite it")
    made = []
    for d in ("/var/lib/jobs", "/var/lib/starter", "/var/lib/starter/execute"):
        if not os.path.exists(d):
            os.mkdir(d, 0o755)
            made.append(d)
    cwd = tempfile.mkdtemp(prefix="starter-readme-", dir="/var/lib")
    os.chmod(cwd, 0o755)             # the job's user (nobody) can enter it
    for name, text in FIXTURES.items():
        with open(os.path.join(cwd, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(cwd, name), 0o755)
    with open(os.path.join(cwd, "input.dat"), "w") as f:
        f.write("verified input\n")
    sig = "".join(f"{hashlib.sha256(open(os.path.join(cwd, n), 'rb').read()).hexdigest()} {mark}{n}\n"
                  for n, mark in (("run.sh", "x"), ("input.dat", " ")))
    with open(os.path.join(cwd, "sig.sha256"), "w") as f:
        f.write(sig)
    with open(os.path.join(cwd, "job.json"), "w") as f:
        f.write('{"id": "readme-jobfile", "user": "nobody", "command": ["./analysis", "--from", "job.json"],'
                ' "limits": {"memory": "256M"}}\n')
    events = open(tmp_path / "events.jsonl", "w")
    try:
        yield cwd, events.fileno(), hashlib.sha256(sig.encode()).hexdigest()
    finally:
        events.close()
        shutil.rmtree(cwd, ignore_errors=True)
        if os.path.exists("/var/lib/jobs/42.json"):
            os.unlink("/var/lib/jobs/42.json")
        for d in reversed(made):
            shutil.rmtree(d, ignore_errors=True)


class RunningJob:
    """A job for JOB: sleeps until vacated (--init, so SIGTERM ends it at once)."""

    def __init__(self, cwd, state_dir):
        self.id = f"readme-{os.getpid()}"
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [STARTER, "run", "--id", self.id, "--user", "nobody", "--init", "--events", f"fd:{w}",
             "--", "sleep", "120"], cwd=cwd, pass_fds=(w,), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        os.close(w)
        self.events = os.fdopen(r)
        for line in self.events:        # wait for the event, not for a time
            if '"running"' in line:
                break
        else:
            raise AssertionError(f"job did not start: {self.proc.communicate()[1]}")

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            subprocess.run([STARTER, "kill", self.id], capture_output=True, timeout=30)
        self.proc.wait(timeout=60)
        self.events.close()


def test_readme_usage_lines_run(readme_env, state_dir):
    cwd, events_fd, digest = readme_env
    job = None
    ran = []
    try:
        for line in usage_lines():
            skip = next((why for opt, why in SKIP.items() if opt in line.split()), None)
            if skip:
                ran.append(f"skipped: {line} ({skip})")
                continue
            argv = shlex.split(line)
            if "JOB" in argv:
                if job is None or not job.alive():
                    if job is not None:
                        job.stop()
                    job = RunningJob(cwd, state_dir)
                argv = [job.id if a == "JOB" else a for a in argv]
            argv = [digest if a == "SHA256" else a for a in argv]
            assert argv[0] == "starter"
            p = subprocess.run(
                [STARTER] + argv[1:], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=120, pass_fds=(events_fd, 3), preexec_fn=lambda: os.dup2(events_fd, 3))
            assert p.returncode == 0, (line, p.returncode, p.stdout, p.stderr)
            ran.append(line)
            if argv[1:3] == ["vacate", job and job.id]:
                job.proc.wait(timeout=60)      # vacated: the next JOB line gets a fresh one
            check_output(argv, p, cwd, job)
    finally:
        if job is not None:
            job.stop()
    assert len([r for r in ran if not r.startswith("skipped")]) >= 12, ran


def check_output(argv, p, cwd, job):
    """What the lines promise, beyond exit 0."""
    cmd = argv[1]
    if cmd == "run" and argv[-3:] == ["./analysis", "--input", "data"]:
        assert p.stdout == f"analysis --input data in {cwd}\n"
        assert '"reason": "exited"' in open("/var/lib/jobs/42.json").read()
    elif cmd == "run" and argv[2:3] == ["--job"]:
        assert p.stdout == f"analysis --from job.json in {cwd}\n"
    elif cmd == "run" and "--manifest" in argv:
        assert p.stdout == "verified input\n"
    elif cmd == "run" and argv[-2:] == ["ps", "faux"]:
        assert len(p.stdout.splitlines()) == 2          # the header and ps itself: PID 1
    elif cmd == "ps":
        assert job is None or job.id in p.stdout
    elif cmd == "status":
        assert f'"id": "{job.id}"' in p.stdout
    elif cmd == "enter":
        assert "sleep 120" in p.stdout
    elif argv[-1] == "--help":
        assert p.stdout.startswith("usage: starter")
