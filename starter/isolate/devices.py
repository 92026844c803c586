"""Devices a job may use: by assignment only.

Every job gets the minimal /dev of mounts.dev() and may open only the nodes
of mounts.DEV_RULES; `--device PATH[:rwm]` and `--gpus LIST` add nodes
(bound into the job at their host paths) and the rules that let the kernel
open them (mounts.dev_rules()).  Imported only for a job given devices: the
default start path needs only mounts.py.
The rules are enforced by the job's cgroup (JobCgroup.set_devices: a
BPF_CGROUP_DEVICE program on cgroup2, the v1 devices controller on v1), so
a node the job reaches by another path (a bind of a directory that holds
one) is refused too (EPERM).

A rule is (type, major, minor, access): type "c" or "b", minor None for
any, access a string of r (read), w (write), m (mknod).  A device is
(path, type, major, minor, access).  GPUs: NVIDIA's, by index (as
nvidia-smi numbers them: PCI bus order) or UUID.
"""

import os
import stat

from starter.spec import values as V
from starter.errors import SpecError

ACCESS_DEFAULT = "rw"

NVIDIA_PROC = "/proc/driver/nvidia/gpus"
# The control nodes a CUDA or NVML program opens besides its GPUs' own, each
# passed where the host has it.
NVIDIA_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


def split_access(field, text):
    """"PATH[:rwm]" -> (PATH, access).  The suffix counts as an access only
    if it is made of r, w and m (a path may hold colons)."""
    text = V.string(field, text)
    path, sep, acc = text.rpartition(":")
    if sep and acc and set(acc) <= set("rwm") and len(set(acc)) == len(acc):
        return path, "".join(a for a in "rwm" if a in acc)
    if sep and acc and len(acc) <= 3 and acc.isalpha():
        raise SpecError(field, f"{V.show(text)}: access {V.show(acc)} must be made of r, w and m")
    return text, ACCESS_DEFAULT


def parse_device(field, text):
    """--device PATH[:rwm] -> (path, type, major, minor, access).  The node
    is looked at without following links (a link is refused: the job binds
    what was checked)."""
    from starter.storage import paths

    path, access = split_access(field, text)
    path = V.host_path(field, path)
    try:
        fd, st = paths.open_path(path, "device")
    except paths.MissingError:
        raise SpecError(field, f"{V.show(path)} does not exist") from None
    except paths.LinkError as e:
        raise SpecError(field, e.args[0], e.hint) from None
    except OSError as e:
        raise SpecError(field, f"{V.show(path)}: {e.strerror}") from None
    os.close(fd)
    return node(field, path, st, access)


def node(field, path, st, access=ACCESS_DEFAULT):
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise SpecError(field, f"{V.show(path)} is not a device node",
                        "give a character or block device (a directory: --bind)")
    if not may_open(path, access):
        raise SpecError(field, f"{V.show(path)}: the device rules of the starter's own cgroup do not allow it",
                        "a job gets only devices its batch system gave the step (Slurm's ConstrainDevices, "
                        "--gres); ask for them there")
    return (path, kind, os.major(st.st_rdev), os.minor(st.st_rdev), access)


def may_open(path, access=ACCESS_DEFAULT):
    """Do the device rules of the starter's own cgroup (a batch system's:
    Slurm's ConstrainDevices, as a v1 devices cgroup or a cgroup2 device
    program) let it open `path` with `access`?  The kernel answers through
    access(2), which applies them without opening the device.  The job's
    cgroups are below the starter's, so the job never gets a device its
    batch system did not give the step."""
    mode = (os.R_OK if "r" in access else 0) | (os.W_OK if "w" in access else 0)
    try:
        return os.access(path, mode or os.F_OK)
    except OSError:
        return False


# ---------------------------------------------------------------- GPUs

def nvidia_gpus(proc=NVIDIA_PROC, dev="/dev"):
    """The host's NVIDIA GPUs as [(index, uuid or None, minor)], index in
    PCI bus order (nvidia-smi's).  From the driver's /proc files where
    present (each GPU's "Device Minor" and "GPU UUID"), else the
    /dev/nvidiaN nodes, index = minor, no UUIDs."""
    out = []
    try:
        buses = sorted(os.listdir(proc))
    except OSError:
        buses = None
    if buses is not None:
        for bus in buses:
            info = {}
            try:
                with open(os.path.join(proc, bus, "information"), "rb") as f:
                    for line in f.read(65536).decode("utf-8", "replace").splitlines():
                        k, sep, v = line.partition(":")
                        if sep:
                            info[k.strip()] = v.strip()
            except OSError:
                continue
            minor = info.get("Device Minor", "")
            if minor.isdigit():
                uuid = info.get("GPU UUID", "")
                out.append((len(out), uuid if uuid.startswith(("GPU-", "MIG-")) else None, int(minor)))
        return out
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    minors = sorted(int(n[6:]) for n in names if n.startswith("nvidia") and n[6:].isdigit() and n[6:].isascii())
    return [(m, None, m) for m in minors]


def parse_gpus(field, value, proc=NVIDIA_PROC, dev="/dev"):
    """--gpus 0,1 | GPU-UUID,... | all | slurm (a job file: a list or that
    string) -> ((index, uuid or None, minor), ...) in the order given, each
    once.  `slurm`: the GPUs the batch system gave the step, as the kernel
    tells them (may_open() on each GPU's node): none is named again, and
    the caller's environment is not trusted for it."""
    if value == "slurm":
        return tuple(g for g in nvidia_gpus(proc, dev) if may_open(os.path.join(dev, f"nvidia{g[2]}")))
    if isinstance(value, (list, tuple)):
        items = [str(x) if type(x) is int else V.string(field, x) for x in value]
    else:
        items = [x.strip() for x in V.string(field, str(value) if type(value) is int else value).split(",")]
    items = [x for x in items if x]
    if not items:
        raise SpecError(field, "no GPU given (indices like 0,1, UUIDs like GPU-..., or all)")
    host = nvidia_gpus(proc, dev)
    if items == ["all"]:
        if not host:
            raise SpecError(field, "this node has no NVIDIA GPU (no /proc/driver/nvidia/gpus, no /dev/nvidiaN)")
        return tuple(host)
    out = []
    for item in items:
        if item.isdigit() and item.isascii():
            found = [g for g in host if g[0] == int(item)]
        elif item.startswith(("GPU-", "MIG-")):
            if not os.path.isdir(proc):
                raise SpecError(field, f"{V.show(item)}: cannot map a UUID to a device here: {proc} does not exist",
                                "give the GPU's index (nvidia-smi -L), or load the NVIDIA driver")
            found = [g for g in host if g[1] == item]
        else:
            raise SpecError(field, f"{V.show(item)} is not a GPU index or UUID (GPU-...)")
        if not found:
            raise SpecError(field, f"no GPU {V.show(item)} on this node ({len(host)} found)",
                            "nvidia-smi -L lists them")
        if found[0] not in out:
            out.append(found[0])
    return tuple(out)


def gpu_devices(field, gpus, dev="/dev"):
    """The device nodes of `gpus` and the control nodes the host has."""
    from starter.storage import paths

    out = []
    if not gpus:
        return out
    names = [f"nvidia{minor}" for _i, _u, minor in gpus] + list(NVIDIA_CONTROL)
    for i, name in enumerate(names):
        p = os.path.join(dev, name)
        try:
            fd, st = paths.open_path(p, "GPU device")
        except paths.MissingError:
            if i < len(gpus):
                raise SpecError(field, f"GPU {gpus[i][0]}: {p} does not exist", "is the NVIDIA driver loaded?") from None
            continue
        except (paths.LinkError, OSError) as e:
            raise SpecError(field, f"{p}: {getattr(e, 'strerror', None) or e.args[0]}") from None
        os.close(fd)
        if i >= len(gpus) and not may_open(p, "rw"):
            continue        # a control node the step's rules leave out: the job goes without it
        out.append(node(field, p, st, "rw"))
    return out


def gpu_env(gpus):
    """What the job's CUDA and NVIDIA tools read: the job sees only its own
    GPUs, numbered from 0, so CUDA_VISIBLE_DEVICES is 0..N-1;
    NVIDIA_VISIBLE_DEVICES names them as the host does (UUIDs where known)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(gpus))),
            "NVIDIA_VISIBLE_DEVICES": ",".join(u or str(i) for i, u, _m in gpus)}
