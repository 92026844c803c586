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

  caps             --net-rate: a capped job's iperf3 rate against its cap, and
                   an uncapped job's rate alone, while the capped one sends,
                   and while an uncapped one sends as much paced by iperf3
                   itself (the control: the neighbour's traffic without a
                   shaper), interleaved
  scale            --scale N: the same start, throughput and netd RSS with N
                   jobs' networks in place, and a starter's PSS beside its job

Throughput rounds alternate the reference (plain_path(): the same two
forwarding hops over plain veths, in namespaces of its own, without
conntrack), the same path with a bare masquerade (conntrack and NAT, no
other rule: what any NAT costs) and the NAT job, so drift hits all alike.

Usage: .venv/bin/python scripts/bench.d/net.py [--jobs 500] [--rounds 15] [--iperf-seconds 3] [--ipv6-only]
                                              [--tmpfs-state] [--skip-iperf] [--scale 2000 (0: none)]
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
    def add_load(self, n, first=0):
        t0 = time.perf_counter()
        for i in range(first, first + n):
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


def interleaved(pairs, seconds, rounds=3):
    """{label: (server ns, host, client ns, port_of)} -> {label: median Gbit/s},
    one iperf3 run of each per round, the order rotated."""
    out = {label: [] for label in pairs}
    labels = list(pairs)
    for i in range(rounds):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            srv_ns, host, ns, port_of = pairs[label]
            out[label].append(iperf_to(srv_ns, host, ns, seconds, port_of, runs=1))
    return {label: statistics.median(v) for label, v in out.items()}


@contextlib.contextmanager
def sending(site, ns, seconds, extra=()):
    """iperf3 from ns to the WAN host in the background for the block."""
    port = site.port()
    srv = subprocess.Popen(site.wan.argv("iperf3", "-s", "-1", "-p", str(port)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    bg = subprocess.Popen(ns.argv("iperf3", "-c", site.wan_addr, "-p", str(port), "-t", str(seconds), *extra),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in (bg, srv):
            p.wait(timeout=seconds + 30)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int([l for l in f if l.startswith("VmRSS")][0].split()[1]) / 1024


def starter_pss_mb(state, nat):
    """PSS of a `starter run --net nat ... sleep` beside its running job, MB."""
    p = subprocess.Popen([STARTER, "run", "--state-dir", state, *nat, "--", "sleep", "30"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
            except OSError:
                kids = []
            if kids and os.readlink(f"/proc/{kids[0]}/exe").endswith("sleep"):
                break
            time.sleep(0.05)
        time.sleep(0.5)
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            return int([l for l in f if l.startswith("Pss:")][0].split()[1]) / 1024
    finally:
        p.terminate()
        p.wait(timeout=60)


def plain_path(stack, masquerade=False):
    """The reference path, as long as a NAT job's (job ns -> host -> uplink ->
    router -> WAN host: two forwarding hops), in four namespaces of its own:
    plain routed veths, both families, no nft table, and so no connection
    tracking (a NAT table in the host's namespace turns conntrack on for
    everything there, a reference beside it included).
    masquerade: the host namespace masquerades what leaves by up0, with no
    other rule (a second reference: conntrack and NAT alone, without ours).
    -> (WAN ns, its IPv4 address, its IPv6 address, job ns)."""
    j, h, r, w = (nethosts.Netns() for _ in range(4))
    for ns in (j, h, r, w):
        stack.callback(ns.close)
        nethosts.run(*ns.argv("sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"))
    # j: eth0 -- h: dn0 | h: up0 -- r: dn0 | r: up0 -- w: eth0, subnets 1, 2, 3
    for a, a_dev, z, z_dev in ((j, "eth0", h, "dn0"), (h, "up0", r, "dn0"), (r, "up0", w, "eth0")):
        nethosts.run(*a.argv("ip", "link", "add", a_dev, "type", "veth", "peer", "name", z_dev, "netns", str(z.pid)))
    for ns, dev, n, host in ((j, "eth0", 1, 2), (h, "dn0", 1, 1), (h, "up0", 2, 1), (r, "dn0", 2, 2),
                             (r, "up0", 3, 1), (w, "eth0", 3, 2)):
        ns.ip("addr", "add", f"10.74.{n}.{host}/24", "dev", dev)
        ns.ip("-6", "addr", "add", f"fd74::{n}:{host}/112", "dev", dev, "nodad")
        ns.ip("link", "set", dev, "up")
    for ns in (j, h, r, w):
        ns.ip("link", "set", "lo", "up")
    for ns, v4, v6 in ((j, "default via 10.74.1.1", "default via fd74::1:1"),
                       (h, "default via 10.74.2.2", "default via fd74::2:2"),
                       (r, "10.74.1.0/24 via 10.74.2.1", "fd74::1:0/112 via fd74::2:1"),
                       (w, "default via 10.74.3.1", "default via fd74::3:1")):
        ns.ip("route", "add", *v4.split())
        ns.ip("-6", "route", "add", *v6.split())
    for ns in (h, r):
        nethosts.run(*ns.argv("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"))
    if masquerade:
        subprocess.run(h.argv("nft", "-f", "-"), input="table inet starter_bench_masq {\n"
                       " chain post { type nat hook postrouting priority 100; oifname \"up0\" masquerade; }\n}\n",
                       text=True, check=True)
    return w, "10.74.3.2", "fd74::3:2", j


# -- IPv6 ---------------------------------------------------------------------
def bench_ipv6(args):
    with contextlib.ExitStack() as stack:
        site = nethosts.Site6(stack)
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
            # The reference: plain_path(), without conntrack; runs alternate.
            wan_ns, _w4, w6, plain = plain_path(stack)
            tp = interleaved({"plain veth, routed": (wan_ns, w6, plain, site.port),
                              "NAT66, 1 job": (site.ns, site.wan6, keep, site.port),
                              "NAT44, 1 job": (site.ns, site.wan4, keep, site.port)}, args.iperf_seconds)
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
            note = f"{v / ref:5.2f}x plain IPv6 veth (target 0.95)" if k != "NAT44, 1 job" else "(the same job, IPv4)"
            print(f"  {k:<20} {v:6.2f}   {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iperf-seconds", type=int, default=3)
    ap.add_argument("--skip-iperf", action="store_true")
    ap.add_argument("--ipv6-only", action="store_true")
    ap.add_argument("--scale", type=int, default=2000, help="also measure with this many jobs' networks (0: not)")
    ap.add_argument("--cap-mbit", type=int, default=200, help="the capped job's --net-rate wan-out")
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
    e2e, tp, caps, scale, rss = {}, {}, {}, {}, {}
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
        rss["1 job"] = rss_mb(b.netd.pid)
        b.stop_netd()
        r1["in-process"] = b.measure("in-process", args.rounds)
        r1["cold process"] = b.measure("cold", max(3, args.rounds // 3))
        e2e_run({"nat without netd, 1 job": nat})

        # ---- throughput, reference and 1 job; a capped job beside
        if not args.skip_iperf:
            w, w_addr, _w6, plain = plain_path(stack)
            ref = (w, w_addr, plain, site.port)
            mw, mw_addr, _mw6, masq = plain_path(stack, masquerade=True)
            job = nethosts.Netns()
            stack.callback(job.close)
            fd = job.open_fd()
            net._local().setup("iperf", fd, b.cfg, os.getpid())
            os.close(fd)
            tp.update(interleaved({"plain veth, routed": ref,
                                   "masquerade alone": (mw, mw_addr, masq, site.port),
                                   "NAT, 1 job": (site.wan, site.wan_addr, job, site.port)}, args.iperf_seconds))
            capped = nethosts.Netns()
            stack.callback(capped.close)
            fd = capped.open_fd()
            cap_cfg = net.NetConfig.from_dict(dict(b.cfg.as_dict(), rate=[("wan_out", args.cap_mbit * 10**6)]))
            net._local().setup("capped", fd, cap_cfg, os.getpid())
            os.close(fd)
            caps["capped job, Mbit/s"] = 1000 * iperf_to(site.wan, site.wan_addr, capped, args.iperf_seconds,
                                                         site.port, runs=3)
            # The control: a neighbour without caps sending as much, paced
            # by iperf3 itself: what its traffic costs this 2-CPU host,
            # shaper or not.
            paced = nethosts.Netns()
            stack.callback(paced.close)
            fd = paced.open_fd()
            net._local().setup("paced", fd, b.cfg, os.getpid())
            os.close(fd)
            runs = {"alone": [], "beside": [], "paced": []}
            for _ in range(5):
                runs["alone"].append(iperf_to(site.wan, site.wan_addr, job, args.iperf_seconds, site.port, runs=1))
                with sending(site, capped, args.iperf_seconds + 2):
                    runs["beside"].append(iperf_to(site.wan, site.wan_addr, job, args.iperf_seconds, site.port, runs=1))
                with sending(site, paced, args.iperf_seconds + 2, ("-b", f"{args.cap_mbit}M")):
                    runs["paced"].append(iperf_to(site.wan, site.wan_addr, job, args.iperf_seconds, site.port, runs=1))
            caps.update({f"uncapped {k}": statistics.median(v) for k, v in runs.items()})
            net._local().teardown("capped", cap_cfg)
            net._local().teardown("paced", b.cfg)

        # ---- N jobs loaded
        b.start_netd()
        per_load_setup = b.add_load(args.jobs)
        rN = {"netd": b.measure("netd", args.rounds)}
        e2e_run({f"none, {args.jobs} jobs": ["--net", "none"], f"nat via netd, {args.jobs} jobs": nat})
        rss[f"{args.jobs} jobs"] = rss_mb(b.netd.pid)
        if not args.skip_iperf:
            tp.update({k if k != "NAT" else f"NAT, {args.jobs} jobs": v for k, v in interleaved(
                {"plain veth, routed (again)": ref, "NAT": (site.wan, site.wan_addr, job, site.port)},
                args.iperf_seconds).items()})
        if args.scale > args.jobs:
            b.add_load(args.scale - args.jobs, first=args.jobs)
            scale["netd"] = b.measure("netd", args.rounds)
            if e2e_ok:
                scale.update(starter_runs(b.state, args.rounds, {"none": ["--net", "none"], "nat": nat}))
                scale["pss"] = starter_pss_mb(b.state, nat)
            rss[f"{args.scale} jobs"] = rss_mb(b.netd.pid)
            if not args.skip_iperf:
                scale.update(interleaved({"plain": ref, "NAT": (site.wan, site.wan_addr, job, site.port)},
                                         args.iperf_seconds))
        b.stop_netd()
        rN["in-process"] = b.measure("in-process", args.rounds)
        if not args.skip_iperf:
            net._local().teardown("iperf", b.cfg)
        b.start_netd()
        per_load_td = b.drop_load()
        b.stop_netd()

    # ---- report
    print(f"\nnet: per-job network setup + teardown (median of {args.rounds}; ms)")
    print(f"  {'path':<14} {'jobs':>5} {'setup':>7} {'teardown':>8} {'total':>7}  vs netd@1")
    base = sum(r1["netd"][:2])
    rows = [("netd", r1["netd"], 1), ("in-process", r1["in-process"], 1), ("cold process", r1["cold process"], 1),
            ("netd", rN["netd"], args.jobs + 1), ("in-process", rN["in-process"], args.jobs + 1)]
    if "netd" in scale:
        rows.append(("netd", scale["netd"], args.scale + 1))
    for label, res, n in rows:
        s, t, rss_ = res
        extra = f"  (peak RSS {rss_:.0f} MB)" if rss_ else ""
        print(f"  {label:<14} {n:>5} {ms(s)} {ms(t):>8} {ms(s + t)}  {((s + t) / base):5.2f}x{extra}")
    print(f"  loading {args.jobs} jobs via netd: {ms(per_load_setup).strip()} ms/job setup, "
          f"{ms(per_load_td).strip()} ms/job teardown")
    print("  netd RSS: " + ", ".join(f"{v:.1f} MB with {k}" for k, v in rss.items()))
    if e2e:
        print(f"\nnet: `starter run -- /bin/true`, median of {args.rounds} (ms)")
        none = e2e["none, 0 jobs"]
        one = e2e["nat via netd, 1 job"]
        for k, v in e2e.items():
            note = ""
            if k.startswith("nat"):
                ref_ = e2e[f"none, {args.jobs} jobs"] if k.endswith(f"{args.jobs} jobs") else none
                note = f"+{ms(v - ref_).strip()} ms vs none (target +10)"
                if k.endswith(f"{args.jobs} jobs"):
                    note += f", {v / one:4.2f}x nat@1"
            print(f"  {k:<28} {ms(v)}   {note}")
    else:
        print("\nnet: starter run skipped: a `starter` table exists (someone runs NAT jobs)")
    if tp:
        print(f"\nnet: iperf3 TCP job ns -> WAN host, {args.iperf_seconds} s, median of 3, interleaved (Gbit/s)")
        for k, v in tp.items():
            ref_ = tp["plain veth, routed (again)"] if k == f"NAT, {args.jobs} jobs" else tp["plain veth, routed"]
            rel = (f"{v / ref_:5.2f}x plain (target 0.95)" if k.startswith("NAT") else
                   f"{v / ref_:5.2f}x plain (conntrack + masquerade, no other rule)" if k.startswith("masq") else "")
            print(f"  {k:<28} {v:6.2f}   {rel}")
    if caps:
        cap = args.cap_mbit
        got = caps["capped job, Mbit/s"]
        print(f"\nnet: --net-rate wan-out={cap}mbit, iperf3 {args.iperf_seconds} s, median of 3")
        print(f"  capped job                   {got:7.1f} Mbit/s  {got / cap:5.3f}x the cap, "
              f"{got / (cap * 1448 / 1514):5.3f}x its TCP payload share (1448/1514)")
        alone = caps["uncapped alone"]
        print(f"  uncapped job alone           {alone:7.2f} Gbit/s  (median of 5, interleaved with:)")
        print(f"  uncapped job, capped beside  {caps['uncapped beside']:7.2f} Gbit/s  "
              f"{caps['uncapped beside'] / alone:5.2f}x alone (target 0.9)")
        print(f"  the same, an uncapped neighbour paced to {cap} Mbit/s by iperf3 -b (no shaper) "
              f"{caps['uncapped paced']:7.2f} Gbit/s  {caps['uncapped paced'] / alone:5.2f}x alone")
    if scale:
        print(f"\nnet: scale, {args.scale} jobs' networks in place (netd)")
        if "nat" in scale:
            print(f"  starter run: none {ms(scale['none']).strip()} ms, nat {ms(scale['nat']).strip()} ms, "
                  f"+{ms(scale['nat'] - scale['none']).strip()} ms (target +10)")
            print(f"  a starter's PSS beside its NAT job: {scale['pss']:.1f} MB")
        if "NAT" in scale:
            print(f"  iperf3: plain {scale['plain']:.2f}, NAT {scale['NAT']:.2f} Gbit/s, "
                  f"{scale['NAT'] / scale['plain']:5.2f}x (target 0.95)")
    bench_ipv6(args)


if __name__ == "__main__":
    main()
