#!/usr/bin/env python3
"""What a start without root costs (starter/rootless/): `starter run --
/bin/true` as root, beside the same from the pilot (tests/pilot.py: an
ordinary account, the wheelhouse's starter in a venv in its home, in a
cgroup delegated to it), without subordinate ids, with the user-mode
network (pasta), and the peer a pilot has today, `unshare -r` with the same
namespaces; interleaved round by round, every variant through setpriv (the
pilot's uid, or root's).  Apptainer is not packaged for Debian 12: not here.

Usage: .venv/bin/python scripts/bench.d/rootless.py [--rounds 31]
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _state import check_node_state, node_state, state_dir  # noqa: E402


def main():
    import pilot as P

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=31)
    a = ap.parse_args()
    if P.account() is None:
        sys.exit("no pilot account: scripts/setup --test makes it")
    subprocess.run([os.path.join(ROOT, "scripts", "build-wheel")], check=True, capture_output=True)
    P.install(os.path.join(ROOT, "dist", "wheelhouse"))
    before = node_state()
    with contextlib.ExitStack() as stack:
        sd = state_dir(stack, "starter-bench-rootless-", tmpfs=False)
        d = stack.enter_context(P.Delegated())
        pw = P.account()
        as_root = ["setpriv", "--reuid=0", "--regid=0", "--init-groups", "--"]
        as_pilot = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", "--"]
        pilot_env = P.env()
        root_env = dict(os.environ, STARTER_STATE_DIR=sd)
        variants = {
            "root: starter run": (as_root + [STARTER, "run", "--", "/bin/true"], root_env),
            "pilot: starter run": (as_pilot + ["starter", "run", "--", "/bin/true"], pilot_env),
            "pilot, no subordinate ids": (as_pilot + ["starter", "run", "--", "/bin/true"],
                                          dict(pilot_env, STARTER_NO_SUBIDS="1")),
            "pilot: --net nat (pasta)": (as_pilot + ["starter", "run", "--net", "nat", "--", "/bin/true"], pilot_env),
            "pilot: unshare -r (peer)": (as_pilot + ["unshare", "-Urpfmin", "--mount-proc", "/bin/true"], pilot_env),
        }
        times = {k: [] for k in variants}
        names = list(variants)
        for i in range(a.rounds + 3):
            got = {}
            for name in names if i % 2 == 0 else names[::-1]:
                argv, env = variants[name]
                t = time.perf_counter()
                p = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True,
                                   preexec_fn=None if name.startswith("root") else lambda: d.enter(os.getpid()))
                got[name] = time.perf_counter() - t
                if p.returncode != 0:
                    sys.exit(f"{name}: exit {p.returncode}: {p.stderr.strip()}")
            if i >= 3:
                for k, v in got.items():
                    times[k].append(v)
        base = statistics.median(times["root: starter run"])
        print(f"{'variant':28} {'median ms':>10} {'IQR ms':>16} {'x root':>7}")
        for k in names:
            q = statistics.quantiles(times[k], n=4)
            m = statistics.median(times[k])
            print(f"{k:28} {m * 1e3:10.2f} {q[0] * 1e3:7.2f}..{q[2] * 1e3:7.2f} {m / base:7.2f}")
        print(f"({a.rounds} rounds, interleaved; the pilot in a cgroup delegated to it)")
    check_node_state(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
