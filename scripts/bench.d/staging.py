#!/usr/bin/env python3
"""Staging costs per job: spool link vs private copy, scratch create/remove, manifest check.

Run as root: `scripts/bench.d/staging.py` (scripts/bench runs every file here).
Prints one table; the ratio column compares each row with its peer (the
private copy for the spool rows, `cp -a`-free Python copy baseline).
"""

import hashlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from starter.storage import manifest, scratch
from starter.spool import store as spool  # noqa: E402

EXE_MB = 64
JOBS = 20
NOBODY = 65534


def timed(fn, n):
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n


def main():
    base = tempfile.mkdtemp(prefix="starter-bench-staging-")
    try:
        return run(base)
    finally:
        shutil.rmtree(base)


def run(base):
    exe = os.path.join(base, "exe")
    with open(exe, "wb") as f:
        f.write(os.urandom(EXE_MB << 20))
    os.chmod(exe, 0o755)
    jobs = os.path.join(base, "jobs")
    os.mkdir(jobs)
    rows = []

    # private copy per job (what happens without the spool)
    copy = timed(lambda i: spool._copy_file(exe, os.path.join(jobs, f"copy{i}")), JOBS)
    rows.append((f"private copy, {EXE_MB} MiB exe", copy, None))

    s = spool.Spool(os.path.join(base, "spool"))
    ch = spool.compute_cmdhash(exe)
    s.store("alice", ch, exe)
    link = timed(lambda i: s.link_into("alice", ch, os.path.join(jobs, f"link{i}")), JOBS)
    rows.append(("spool link_into (hash known)", link, copy))
    add = timed(lambda i: s.add("alice", exe, dest=os.path.join(jobs, f"add{i}")), JOBS)
    rows.append(("spool add+link (hashes the file)", add, copy))
    release = timed(lambda i: s.release(os.path.join(jobs, f"link{i}"), "alice", ch), JOBS)
    rows.append(("spool release", release, None))

    # scratch with 1000 small files and a 20-deep tree
    parent = os.path.join(base, "execute")
    os.mkdir(parent, 0o755)

    def scratch_cycle(i):
        sc = scratch.create_in(parent, str(i), NOBODY, NOBODY)
        for k in range(1000):
            open(os.path.join(sc.path, f"f{k}"), "w").close()
        d = sc.path
        for _ in range(20):
            d = os.path.join(d, "d")
            os.mkdir(d)
        t = time.perf_counter()
        sc.remove()
        return time.perf_counter() - t

    rm_times = [scratch_cycle(i) for i in range(10)]
    rm = sum(rm_times) / len(rm_times)

    def py_rmtree(i):
        d = os.path.join(base, f"r{i}")
        os.mkdir(d)
        for k in range(1000):
            open(os.path.join(d, f"f{k}"), "w").close()
        x = d
        for _ in range(20):
            x = os.path.join(x, "d")
            os.mkdir(x)
        t = time.perf_counter()
        shutil.rmtree(d)
        return time.perf_counter() - t

    base_rm = sum(py_rmtree(i) for i in range(10)) / 10
    rows.append(("scratch remove, 1000 files + 20 deep", rm, base_rm))
    rows.append(("  (peer: shutil.rmtree, no checks)", base_rm, None))
    create = timed(lambda i: scratch.create_in(parent, f"c{i}", NOBODY, NOBODY).remove(), 50)
    rows.append(("scratch create+remove, empty", create, None))

    # manifest: the exe plus 10 small files
    src = os.path.join(base, "src")
    os.mkdir(src)
    lines = []
    shutil.copy(exe, os.path.join(src, "exe"))
    lines.append(f"{hashlib.sha256(open(exe, 'rb').read()).hexdigest()}  exe")
    for k in range(10):
        data = os.urandom(4096)
        open(os.path.join(src, f"in{k}"), "wb").write(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  in{k}")
    sig = os.path.join(base, "sig")
    open(sig, "w").write("\n".join(lines) + "\n")
    digest = hashlib.sha256(open(sig, "rb").read()).hexdigest()

    def stage(i):
        sc = scratch.create_in(parent, f"m{i}", NOBODY, NOBODY)
        manifest.verify_and_stage(sig, digest, src, sc.fd, NOBODY, NOBODY)
        sc.remove()

    m = timed(stage, 5)
    rows.append((f"manifest verify+stage, {EXE_MB} MiB + 10 files", m, copy))

    print(f"{'staging':44} {'ms/op':>9} {'ratio':>7}")
    for name, t, peer in rows:
        ratio = f"{t / peer:7.4f}" if peer else ""
        print(f"{name:44} {t * 1000:9.3f} {ratio}")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("staging bench: run as root (chown to uid 65534)")
    sys.exit(main())
