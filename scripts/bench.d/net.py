#!/usr/bin/env python3
"""Job networks: per-job setup+teardown cost and NAT throughput.

Everything runs against a private test site (tests/nethosts.py: an uplink
veth to a router namespace with a LAN and a WAN host behind it) and is
removed at the end.  Traffic goes only to those namespaces.

  setup+teardown   one job's network (lease, veth born in the job's netns,
                   addresses, route, counters + set elements; then counters
                   read and everything removed), median over --rounds, at
                   1 job and with --jobs other jobs' networks in place:
                     netd          through the per-node helper (the starter
                                   pays a unix-socket round trip)
                     in-process    handles already open in this process
                     cold process  what a starter without netd pays: a fresh
                                   interpreter loading libnftables (rtnetlink is
                                   spoken directly)
  starter run      `starter run -- /bin/true` end to end, --net none vs nat,
                   interleaved round by round
                   (skipped when a `starter` table already exists on the node)
  iperf3           job namespace -> WAN host: through our NAT (1 job, and with
                   --jobs jobs' elements loaded) vs the same routed path over
                   a plain veth with no nft table at all
  ipv6             on a dual-stack site (tests/test_ipv6.py's): setup+teardown
                   of an IPv4-only job (--ipv6 off) next to a dual-stack one,
                   and iperf3 over IPv6 through NAT66 vs a plain routed veth
                   (--ipv6-only: just this part)

Usage: .venv/bin/python scripts/bench.d/net.py [--jobs 500] [--rounds 15] [--iperf-seconds 3] [--ipv6-only]
                                              [--tmpfs-state] [--skip-iperf]
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

import _state  # noqa: E402
import nethosts  # noqa: E402
from starter import net  # noqa: E402

PY = os.path.join(REPO, ".venv", "bin", "python")
STARTER = os.path.join(REPO, ".venv", "bin", "starter")
POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"

COLD = r"""
import os, sys, time
t0 = time.perf_counter()
from starter import net
cfg = net.NetConfig.from_dict(eval(sys.argv[1]))
fd = os.open(sys.argv[2], os.O_RDONLY)
net.setup(sys.argv[3], fd, cfg)
os.close(fd)
t1 = time.perf_counter()
print(f"{t1 - t0}", flush=True)
sys.stdin.readline()                      # the job runs and exits
t2 = time.perf_counter()
net.teardown(sys.argv[3], cfg)
t3 = time.perf_counter()
rss = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(f"{t3 - t2} {rss}", flush=True)
"""


def ms(x):
    return f"{1000 * x:7.1f}"


class Bench:
    def __init__(self, site, stack, args, table):
        self.site, self.stack, self.args = site, stack, args
        self.state = _state.state_dir(stack, "starter-bench-net-", args.tmpfs_state)
        self.cfg = net.NetConfig(state_dir=self.state, pool=POOL, lan=(site.lan_cidr,),
                                 uplink=site.uplink, table=table)
        stack.callback(self.gc)
        self.netd = None
        self.load = []

    def gc(self):
        self.stop_netd()
        net._local().gc(self.cfg, set())

    # -- netd ------------------------------------------------------------
    def start_netd(self):
        code = f"from starter import net; net.serve(net.NetConfig(state_dir={self.state!r}))"
        self.netd = subprocess.Popen([PY, "-c", code])
        sock = net.socket_path(self.cfg)
        for _ in range(500):
            if os.path.exists(sock):
                return
            time.sleep(0.01)
        raise RuntimeError("netd did not start")

    def stop_netd(self):
        if self.netd is not None:
            self.netd.send_signal(signal.SIGTERM)
            self.netd.wait(timeout=30)
            self.netd = None

    # -- one job's network -------------------------------------------------
    def cycle(self, mode, job_id):
        ns = nethosts.Netns()
        try:
            fd = ns.open_fd()
            try:
                if mode == "cold":
                    return self._cold(ns, job_id)
                t0 = time.perf_counter()
                if mode == "netd":
                    net.setup(job_id, fd, self.cfg)
                else:
                    net._local().setup(job_id, fd, self.cfg, os.getpid())
                t1 = time.perf_counter()
            finally:
                os.close(fd)
        finally:
            ns.close()  # the job exits; its netns (and the veth) start to go
        t2 = time.perf_counter()
        if mode == "netd":
            net.teardown(job_id, self.cfg)
        else:
            net._local().teardown(job_id, self.cfg)
        t3 = time.perf_counter()
        return t1 - t0, t3 - t2, None

    def _cold(self, ns, job_id):
        p = subprocess.Popen([PY, "-c", COLD, repr(self.cfg.as_dict()), f"/proc/{ns.pid}/ns/net", job_id],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            setup = float(p.stdout.readline())
            ns.close()
            p.stdin.write("\n")
            p.stdin.flush()
            td, rss = p.stdout.readline().split()
            p.wait(timeout=30)
            return setup, float(td), int(rss) / 1024
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

    def measure(self, mode, rounds):
        setups, tds, rss = [], [], []
        for i in range(rounds):
            s, t, r = self.cycle(mode, f"bench-{mode}-{i}")
            setups.append(s)
            tds.append(t)
            if r:
                rss.append(r)
        return statistics.median(setups), statistics.median(tds), (max(rss) if rss else None)

    # -- background load ---------------------------------------------------
    def add_load(self, n):
        t0 = time.perf_counter()
        for i in range(n):
            ns = nethosts.Netns()
            self.load.append(ns)
            self.stack.callback(ns.close)
            fd = ns.open_fd()
            try:
                net.setup(f"load-{i}", fd, self.cfg)
            finally:
                os.close(fd)
        return (time.perf_counter() - t0) / max(n, 1)

    def drop_load(self):
        t0 = time.perf_counter()
        for i, ns in enumerate(self.load):
            ns.close()
            net.teardown(f"load-{i}", self.cfg)
        n = len(self.load)
        self.load = []
        return (time.perf_counter() - t0) / max(n, 1)


# -- iperf3 ------------------------------------------------------------------
def iperf(site, client_ns, seconds, runs=3):
    return iperf_to(site.wan, site.wan_addr, client_ns, seconds, site.port, runs)


def iperf_to(ns_server, host, client_ns, seconds, port_of, runs=3):
    """iperf3 TCP from client_ns to a one-shot server in ns_server at host
    (either family), `runs` times -> median Gbit/s."""
    out = []
    for _ in range(runs):
        port = port_of()
        srv = subprocess.Popen(ns_server.argv("iperf3", "-s", "-1", "-p", str(port)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            r = subprocess.run(client_ns.argv("iperf3", "-c", host, "-p", str(port), "-t", str(seconds), "-J"),
                               capture_output=True, text=True, timeout=seconds + 30)
            out.append(json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9)
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.wait()
    return statistics.median(out)


@contextlib.contextmanager
def plain_routed_ns(site, stack):
    """A namespace on a plain veth, routed (not NATed) to the WAN host over
    the same uplink, with no nft table involved: the reference path."""
    ns = nethosts.Netns()
    stack.callback(ns.close)
    host_if = "stdir" + site.uplink[5:]
    t = site.uplink_addr.split(".")[2]
    nethosts.run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", str(ns.pid))
    try:
        nethosts.run("ip", "addr", "add", f"10.75.{t}.1/30", "dev", host_if)
        nethosts.run("ip", "link", "set", host_if, "up")
        ns.ip("addr", "add", f"10.75.{t}.2/30", "dev", "eth0")
        ns.ip("link", "set", "eth0", "up")
        ns.ip("route", "add", "default", "via", f"10.75.{t}.1")
        site.router.ip("route", "add", f"10.75.{t}.0/30", "via", site.uplink_addr)
        # per-interface forwarding on our two test interfaces only; restored below
        flags = [f"/proc/sys/net/ipv4/conf/{i}/forwarding" for i in (host_if, site.uplink)]
        with _flags_on(flags):
            yield ns
    finally:
        nethosts.run("ip", "link", "del", host_if, check=False)


@contextlib.contextmanager
def _flags_on(paths):
    """Write 1 to these sysctl files (the test interfaces' forwarding) for
    the block; put back what they held after it."""
    old = []
    for f in paths:
        with open(f) as fh:
            old.append(fh.read().strip())
        with open(f, "w") as fh:
            fh.write("1")
    try:
        yield
    finally:
        for f, v in zip(paths, old):
            with contextlib.suppress(FileNotFoundError), open(f, "w") as fh:
                fh.write(v)


# -- starter run -------------------------------------------------------------
def starter_runs(state, runs, variants):
    """{label: extra args} -> {label: median s} of `starter run -- /bin/true`,
    the variants interleaved round by round (order rotated), so drift hits
    them alike."""
    times = {label: [] for label in variants}
    labels = list(variants)
    for i in range(runs):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            t0 = time.perf_counter()
            r = subprocess.run([STARTER, "run", "--state-dir", state, *variants[label], "--", "/bin/true"],
                               capture_output=True, text=True, timeout=60)
            times[label].append(time.perf_counter() - t0)
            if r.returncode != 0:
                raise RuntimeError(f"starter run {' '.join(variants[label])} failed: {r.stderr.strip()}")
    return {label: statistics.median(t) for label, t in times.items()}


# -- IPv6 ---------------------------------------------------------------------
@contextlib.contextmanager
def plain_routed_ns6(site, stack):
    """IPv6 twin of plain_routed_ns: a plain veth routed (not NATed) to the
    dual-stack site's WAN host, IPv6 forwarding on our two test interfaces
    only (force_forwarding; conf.all untouched), restored below."""
    ns = nethosts.Netns()
    stack.callback(ns.close)
    host_if = "st6p" + secrets.token_hex(3)
    prefix = site.addr6.rsplit("::", 1)[0] + ":ff"
    nethosts.run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", str(ns.pid))
    try:
        nethosts.run("ip", "-6", "addr", "add", f"{prefix}::1/64", "dev", host_if, "nodad")
        nethosts.run("ip", "link", "set", host_if, "up")
        ns.ip("-6", "addr", "add", f"{prefix}::2/64", "dev", "eth0", "nodad")
        ns.ip("link", "set", "eth0", "up")
        ns.ip("-6", "route", "add", "default", "via", f"{prefix}::1")
        site.ns.ip("-6", "route", "add", f"{prefix}::/64", "via", site.addr6)
        flags = [f"/proc/sys/net/ipv6/conf/{i}/force_forwarding" for i in (host_if, site.uplink)]
        with _flags_on(flags):
            yield ns
    finally:
        nethosts.run("ip", "link", "del", host_if, check=False)


def bench_ipv6(args):
    from test_ipv6 import Site6

    with contextlib.ExitStack() as stack:
        site = Site6(stack)
        state = tempfile.mkdtemp(prefix="starter-bench-net6-", dir="/run")
        stack.callback(shutil.rmtree, state, True)
        stack.callback(shutil.rmtree, state + ".seccomp", True)   # the filter cache beside it
        table = "starter_bench6"
        cfgs = {mode: net.NetConfig(state_dir=state, pool=POOL, lan=site.lan_cidrs, uplink=(site.uplink,),
                                    table=table, ipv6=mode) for mode in ("off", "auto")}
        stack.callback(lambda: net._local().gc(cfgs["off"], set()))
        w = net._local()
        # a long-lived job keeps the table, so each round is a job's own cost
        keep = nethosts.Netns()
        stack.callback(keep.close)
        fd = keep.open_fd()
        w.setup("keep", fd, cfgs["auto"], os.getpid())
        os.close(fd)
        cost = {}
        for mode in ("off", "auto", "off", "auto"):      # interleaved against drift
            for i in range(args.rounds):
                ns = nethosts.Netns()
                try:
                    fd = ns.open_fd()
                    t0 = time.perf_counter()
                    lease = w.setup(f"c{mode}{i}", fd, cfgs[mode], os.getpid())
                    t1 = time.perf_counter()
                    os.close(fd)
                    assert bool(lease.get("address6")) == (mode == "auto"), lease
                finally:
                    ns.close()
                t2 = time.perf_counter()
                w.teardown(f"c{mode}{i}", cfgs[mode])
                t3 = time.perf_counter()
                cost.setdefault(mode, []).append((t1 - t0, t3 - t2))
        tp = {}
        if not args.skip_iperf:
            # The reference runs on a second, identical site: the table's
            # guard drops routed (not NATed) replies on the jobs' uplink.
            # Runs alternate, one of each per round, so load from others on
            # the node hits both alike.
            ref_site = Site6(stack)
            with plain_routed_ns6(ref_site, stack) as plain:
                for _ in range(3):
                    for label, srv_site, host, ns in (("plain veth, routed", ref_site, ref_site.wan6, plain),
                                                      ("NAT66, 1 job", site, site.wan6, keep),
                                                      ("NAT44, 1 job", site, site.wan4, keep)):
                        tp.setdefault(label, []).append(
                            iperf_to(srv_site.ns, host, ns, args.iperf_seconds, srv_site.port, runs=1))
            tp = {k: statistics.median(v) for k, v in tp.items()}
        w.teardown("keep", cfgs["auto"])
    print(f"\nnet/ipv6: per-job setup + teardown, in-process, median of {2 * args.rounds} (ms)")
    for mode, label in (("off", "IPv4 only (--ipv6 off)"), ("auto", "dual-stack")):
        s = statistics.median(x[0] for x in cost[mode])
        t = statistics.median(x[1] for x in cost[mode])
        print(f"  {label:<24} {ms(s)} {ms(t):>8} {ms(s + t)}")
    if tp:
        print(f"\nnet/ipv6: iperf3 TCP job ns -> WAN host, {args.iperf_seconds} s, median of 3, interleaved (Gbit/s)")
        ref = tp["plain veth, routed"]
        for k, v in tp.items():
            note = f"{v / ref:5.2f}x plain IPv6 veth (target 0.90)" if k != "NAT44, 1 job" else "(the same job, IPv4)"
            print(f"  {k:<20} {v:6.2f}   {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iperf-seconds", type=int, default=3)
    ap.add_argument("--skip-iperf", action="store_true")
    ap.add_argument("--ipv6-only", action="store_true")
    ap.add_argument("--tmpfs-state", action="store_true",
                    help="put the state directory on a tmpfs of its own (as /run is on a node)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("net bench: run as root")
    if args.ipv6_only:
        bench_ipv6(args)
        return

    # `starter run` uses the default table; measure it only when that table is
    # free (nobody runs NAT jobs on the node), and then use it throughout, so
    # the loaded jobs and the measured `starter run` share one table.
    e2e_ok = "table inet starter\n" not in subprocess.run(["nft", "list", "tables"], capture_output=True,
                                                            text=True).stdout
    e2e = {}
    with nethosts.site() as site, contextlib.ExitStack() as stack:
        b = Bench(site, stack, args, "starter" if e2e_ok else "starter_bench")
        nat = ["--net", "nat", "--uplink", site.uplink, "--lan", site.lan_cidr, "--pool", POOL]

        def e2e_run(variants):
            if e2e_ok:
                e2e.update(starter_runs(b.state, args.rounds, variants))

        # ---- 1 job
        b.start_netd()
        r1 = {"netd": b.measure("netd", args.rounds)}
        e2e_run({"none, 0 jobs": ["--net", "none"], "nat via netd, 1 job": nat})
        b.stop_netd()
        r1["in-process"] = b.measure("in-process", args.rounds)
        r1["cold process"] = b.measure("cold", max(3, args.rounds // 3))
        e2e_run({"nat without netd, 1 job": nat})

        # ---- throughput, reference and 1 job
        tp = {}
        if not args.skip_iperf:
            with plain_routed_ns(site, stack) as plain:
                tp["plain veth, routed"] = iperf(site, plain, args.iperf_seconds)
            job = nethosts.Netns()
            stack.callback(job.close)
            fd = job.open_fd()
            net._local().setup("iperf", fd, b.cfg, os.getpid())
            os.close(fd)
            tp["NAT, 1 job"] = iperf(site, job, args.iperf_seconds)

        # ---- N jobs loaded
        b.start_netd()
        per_load_setup = b.add_load(args.jobs)
        rN = {"netd": b.measure("netd", args.rounds)}
        e2e_run({f"none, {args.jobs} jobs": ["--net", "none"], f"nat via netd, {args.jobs} jobs": nat})
        b.stop_netd()
        rN["in-process"] = b.measure("in-process", args.rounds)
        if not args.skip_iperf:
            tp[f"NAT, {args.jobs} jobs"] = iperf(site, job, args.iperf_seconds)
            net._local().teardown("iperf", b.cfg)
        b.start_netd()
        per_load_td = b.drop_load()
        b.stop_netd()

    # ---- report
    print(f"\nnet: per-job network setup + teardown (median of {args.rounds}; ms)")
    print(f"  {'path':<14} {'jobs':>5} {'setup':>7} {'teardown':>8} {'total':>7}  vs netd@1")
    base = sum(r1["netd"][:2])
    for label, res, n in (("netd", r1["netd"], 1), ("in-process", r1["in-process"], 1),
                          ("cold process", r1["cold process"], 1),
                          ("netd", rN["netd"], args.jobs + 1), ("in-process", rN["in-process"], args.jobs + 1)):
        s, t, rss = res
        extra = f"  (peak RSS {rss:.0f} MB)" if rss else ""
        print(f"  {label:<14} {n:>5} {ms(s)} {ms(t):>8} {ms(s + t)}  {((s + t) / base):5.2f}x{extra}")
    print(f"  loading {args.jobs} jobs via netd: {ms(per_load_setup).strip()} ms/job setup, "
          f"{ms(per_load_td).strip()} ms/job teardown")
    if e2e:
        print(f"\nnet: `starter run -- /bin/true`, median of {args.rounds} (ms)")
        none = e2e["none, 0 jobs"]
        one = e2e["nat via netd, 1 job"]
        for k, v in e2e.items():
            note = ""
            if k.startswith("nat"):
                ref = e2e[f"none, {args.jobs} jobs"] if k.endswith(f"{args.jobs} jobs") else none
                note = f"+{ms(v - ref).strip()} ms vs none (target +10)"
                if k.endswith(f"{args.jobs} jobs"):
                    note += f", {v / one:4.2f}x nat@1 (target 1.1x)"
            print(f"  {k:<28} {ms(v)}   {note}")
    else:
        print("\nnet: starter run skipped: a `starter` table exists (someone runs NAT jobs)")
    if tp:
        print(f"\nnet: iperf3 TCP job ns -> WAN host, {args.iperf_seconds} s, median of 3 (Gbit/s)")
        ref = tp["plain veth, routed"]
        one = tp.get("NAT, 1 job")
        for k, v in tp.items():
            rel = f"{v / ref:5.2f}x plain (target 0.90)"
            if one and k.startswith("NAT") and k != "NAT, 1 job":
                rel += f", {v / one:5.2f}x 1-job (target 0.95)"
            print(f"  {k:<20} {v:6.2f}   {rel}")
    bench_ipv6(args)


if __name__ == "__main__":
    main()
