"""scripts/soak N: N jobs, PARALLEL at a time, mixing --net nat, scratch
directories and limits; a random share of the starters is SIGKILLed at a
random moment, and `starter gc` runs now and then while jobs start.  At the
end gc runs once more and everything any job could have left is counted.

One summary line; exit 1 if anything was left, a job that was not killed was
refused or failed, or gc did not come clean.
"""

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
STARTER = os.path.join(REPO, ".venv", "bin", "starter")

from starter import cgroups  # noqa: E402
from starter.net import ipam  # noqa: E402


def main():
    ap = argparse.ArgumentParser(prog="scripts/soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", type=int)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--kill", type=float, default=0.1, help="share of starters SIGKILLed (default 0.1)")
    ap.add_argument("--nat", type=float, default=0.3, help="share of jobs with --net nat (default 0.3)")
    ap.add_argument("--scratch", type=float, default=0.5, help="share of jobs with a scratch (default 0.5)")
    ap.add_argument("--gc-every", type=float, default=2.0, help="seconds between concurrent `starter gc` runs (0: none)")
    ap.add_argument("--no-netd", action="store_true", help="NAT in-process instead of through netd")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--verbose", "-v", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("scripts/soak: run as root")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rnd = random.Random(seed)
    tag = f"{os.getpid():x}"
    work = tempfile.mkdtemp(prefix="starter-soak-")
    os.chmod(work, 0o755)
    state_dir = os.path.join(work, "state")
    ex = os.path.join(work, "exec")
    os.mkdir(ex, 0o755)
    pool = free_pool(rnd)
    env = dict(os.environ, STARTER_STATE_DIR=state_dir)
    env.pop("STARTER_FAULT", None)

    netd = None
    if not a.no_netd and a.nat > 0:
        os.makedirs(state_dir, 0o700, exist_ok=True)
        netd = subprocess.Popen([STARTER, "netd", "--state-dir", state_dir], env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(state_dir, "netd.sock")):
            if netd.poll() is not None or time.monotonic() > deadline:
                sys.exit("scripts/soak: netd did not come up")
            time.sleep(0.05)

    plan = []
    for i in range(a.jobs):
        args = [STARTER, "run", "--id", f"soak-{tag}-{i}", "--user", "nobody"]
        if rnd.random() < a.nat:
            args += ["--net", "nat", "--pool", pool]
        if rnd.random() < a.scratch:
            args += ["--execute-dir", ex]
        if rnd.random() < 0.5:
            args += ["--memory", rnd.choice(["64M", "256M", "1G"])]
        if rnd.random() < 0.5:
            args += ["--pids", str(rnd.choice([50, 200, 1000]))]
        if rnd.random() < 0.3:
            args += ["--cpus", rnd.choice(["0.5", "1", "2"])]
        nap = rnd.choice(["0", "0.01", "0.05", "0.2"])
        args += ["--", "/bin/sh", "-c", f"echo soak > f 2>/dev/null; sleep {nap} & sleep {nap}; wait"]
        kill_after = rnd.uniform(0.0, 0.4) if rnd.random() < a.kill else None
        plan.append((i, args, kill_after))

    counts = {"ok": 0, "killed": 0, "refused": 0, "failed": 0}
    problems = []
    lock = threading.Lock()
    todo = list(plan)
    stop_gc = threading.Event()
    gc_runs = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, args, kill_after = todo.pop(0)
            p = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
            if kill_after is not None:
                try:
                    p.wait(kill_after)
                except subprocess.TimeoutExpired:
                    p.kill()
            try:
                _, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            rc = p.returncode
            with lock:
                if rc == -9:
                    counts["killed"] += 1
                elif rc == 0:
                    counts["ok"] += 1
                elif rc == 125 and ("already running" in err or "being reclaimed" in err or "earlier run" in err):
                    counts["refused"] += 1
                    problems.append(f"job {i} refused: {err.strip()}")
                else:
                    counts["failed"] += 1
                    problems.append(f"job {i} rc {rc}: {err.strip()[-300:]}")
            if rc not in (0, -9) and " on stj" in err:
                # Which job's veth, and in what state (for the NAT layer's maintainers).
                ifname = err.split(" on stj", 1)[1].split()[0]
                info = subprocess.run(["ip", "-d", "-o", "link", "show", "dev", "stj" + ifname],
                                      capture_output=True, text=True)
                owner = [j for j in range(a.jobs) if ipam.job_key(f"soak-{tag}-{j}") == "stj" + ifname]
                with lock:
                    problems.append(f"  veth stj{ifname} (job {owner}): {(info.stdout or info.stderr).strip()[:400]}")

    def gc_loop():
        while not stop_gc.wait(a.gc_every):
            g = subprocess.run([STARTER, "gc", "--state-dir", state_dir], env=env, capture_output=True,
                               text=True, timeout=600)
            gc_runs.append(g.returncode)
            if a.verbose and g.stdout.strip():
                print(g.stdout.strip(), file=sys.stderr)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(a.parallel)]
    gct = threading.Thread(target=gc_loop) if a.gc_every > 0 else None
    for t in threads + ([gct] if gct else []):
        t.start()
    for t in threads:
        t.join()
    stop_gc.set()
    if gct:
        gct.join()
    wall = time.monotonic() - t0

    # The final gc must come clean in one go: the killed starters' jobs are
    # dead (their PID 1 had a parent-death signal), so nothing is still held.
    g = subprocess.run([STARTER, "gc", "--state-dir", state_dir], env=env, capture_output=True, text=True,
                       timeout=600)
    if g.returncode != 0:
        problems.append(f"final gc exit {g.returncode}: {g.stdout.strip()[-2000:]} {g.stderr.strip()[-500:]}")
    if netd is not None:
        netd.terminate()
        netd.wait(30)
        # netd may have finished deferred teardowns after the gc: once more.
        subprocess.run([STARTER, "gc", "--state-dir", state_dir], env=env, capture_output=True, timeout=600)

    leftovers = count_leftovers(state_dir, ex, [f"soak-{tag}-{i}" for i in range(a.jobs)])
    problems += leftovers
    n_left = len(leftovers)
    print(f"soak: jobs={a.jobs} parallel={a.parallel} ran={counts['ok']} killed={counts['killed']} "
          f"refused={counts['refused']} failed={counts['failed']} leftovers={n_left} "
          f"gc_during={len(gc_runs)} wall={wall:.1f}s seed={seed}")
    for p in problems[:30]:
        print(f"  {p}", file=sys.stderr)
    bad = n_left or counts["refused"] or counts["failed"] or g.returncode
    if not bad:
        shutil.rmtree(work, ignore_errors=True)
    else:
        with open(os.path.join(work, "problems.txt"), "w") as f:
            f.write("\n".join(problems) + "\n")
        print(f"  (all {len(problems)} in {work}/problems.txt)", file=sys.stderr)
    return 1 if bad else 0


def free_pool(rnd):
    """A /16 for the soak's jobs that no address on this host overlaps, outside
    the 10.216-247 range the tests draw their pools from (a test running at
    the same time would otherwise refuse our jobs, or we its)."""
    import ipaddress

    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = [ipaddress.ip_interface(line.split()[3]).network for line in out.splitlines() if " inet " in line]
    for _ in range(100):
        pool = ipaddress.ip_network(f"10.{180 + rnd.randrange(30)}.0.0/16")
        if not any(pool.overlaps(u) for u in used):
            return str(pool)
    sys.exit("scripts/soak: no free /16 in 10.180-209.0.0 for the jobs")


def count_leftovers(state_dir, ex, ids):
    left = []
    for root, _, files in os.walk(state_dir):
        left += [f"state: {os.path.join(root, f)}" for f in files if f != "netd.sock"]
    if os.path.isdir(ex):
        left += [f"scratch: {os.path.join(ex, n)}" for n in os.listdir(ex)]
    be = cgroups.open_backend()
    for j in ids:
        left += [f"cgroup: {p}" for p in be.job_paths(j).values() if os.path.exists(p)]
    keys = {ipam.job_key(j) for j in ids}
    left += [f"veth: {n}" for n in os.listdir("/sys/class/net") if n in keys]
    nft = subprocess.run(["nft", "list", "table", "inet", "starter"], capture_output=True, text=True).stdout
    left += [f"nft: {line.strip()}" for line in nft.splitlines() if any(k in line for k in keys)]
    return left


if __name__ == "__main__":
    sys.exit(main())
