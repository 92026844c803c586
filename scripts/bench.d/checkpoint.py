#!/usr/bin/env python3
"""What `starter checkpoint` costs over CRIU's own dump of the same tree, and
how long a restore and how big an image are, for a job holding --size MiB of
touched memory (default 1024).  Where CRIU does not work (`criu check`
fails: this project's 6.18 host), it says so and stops: run it in the VM,

  scripts/vm-test -- python scripts/bench.d/checkpoint.py --size 256 --rounds 3

Each round, the order alternating, dumps the running job (--leave-running)
twice:
  starter   `starter checkpoint JOB --to DIR --leave-running` (the CLI's start,
            the job's entry, its fds' scan, the dump, the SHA-256 of every
            image file but the raw memory pages, and the signed record)
  criu      the same CRIU command line run by hand (checkpoint.dump_argv)
Then one `starter run --restore` of the last image, timed to its job running.
Target (issue 26): starter's dump at most 1.2x CRIU's.

Usage: .venv/bin/python scripts/bench.d/checkpoint.py [--size MIB] [--rounds N] [--dir DIR]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
JOB_ID = "bench-ck"

from starter.checkpoint import criu as checkpoint, directory as checkpoint_dir  # noqa: E402


def _wait_running(job_id, timeout=120, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the restore ended ({proc.returncode}): {proc.stderr.read().strip()}")
        p = subprocess.run([STARTER, "status", job_id, "--json"], capture_output=True, text=True)
        if p.returncode == 0:
            st = json.loads(p.stdout)
            if st.get("state") == "running":
                return st
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} did not run within {timeout} s")


def _size(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024, help="MiB of memory the job touches")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp",
                    help="where the images go (room for two: the VM's disk has ~2 GiB free; its /tmp is RAM)")
    args = ap.parse_args()
    check = subprocess.run(["criu", "check"], capture_output=True, text=True) if shutil.which("criu") else None
    if check is None or check.returncode != 0:
        why = "criu is not installed" if check is None else (check.stderr.strip().splitlines() or ["?"])[-1]
        print(f"skipped: CRIU does not work here ({why}); run it in the VM (see --help)")
        return
    had_key = os.path.exists(checkpoint_dir.KEY)
    work = tempfile.mkdtemp(prefix="starter-bench-ck-", dir=args.dir)
    code = (f"b = bytearray({args.size} << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ready', flush=True)\n"
            "import time\n"
            "while True: time.sleep(1)\n")
    job = subprocess.Popen([STARTER, "run", "--id", JOB_ID, "--user", "65534", "--", "python3", "-c", code],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    restored = None
    times = {"starter": [], "criu": []}
    try:
        assert job.stdout.readline().strip() == "ready"
        st = _wait_running(JOB_ID)
        pid = st["pid"]
        stdio = checkpoint._externals(pid, [pid])
        exe = checkpoint.criu()
        last = None
        for r in range(args.rounds):
            for kind in (("starter", "criu") if r % 2 == 0 else ("criu", "starter")):
                d = os.path.join(work, f"{kind}-{r}")
                if kind == "starter":
                    argv = [STARTER, "checkpoint", JOB_ID, "--to", d, "--leave-running"]
                else:
                    os.makedirs(os.path.join(d, "images"))
                    argv = checkpoint.dump_argv(exe, pid, os.path.join(d, "images"), os.path.join(d, "dump.log"),
                                                stdio, True)
                t = time.perf_counter()
                p = subprocess.run(argv, capture_output=True, text=True)
                times[kind].append(time.perf_counter() - t)
                if p.returncode != 0:
                    why = p.stderr.strip() or checkpoint._criu_error(os.path.join(d, "dump.log"))
                    raise SystemExit(f"{kind} dump failed: {why}")
                if kind == "starter":
                    if last:
                        shutil.rmtree(last, ignore_errors=True)
                    last = d
                else:
                    shutil.rmtree(d, ignore_errors=True)
        size = _size(last)
        job.kill()              # the starter: its job dies with it; gc below
        job.wait()
        subprocess.run([STARTER, "gc"], capture_output=True)
        t = time.perf_counter()
        # stdio of the same kinds as the dumped job's (a pipe for its stdout)
        restored = subprocess.Popen([STARTER, "run", "--restore", last], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_running(JOB_ID, timeout=600, proc=restored)
        restore_s = time.perf_counter() - t
        s, c = statistics.median(times["starter"]), statistics.median(times["criu"])
        print(f"{args.rounds} rounds, interleaved, order alternating; a job touching {args.size} MiB; medians")
        print()
        print("| dump | s | x criu |")
        print("|---|---:|---:|")
        print(f"| criu by hand | {c:.2f} | 1.00 |")
        print(f"| starter checkpoint | {s:.2f} | {s / c:.2f} |")
        print()
        print(f"image: {size / 2**20:.0f} MiB; `starter run --restore` to the job running: {restore_s:.2f} s")
        print(f"per round, starter - criu: {[round(a - b, 2) for a, b in zip(times['starter'], times['criu'])]} s")
    finally:
        for p in (job, restored):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run([STARTER, "gc"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        if not had_key:         # made by the first checkpoint, for this run only
            try:
                os.unlink(checkpoint_dir.KEY)
            except FileNotFoundError:
                pass


if __name__ == "__main__":
    main()
