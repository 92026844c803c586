#!/usr/bin/env python3
"""Teardown: the starter's time from "kill the job" to its report, against
the kernel's own time to empty the same cgroup tree.

The tree: a shell in the job's namespaces that starts N `sleep`s and says
"ready" on its stdout.  Alternately, round by round:

  kernel    the tree cloned into a cgroup2 cgroup as a job is (ns.spawn with
            the job's namespaces, mounts and seccomp filter, CLONE_INTO_CGROUP,
            the v1 hierarchies too); timed from a plain write of 1 to
            cgroup.kill to cgroup.events saying "populated 0" (poll for POLLPRI)
  starter   `starter run --net none -- sh ...`; timed from the kill signal
            (SIGQUIT: action kill) to the starter's exit, which comes after
            its cgroup is empty, measured, removed and its report written

The kernel's time is shown twice: to "populated 0", and to the job's main
process reaped.  The main process is PID 1 of the job's PID namespace, and
its exit status (which the report needs) exists only after the kernel has
reaped every other process of the namespace (zap_pid_ns_processes, ~10 us
each): that is the kernel's time to end the job.  overhead = starter - kernel
to reaped (median of the per-round differences), also as a share of it.  Survivors: every pid of the tree is checked after
each round (its /proc entry gone, or a different process); any survivor fails
the bench.  Needs cgroup.kill (a cgroup2 hierarchy, kernel >= 5.14).

Usage: .venv/bin/python scripts/bench.d/teardown.py [--runs 15] [--procs 200,1000]
"""

import argparse
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from starter import cgroups, ns  # noqa: E402

STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
PARENT = "starter_bench_teardown"
ENV = {"PATH": "/usr/bin:/bin"}


def tree_script(n):
    return f'i=0; while [ $i -lt {n} ]; do sleep 1000 & i=$((i+1)); done; echo ready; wait'


def _read_ready(fd, timeout=60):
    buf = b""
    deadline = time.monotonic() + timeout
    while b"ready" not in buf:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            raise RuntimeError("the tree did not say ready")
        chunk = os.read(fd, 64)
        if not chunk:
            raise RuntimeError("the tree exited before it was ready")
        buf += chunk


def _procs_of(cgdir):
    """(pid, start time) of every process in the cgroup tree."""
    out = []
    for dirpath, _, names in os.walk(cgdir):
        if "cgroup.procs" in names:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                for line in f:
                    pid = int(line)
                    out.append((pid, _start(pid)))
    return out


def _start(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError):
        return None


def _survivors(procs):
    return [pid for pid, st in procs if st is not None and _start(pid) == st]


_job_like = None


def job_like(backend):
    """What makes the tree the same as a `starter run --net none` job's: its
    namespaces, mount plan and seccomp filter (the filter alone makes each
    of a thousand exits measurably slower)."""
    global _job_like
    if _job_like is None:
        from starter import mounts as M, seccomp

        plan = tuple(M.cgroup_view(backend.view()) + M.private_dirs(65534, 65534, None)
                     + M.hide(("/run/starter",)))
        _job_like = {"namespaces": frozenset({"pid", "mnt", "ipc", "cgroup", "net"}), "mounts": plan,
                     "seccomp": seccomp.load("default")}
    return _job_like


def kernel_round(backend, n, k):
    """-> (seconds from the cgroup.kill write to populated 0, to the main
    process reaped, survivors)."""
    cg = backend.create(f"k{os.getpid()}-{k}")
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            spec = ns.ChildSpec(["/bin/sh", "-c", tree_script(n)], ENV, cgroup_fd=cg.clone_fd(),
                                uid=65534, gid=65534, stdio=(None, w, None), **job_like(backend))
            with ns.spawn(spec) as child:
                cg.add_pid(child.pid, cloned=True)
                child.release()
                child.wait_started()
                os.close(w)
                w = None
                _read_ready(r)
                procs = _procs_of(cg.paths["unified"])
                events = os.path.join(cg.paths["unified"], "cgroup.events")
                efd = os.open(events, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.pread(efd, 4096, 0)
                    p = select.poll()
                    p.register(efd, select.POLLPRI | select.POLLERR)
                    kfd = os.open(os.path.join(cg.paths["unified"], "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
                    t0 = time.perf_counter()
                    os.write(kfd, b"1")
                    while b"populated 0" not in os.pread(efd, 4096, 0):
                        p.poll(1000)
                    dt = time.perf_counter() - t0
                    os.close(kfd)
                finally:
                    os.close(efd)
                # The job's main process is PID 1 of its PID namespace: its exit
                # status comes only after the kernel has reaped every other
                # process of the namespace (zap_pid_ns_processes), ~10 us each.
                child.wait()
                dt_reaped = time.perf_counter() - t0
        finally:
            os.close(r)
            if w is not None:
                os.close(w)
        return dt, dt_reaped, _survivors(procs)
    finally:
        cg.destroy(prune=False)


def starter_round(n, k, state_dir):
    """-> (seconds from SIGQUIT to the starter's exit, survivors, report)."""
    job_id = f"benchtd{os.getpid()}-{k}"
    report = os.path.join(state_dir, f"{job_id}.report.json")
    r, w = os.pipe2(os.O_CLOEXEC)
    p = subprocess.Popen([STARTER, "run", "--net", "none", "--user", "nobody", "--id", job_id, "--report", report,
                          "--", "/bin/sh", "-c", tree_script(n)], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    try:
        _read_ready(r)
        be = cgroups.open_backend()
        procs = _procs_of(be.job_paths(job_id)["unified"])
        t0 = time.perf_counter()
        os.kill(p.pid, 3)  # SIGQUIT: the kill action
        p.wait()
        dt = time.perf_counter() - t0
    finally:
        os.close(r)
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read().decode().strip()
    p.stderr.close()
    if not os.path.exists(report):
        raise RuntimeError(f"no report from the starter: {err}")
    os.unlink(report)
    return dt, _survivors(procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--procs", default="200,1000")
    args = ap.parse_args()
    backend = cgroups.open_backend(PARENT)
    if not backend.supports_kill:
        print("teardown: skipped: this kernel has no cgroup.kill to compare against")
        return
    print(f"kill to empty (kernel: write cgroup.kill + poll) vs kill to report (starter run), "
          f"median of {args.runs} rounds, alternately; load {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print(f"{'processes':>10} {'kernel: empty':>14} {'+ reaped':>9} {'starter':>9} "
          f"{'overhead':>9} {'overhead':>9} {'survivors':>10}")
    print(f"{'':>10} {'ms':>14} {'ms':>9} {'ms':>9} {'ms':>9} {'':>9}")
    state_dir = tempfile.mkdtemp(prefix="starter-bench-teardown-")
    try:
        for n in (int(x) for x in args.procs.split(",")):
            kt, kr, st, diffs, survivors = [], [], [], [], 0
            for i in range(args.runs + 1):
                rounds = (("k", kernel_round), ("s", starter_round))
                res = {}
                for name, fn in (rounds if i % 2 == 0 else rounds[::-1]):
                    if name == "k":
                        res[name] = fn(backend, n, i)
                    else:
                        res[name] = fn(n, i, state_dir)
                survivors += len(res["k"][2]) + len(res["s"][1])
                if i == 0:
                    continue  # warm-up
                kt.append(res["k"][0])
                kr.append(res["k"][1])
                st.append(res["s"][0])
                diffs.append(res["s"][0] - res["k"][1])
            k, r, s, d = (statistics.median(x) for x in (kt, kr, st, diffs))
            print(f"{n:>10} {k * 1000:14.2f} {r * 1000:9.2f} {s * 1000:9.2f} {d * 1000:9.2f} "
                  f"{d / r * 100:8.1f}% {survivors:>10}")
            if survivors:
                raise SystemExit(f"teardown: {survivors} processes survived the kill")
    finally:
        backend.prune()
        os.rmdir(state_dir)
    print("target: overhead at most 5% of the kernel's time (to reaped), zero survivors")


if __name__ == "__main__":
    main()
