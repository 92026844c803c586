#!/usr/bin/env python3
"""Jobs across nodes (--net job): the start cost of a job's part of its
network across nodes, and the throughput between two nodes' parts.

Everything runs on a cluster of network namespaces (tests/nethosts.py:
Fabric, 2 nodes on a bridge; a starter runs "on" node i by running in its
namespace, with node i's state directory) and is removed at the end.
Traffic goes only between those namespaces.

  start            `starter run --net nat -- /bin/true` against `starter run
                   --net job --peers <the fabric> --node n1 --net-id <new
                   each round> -- /bin/true` on node 1, interleaved round by
                   round (the order alternating), --rounds, the same state
                   directory for both: wall time of each (median, IQR) and of
                   the difference per round (job - nat), and the same of the
                   setup alone (STARTER_TRACE's phases up to "running": the
                   issue's target, +20 ms at most; the whole run adds the
                   part's end: its init's PID namespace, its /dev/shm).  Twice: with `starter netd` running on node 1 (a
                   node as deployed) and without it (the starter does the
                   work itself)
  iperf3           TCP between two nodes, --iperf-seconds, --iperf-rounds,
                   the two variants interleaved round by round:
                     job     both nodes' parts of one job: the server
                             (`iperf3 -s -1`) a job on n2, the client
                             (`iperf3 -c n2`, by its name in the job's
                             /etc/hosts) a job on n1: through vx0 (VXLAN,
                             MTU 50 below the fabric's) on both ends
                     bare    iperf3 in the node namespaces themselves, n1 to
                             n2's fabric address: the reference
                   Median Gbit/s (receiver) of each, job/bare (target: at
                   least 0.90).  Per job round, what the client part's report
                   counted as sent to n2 (network.overlay.peers.n2.out.bytes)
                   over what iperf3 says it sent (end.sum_sent.bytes): a
                   little above 1, the counters count the IP and TCP headers
                   (and iperf3's control connection) too

At the end: no process of the bench left, and nethosts.fabric_leftovers()
of the fabric printed (must be {}).

Usage: .venv/bin/python scripts/bench.d/multinode.py [--rounds 30] [--iperf-rounds 5] [--iperf-seconds 3]
                                                    [--skip-iperf]
"""

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _state  # noqa: E402
import nethosts  # noqa: E402
from starter.state import store  # noqa: E402

STARTER = os.path.join(REPO, ".venv", "bin", "starter")
IPERF3 = "/usr/bin/iperf3"
WARMUP = 3


def ms(x):
    return f"{1000 * x:.1f}"


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


class Bench:
    def __init__(self, fab, root):
        self.fab, self.root = fab, root
        self._net_id = 1000 + secrets.randbelow(10**7)
        self._port = 20000 + secrets.randbelow(20000)
        self.ports = []             # every iperf3 port used: the leftover check looks for them
        self.netds = {}

    def net_id(self):
        """A job network id no earlier round used: never 'already has a part'."""
        self._net_id += 1
        return str(self._net_id)

    def port(self):
        self._port += 1
        self.ports.append(self._port)
        return self._port

    def job_args(self, i, net_id, *extra):
        fab = self.fab
        return [STARTER, "run", "--state-dir", fab.state_dirs[i - 1], "--net", "job", "--peers", fab.peers,
                "--node", f"n{i}", "--net-id", net_id, *extra]

    # -- netd ----------------------------------------------------------------
    def start_netd(self, i):
        sd = self.fab.state_dirs[i - 1]
        sock = os.path.join(sd, "netd.sock")
        p = subprocess.Popen(self.fab.argv(i, STARTER, "netd", "--state-dir", sd), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.netds[i] = p
        for _ in range(1000):
            if os.path.exists(sock):
                return
            if p.poll() is not None:
                raise RuntimeError(f"netd on n{i} ended: {p.stderr.read()}")
            time.sleep(0.01)
        raise RuntimeError(f"netd on n{i} did not start")

    def stop_netds(self):
        for i, p in list(self.netds.items()):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                _out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                _out, err = p.communicate()
            if err.strip():
                print(f"  (netd on n{i} said: {err.strip()})")
            del self.netds[i]

    # -- start cost ------------------------------------------------------------
    def starts(self, rounds):
        """--net nat vs --net job on n1, interleaved -> ({label: [s]}, [job - nat per round],
        {label: [setup s]}, [setup job - nat per round]): wall time, and the
        setup alone (STARTER_TRACE's phases up to "running": the job runs)."""
        sd = self.fab.state_dirs[0]
        times, diffs = {"nat": [], "job": []}, []
        setups, setup_diffs = {"nat": [], "job": []}, []
        env = dict(os.environ, STARTER_TRACE="1")
        for r in range(rounds + WARMUP):
            got, setup = {}, {}
            for label in ("nat", "job") if r % 2 == 0 else ("job", "nat"):
                argv = ([STARTER, "run", "--state-dir", sd, "--net", "nat"] if label == "nat"
                        else self.job_args(1, self.net_id()))
                argv = self.fab.argv(1, *argv, "--", "/bin/true")
                t0 = time.monotonic()
                p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
                got[label] = time.monotonic() - t0
                if p.returncode != 0:
                    raise RuntimeError(f"starter run --net {label} failed ({p.returncode}): {p.stderr.strip()}")
                setup[label] = setup_s(p.stderr)
            if r >= WARMUP:
                for k, v in got.items():
                    times[k].append(v)
                    setups[k].append(setup[k])
                diffs.append(got["job"] - got["nat"])
                setup_diffs.append(setup["job"] - setup["nat"])
        return times, diffs, setups, setup_diffs

    # -- iperf3 ------------------------------------------------------------------
    def iperf_bare(self, seconds):
        """-> (Gbit/s received, bytes sent)."""
        port = self.port()
        srv = subprocess.Popen(self.fab.argv(2, IPERF3, "-s", "-1", "-p", str(port)), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_listening(srv, port)
            r = subprocess.run(self.fab.argv(1, IPERF3, "-c", self.fab.addrs[1], "-p", str(port),
                                             "-t", str(seconds), "-J"),
                               capture_output=True, text=True, timeout=seconds + 60)
            end = iperf_end(r)
            srv.wait(timeout=30)
            return end["sum_received"]["bits_per_second"] / 1e9, end["sum_sent"]["bytes"]
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.wait()

    def iperf_job(self, seconds):
        """-> (Gbit/s received, bytes sent, bytes the client part counted out to n2)."""
        port = self.port()
        net_id = self.net_id()
        report = os.path.join(self.root, f"report-{net_id}.json")
        srv = self.fab.popen(2, *self.job_args(2, net_id), "--", IPERF3, "-s", "-1", "-p", str(port))
        try:
            wait_listening(srv, port, IPERF3)
            r = subprocess.run(self.fab.argv(1, *self.job_args(1, net_id, "--report", report), "--",
                                             IPERF3, "-c", "n2", "-p", str(port), "-t", str(seconds), "-J"),
                               capture_output=True, text=True, timeout=seconds + 120)
            end = iperf_end(r)
            out, err = srv.communicate(timeout=60)
            if srv.returncode != 0:
                raise RuntimeError(f"the server's part ended {srv.returncode}: {err.strip()}")
            with open(report) as f:
                counted = json.load(f)["network"]["overlay"]["peers"]["n2"]["out"]["bytes"]
            return end["sum_received"]["bits_per_second"] / 1e9, end["sum_sent"]["bytes"], counted
        finally:
            if srv.poll() is None:
                srv.terminate()
                srv.communicate(timeout=60)

    def iperf(self, rounds, seconds):
        out = {"bare": [], "job": [], "counted/sent": []}
        for r in range(rounds):
            for label in ("bare", "job") if r % 2 == 0 else ("job", "bare"):
                if label == "bare":
                    gbit, _sent = self.iperf_bare(seconds)
                else:
                    gbit, sent, counted = self.iperf_job(seconds)
                    out["counted/sent"].append((counted, sent))
                out[label].append(gbit)
        return out


def setup_s(stderr):
    """STARTER_TRACE's phases from the starter's first line to "running"
    (its interpreter's start left out: the same for both) -> seconds."""
    total = 0.0
    for line in stderr.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[:2] == ["starter:", "trace"] and parts[2] != "interpreter":
            total += float(parts[3]) / 1000
            if parts[2] == "running":
                return total
    raise RuntimeError("no STARTER_TRACE phases up to running in: " + stderr[-500:])


def iperf_end(r):
    """iperf3 -J's "end" object, or an error with what it said."""
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise RuntimeError(f"iperf3 client: exit {r.returncode}: {r.stdout[-500:]} {r.stderr[-500:]}") from None
    if "error" in doc or r.returncode != 0:
        raise RuntimeError(f"iperf3 client: exit {r.returncode}: {doc.get('error')} {r.stderr[-500:]}")
    return doc["end"]


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def listening(pid, port):
    """Whether the network namespace of pid has a TCP socket listening on port."""
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_listening(proc, port, exe=None, timeout=30):
    """Until proc (or, with exe, its descendant running exe: the job) listens
    on port in its namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"iperf3 server ended ({proc.returncode}) before it listened: {err.strip()}")
        pids = [proc.pid] if exe is None else [p for p in descendants(proc.pid) if _exe(p) == exe]
        if any(listening(p, port) for p in pids):
            return
        time.sleep(0.02)
    raise RuntimeError(f"iperf3 server did not listen on {port}")


def _exe(pid):
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def bench_processes(root, ports):
    """Processes still running that are the bench's: a starter or netd of
    its state root, an iperf3 on one of its ports."""
    ports = {str(p) for p in ports}
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if any(root in a for a in argv) or (any(a.endswith("iperf3") for a in argv[:1])
                                            and "-p" in argv and argv[argv.index("-p") + 1] in ports):
            found.append((int(d), " ".join(argv)))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--iperf-rounds", type=int, default=5)
    ap.add_argument("--iperf-seconds", type=int, default=3)
    ap.add_argument("--skip-iperf", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("multinode bench: run as root")

    before = _state.node_state()
    root = tempfile.mkdtemp(prefix="starter-bench-multinode-", dir="/run")
    starts, tp, leftovers, left_procs = {}, None, None, None
    try:
        with nethosts.fabric(2, root) as fab, contextlib.ExitStack() as stack:
            b = Bench(fab, root)
            stack.callback(b.stop_netds)
            for sd in fab.state_dirs:
                os.makedirs(sd, exist_ok=True)
            starts["without netd"] = b.starts(args.rounds)
            for i in (1, 2):
                b.start_netd(i)
            starts["via netd"] = b.starts(args.rounds)
            if not args.skip_iperf:
                tp = b.iperf(args.iperf_rounds, args.iperf_seconds)
            b.stop_netds()
            left_procs = bench_processes(root, b.ports)
            leftovers = nethosts.fabric_leftovers(fab)
        gc_left = {f"n{i}": ids for i, sd in enumerate(fab.state_dirs, 1) if (ids := store.list_ids(sd))}
    finally:
        shutil.rmtree(root, True)      # the nodes' state directories and filter caches
    after_procs = bench_processes(root, b.ports)

    # ---- report
    print(f"\nmultinode: `starter run ... -- /bin/true` on node 1 of 2, --net nat vs --net job, "
          f"{args.rounds} interleaved rounds (ms: median, IQR)")
    for mode, (times, diffs, setups, setup_diffs) in starts.items():
        for what, t, dd in (("whole run", times, diffs), ("setup     ", setups, setup_diffs)):
            nat, job = quartiles(t["nat"]), quartiles(t["job"])
            d = quartiles(dd)
            print(f"  {mode:<13} {what} nat {ms(nat[1]):>6} ({ms(nat[0])}..{ms(nat[2])})   "
                  f"job {ms(job[1]):>6} ({ms(job[0])}..{ms(job[2])})   "
                  f"job - nat per round {1000 * d[1]:+.1f} ({1000 * d[0]:+.1f}..{1000 * d[2]:+.1f}) "
                  f"[{job[1] / nat[1]:.2f}x{'; target +20' if what.startswith('setup') else ''}]")
    if tp:
        bare, job = statistics.median(tp["bare"]), statistics.median(tp["job"])
        print(f"\nmultinode: iperf3 TCP n1 -> n2, {args.iperf_seconds} s, median of {args.iperf_rounds}, "
              f"interleaved (Gbit/s, receiver)")
        print(f"  bare fabric (node namespaces)   {bare:6.2f}   rounds: {' '.join(f'{x:.2f}' for x in tp['bare'])}")
        print(f"  one job's parts (vx0)           {job:6.2f}   rounds: {' '.join(f'{x:.2f}' for x in tp['job'])}")
        print(f"  job / bare                      {job / bare:6.2f}   (target 0.90)")
        print("  counted by the client's report / sent by iperf3, per job round: "
              + ", ".join(f"{c / s:.4f}" for c, s in tp["counted/sent"]))
        print("    (bytes: " + ", ".join(f"{c}/{s}" for c, s in tp["counted/sent"]) + ")")
    print(f"\nmultinode: fabric_leftovers {leftovers}; bench processes left before the fabric went: "
          f"{len(left_procs)}, after: {len(after_procs)}; job entries left: {gc_left or 'none'}")
    for pid, cmd in left_procs + after_procs:
        print(f"  left: {pid} {cmd}")
    _state.check_node_state(before)
    if leftovers or left_procs or after_procs or gc_left:
        sys.exit("multinode bench: left something behind")


if __name__ == "__main__":
    main()
