"""What a private test Slurm needs of this host (tests/slurm.py): its
binaries, free ports on 127.0.0.1, the v1 controllers proctrack/cgroup
uses, and why a test must be skipped."""

import os
import shutil
import socket

CGROUP_ROOT = "/sys/fs/cgroup"
_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol",
             "scancel", "sinfo")


class SlurmError(RuntimeError):
    """The private Slurm did not start, or a command against it failed."""


def missing_binaries():
    """Names of the programs the harness needs that are not installed."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in _BINARIES if shutil.which(b, path=path) is None]


def skip_reason(proctrack=None):
    """Why a SlurmCluster (with this proctrack) cannot run here, or None when it can."""
    missing = missing_binaries()
    if missing:
        return ("Slurm/munge not installed (missing %s); install slurmd slurmctld "
                "slurm-client munge" % ", ".join(missing))
    if os.geteuid() != 0:
        return "the private Slurm runs slurmd as root (SlurmdUser=root)"
    if proctrack == "cgroup" and not _cgroup_v1_controllers():
        return ("proctrack/cgroup is configured here with CgroupPlugin=cgroup/v1 and this "
                "host has no v1 controllers (Slurm 22.05's cgroup/v2 needs systemd and dbus)")
    return None


def _which(name):
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise SlurmError("%s not found; install slurmd slurmctld slurm-client munge" % name)
    return found


def _free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cgroup_v1_controllers():
    """Mounted v1 hierarchies under /sys/fs/cgroup (directories that are not cgroup2)."""
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if fstype == "cgroup" and mnt.startswith(CGROUP_ROOT + "/"):
                    out.append(mnt)
    except OSError:
        pass
    return sorted(out)
