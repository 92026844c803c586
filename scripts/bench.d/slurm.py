#!/usr/bin/env python3
"""starter under Slurm: what a private single-node Slurm costs to start, and what
starter adds to a step (srun starter run -- /bin/true versus srun /bin/true).

Run as root: `scripts/bench.d/slurm.py` (scripts/bench runs every file here).
Prints one table per proctrack plugin; the ratio column compares each row with its
peer (the plain srun step). Skips with a message when Slurm is not installed.
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))

from slurm import SlurmCluster, skip_reason  # noqa: E402

STARTER = os.path.join(REPO, ".venv", "bin", "starter")
STEPS = 15
STARTS = 3


def median_time(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check(r):
    if r.returncode != 0:
        raise SystemExit("step failed (exit %d): %s" % (r.returncode, r.stderr))


def bench(proctrack, base):
    rows = []
    starts = []
    for i in range(STARTS):
        with SlurmCluster(os.path.join(base, "%s-start%d" % (proctrack, i)),
                          proctrack=proctrack) as s:
            starts.append(s.startup_s)
    rows.append(("cluster start (munged+ctld+slurmd idle)", statistics.median(starts), None))

    state = os.path.join(base, "state-" + proctrack)
    os.mkdir(state)
    with SlurmCluster(os.path.join(base, proctrack), proctrack=proctrack) as s:
        plain = median_time(lambda: check(s.srun(["/bin/true"])), STEPS)
        rows.append(("srun /bin/true", plain, None))
        wrapped = median_time(lambda: check(s.srun(
            [STARTER, "run", "--state-dir", state, "--", "/bin/true"])), STEPS)
        rows.append(("srun starter run -- /bin/true", wrapped, plain))
    bare = median_time(lambda: check(subprocess.run(
        [STARTER, "run", "--state-dir", state, "--", "/bin/true"],
        capture_output=True, text=True)), STEPS)
    rows.append(("starter run -- /bin/true (no Slurm)", bare, plain))
    return rows


def main():
    reason = skip_reason()
    if reason:
        print("skipped: " + reason)
        return 0
    base = tempfile.mkdtemp(prefix="starter-bench-slurm-")
    try:
        for proctrack in ("linuxproc", "cgroup"):
            rows = bench(proctrack, base)
            print("\nproctrack/%s (median of %d steps, %d starts)" % (proctrack, STEPS, STARTS))
            print("%-44s %10s %8s" % ("", "ms", "ratio"))
            for name, secs, peer in rows:
                ratio = "%.2fx" % (secs / peer) if peer else ""
                print("%-44s %10.1f %8s" % (name, secs * 1000, ratio))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
