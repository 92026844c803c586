#!/usr/bin/env python3
"""A user's `starter run` (through the set-user-ID launcher's relay and root
half, docs/design.md "Callers that are not root") side by side with root's,
interleaved round by round, the order alternating: start to exit of
`/bin/true` in fresh PID, network and mount namespaces.

  root    setpriv --reuid=0 ... starter run --net none --user 65534 -- /bin/true
  user    setpriv --reuid=65534 ... starter run --net none -- /bin/true

The same job as the same user (a named one: its escape check at the end is
the same), so only the way in differs: the relay's fork, the root half's
reset, the policy's checks and the caller's rights around its paths.

Both go through setpriv, so both pay the same extra exec.  The target
(issue: unprivileged callers) is the user's start at most the root start's
time.  Where no node policy exists, a temporary one (only its state_dir)
is written and removed after; an existing one is used as it is.

Usage: .venv/bin/python scripts/bench.d/callers.py [--runs 60]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
POLICY = "/etc/starter/starter.toml"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()
    state = tempfile.mkdtemp(prefix="starter-bench-callers-")
    made_policy = made_dir = False
    if not os.path.exists(POLICY):
        made_dir = not os.path.isdir("/etc/starter")
        os.makedirs("/etc/starter", 0o755, exist_ok=True)
        with open(POLICY, "w") as f:
            f.write(f'[defaults]\nstate_dir = "{state}/run"\n')
        os.chmod(POLICY, 0o644)
        made_policy = True
    # Both read the node policy (root's start too): the same state directory,
    # and nothing of the starter's own variables (a user's are refused).
    env = {"PATH": "/usr/bin:/bin"}
    variants = {
        # The same job as the same user (65534): only the caller differs.
        "root": ["setpriv", "--reuid=0", "--regid=0", "--keep-groups", STARTER, "run", "--net", "none",
                 "--user", "65534", "--", "/bin/true"],
        "user": ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", STARTER, "run", "--net",
                 "none", "--", "/bin/true"],
    }
    times = {k: [] for k in variants}
    diffs = []
    try:
        for i in range(args.runs + 5):
            order = list(variants) if i % 2 == 0 else list(variants)[::-1]
            got = {}
            for name in order:
                t = time.perf_counter()
                p = subprocess.run(variants[name], env=env, cwd="/", capture_output=True, text=True)
                got[name] = time.perf_counter() - t
                if p.returncode != 0:
                    sys.exit(f"{name}: exit {p.returncode}: {p.stderr.strip()}")
            if i >= 5:      # warm-up
                for k, v in got.items():
                    times[k].append(v)
                diffs.append(got["user"] - got["root"])
    finally:
        if made_policy:
            os.unlink(POLICY)
            if made_dir:
                os.rmdir("/etc/starter")
        shutil.rmtree(state, ignore_errors=True)
    root = statistics.median(times["root"])
    print(f"{args.runs} rounds, interleaved, order alternating; medians")
    print()
    print("| caller | ms | x root |")
    print("|---|---:|---:|")
    for k in variants:
        m = statistics.median(times[k])
        print(f"| {k} | {m * 1e3:.2f} | {m / root:.2f} |")
    q = statistics.quantiles(diffs, n=4)
    print()
    print(f"user - root, per round: median {statistics.median(diffs) * 1e3:+.2f} ms, "
          f"IQR {q[0] * 1e3:+.2f}..{q[2] * 1e3:+.2f} ms")


if __name__ == "__main__":
    main()
