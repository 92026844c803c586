#!/usr/bin/env python3
"""Start-to-exit latency of a job in pid+net+mnt namespaces, and the memory
the starter keeps beside a running job.

  ns.spawn (in process)   spawn + release + wait_started + wait of /bin/true,
                          measured inside one Python process (the shim's cost)
  starter run             the whole command: `starter run --net none -- /bin/true`
  seccomp filter          its cost per job: the profile read, parsed and compiled
                          (in process), ns.spawn with and without it, and
                          `starter run` with the default filter and with
                          `--seccomp off`, run alternately in pairs
  unshare                 unshare -pnm --fork --mount-proc true      (the reference)
  bwrap                   bwrap --unshare-pid --unshare-net --dev-bind / / --proc /proc true
  crun / runc             an OCI bundle (tiny rootfs: /usr bound read-only), pid+net+mnt
  python -c pass          the interpreter start-up every `starter run` pays

Commands are timed with hyperfine -N (no shell) where installed, else with a
loop here; medians, and ratios to unshare.  Then the PSS (smaps_rollup) of
the starter process beside `starter run -- sleep 5`.

Usage: .venv/bin/python scripts/bench.d/core.py [--runs 100]
Cleans up after itself: the bundle directory, the runtimes' containers and
cgroups (named starter_bench_core*).
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

from starter import ns  # noqa: E402

STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
CG_NAME = "starter_bench_core"
ENV = {"PATH": "/usr/bin:/bin"}


def bench_spawn(runs, **kw):
    spec = ns.ChildSpec(["/bin/true"], ENV, **kw)
    times = []
    for i in range(runs + 5):
        t = time.perf_counter()
        with ns.spawn(spec) as child:
            child.release()
            child.wait_started()
            status = child.wait()
        dt = time.perf_counter() - t
        assert status == 0, status
        if i >= 5:  # warm-up
            times.append(dt)
    return statistics.median(times)


def bench_seccomp_compile(runs):
    """Median seconds to read, parse and compile the default profile, as every
    job does (no memo)."""
    from starter import seccomp

    times = []
    for i in range(runs + 5):
        t = time.perf_counter()
        seccomp.compile_bytes(seccomp._read_profile(seccomp.DEFAULT), "default")
        if i >= 5:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_spawn_pairs(runs, filt):
    """ns.spawn of /bin/true with and without the filter, alternately: median
    of the per-round difference (the shim's install + the kernel's checks)."""
    specs = (ns.ChildSpec(["/bin/true"], ENV, seccomp=filt), ns.ChildSpec(["/bin/true"], ENV))
    diffs = []
    for i in range(runs + 5):
        t = []
        for spec in specs if i % 2 == 0 else specs[::-1]:
            t0 = time.perf_counter()
            with ns.spawn(spec) as child:
                child.release()
                child.wait_started()
                child.wait()
            t.append((spec.seccomp is not None, time.perf_counter() - t0))
        if i >= 5:
            d = dict(t)
            diffs.append(d[True] - d[False])
    return statistics.median(diffs)


LOAD_SCRIPT = """
import sys, time
sys.path[:0] = [{root!r}, {site!r}]
from starter import _native
t = time.perf_counter()
from starter import seccomp
seccomp.load("default", False, {state!r})
print(time.perf_counter() - t)
"""


def bench_load_fresh(runs):
    """What a job start pays on the Python side with a cached profile: import
    starter.seccomp, read and hash the profile, read the cache file; in a
    fresh interpreter each time, as `starter run` is."""
    import sysconfig

    state = os.environ.get("STARTER_STATE_DIR") or "/run/starter"
    code = LOAD_SCRIPT.format(root=ROOT, site=sysconfig.get_paths()["purelib"], state=state)
    py = os.path.join(ROOT, ".venv", "bin", "python")
    times = []
    for i in range(runs + 2):
        out = subprocess.run([py, "-IS", "-c", code], check=True, capture_output=True, text=True).stdout
        if i >= 2:  # the first fills the cache
            times.append(float(out))
    return statistics.median(times)


def bench_pairs(a, b, runs):
    """Run argv a and b alternately (order flipped every round, so drift and
    noise on this shared machine hit both alike): medians of a, of b, and of
    the per-round difference a - b."""
    ta, tb = [], []
    for i in range(runs + 5):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for argv, out in order:
            t = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            if i >= 5:
                out.append(time.perf_counter() - t)
    diff = statistics.median(x - y for x, y in zip(ta, tb))
    return statistics.median(ta), statistics.median(tb), diff


def bench_cmd(argv, runs, hide_unified=False, env=None):
    """Median seconds of argv, via hyperfine -N if available.

    hide_unified: run the timing inside a mount namespace whose
    /sys/fs/cgroup/unified is covered by an empty tmpfs.  crun refuses hybrid
    hosts whose cgroup2 has any controller ("drop all controllers from
    cgroupv2"); it then sees a plain v1 host.  Nothing changes on the host."""
    hf = shutil.which("hyperfine")
    if hf:
        with tempfile.NamedTemporaryFile(suffix=".json", dir=os.path.join(ROOT, "build")
                                         if os.path.isdir(os.path.join(ROOT, "build")) else None) as out:
            cmd = [hf, "-N", "--warmup", "5", "--runs", str(runs), "--style", "none",
                   "--export-json", out.name, " ".join(argv)]
            if hide_unified:
                rc = _run_hiding_unified(cmd)
            else:
                rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=env).returncode
            if rc != 0:
                r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                raise RuntimeError((r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1])
            return json.load(open(out.name))["results"][0]["median"]
    times = []
    for i in range(runs + 5):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
        if i >= 5:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _run_hiding_unified(cmd):
    from starter.mounts import Mount

    null = os.open(os.devnull, os.O_WRONLY)
    try:
        spec = ns.ChildSpec(cmd, dict(os.environ), cwd=os.getcwd(), namespaces=frozenset({"mnt"}),
                            mounts=(Mount("tmpfs", "/sys/fs/cgroup/unified", options="size=4k"),),
                            private_tmp=False, drop_privileges=False, stdio=(None, null, null))
        with ns.spawn(spec) as child:
            child.release()
            child.wait_started()
            return ns.exit_code(child.wait())
    finally:
        os.close(null)


def make_bundle(tmp, runtime):
    """An OCI bundle: rootfs with /usr bound read-only and the merged-usr
    links, args /bin/true, no terminal, namespaces pid/net/mnt only."""
    bundle = os.path.join(tmp, runtime)
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(rootfs)
    for d in ("usr", "proc", "dev", "sys", "tmp", "etc"):
        os.mkdir(os.path.join(rootfs, d))
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + link):
            os.symlink(os.readlink("/" + link), os.path.join(rootfs, link))
    subprocess.run([runtime, "spec"], cwd=bundle, check=True)
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["process"]["args"] = ["/bin/true"]
    cfg["process"]["terminal"] = False
    cfg.pop("hostname", None)  # no uts namespace here
    cfg["root"] = {"path": "rootfs", "readonly": True}
    cfg["mounts"].append({"destination": "/usr", "type": "bind", "source": "/usr",
                          "options": ["rbind", "ro", "nosuid", "nodev"]})
    cfg["linux"]["namespaces"] = [{"type": t} for t in ("pid", "network", "mount")]
    # Relative: under the runtime's own cgroup, in a subtree we remove after.
    cfg["linux"]["cgroupsPath"] = f"{CG_NAME}/{runtime}"
    with open(path, "w") as f:
        json.dump(cfg, f)
    return bundle


def _hybrid_with_controllers():
    try:
        with open("/sys/fs/cgroup/unified/cgroup.controllers") as f:
            return bool(f.read().split())
    except OSError:
        return False


def remove_bench_cgroups():
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup", topdown=False):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if CG_NAME in p:
                try:
                    os.rmdir(p)
                except OSError:
                    pass


def pss_beside_sleep():
    """kB of PSS of the starter process while its job sleeps; None if the CLI
    does not run."""
    p = subprocess.Popen([STARTER, "run", "--", "sleep", "5"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and p.poll() is None:
            kids = _children(p.pid)
            if kids and any(_comm(k) == "sleep" for k in _descendants(p.pid)):
                break
            time.sleep(0.05)
        if p.poll() is not None:
            return None, p.stderr.read().decode().strip()
        time.sleep(0.3)
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]), None
        return None, "no Pss line"
    finally:
        if p.poll() is None:
            p.wait(timeout=30)
        p.stderr.close()


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _descendants(pid):
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    rows = []  # (name, seconds or None, note)

    rows.append(("ns.spawn /bin/true (in process)", bench_spawn(args.runs), ""))
    rows.append(("ns.spawn, init mode (in process)", bench_spawn(args.runs, init=True), ""))
    from starter import seccomp

    filt = seccomp.load("default")
    rows.append(("ns.spawn + default filter (in process)", bench_spawn(args.runs, seccomp=filt), ""))
    sc_rows = [("seccomp: read+parse+compile default", bench_seccomp_compile(args.runs),
                f"{len(filt.bpf) // 8} BPF instructions; only on a cache miss"),
               ("seccomp: load, cached, fresh process", bench_load_fresh(min(args.runs, 50)),
                "import + read + hash + cache file"),
               ("ns.spawn + filter - ns.spawn (paired)", bench_spawn_pairs(args.runs, filt),
                "install in the child + filtered exec")]
    if os.access(STARTER, os.X_OK):
        run_off = [STARTER, "run", "--net", "none", "--seccomp", "off", "--", "/bin/true"]
        run_on = [STARTER, "run", "--net", "none", "--", "/bin/true"]
        on, off, diff = bench_pairs(run_on, run_off, args.runs)
        sc_rows += [("starter run (default filter), paired", on, ""),
                    ("starter run --seccomp off, paired", off, ""),
                    ("  filter cost per job (paired diff)", diff, "target: at most 1 ms")]

    tmp = tempfile.mkdtemp(prefix="starter-bench-core-")
    try:
        cmds = []  # (name, argv, env)
        if os.access(STARTER, os.X_OK):
            run_true = [STARTER, "run", "--net", "none", "--", "/bin/true"]
            cmds.append(("starter run --net none", run_true, None))
            if os.environ.get("PYTHONDONTWRITEBYTECODE"):
                # This environment compiles every module on every start;
                # an installed starter has its .pyc files.
                env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
                env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
                cmds.append(("starter run, .pyc cached", run_true, env))
        cmds += [
            ("unshare -pnm --fork --mount-proc", ["unshare", "-pnm", "--fork", "--mount-proc", "true"], None),
            ("bwrap", ["bwrap", "--unshare-pid", "--unshare-net", "--dev-bind", "/", "/",
                       "--proc", "/proc", "true"], None),
        ]
        for rt in ("crun", "runc"):
            if shutil.which(rt):
                bundle = make_bundle(tmp, rt)
                cmds.append((f"{rt} run", [rt, "run", "--bundle", bundle, f"{CG_NAME}-{rt}"], None))
        cmds.append(("python3 -c pass", ["/usr/bin/python3", "-c", "pass"], None))
        for name, argv, env in cmds:
            if not shutil.which(argv[0]) and not os.access(argv[0], os.X_OK):
                rows.append((name, None, "not installed"))
                continue
            hide = argv[0] == "crun" and _hybrid_with_controllers()
            try:
                rows.append((name, bench_cmd(argv, args.runs, hide, env),
                             "cgroup v1 view (crun refuses this hybrid)" if hide else ""))
            except (RuntimeError, subprocess.CalledProcessError) as e:
                rows.append((name, None, f"failed: {e}"))
    finally:
        for rt in ("crun", "runc"):
            if shutil.which(rt):
                subprocess.run([rt, "delete", "--force", f"{CG_NAME}-{rt}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
        remove_bench_cgroups()

    ref = next((t for n, t, _ in rows if n.startswith("unshare") and t), None)
    print(f"start-to-exit of /bin/true in pid+net+mnt namespaces, median of {args.runs}")
    print(f"{'':36} {'median ms':>10} {'x unshare':>10}")
    for name, t, note in rows:
        if t is None:
            print(f"{name:36} {'-':>10} {'':>10}  {note}")
            continue
        ratio = f"{t / ref:.2f}" if ref else "-"
        print(f"{name:36} {t * 1000:10.2f} {ratio:>10}  {note}")
    print("target: starter run at or under 15 ms")
    print()
    print("syscall filter (rows run alternately, in pairs)")
    for name, t, note in sc_rows:
        print(f"{name:36} {t * 1000:10.2f} {'':>10}  {note}")

    if os.access(STARTER, os.X_OK):
        pss, err = pss_beside_sleep()
        print()
        if pss is None:
            print(f"PSS of the starter beside `starter run -- sleep 5`: n/a ({err})")
        else:
            print(f"PSS of the starter beside `starter run -- sleep 5`: {pss / 1024:.1f} MB "
                  f"(target < 10 MB)")


if __name__ == "__main__":
    main()
