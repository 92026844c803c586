#!/usr/bin/env python3
"""`starter metrics` on a busy node, against a plain `cat` of the same files.

--jobs `starter run --net none -- sleep` jobs (plus --nat NAT jobs against
the private test site of tests/nethosts.py, which moved some bytes so their
counters are not zero) run in a private state directory.  Then, median of
--rounds each:

  starter metrics       the whole command: interpreter start, the state
                        directory, every job's entry, lock, cgroup files and,
                        for NAT jobs, five nft counters by netlink
  cat (same files)      one `cat` process reading exactly the files the
                        metrics pass opened (recorded with a Python audit
                        hook: state entries and cgroup files; the nft counters
                        are netlink requests, not files, so cat has no part
                        of them)
  metrics.text()        the same pass inside a warm interpreter (no start-up)

Target: starter metrics at most 2x the cat.  Everything started here is
stopped (SIGQUIT: the starter's kill action) and reclaimed at the end.

Usage: .venv/bin/python scripts/bench.d/metrics.py [--jobs 500] [--nat 3] [--rounds 15]
"""

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import nethosts  # noqa: E402

PY = os.path.join(REPO, ".venv", "bin", "python")
STARTER = os.path.join(REPO, ".venv", "bin", "starter")
POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"

RECORD = r"""
import sys
seen = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        seen.append(args[0])
from starter.observe import metrics
sys.addaudithook(hook)
metrics.text(sys.argv[1])
for p in dict.fromkeys(seen):
    if p.startswith(("/sys/fs/cgroup/", sys.argv[1])) and not p.endswith(".lock"):
        print(p)
"""


def timed(argv, rounds, **kw):
    """-> (median wall seconds, median cpu seconds (user+sys) of the command)."""
    import resource

    wall, cpu = [], []
    for _ in range(rounds):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        wall.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return statistics.median(wall), statistics.median(cpu)


def wait_running(state, ids, timeout, procs=None):
    deadline = time.monotonic() + timeout
    left = set(ids)
    while left and time.monotonic() < deadline:
        for job_id in list(left):
            try:
                with open(os.path.join(state, job_id + ".json")) as f:
                    if json.load(f).get("state") == "running":
                        left.discard(job_id)
            except (OSError, ValueError):
                pass
        if left:
            time.sleep(0.2)
    if left:
        raise SystemExit(f"{len(left)} jobs did not start within {timeout} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--nat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    procs = []
    with contextlib.ExitStack() as stack:
        state = tempfile.mkdtemp(prefix="starter-bench-metrics-", dir="/run")
        stack.callback(shutil.rmtree, state, True)
        stack.callback(shutil.rmtree, state + ".seccomp", True)   # the filter cache beside it
        stack.callback(subprocess.run, [STARTER, "gc", "--state-dir", state], capture_output=True)

        def stop_all():
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGQUIT)
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

        stack.callback(stop_all)
        tag = secrets.token_hex(2)
        ids = []
        t0 = time.monotonic()

        def launch(job_id):
            return subprocess.Popen([STARTER, "run", "--id", job_id, "--state-dir", state, "--user", "nobody",
                                     "--net", "none", "--", "sleep", "3600"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        batch = {}
        for i in range(args.jobs):
            job_id = f"bm{tag}-{i}"
            ids.append(job_id)
            batch[job_id] = launch(job_id)
            procs.append(batch[job_id])
            if len(batch) == 25 or i == args.jobs - 1:
                # Concurrent starts can trip over each other's start-up gc
                # (state.is_live's shared lock): start those again.
                for _ in range(5):
                    for jid, p in list(batch.items()):
                        if p.poll() is not None:
                            batch[jid] = launch(jid)
                            procs.append(batch[jid])
                    try:
                        wait_running(state, list(batch), 60)
                        break
                    except SystemExit:
                        continue
                batch = {}
        if args.nat:
            site = stack.enter_context(nethosts.site())
            tmp = tempfile.mkdtemp(prefix="starter-bench-metrics-srv-")
            stack.callback(shutil.rmtree, tmp, True)
            with open(os.path.join(tmp, "client.py"), "w") as f:
                f.write(nethosts.CLIENT)
            os.chmod(os.path.join(tmp, "client.py"), 0o644)
            os.chmod(tmp, 0o755)
            for i in range(args.nat):
                srv = site.serve("lan", "send", 200_000)
                job_id = f"bm{tag}-nat{i}"
                ids.append(job_id)
                script = (f"/usr/bin/python3 /srv/client.py recv {site.lan_addr} {srv.port} 200000 '' 20; "
                          "exec sleep 3600")
                procs.append(subprocess.Popen(
                    [STARTER, "run", "--id", job_id, "--state-dir", state, "--user", "nobody", "--net", "nat",
                     "--pool", POOL, "--lan", site.lan_cidr, "--uplink", site.uplink, "--ro-bind", f"{tmp}:/srv",
                     "--", "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
                srv.result()
        wait_running(state, ids, 300)
        print(f"{len(ids)} jobs running ({args.nat} NAT) after {time.monotonic() - t0:.1f} s")

        files = subprocess.run([PY, "-c", RECORD, state], check=True, capture_output=True,
                               text=True).stdout.split()
        out = subprocess.run([STARTER, "metrics", "--state-dir", state], check=True, capture_output=True,
                             text=True).stdout
        series = sum(1 for l in out.splitlines() if l and not l.startswith("#"))
        print(f"{len(files)} files per pass ({len(files) / len(ids):.1f} per job), {series} series, "
              f"{len(out)} bytes of output")

        # Alternate the two so that a change in the machine's load hits both.
        m, c = [], []
        for _ in range(args.rounds):
            m.append(timed([STARTER, "metrics", "--state-dir", state], 1))
            c.append(timed(["cat", *files], 1))
        (m_wall, m_cpu), (c_wall, c_cpu) = [(statistics.median(w for w, _ in x), statistics.median(u for _, u in x))
                                            for x in (m, c)]
        warm = subprocess.run([PY, "-c", (
            "import sys, time, statistics\n"
            "from starter.observe import metrics\n"
            "metrics.text(sys.argv[1])\n"
            "ts = []\n"
            "for _ in range(int(sys.argv[2])):\n"
            "    t0 = time.perf_counter(); metrics.text(sys.argv[1]); ts.append(time.perf_counter() - t0)\n"
            "print(statistics.median(ts))\n"), state, str(args.rounds)],
            check=True, capture_output=True, text=True).stdout
        t_warm = float(warm)
        p_wall, p_cpu = timed([PY, "-IS", "-c", "pass"], args.rounds)

        print(f"\nload {open('/proc/loadavg').read().split()[0]} on {os.cpu_count()} cpus; medians of {args.rounds}")
        print(f"| {len(ids)} jobs | wall ms | x cat | cpu ms (user+sys) | x cat |")
        print("|---|---:|---:|---:|---:|")
        print(f"| `cat` of the same {len(files)} files | {1000 * c_wall:.1f} | 1.00 | {1000 * c_cpu:.1f} | 1.00 |")
        print(f"| **`starter metrics`** | **{1000 * m_wall:.1f}** | **{m_wall / c_wall:.2f}** | {1000 * m_cpu:.1f} "
              f"| {m_cpu / c_cpu:.2f} |")
        print(f"| `metrics.text()` in a warm interpreter | {1000 * t_warm:.1f} | {t_warm / c_wall:.2f} | | |")
        print(f"| `python -IS -c pass` (start-up alone) | {1000 * p_wall:.1f} | {p_wall / c_wall:.2f} | {1000 * p_cpu:.1f} | |")
        print(f"\nper job: {1000 * t_warm / len(ids):.3f} ms in process; target starter metrics <= 2x cat (wall): "
              f"{'met' if m_wall <= 2 * c_wall else 'missed'}")


if __name__ == "__main__":
    main()
