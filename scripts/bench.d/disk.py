#!/usr/bin/env python3
"""What --disk costs a job: `starter run --execute-dir D` with and without
`--disk 64M`, interleaved round by round (same node, same load), through
the real `starter` command.

Two jobs: `true` (the setup and teardown alone) and one that writes 32 MiB
into its scratch (the teardown then also writes back what the job left in
the image's page cache, or removes the files from the plain scratch).  Per
pair: the median wall time of the whole `starter run`, the median of the
per-round differences, and from STARTER_TRACE the `disk` phase (scratch,
image, mkfs, loop device, mount) and the `teardown` phase.

Usage: .venv/bin/python scripts/bench.d/disk.py [--rounds 21]
"""

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))

from _state import state_dir  # noqa: E402


def run(args, env):
    t = time.perf_counter()
    p = subprocess.run([STARTER, "run", *args], env=env, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"disk bench: starter run failed ({p.returncode}): {p.stderr.strip()}")
    phases = {}
    for line in p.stderr.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[:2] == ["starter:", "trace"] and parts[4] == "ms":
            phases[parts[2]] = float(parts[3])
    return wall * 1000, phases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    a = ap.parse_args()
    ex = tempfile.mkdtemp(prefix="starter-bench-disk-", dir="/var/lib")
    os.chmod(ex, 0o755)
    try:
        with contextlib.ExitStack() as stack:
            sd = state_dir(stack, "starter-bench-disk-", tmpfs=False)
            env = dict(os.environ, STARTER_STATE_DIR=sd, STARTER_TRACE="1")
            base = ["--user", "nobody", "--execute-dir", ex]
            jobs = [("true", ["--", "true"]),
                    ("write 32 MiB", ["--", "sh", "-c", "dd if=/dev/zero of=f bs=1M count=32 2>/dev/null"])]
            print(f"{'job':14} {'':9} {'wall ms':>9} {'disk ms':>8} {'teardown ms':>12}")
            for name, cmd in jobs:
                got = {False: [], True: []}
                run(base + cmd, env)        # warm: the page cache, the images directory
                for _ in range(a.rounds):
                    for disk in (False, True):
                        got[disk].append(run(base + (["--disk", "64M"] if disk else []) + cmd, env))
                for disk in (False, True):
                    walls = [w for w, _ in got[disk]]
                    dphase = statistics.median(p.get("disk", 0.0) for _, p in got[disk])
                    tphase = statistics.median(p.get("teardown", 0.0) for _, p in got[disk])
                    label = "--disk 64M" if disk else "plain"
                    print(f"{name:14} {label:9} {statistics.median(walls):9.2f} {dphase:8.2f} {tphase:12.2f}")
                diff = statistics.median(d[0] - p[0] for d, p in zip(got[True], got[False]))
                plain = statistics.median(w for w, _ in got[False])
                print(f"{name:14} {'added':9} {diff:9.2f}   (x{(plain + diff) / plain:.2f} of plain; "
                      f"median of {a.rounds} per-round differences)")
    finally:
        shutil.rmtree(ex)
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("disk bench: run as root")
    sys.exit(main())
