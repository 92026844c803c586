"""Checkpoint and restore of a NAT job (starter/checkpoint/criu.py, issue 26),
through the real CLI, against the private test site of tests/nethosts.py.

Where CRIU works (the v2 VM: scripts/test runs this file there alone; the
network does not change with the cgroup layout): the job sends to the WAN
host, is dumped while it waits, and restored into a fresh namespace wired
as a new job's.  It sends again from there; the connection it held across
the dump comes back closed (its address is another).  The report counts
every byte once: each segment's counters, and their sum within 1% of what
was sent (headers off, retransmissions on)."""

import json
import os
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from conftest import STARTER  # noqa: E402
from test_checkpoint import CRIU, _end, _hybrid, checkpoint_and_end, key  # noqa: E402,F401  (key: the fixture)

POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"
N = 3_000_000

# The job: one transfer to the WAN host (nethosts.CLIENT, its first
# argument), a connection held open, then it waits for a line on stdin (the
# dump comes while it waits; the line, to the restored job's stdin); then
# the held connection is tried and a second transfer made.
NAT_JOB = r"""
import socket, sys
client, host, p1, p2, p3, n = sys.argv[1:7]
def send(port):
    sys.argv = ["client", "send", host, port, n, "", "60"]
    exec(client, {"__name__": "client"})
send(p1)
held = socket.create_connection((host, int(p3)), timeout=60)
print("phase1", flush=True)
sys.stdin.readline()
try:
    held.send(b"x")
    held.send(b"x")
    print("held open", flush=True)
except OSError as e:
    print("held closed", e.errno, flush=True)
send(p2)
"""


@pytest.fixture
def site():
    with nethosts.site() as s:
        yield s


@pytest.mark.net
@pytest.mark.skipif(not CRIU or _hybrid(), reason="needs CRIU working and a pure cgroup v2 or v1 layout: "
                    "scripts/vm-test -- python -m pytest tests/test_checkpoint_nat.py")
def test_a_nat_job_restored_counts_every_byte_once(key, site, tmp_path):  # noqa: F811
    ck = tmp_path / "ck"
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    s1, s2, s3 = (site.serve("wan", "recv", 0) for _ in range(3))
    nat = ["--net", "nat", "--pool", POOL, "--lan", site.lan_cidr, "--uplink", site.uplink]
    job = subprocess.Popen([STARTER, "run", "--id", "ckn", "--user", "65534", *nat, "--report", str(r1), "--",
                            "python3", "-c", NAT_JOB, nethosts.CLIENT, site.wan_addr, str(s1.port), str(s2.port),
                            str(s3.port), str(N)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    restored = None
    try:
        first = [job.stdout.readline().strip(), job.stdout.readline().strip()]
        assert first == [f"sent {N}", "phase1"], (first, job.stderr.read() if job.poll() is not None else "")
        checkpoint_and_end("ckn", ck, job, r1)
        retrans = nethosts.retransmitted(job.stderr.read())
        restored = subprocess.Popen([STARTER, "run", "--restore", str(ck), "--report", str(r2)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = restored.communicate("go\n", timeout=300)
        assert restored.returncode == 0, (out, err)
        lines = out.splitlines()
        assert lines[0].split()[:2] == ["held", "closed"], out      # another address: CRIU's --tcp-close
        assert lines[-1] == f"sent {N}", out
        for s in (s1, s2):
            assert s.result()[0].splitlines()[-1] == f"received {N}"
        rep = json.loads(r2.read_text())
        assert rep["reason"] == "exited" and len(rep["segments"]) == 2, rep
        segs = rep["segments"]
        assert all(s["network"]["wan_out"]["bytes"] > N for s in segs), segs
        total = rep["total"]["network"]["wan_out"]
        assert total["bytes"] == sum(s["network"]["wan_out"]["bytes"] for s in segs), rep
        assert rep["network"]["wan_out"] == segs[-1]["network"]["wan_out"]     # this run's own, as ever
        sent = 2 * N + retrans + nethosts.retransmitted(err)
        payload = total["bytes"] - 52 * total["packets"]        # IP + TCP headers
        assert abs(payload - sent) <= 0.01 * sent, (payload, sent, rep["total"])
    finally:
        _end(job, restored)
