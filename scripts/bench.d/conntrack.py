#!/usr/bin/env python3
"""Conntrack cleanup at a NAT job's end: the ways starter/net/conntrack.py
finds one dead dual-stack job's entries, side by side, interleaved round by
round, on a small table and on one of --entries entries.

  flush         one flush by the job's mark (the kernel walks its table
                once and deletes the matches: how a job's end goes now)
  one dump      one unfiltered dump, matched in Python (by address, while
                the table is small: where the marks are not trusted)
  4 dumps       four dumps filtered in the kernel by address and direction
                (by address in a big table: before the marks, every job)

Each round makes the job's three entries (IPv4 out and in, IPv6 out, with
its mark) with the conntrack tool, times conntrack.forget(), and checks they
are gone.  The big table's extra entries are TEST-NET addresses (no traffic),
made with the conntrack tool and deleted after.  Needs the conntrack tool.

Usage: .venv/bin/python scripts/bench.d/conntrack.py [--rounds 15] [--entries 3000]
"""

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from starter.net import conntrack, nftrules  # noqa: E402

JOB4, JOB6 = "10.251.77.2", "fd70:7639:1864::4d:2"
FILLER_DST = "192.0.2.77"    # every filler entry's destination: deleted by it after


def _make_job_entries(mark):
    for m in (("-s", JOB4, "-d", "192.0.2.1", "-p", "udp", "--sport", "9", "--dport", "9"),
              ("-s", "192.0.2.1", "-d", JOB4, "-p", "udp", "--sport", "10", "--dport", "11"),
              ("-s", JOB6, "-d", "2001:db8::1", "-p", "udp", "--sport", "9", "--dport", "9")):
        subprocess.run(["conntrack", "-I", *m, "-m", str(mark), "-t", "120"], check=True, capture_output=True)


def _left():
    return subprocess.run(["conntrack", "-L", "-s", JOB4], capture_output=True, text=True).stdout.strip()


def _round(way, mark):
    import time

    _make_job_entries(mark)
    conntrack.SMALL_TABLE = -1 if way == "4 dumps" else 1 << 30
    marks = {mark: [JOB4, JOB6]} if way == "flush" else None
    t = time.perf_counter()
    conntrack.forget([JOB4, JOB6], marks)
    ms = (time.perf_counter() - t) * 1e3
    if _left():
        raise SystemExit(f"conntrack bench: {way} left the job's entries: {_left()}")
    return ms


def _fill(n):
    lines = [f"conntrack -I -s 198.18.{i // 250}.{i % 250 + 1} -d {FILLER_DST} -p udp --sport {1024 + i % 60000} "
             f"--dport 9 -t 600 >/dev/null 2>&1" for i in range(n)]
    subprocess.run(["sh"], input="\n".join(lines), text=True, check=True)


def _count():
    with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
        return int(f.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--entries", type=int, default=3000)
    a = ap.parse_args()
    if subprocess.run(["sh", "-c", "command -v conntrack"], capture_output=True).returncode:
        raise SystemExit("conntrack bench: needs the conntrack tool (scripts/setup --test)")
    mark = nftrules.job_mark(JOB4)
    with open("/proc/sys/net/netfilter/nf_conntrack_buckets") as f:
        buckets = f.read().strip()
    print(f"conntrack table: {buckets} buckets; median ms of {a.rounds} interleaved rounds per way")
    print()
    print("| table | entries | way | ms | x flush |")
    print("|---|---:|---|---:|---:|")
    try:
        for table, ways in (("small", ("flush", "one dump")), ("big", ("flush", "4 dumps"))):
            if table == "big":
                _fill(a.entries)
            entries = _count()
            got = {w: [] for w in ways}
            for r in range(a.rounds):
                for w in (ways if r % 2 else ways[::-1]):
                    got[w].append(_round(w, mark))
            base = statistics.median(got["flush"])
            for w in ways:
                m = statistics.median(got[w])
                print(f"| {table} | {entries} | {w} | {m:.2f} | {m / base:.1f} |")
    finally:
        subprocess.run(["conntrack", "-D", "-d", FILLER_DST], capture_output=True)
        subprocess.run(["conntrack", "-D", "-s", JOB4], capture_output=True)
        subprocess.run(["conntrack", "-D", "-d", JOB4], capture_output=True)
        subprocess.run(["conntrack", "-D", "-s", JOB6], capture_output=True)


if __name__ == "__main__":
    main()
