#!/usr/bin/env python3
"""Teardown of a forking process tree: cgroup kill vs a /proc walker.

A tree of ~N processes that keeps forking and double-forking (setsid, so
the grandchildren are reparented away from the tree) is started in a job
cgroup capped by pids.max (so the storm can never hurt the machine), then
torn down by:

  cgroup kill     JobCgroup.kill(): cgroup.kill where the kernel has it
                  (one write, the kernel kills the tree atomically against forks)
  freezer loop    the v1 path: freeze, SIGKILL every listed pid, thaw, repeat
                  (only where v1 hierarchies with a freezer are mounted)
  /proc walk      psutil.Process(root).children(recursive=True), kill each,
                  a few rounds: what starters without cgroups do

and timed until the cgroup is empty; survivors are what the cgroup still
holds afterwards (they are then removed with cgroup kill).  Also: the
per-job cost of create(limits) + destroy() of an empty job cgroup.

Usage: .venv/bin/python scripts/bench.d/cgroups.py [--procs 3000] [--rounds 3]
"""

import argparse
import os
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from starter import cgroups  # noqa: E402
from starter.cgroups import Limits, files  # noqa: E402

TREE = textwrap.dedent(
    """
    import gc, os, random, time
    gc.freeze(); gc.disable()          # keep forked children's pages shared
    random.seed(os.getpid())
    while True:
        try:
            if os.fork() == 0:
                random.seed(os.getpid())
                continue               # the child grows the tree too
            if random.random() < 0.3:  # and now and then a setsid daemon
                mid = os.fork()
                if mid == 0:
                    os.setsid()
                    if os.fork() == 0:
                        random.seed(os.getpid())
                        continue
                    os._exit(0)
                os.waitpid(mid, 0)
        except OSError:
            pass                        # EAGAIN at pids.max: keep trying
        time.sleep(0.02 + random.random() * 0.05)
    """
)


# The same number of processes, all asleep: no fork storm competing for the
# CPUs while they are killed.
SLEEPERS = textwrap.dedent(
    """
    import os, sys, time
    for i in range(int(sys.argv[1]) - 1):
        if os.fork() == 0:
            break
    time.sleep(1000)
    """
)


def start_tree(cg, procs, timeout=120.0, code=TREE):
    p = subprocess.Popen(
        ["sh", "-c", 'read x; exec "$@"', "sh", sys.executable, "-c", code, str(int(procs * 0.97))],
        stdin=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    cg.add_pid(p.pid)
    p.stdin.write(b"go\n")
    p.stdin.close()
    target = int(procs * 0.97)
    end = time.monotonic() + timeout
    n = 0
    while time.monotonic() < end:
        n = files.read_int_or_none(os.path.join(cg.paths["pids"], "pids.current")) if "pids" in cg.paths else len(cg.pids())
        if n is None:
            n = len(cg.pids())
        if n >= target:
            break
        time.sleep(0.1)
    return p, len(cg.pids())


def wait_empty(cg, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cg.is_empty() and not cg.pids():
            return True
        time.sleep(0.001)
    return False


def run_cgroup_kill(be, procs, label, code=TREE):
    key = "".join(c if c.isalnum() else "_" for c in label)
    cg = be.create(f"bench-{os.getpid()}-{key}", Limits(pids=procs, memory_bytes=8 << 30))
    try:
        root, n = start_tree(cg, procs, code=code)
        t0 = time.monotonic()
        survivors = cg.kill(timeout=30)
        dt = time.monotonic() - t0
        root.wait()
        return dict(method=label, procs=n, ms=dt * 1000, survivors=len(survivors))
    finally:
        cg.destroy(timeout=30)


def run_proc_walk(be, procs, rounds):
    import psutil

    cg = be.create(f"bench-{os.getpid()}-walk", Limits(pids=procs, memory_bytes=8 << 30))
    try:
        root, n = start_tree(cg, procs)
        t0 = time.monotonic()
        for _ in range(rounds):
            try:
                r = psutil.Process(root.pid)
                victims = r.children(recursive=True) + [r]
            except psutil.NoSuchProcess:
                victims = []  # the root is dead: a /proc walker has nothing to start from
            for v in victims:
                try:
                    v.kill()
                except psutil.NoSuchProcess:
                    pass
            root.poll()
        dt = time.monotonic() - t0
        time.sleep(0.2)  # let the killed ones leave the cgroup
        survivors = len(cg.pids())
        return dict(method=f"/proc walk (psutil, {rounds} rounds)", procs=n, ms=dt * 1000, survivors=survivors,
                    note="time of the walk; the tree is NOT gone")
    finally:
        cg.kill(timeout=30)
        root.wait()
        cg.destroy(timeout=30)


def run_create_destroy(be, n=50):
    lim = Limits(memory_bytes=1 << 30, pids=1000, cpus=1.0)
    t0 = time.monotonic()
    for i in range(n):
        cg = be.create(f"bench-{os.getpid()}-cd{i}", lim)
        cg.destroy(prune=False)
    dt = (time.monotonic() - t0) / n
    be.prune()
    return dt * 1000


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=3000, help="pids.max of the tree's cgroup (default 3000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the /proc walker (default 3)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("cgroups bench: skipped (needs root)")
        return 0
    if not 10 <= args.procs <= 4000:
        ap.error("--procs must be in 10..4000 (the storm stays bounded)")
    parent = f"starter-bench-{os.getpid()}"  # private: another session's gc cannot touch it
    be = cgroups.open_backend(parent)
    rows = []
    try:
        label = "cgroup.kill" if be.supports_kill else "freeze+SIGKILL (cgroup2)"
        rows.append(run_cgroup_kill(be, args.procs, label))
        rows.append(run_cgroup_kill(be, args.procs, label + ", sleeping tree", code=SLEEPERS))
        rows[-1]["note"] = "same size, no fork storm"
        if be.kind == "hybrid" and "freezer" in be.layout.v1:
            v1 = cgroups.backend_for(be.layout.replace(kind="v1"), parent)
            rows.append(run_cgroup_kill(v1, args.procs, "v1 freezer loop"))
        try:
            rows.append(run_proc_walk(be, args.procs, args.rounds))
        except ImportError:
            rows.append(dict(method="/proc walk", procs=0, ms=float("nan"), survivors=-1, note="psutil missing"))
        per_job = run_create_destroy(be)
    finally:
        be.close()
    base = rows[0]["ms"]
    print(f"cgroups bench ({be.kind} host, {os.cpu_count()} cpus): teardown of a forking tree, pids.max={args.procs}")
    print("ms: from the first kill until the cgroup is empty (the /proc walker: until its last round)")
    print(f"{'method':34} {'procs':>6} {'ms':>9} {'x cgroup':>9} {'survivors':>10}")
    for r in rows:
        ratio = r["ms"] / base if base else float("nan")
        print(f"{r['method']:34} {r['procs']:6d} {r['ms']:9.1f} {ratio:9.2f} {r['survivors']:10d}  {r.get('note', '')}")
    print(f"create(limits)+destroy of an empty job cgroup: {per_job:.2f} ms per job ({be.kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
