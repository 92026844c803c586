#!/usr/bin/env python3
"""Many NAT jobs through netd: --jobs real `starter run --net nat` jobs,
--parallel at a time, each sending and receiving --bytes over TCP to an
echo server on the test site's WAN host (tests/nethosts.py).  Checked: every
job started, got an address (its "running" event), passed its bytes, and
its report counted them (wan_out and wan_in at least the payload); after
netd stops and `starter gc` runs, nothing is left (leases, veths, the table,
state entries).  Printed: wall time, jobs per second, netd's peak RSS.

Usage: .venv/bin/python scripts/bench.d/netscale.py [--jobs 2000] [--parallel 50] [--bytes 10000]
"""

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import _state  # noqa: E402
import nethosts  # noqa: E402

STARTER = os.path.join(REPO, ".venv", "bin", "starter")
POOL = f"10.{216 + secrets.randbelow(32)}.0.0/16"

ECHO = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1024)
print("ready", flush=True)
def serve(c):
    with c:
        c.settimeout(30)
        want, got = int(sys.argv[2]), b""
        while len(got) < want:
            b = c.recv(65536)
            if not b:
                return
            got += b
        c.sendall(got)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

CLIENT = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
n = int(sys.argv[3]); s.sendall(b"x" * n); got = 0
while got < n:
    b = s.recv(65536)
    if not b:
        break
    got += len(b)
print("echoed", got)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--parallel", type=int, default=50)
    ap.add_argument("--bytes", type=int, default=10000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("netscale bench: run as root")
    failures, addresses, peak = [], {}, [0]
    lock = threading.Lock()
    with nethosts.site() as site, contextlib.ExitStack() as stack:
        state = _state.state_dir(stack, "starter-bench-netscale-", False)
        reports = os.path.join(state + ".reports")
        os.makedirs(reports)
        stack.callback(subprocess.run, ["rm", "-rf", reports])
        port = site.port()
        echo = site.wan.popen(nethosts.PY, "-c", ECHO, str(port), str(args.bytes))
        stack.callback(lambda: (echo.kill(), echo.wait()))
        assert echo.stdout.readline().strip() == "ready"
        netd = subprocess.Popen([STARTER, "netd", "--state-dir", state])
        try:
            for _ in range(600):
                if os.path.exists(os.path.join(state, "netd.sock")):
                    break
                time.sleep(0.05)
            nat = ["--net", "nat", "--uplink", site.uplink, "--lan", site.lan_cidr, "--pool", POOL]
            todo = list(range(args.jobs))

            def worker():
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop()
                    rep = os.path.join(reports, f"{i}.json")
                    p = subprocess.run([STARTER, "run", "--state-dir", state, "--id", f"scale{i}", *nat,
                                        "--report", rep, "--events", os.path.join(reports, f"{i}.ev"), "--",
                                        "/usr/bin/python3", "-c", CLIENT, site.wan_addr, str(port), str(args.bytes)],
                                       capture_output=True, text=True, timeout=300)
                    ok = p.returncode == 0 and f"echoed {args.bytes}" in p.stdout
                    why = None if ok else f"exit {p.returncode}: {p.stderr.strip()[:200]} {p.stdout.strip()[:100]}"
                    if ok:
                        r = json.loads(open(rep).read())["network"]
                        if r["wan_out"]["bytes"] < args.bytes or r["wan_in"]["bytes"] < args.bytes:
                            why = f"counted {r}"
                        ev = [json.loads(line) for line in open(os.path.join(reports, f"{i}.ev"))]
                        run = [e for e in ev if e.get("event") == "running"]
                        with lock:
                            addresses[i] = run[0].get("address") if run else None
                    with lock:
                        if why:
                            failures.append((i, why))
                    with contextlib.suppress(OSError):
                        with open(f"/proc/{netd.pid}/status") as f:
                            rss = int([l for l in f if l.startswith("VmRSS")][0].split()[1])
                        peak[0] = max(peak[0], rss)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker) for _ in range(args.parallel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            netd.terminate()
            netd.wait(timeout=60)
        gc = subprocess.run([STARTER, "gc", "--state-dir", state], capture_output=True, text=True)
        left = {
            "leases": [n for n in os.listdir(os.path.join(state, "net", "leases"))]
            if os.path.isdir(os.path.join(state, "net", "leases")) else [],
            "veths": [l for l in subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True,
                                                text=True).stdout.splitlines() if ": stj" in l],
            "table": "table inet starter\n" in subprocess.run(["nft", "list", "tables"], capture_output=True,
                                                               text=True).stdout,
            "entries": [n for n in os.listdir(state) if n.endswith(".json")],
        }
    print(f"\nnetscale: {args.jobs} NAT jobs, {args.parallel} at a time, each echoing {args.bytes} bytes "
          f"through the WAN host")
    print(f"  wall {wall:.1f} s, {args.jobs / wall:.1f} jobs/s; netd peak RSS {peak[0] / 1024:.1f} MB")
    print(f"  failed: {len(failures)}" + (f" (first: {failures[0]})" if failures else ""))
    print(f"  jobs with an address: {sum(1 for a in addresses.values() if a)} of {args.jobs}")
    print(f"  left after netd stopped and gc ({gc.returncode}): "
          + ", ".join(f"{k} {len(v) if isinstance(v, list) else v}" for k, v in left.items()))
    if failures or any(left.values()) or gc.returncode:
        sys.exit(1)


if __name__ == "__main__":
    main()
