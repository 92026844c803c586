#!/usr/bin/env python3
"""What --image costs a job's start: `starter run -- /bin/true` on the
host's root against `starter run --image sha256:<cached> -- /bin/true`,
interleaved round by round, through the real `starter` command: cold (no
netd: each job mounts the image afresh and decompresses what it reads) and
warm (netd holds the image between jobs: image/mount.py keep_warm); beside
them the same image by hand, `unshare -m` + `mount -o loop,ro` + chroot
(what a site's wrapper without the starter does; neither apptainer nor
enroot is packaged for Debian 12).  The image: a small root file system of
this host's own tools (tests/imagefiles.py), imported once.

Usage: .venv/bin/python scripts/bench.d/image.py [--rounds 41]
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTER = os.path.join(ROOT, ".venv", "bin", "starter")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _state import check_node_state, node_state, state_dir  # noqa: E402


def main():
    import imagefiles

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=41)
    a = ap.parse_args()
    before = node_state()
    work = tempfile.mkdtemp(prefix="starter-bench-image-")
    try:
        with contextlib.ExitStack() as stack:
            sd = state_dir(stack, "starter-bench-image-", tmpfs=False)
            warm_sd = state_dir(stack, "starter-bench-image-netd-", tmpfs=False)
            cache = os.path.join(work, "cache")
            env = dict(os.environ, STARTER_STATE_DIR=sd, STARTER_IMAGE_CACHE=cache)
            netd = subprocess.Popen([STARTER, "netd", "--state-dir", warm_sd], env=env)
            stack.callback(netd.wait)
            stack.callback(netd.terminate)
            deadline = time.monotonic() + 10
            while not os.path.exists(os.path.join(warm_sd, "netd.sock")) and time.monotonic() < deadline:
                time.sleep(0.05)
            # Two images (one file apart): netd's warm one is not the cold one's.
            digests = []
            for name in ("cold", "warm"):
                sqfs = imagefiles.rootfs(os.path.join(work, name), os.path.join(work, name + ".sqfs"), name)
                digests.append(json.loads(subprocess.run([STARTER, "image", "import", sqfs, "--json"], env=env,
                                                         check=True, capture_output=True, text=True).stdout)["digest"])
            digest, warm = digests
            mnt = os.path.join(work, "mnt")
            os.mkdir(mnt)
            variants = {
                "plain": [STARTER, "run", "--", "/bin/true"],
                "--image": [STARTER, "run", "--image", digest, "--", "/bin/true"],
                "--image, warm (netd)": [STARTER, "run", "--state-dir", warm_sd, "--image", warm, "--", "/bin/true"],
                "unshare+loop+chroot": ["unshare", "-m", "-p", "-f", "--propagation", "private", "sh", "-c",
                                        'mount -o loop,ro "$1" "$2" && exec chroot "$2" /bin/true', "sh", sqfs, mnt],
            }
            times = {k: [] for k in variants}
            diffs = []
            names = list(variants)
            for i in range(a.rounds + 3):
                got = {}
                for name in names if i % 2 == 0 else names[::-1]:
                    t = time.perf_counter()
                    p = subprocess.run(variants[name], env=env, cwd="/", capture_output=True, text=True)
                    got[name] = time.perf_counter() - t
                    if p.returncode != 0:
                        sys.exit(f"{name}: exit {p.returncode}: {p.stderr.strip()}")
                if i >= 3:
                    for k, v in got.items():
                        times[k].append(v)
                    diffs.append((got["--image"] - got["plain"], got["--image, warm (netd)"] - got["plain"]))
            base = statistics.median(times["plain"])
            print(f"{'variant':22} {'median ms':>10} {'x plain':>8}")
            for k in names:
                m = statistics.median(times[k])
                print(f"{k:22} {m * 1e3:10.2f} {m / base:8.2f}")
            print()
            for i, label in enumerate(("--image", "--image, warm (netd)")):
                d = [x[i] for x in diffs]
                q = statistics.quantiles(d, n=4)
                print(f"{label} - plain, per round: median {statistics.median(d) * 1e3:+.2f} ms, "
                      f"IQR {q[0] * 1e3:+.2f}..{q[2] * 1e3:+.2f} ms ({a.rounds} rounds)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    check_node_state(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
