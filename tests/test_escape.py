"""A job cannot use a same-uid host daemon to start a process outside its
cgroup (issue 10).  tmux keeps its socket in /tmp/tmux-UID, screen in
/run/screen/S-USER, systemd --user and D-Bus in /run/user/UID: each of those
directories is private to the job (docs/design.md, "What a job sees:
namespaces and mounts"), so the job cannot find the host daemon's socket, while a daemon the
job starts itself works and stays inside the job.

Each test starts the host daemon as `nobody` (the job's user here) and ends it
by pid."""

import os
import shutil
import subprocess
import time

import pytest

from conftest import SLOWDOWN, wait_for

NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
MARK = "sleep 7777"


def _outside(marker):
    """pids of processes running `marker` (a job's process escaped if it runs after the job)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().replace(b"\0", b" ").strip() == marker.encode():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def _end(pids):
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed (scripts/setup --test installs it)")
def test_host_tmux_server_is_out_of_reach(starter, tmp_path):
    sock_dir = "/tmp/tmux-65534"
    sock = os.path.join(sock_dir, "default")
    if os.path.exists(sock):
        pytest.skip("a tmux server of nobody already runs on this node; not ours to touch")
    host = subprocess.Popen([*NOBODY, "env", "-u", "TMUX_TMPDIR", "HOME=/tmp", "SHELL=/bin/sh", "tmux", "new-session", "-d", "-s", "host", "sleep 600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    host.wait(timeout=20)
    try:
        wait_for(lambda: os.path.exists(sock), f"{sock} to appear")
        # The host's server is alive (were SHELL unset, tmux would take
        # nobody's nologin, the session would end, and this test prove nothing).
        subprocess.run([*NOBODY, "tmux", "-S", sock, "has-session", "-t", "host"], check=True, timeout=10)
        p = starter("run", "--user", "nobody", "--", "sh", "-c",
                    f"tmux -S {sock} new-window '{MARK}'; echo host=$?; "
                    f"tmux new-session -d '{MARK}' && echo own=0; tmux ls | wc -l")
        assert p.returncode == 0, p.stderr
        assert "host=1" in p.stdout and "own=0" in p.stdout, p.stdout   # its own server works, inside
        # Nothing the job asked for runs anywhere now that it is over (the
        # host server would have started it outside the job's cgroup).
        windows = subprocess.run([*NOBODY, "tmux", "-S", sock, "list-panes", "-a", "-F", "#{pane_start_command}"],
                                 capture_output=True, text=True, timeout=10).stdout
        assert MARK not in windows, windows
        assert _outside(MARK) == []
    finally:
        subprocess.run([*NOBODY, "tmux", "-S", sock, "kill-server"], capture_output=True, timeout=10)
        _end(_outside(MARK))
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.skipif(not shutil.which("screen"), reason="screen is not installed (scripts/setup --test installs it)")
@pytest.mark.skipif(not os.path.isdir("/run/screen"), reason="this host keeps no screen sockets in /run/screen")
def test_host_screen_session_is_out_of_reach(starter):
    name = f"host{os.getpid()}"
    sdir = "/run/screen/S-nobody"
    made_sdir = not os.path.exists(sdir)
    before = set(os.listdir(sdir)) if os.path.isdir(sdir) else set()
    subprocess.run([*NOBODY, "env", "HOME=/tmp", "screen", "-dmS", name, "sleep", "600"], timeout=20, check=True)
    session = None
    try:
        # screen -dm returns before its server has made the session's socket:
        # poll for it, with a deadline.
        deadline = time.monotonic() + 10 * SLOWDOWN
        while session is None:
            new = [n for n in (set(os.listdir(sdir)) if os.path.isdir(sdir) else set()) - before if n.endswith("." + name)]
            if new:
                session = int(new[0].split(".")[0])
            else:
                assert time.monotonic() < deadline, "the host screen session did not start"
                time.sleep(0.02)
        p = starter("run", "--user", "nobody", "--", "sh", "-c",
                    f"screen -S {name} -X screen {MARK}; echo host=$?; screen -ls | grep -c {name}")
        assert p.returncode == 1 and "host=1" in p.stdout and p.stdout.strip().endswith("0"), (p.stdout, p.stderr)
        assert _outside(MARK) == []
    finally:
        _end([session] if session else [])
        _end(_outside(MARK))
        if os.path.isdir(sdir):
            for n in set(os.listdir(sdir)) - before:
                try:
                    os.unlink(os.path.join(sdir, n))
                except OSError:
                    pass
            if made_sdir:
                try:
                    os.rmdir(sdir)
                except OSError:
                    pass
