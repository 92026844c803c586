"""The cgroup2 half of a job that pure v2 and hybrid hosts share: membership
(cgroup.procs, cgroup.events "populated"), freezing (cgroup.freeze), killing
(cgroup.kill), CPU time (cpu.stat's core fields, present even on a cgroup2
with no controllers enabled) and pressure (PSI).  Its own module so that a
hybrid host's starter does not load the v2 backend (controllers, delegation)
it never uses.
"""

import errno
import os
import time

from ..errors import CgroupError
from . import files, parsers
from .dirs import EventsWatch, subdirs_bottom_up
from .kill import kill_pids


class UnifiedTracking:
    """Tracking, freezing and killing through the job's cgroup2 directory."""

    @property
    def upath(self):
        return self.paths["unified"]

    def _ufile(self, name):
        return os.path.join(self.paths["unified"], name)

    def clone_fd(self):
        """O_DIRECTORY fd of the cgroup2 dir for clone3(CLONE_INTO_CGROUP).
        Owned by this object."""
        if self._clone_fd is None:
            try:
                self._clone_fd = os.open(self.upath, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                raise CgroupError(f"cannot open {self.upath}: {os.strerror(e.errno)}", files.hint_for(e.errno))
        return self._clone_fd

    def events_fd(self):
        """An fd that polls POLLPRI when cgroup.events changes (populated,
        frozen).  After it does: drain_events(), then check is_empty().
        Owned by this object."""
        if self._events is None:
            self._events = EventsWatch(self._ufile("cgroup.events"))
        return self._events.fd

    def drain_events(self):
        """Re-arm events_fd() after it polled POLLPRI."""
        if self._events is not None:
            self._events.drain()

    def _read_events(self):
        return parsers.parse_flat_keyed(self._text(self._ufile("cgroup.events")))

    def is_empty(self):
        """No process left in the job or any cgroup below it."""
        ev = self._read_events()
        return ev.get("populated", 0) == 0

    # -- devices --------------------------------------------------------------
    def set_devices(self, rules):
        """A BPF_CGROUP_DEVICE program with `rules` as its allow list,
        attached to the job's cgroup2 directory (native/devices.c).  cgroup2
        has no devices controller; the program works with or without
        controllers (a hybrid host's controller-less cgroup2 too), and with
        BPF_F_ALLOW_MULTI an ancestor's program (systemd's) still applies.
        -> "starter", or "ancestor" where an ancestor's exclusive program
        holds the rules instead (then none can be attached below it)."""
        from starter._native import ffi, lib

        arr = ffi.new("struct shim_dev_rule[]", max(len(rules), 1))
        for i, (kind, major, minor, access) in enumerate(rules):
            r = arr[i]
            r.type = {"c": lib.SHIM_DEV_CHAR, "b": lib.SHIM_DEV_BLOCK, "a": 0}[kind]
            r.major = lib.SHIM_DEV_ANY if major is None else major
            r.minor = lib.SHIM_DEV_ANY if minor is None else minor
            r.access = ((lib.SHIM_DEV_READ if "r" in access else 0) | (lib.SHIM_DEV_WRITE if "w" in access else 0)
                        | (lib.SHIM_DEV_MKNOD if "m" in access else 0))
        log = ffi.new("char[]", 1024)
        ret = lib.shim_devices_attach(self.clone_fd(), arr, len(rules), log, 1024)
        if ret == -errno.EPERM:
            # The load worked; the attach is refused only where an ancestor's
            # device program is exclusive (attached without ALLOW_OVERRIDE
            # or ALLOW_MULTI: Slurm's cgroup/v2 task cgroup).  That program
            # applies to the job and nothing below it can replace it.
            return "ancestor"
        if ret < 0:
            words = ffi.string(log).decode("utf-8", "replace").strip().splitlines()[-1:]
            raise CgroupError(
                f"cannot restrict the devices of job {self.id}: a cgroup device program "
                f"(bpf) failed: {errno.errorcode.get(-ret, -ret)} ({os.strerror(-ret)})"
                + (f": {words[0]}" if words else ""),
                "the kernel needs CONFIG_CGROUP_BPF (Linux 4.15+); the starter does not run a job "
                "that could open every device")
        return "starter"

    # -- freezer ------------------------------------------------------------
    def freeze(self, timeout=5.0):
        """Freeze every process in the job (and below); returns once
        cgroup.events says "frozen 1"."""
        files.write(self._ufile("cgroup.freeze"), 1)
        self._wait_events("frozen", 1, timeout, "freeze")

    def thaw(self, timeout=5.0):
        files.write(self._ufile("cgroup.freeze"), 0)
        self._wait_events("frozen", 0, timeout, "thaw")

    def frozen(self):
        return self._read_events().get("frozen", 0) == 1

    def _wait_events(self, key, value, timeout, what):
        if self._events_value(key) == value:
            return
        w = EventsWatch(self._ufile("cgroup.events"))
        try:
            deadline = time.monotonic() + timeout
            while self._events_value(key) != value:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CgroupError(
                        f"{what} of {self.upath} did not complete within {timeout}s "
                        f"(cgroup.events: {self._read_events()})",
                        "a process may be in uninterruptible sleep (D state)",
                    )
                w.wait(min(left, 0.05))
        finally:
            w.close()

    def _events_value(self, key):
        return self._read_events().get(key, 0)

    def _thaw_tree(self, d):
        # A job may have frozen its own sub-cgroups; an empty frozen cgroup
        # can be removed anyway, so nothing to do on cgroup2.
        pass

    # -- kill -----------------------------------------------------------------
    def _exit_watch(self):
        # populated in cgroup.events drops when the last task has exited.
        if not os.path.isdir(self.upath):
            return None
        return EventsWatch(self._ufile("cgroup.events"), self.kept)

    def _kill_tree(self):
        # Atomic against concurrent forks: one write kills the tree, frozen,
        # chmod'ed and nested sub-cgroups included.  Kernels before 5.14
        # have no cgroup.kill.
        try:
            self.kept.write(self._ufile("cgroup.kill"), 1)
        except CgroupError as e:
            if getattr(e, "errno", None) != errno.ENOENT:
                raise
            return False   # no cgroup.kill, or the cgroup is gone: nothing left to kill there
        return True

    def keep_open(self):
        super().keep_open()
        self.kept.open(self._ufile("cgroup.events"))
        self.kept.open(self._ufile("cgroup.kill"), os.O_WRONLY)

    def _kill_round(self, left, deadline):
        """SIGKILL the cgroup2 tree, including sub-cgroups the job made,
        froze or chmod'ed.  Once it is empty, what is left (`left`) is in a
        v1 job cgroup only (hybrid: attached halfway): SIGKILL by pid."""
        if self.is_empty():
            kill_pids(left)
        elif os.path.exists(self._ufile("cgroup.kill")):
            self._kill_tree()
        else:
            self._kill_by_freezing()

    def _kill_by_freezing(self):
        """Kernels before 5.14 have no cgroup.kill: freeze the tree so
        nothing forks, SIGKILL every pid listed in it (fatal signals reach
        frozen tasks on cgroup2), thaw."""
        try:
            files.write(self._ufile("cgroup.freeze"), 1)
        except CgroupError:
            pass
        for d in subdirs_bottom_up(self.upath):
            kill_pids(files.read_pids(os.path.join(d, "cgroup.procs")))
            # A threaded cgroup (a delegated job can make them) lists no
            # processes, only threads; SIGKILL to a thread ends its process.
            kill_pids(files.read_pids(os.path.join(d, "cgroup.threads")))
        for d in subdirs_bottom_up(self.upath):
            try:
                files.write(os.path.join(d, "cgroup.freeze"), 0)
            except CgroupError:
                pass

    # -- accounting on the cgroup2 side -----------------------------------------
    def _tracking_stats(self):
        out = {}
        cpu = parsers.parse_flat_keyed(self._text(self._ufile("cpu.stat")))
        if "user_usec" in cpu:
            out["cpu_user_s"] = cpu["user_usec"] / 1e6
            out["cpu_system_s"] = cpu.get("system_usec", 0) / 1e6
        psi = {}
        for res in ("cpu", "memory", "io"):
            t = parsers.pressure_totals(self._text(self._ufile(f"{res}.pressure")))
            if t is not None:
                psi[res] = t
        out["psi"] = psi or None
        return out
