"""What a private test Slurm needs of this host (tests/slurm.py): its
binaries, free ports on 127.0.0.1 (and a host name that resolves there), an IPv4 address that is not loopback, the
cgroup layout and what Slurm's cgroup plugin for it needs (the v1 controllers,
or system.slice with its controllers on pure cgroup v2), and why a test must
be skipped."""

import os
import shutil
import socket
import subprocess

CGROUP_ROOT = "/sys/fs/cgroup"
# Under the test VMs' emulation (scripts/vm-test: qemu TCG, about 7x slower) every
# bound the harness waits for stretches by this much, as tests/conftest.py's.
SLOWDOWN = 7.0 if os.environ.get("STARTER_VM") else 1.0
_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol",
             "scancel", "sinfo")


class SlurmError(RuntimeError):
    """The private Slurm did not start, or a command against it failed."""


def missing_binaries():
    """Names of the programs the harness needs that are not installed."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in _BINARIES if shutil.which(b, path=path) is None]


# What Slurm's cgroup/v2 plugin enables below system.slice (as systemd does on a
# node): without them slurmd says "Controller ... is not enabled!" and, with the
# constraints on, steps fail with "Plugin initialization failed".
SYSTEM_SLICE = os.path.join(CGROUP_ROOT, "system.slice")
SLICE_CONTROLLERS = ("cpuset", "cpu", "io", "memory", "pids")


def skip_reason(proctrack=None):
    """Why a SlurmCluster (with this proctrack) cannot run here, or None when it can."""
    missing = missing_binaries()
    if missing:
        return ("Slurm/munge not installed (missing %s); install slurmd slurmctld "
                "slurm-client munge" % ", ".join(missing))
    if os.geteuid() != 0:
        return "the private Slurm runs slurmd as root (SlurmdUser=root)"
    reason = hostname_not_on_127001()
    if reason:
        return reason
    if not _non_loopback_ipv4():
        return ("no IPv4 address but loopback: Slurm resolves with AI_ADDRCONFIG and its "
                "slurmctld cannot bind (add one, e.g. a /32 on lo, as scripts/vm/vm-init does)")
    if proctrack == "cgroup":
        layout = cgroup_layout()
        if layout == "v2":
            return _system_slice_missing()
        if not _cgroup_v1_controllers():
            return "proctrack/cgroup: no cgroup v1 controllers and no pure cgroup v2 under %s" \
                % CGROUP_ROOT
    return None


def cgroup_layout():
    """"v2" (one cgroup2 hierarchy at /sys/fs/cgroup), "hybrid" (v1 controllers and a
    cgroup2 beside them) or "v1" (v1 hierarchies only)."""
    types = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _dev, mnt, fstype = line.split()[:3]
                if fstype in ("cgroup", "cgroup2"):
                    types[mnt] = fstype
    except OSError:
        pass
    if types.get(CGROUP_ROOT) == "cgroup2":
        return "v2"
    return "hybrid" if "cgroup2" in types.values() else "v1"


def cgroup_plugin():
    """The CgroupPlugin a site sets for this host's layout: Slurm 22.05's cgroup/v2
    wants a pure cgroup v2 hierarchy; hybrid hosts (controllers on v1) use cgroup/v1."""
    return "cgroup/v2" if cgroup_layout() == "v2" else "cgroup/v1"


def _system_slice_missing():
    """Why Slurm's cgroup/v2 plugin cannot run here, or None."""
    try:
        with open(os.path.join(SYSTEM_SLICE, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        with open(os.path.join(CGROUP_ROOT, "cgroup.controllers")) as f:
            available = set(f.read().split())
    except OSError:
        return ("Slurm's cgroup/v2 plugin puts slurmd in %s, which does not exist (systemd "
                "makes it on a node, scripts/vm/vm-init in the test VM)" % SYSTEM_SLICE)
    lacking = [c for c in SLICE_CONTROLLERS if c in available and c not in enabled]
    if lacking:
        return ("Slurm's cgroup/v2 plugin needs %s enabled in %s/cgroup.subtree_control"
                % (" ".join("+" + c for c in lacking), SYSTEM_SLICE))
    return None


def _non_loopback_ipv4():
    """Whether any interface has an IPv4 address outside 127.0.0.0/8."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True   # cannot tell: let Slurm say
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            addr = fields[fields.index("inet") + 1]
            if not addr.startswith("127."):
                return True
    return False


def _which(name):
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise SlurmError("%s not found; install slurmd slurmctld slurm-client munge" % name)
    return found


def hostname_not_on_127001():
    """Why the host's name keeps a private Slurm from working, or None.

    With NoInAddrAny/NoCtldInAddrAny the daemons and srun listen on the address of the
    host's name (Slurm puts the host's name for `localhost`), while slurmd and
    slurmstepd call srun back at the source address of its request, 127.0.0.1 over
    loopback: the name must resolve to 127.0.0.1 (Debian's installer maps it to
    127.0.1.1; scripts/vm/build-image maps the VM's to 127.0.0.1)."""
    name = socket.gethostname()
    try:
        addrs = {i[4][0] for i in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        return None
    loop = sorted(a for a in addrs if a.startswith("127."))
    if loop and "127.0.0.1" not in loop:
        return ("the host name %r resolves to %s, not 127.0.0.1: srun would listen there "
                "and be called back at 127.0.0.1 (map it to 127.0.0.1 in /etc/hosts)"
                % (name, ", ".join(loop)))
    return None


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
