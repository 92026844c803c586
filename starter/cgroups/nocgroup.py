"""No cgroup at all: a starter without root where nothing is delegated to
its pilot (starter/rootless).  The job is still one tree that cannot
escape: its PID namespace, whose init the starter holds; when that init
dies the kernel kills every other process in it.  What this cannot give is
in rootless/pilot.not_enforced(): limits, the usage figures, the freezer
(suspend), the kill of the whole tree in one write.  A job that asks for a
limit, or `--require`s one of those, is refused (pilot.check_required).

The same face as a JobCgroup where the starter's job path uses one; the
admin commands refuse what needs a cgroup in one line.
"""

import os
import time

from .files import CgroupError

KIND = "none"


class NoBackend:
    kind = KIND
    parents = {}
    watch_roles = ()
    cpuset = False

    def __repr__(self):
        return "<NoBackend>"

    def add_cpuset(self):
        raise CgroupError("--cpuset needs a cgroup, and none is delegated to this pilot",
                          "run the pilot in a delegated cgroup, or leave --cpuset out")

    def check_delegation(self):
        raise CgroupError("--delegate needs a cgroup, and none is delegated to this pilot")

    def job_paths(self, job_id):
        return {}

    def view(self):
        return []

    def create(self, job_id, limits=None):
        if limits is not None and not limits.empty():
            raise CgroupError("a limit (--memory, --cpus, --pids, --io-max ...) needs a cgroup, and none is "
                              "delegated to this pilot",
                              "run the pilot in a delegated cgroup (systemd's Delegate=yes, the batch "
                              "system's slot cgroup), or leave the limits out")
        return NoCgroup(self, job_id)

    def open_job(self, job_id, must_exist=True):
        raise CgroupError(f"job {job_id} has no cgroup (none is delegated to this pilot)")

    def list_jobs(self):
        return []

    def prune(self):
        return True

    def close(self):
        return True


class NoCgroup:
    """The job's PID namespace's init, by pid (the starter's child: its
    pid is not reused before the starter reaps it)."""

    def __init__(self, backend, job_id):
        self.backend, self.id = backend, job_id
        self.paths = {}
        self.pid = None

    def clone_fd(self):
        return None

    def add_pid(self, pid, cloned=False):
        self.pid = pid

    def keep_open(self):
        pass

    def end_on_oom(self):
        return None

    def is_empty(self):
        if self.pid is None:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        # A zombie is gone for this: its namespace's other processes died with it.
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] == b"Z"
        except OSError:
            return True

    def kill(self, timeout=5.0, then=None):
        """SIGKILL the job's init: the kernel kills the rest of its PID
        namespace.  -> [] once it is gone, else [its pid] after timeout."""
        deadline = time.monotonic() + timeout
        called = False
        while not self.is_empty():
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                break
            if time.monotonic() >= deadline:
                return [self.pid]
            if then is not None and not called:
                called = True
                then()
            time.sleep(0.01)
        return []

    def _no(self, what):
        raise CgroupError(f"job {self.id}: {what} needs a cgroup, and none is delegated to this pilot",
                          "run the pilot in a delegated cgroup")

    def freeze(self, timeout=5.0):
        self._no("suspend (the freezer)")

    def thaw(self, timeout=5.0):
        self._no("resume (the freezer)")

    def frozen(self):
        return False

    def moved_out(self, roles):
        return []

    def oom_kills(self):
        return None

    def own_oom(self):
        return None

    def holds(self, pid):
        return pid == self.pid

    def payload_stats(self, limit=None):
        return [], 0

    def stats(self):
        return {}

    def destroy(self, timeout=5.0, prune=True):
        if not self.is_empty() and self.kill(timeout):
            raise CgroupError(f"job {self.id}: its init {self.pid} survived SIGKILL for {timeout}s",
                              "it is probably in uninterruptible sleep; `starter gc` retries later")

    def close(self):
        pass
