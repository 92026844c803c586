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
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
POLICY = "/etc/starter/starter.toml"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _state import interleaved_pair, print_difference  # noqa: E402


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
    try:
        times, diffs = interleaved_pair(variants, args.runs, env)
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
    print_difference("user - root", diffs)

if __name__ == "__main__":
    main()
