#!/usr/bin/env python3
"""What binding a job to CPUs (--cpuset) costs its start: `starter run
--net none -- /bin/true` with and without `--cpuset`, interleaved round by
round, the order alternating.  On v1 and hybrid hosts a bound job gets a
cgroup in the cpuset hierarchy too (a mkdir, two writes, a migration, an
rmdir); on v2 the cpuset controller is enabled for every job, and binding
costs two writes.

  plain    starter run --net none -- /bin/true
  cpuset   starter run --net none --cpuset <every CPU of this process> -- /bin/true

Both with STARTER_TRACE: the phases where the difference lands (cgroup,
attach, teardown) are printed beside the start-to-exit time.

Usage: .venv/bin/python scripts/bench.d/cpuset.py [--runs 60]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
PHASES = ("cgroup", "attach", "teardown")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _state import interleaved_pair, print_difference  # noqa: E402


def cpu_list():
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()
    state = tempfile.mkdtemp(prefix="starter-bench-cpuset-")
    env = {"PATH": "/usr/bin:/bin", "STARTER_STATE_DIR": f"{state}/run", "STARTER_TRACE": "1"}
    if os.environ.get("STARTER_POLICY"):     # a root caller's other policy file
        env["STARTER_POLICY"] = os.environ["STARTER_POLICY"]
    variants = {
        "plain": [STARTER, "run", "--net", "none", "--", "/bin/true"],
        "cpuset": [STARTER, "run", "--net", "none", "--cpuset", cpu_list(), "--", "/bin/true"],
    }
    phases = {k: {p: [] for p in PHASES} for k in variants}

    def trace(name, p):     # starter: trace <phase> <ms> ms
        for line in p.stderr.splitlines():
            w = line.split()
            if len(w) == 5 and w[1] == "trace" and w[2] in PHASES:
                phases[name][w[2]].append(float(w[3]))

    try:
        times, diffs = interleaved_pair(variants, args.runs, env, each=trace)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    plain = statistics.median(times["plain"])
    print(f"{args.runs} rounds, interleaved, order alternating; medians; --cpuset {cpu_list()}")
    print()
    print("| job | ms | x plain | " + " | ".join(f"{p} ms" for p in PHASES) + " |")
    print("|---|---:|---:|" + "---:|" * len(PHASES))
    for k in variants:
        m = statistics.median(times[k])
        ph = " | ".join(f"{statistics.median(phases[k][p]):.2f}" if phases[k][p] else "-" for p in PHASES)
        print(f"| {k} | {m * 1e3:.2f} | {m / plain:.2f} | {ph} |")
    print_difference("cpuset - plain", diffs)

if __name__ == "__main__":
    main()
