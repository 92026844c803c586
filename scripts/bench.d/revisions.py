#!/usr/bin/env python3
"""The same `starter run --net none -- /bin/true` from two git revisions,
interleaved round by round, the order alternating: what a change did to the
start, measured against the head before it (a refactoring must show no
difference beyond noise).

  revisions.py                    HEAD^ against HEAD
  revisions.py OLD..NEW [...]     each pair, one after the other

Each revision is checked out in a temporary worktree and set up there
(scripts/setup: its venv, native build and launcher), then removed.  Both
start through their own launcher as root, with STARTER_TRACE, so the table
gives the wall time and the starter's own (from its first line to its end),
in a state directory of the bench's own: an older revision keeps things
there that today's does not (its uid leases, once), and the node's default
state directory must be left as it was found (checked at the end).

Usage: .venv/bin/python scripts/bench.d/revisions.py [--runs 40] [OLD..NEW ...]
"""

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _state import check_node_state, interleaved_pair, node_state, print_difference, state_dir  # noqa: E402


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev, where, trees):
    """A set-up worktree of rev (made once per revision) -> its path."""
    sha = git("rev-parse", "--verify", rev + "^{commit}")
    if sha not in trees:
        path = os.path.join(where, sha[:12])
        git("worktree", "add", "--detach", path, sha)
        trees[sha] = path
        setup = subprocess.run([os.path.join(path, "scripts", "setup")], capture_output=True, text=True)
        if setup.returncode != 0:
            sys.exit(f"{rev}: scripts/setup failed: {setup.stderr.strip()[-500:]}")
    return trees[sha]


def own_ms(proc):
    """The starter's own time, from STARTER_TRACE's total line."""
    for line in proc.stderr.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[1] == "trace" and parts[2] == "total":
            return float(parts[3])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("pairs", nargs="*", default=["HEAD^..HEAD"])
    args = ap.parse_args()
    pairs = []
    for p in args.pairs:
        old, sep, new = p.partition("..")
        if not sep or not old or not new:
            sys.exit(f"revisions.py: {p!r}: give OLD..NEW")
        pairs.append((old, new))
    before = node_state()
    where = tempfile.mkdtemp(prefix="starter-bench-revisions-")
    trees = {}
    stack = contextlib.ExitStack()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "STARTER_TRACE": "1",
           "STARTER_STATE_DIR": state_dir(stack, "starter-bench-revisions-", tmpfs=False)}
    try:
        print(f"`starter run --net none -- /bin/true`, {args.runs} rounds a pair, interleaved, "
              "order alternating; medians")
        for old, new in pairs:
            variants = {}
            for rev in (old, new):
                variants[rev] = [os.path.join(checkout(rev, where, trees), ".venv", "bin", "starter"),
                                 "run", "--net", "none", "--", "/bin/true"]
            own = {old: [], new: []}
            times, diffs = interleaved_pair(variants, args.runs, env,
                                            each=lambda name, proc: own[name].append(own_ms(proc)))
            print()
            print(f"| {old}..{new} | wall ms | starter's own ms |")
            print("|---|---:|---:|")
            for rev in (old, new):
                print(f"| {rev} ({git('rev-parse', '--short', rev)}) | {statistics.median(times[rev]) * 1e3:.2f} | {statistics.median(own[rev]):.2f} |")
            print_difference(f"{new} - {old}, wall", diffs)
            if None not in own[old] + own[new]:
                print_difference(f"{new} - {old}, the starter's own",
                                 [(b - a) / 1e3 for a, b in zip(own[old], own[new])])
    finally:
        stack.close()
        for path in trees.values():
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(["git", "-C", ROOT, "worktree", "prune"], capture_output=True)
    check_node_state(before)


if __name__ == "__main__":
    main()
