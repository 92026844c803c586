"""What more than one bench section needs (not a section itself:
scripts/bench runs only the files whose names do not start with "_")."""

import os
import shutil
import subprocess
import tempfile

# The node's default state directory and its uid and project leases: a
# section that runs jobs in a state directory of its own leaves them as it
# found them (check_node_state).
NODE_STATE = ("/run/starter", "/run/starter-uids", "/run/starter-projects")


def state_dir(stack, prefix, tmpfs):
    """A state directory of the bench's own under /run, removed at the end
    with the filter cache beside it.  tmpfs: on a tmpfs of its own, as /run
    is on a node; where it is not (this development host: one ext4 volume),
    that shows the difference a disk makes.  Unmounted at the end."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/run")
    stack.callback(shutil.rmtree, path, True)
    stack.callback(shutil.rmtree, path + ".seccomp", True)
    if tmpfs:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=64m", "starter-bench", path], check=True)
        stack.callback(subprocess.run, ["umount", "-l", path], check=False)
    return path


def node_state():
    """Every path below NODE_STATE, at any depth."""
    found = set()
    for top in NODE_STATE:
        for root, dirs, files in os.walk(top):
            found |= {os.path.join(root, n) for n in dirs + files}
    return found


def check_node_state(before):
    """Exit, naming them, if paths below NODE_STATE appeared since `before`
    (node_state()): the bench leaked into the node's state."""
    import sys

    left = sorted(node_state() - before)
    if left:
        sys.exit(f"the bench left these in the node's state: {', '.join(left)}")


def interleaved_pair(variants, runs, env, warmup=5, each=None):
    """Run two commands (variants: {name: argv}, base first) once a round,
    the order alternating, `runs` rounds after `warmup`; each(name, proc)
    sees every measured run.  -> ({name: [seconds]}, [second - base per
    round]).  Exits on a failed run, with its stderr."""
    import sys
    import time

    base, other = list(variants)
    times = {k: [] for k in variants}
    diffs = []
    for i in range(runs + warmup):
        got = {}
        for name in (base, other) if i % 2 == 0 else (other, base):
            t = time.perf_counter()
            p = subprocess.run(variants[name], env=env, cwd="/", capture_output=True, text=True)
            got[name] = time.perf_counter() - t
            if p.returncode != 0:
                sys.exit(f"{name}: exit {p.returncode}: {p.stderr.strip()}")
            if i >= warmup and each is not None:
                each(name, p)
        if i >= warmup:
            for k, v in got.items():
                times[k].append(v)
            diffs.append(got[other] - got[base])
    return times, diffs


def print_difference(label, diffs):
    """The per-round difference's median and interquartile range."""
    import statistics

    q = statistics.quantiles(diffs, n=4)
    print()
    print(f"{label}, per round: median {statistics.median(diffs) * 1e3:+.2f} ms, "
          f"IQR {q[0] * 1e3:+.2f}..{q[2] * 1e3:+.2f} ms")
