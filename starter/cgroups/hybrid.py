"""Hybrid hosts: a controller-less cgroup2 mount (usually
/sys/fs/cgroup/unified) next to v1 controller hierarchies.

The cgroup2 side tracks the job: clone3(CLONE_INTO_CGROUP) target,
cgroup.events "populated" (polled for POLLPRI), cgroup.freeze,
cgroup.kill, cpu.stat (user/system usec are kept on every cgroup2 cgroup,
controller or not) and PSI.  The v1 side limits and accounts: memory
(limit, memsw, peak, oom_kill), pids, cpu (quota, shares), blkio, and
cpuset for a job bound to CPUs.  v1 freezer is not used: the cgroup2
freezer already covers every process.

Nothing is ever written to a cgroup.subtree_control here: the cgroup2 side
has no controllers to enable.
"""

from .backend import Backend
from .base import JobCgroup
from .v1 import HYBRID_V1_ROLES, V1Resources, V1ResourcesBackend
from .unified import UnifiedTracking


class HybridJob(UnifiedTracking, V1Resources, JobCgroup):
    pass


class HybridBackend(V1ResourcesBackend, Backend):
    kind = "hybrid"
    job_class = HybridJob

    def fixed_roles(self):
        return ("unified",) + tuple(r for r in HYBRID_V1_ROLES if r in self.layout.v1)
