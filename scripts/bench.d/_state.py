"""What more than one bench section needs (not a section itself:
scripts/bench runs only the files whose names do not start with "_")."""

import shutil
import subprocess
import tempfile


def state_dir(stack, prefix, tmpfs):
    """A state directory of the bench's own under /run, removed at the end
    with the filter cache beside it.  tmpfs: on a tmpfs of its own, as /run
    is on a node; where it is not (this development host: one ext4 volume),
    that shows the difference a disk makes.  Unmounted at the end."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/run")
    stack.callback(shutil.rmtree, path, True)
    stack.callback(shutil.rmtree, path + ".seccomp", True)
    if tmpfs:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=64m", "starter-bench", path], check=True)
        stack.callback(subprocess.run, ["umount", "-l", path], check=False)
    return path
