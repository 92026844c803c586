"""Which namespaces a job is in: the record the starter makes at clone
(made_for: identities of what it made) and the check `starter enter` makes
against it before joining (open_namespaces), NamespacesChanged when the
job's PID 1 left them.
"""

import os
import _signal  # not `signal`: it builds enums at import

from starter.isolate.childspec import NS_SLOTS
from starter.errors import StarterError

# `starter enter` joins what the starter made for the job, never what the
# job's PID 1 is in now: a job with a user namespace of its own (--userns-root,
# --allow-userns) can unshare() its mount namespace and mount over /bin there,
# and an admin who joined that namespace would run the job's binaries as
# whoever they entered as.  So the starter records which namespaces it made
# (identities(), right after clone, before the child runs anything of the
# job's), and enter opens the PID 1's namespaces by path and joins them by
# those fds only if every one is the recorded one (open_namespaces()).
#
# The cgroup namespace is made by the child after the release byte (where
# the starter cannot read it before the job runs), so it has no identity on
# record; it is checked by its owner instead: the child makes it as root of
# the host's user namespace, before any --userns-root, so that namespace
# owns it; every namespace the job could make or join is owned by a user
# namespace of the job's (it has no capability in the host's).

NS_GET_USERNS = 0xb701      # _IO(0xb7, 0x1), <linux/nsfs.h>


class NamespacesChanged(StarterError):
    """The job's PID 1 is no longer in the namespaces the starter made."""

    def __init__(self, changed, message, hint=None):
        super().__init__(message, hint)
        self.changed = changed


def identities(pid, names):
    """name -> [st_dev, st_ino] of /proc/PID/ns/NAME: which namespace of that
    type the process is in.  For a process that cannot have changed them
    (the starter's child before the release byte)."""
    out = {}
    for name in names:
        st = os.stat(f"/proc/{pid}/ns/{name}")
        out[name] = [st.st_dev, st.st_ino]
    return out


def made_for(pid, spec):
    """The record of what the starter made for its child `pid` (ChildSpec
    `spec`), for open_namespaces(): identities() of the namespaces it was
    cloned into; its cgroup namespace, made after the release unless at
    clone, as None (checked by its owner)."""
    later = set() if spec.cgroupns_at_clone else {"cgroup"} & spec.namespaces
    out = identities(pid, spec.namespaces - later)
    out.update(dict.fromkeys(later))
    return out


def _owned_by_our_user_namespace(fd):
    import fcntl

    owner = fcntl.ioctl(fd, NS_GET_USERNS)
    try:
        st, ours = os.fstat(owner), os.stat("/proc/self/ns/user")
    finally:
        os.close(owner)
    return (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino)


def open_namespaces(pidfd, recorded):
    """fds of the namespaces `recorded` names (name -> [st_dev, st_ino]; a
    cgroup namespace may be None: made after the release, checked by its
    owner), opened from the process of `pidfd`, each checked to be the
    recorded one.  The process is checked to be alive after the opens, so
    /proc/PID named it throughout (a pid is not reused before its process
    is reaped).  Raises NamespacesChanged if any differs, StarterError if
    the process is gone."""
    pid = _pid_of_pidfd(pidfd)
    fds = {}
    changed = []
    try:
        for name, ident in recorded.items():
            if name not in NS_SLOTS:
                raise StarterError(f"cannot enter a {name} namespace")
            if ident is None and name != "cgroup":
                raise StarterError(f"no record of the job's {name} namespace")
            if pid <= 0:
                raise ProcessLookupError
            fd = fds[name] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            if ident is None:
                same = _owned_by_our_user_namespace(fd)
            else:
                st = os.fstat(fd)
                same = [st.st_dev, st.st_ino] == list(ident)
            if not same:
                changed.append(name)
        _signal.pidfd_send_signal(pidfd, 0)
    except (ProcessLookupError, FileNotFoundError):
        close_namespaces(fds)
        raise StarterError(f"the job's PID 1 (pid {pid}) is gone") from None
    except BaseException:
        close_namespaces(fds)
        raise
    if changed:
        close_namespaces(fds)
        raise NamespacesChanged(changed, f"the job's PID 1 (pid {pid}) left the "
                                f"{', '.join(sorted(changed))} namespace{'s' if len(changed) > 1 else ''} "
                                "the starter made for it")
    return fds


def open_recorded(entry, names):
    """The namespaces `names` a job's starter recorded in its state entry
    ("namespaces", "pid"), opened from that process by open_namespaces()
    -> {name: fd}.  Raises StarterError where the entry records none or the
    process is gone, NamespacesChanged where it left them."""
    recorded = entry.get("namespaces") or {}
    pid = entry.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not all(recorded.get(n) for n in names):
        raise StarterError("the job's entry records no such namespaces")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        raise StarterError(f"the job's PID 1 (pid {pid}) is gone") from None
    try:
        return open_namespaces(pidfd, {n: recorded[n] for n in names})
    finally:
        os.close(pidfd)


def close_namespaces(fds):
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass


def _pid_of_pidfd(pidfd):
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            for line in f:
                if line.startswith(b"Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1
