"""A checkpoint taken in one VM boot, restored in the next from the image
copied over (issue 26; another boot stands in for another node).
scripts/vm-checkpoint-boots runs it twice in the v2 VM, with one carry
directory (scripts/vm-test --carry: /job/carry in the VM):

  dump DIR     test_checkpoint's job (a counter, a file in its private /tmp,
               a SysV shared memory segment, a child) checkpointed at tick 5
               into DIR/image; beside it the node's key (nodes that restore
               each other's images share it), the last tick and this boot's id
  restore DIR  the key installed as this node's; the image restored: the
               ticks go on from the last, the file, the segment, PID 1 and the
               child are there, the exit code passes through, the report
               lists both segments.

Not a pytest module: the two halves run in two boots."""

import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import STARTER  # noqa: E402
from test_checkpoint import JOB, KEY, make_key  # noqa: E402


def boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def dump(d):
    if not os.path.exists(KEY):
        make_key()
    job = subprocess.Popen([STARTER, "run", "--id", "boots", "--user", "65534", "--report", "/tmp/r1.json", "--",
                            "sh", "-c", JOB], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    before = []
    for line in job.stdout:
        before.append(line)
        if line.strip() == "tick 5":
            break
    p = subprocess.run([STARTER, "checkpoint", "boots", "--to", os.path.join(d, "image")], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert job.wait(timeout=120) == 137, job.stderr.read()
    with open("/tmp/r1.json") as f:
        assert json.load(f)["reason"] == "checkpointed"
    before += job.stdout.read().splitlines()
    last = max(int(x.split()[1]) for x in before if x.startswith("tick "))
    shutil.copy(KEY, os.path.join(d, "key"))
    with open(os.path.join(d, "dump.json"), "w") as f:
        json.dump({"last": last, "boot": boot_id()}, f)
    print(f"checkpointed at tick {last} in boot {boot_id()}")


def restore(d):
    with open(os.path.join(d, "dump.json")) as f:
        was = json.load(f)
    assert was["boot"] != boot_id(), "the same boot: not another node's image"
    os.makedirs(os.path.dirname(KEY), 0o755, exist_ok=True)
    shutil.copy(os.path.join(d, "key"), KEY)
    os.chmod(KEY, 0o600)
    p = subprocess.run([STARTER, "run", "--restore", os.path.join(d, "image"), "--report", "/tmp/r2.json"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert p.returncode == 7, (p.stdout, p.stderr)
    ticks = [int(x.split()[1]) for x in p.stdout.splitlines() if x.startswith("tick ")]
    assert ticks == list(range(was["last"] + 1, 41)), (was, p.stdout)
    assert p.stdout.strip().splitlines()[-1].split() == ["done", "40", "40", "1", "1", "child"], p.stdout
    with open("/tmp/r2.json") as f:
        rep = json.load(f)
    assert rep["reason"] == "exited" and rep["exit_code"] == 7 and len(rep["segments"]) == 2, rep
    print(f"restored in boot {boot_id()} from tick {was['last']} (checkpointed in boot {was['boot']}): "
          f"ticks {ticks[0]}..{ticks[-1]}, exit 7, {len(rep['segments'])} segments, "
          f"total wall {rep['total']['wall_s']:.1f} s")


if __name__ == "__main__":
    {"dump": dump, "restore": restore}[sys.argv[1]](sys.argv[2])
