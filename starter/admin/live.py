"""A live job as the admin's commands reach it: its state entry (entry) and
its cgroup where its starter recorded it (job_cgroup).  ps, status, top, the
control signals and enter (jobs.py), metrics, checkpoint and gc all open a
job through these two, and trust nothing else the entry says."""

import os

from starter.errors import StarterError
from starter.state import store as S


def entry(state_dir, job_id):
    """The state entry of job `job_id` (a valid id with a lock file), as
    recorded; StarterError when there is no such job."""
    from starter.spec import values

    values.job_id("job", job_id)
    if not os.path.exists(os.path.join(state_dir, job_id + ".lock")):
        raise StarterError(f"no job {job_id!r} on this node", "`starter ps` lists the jobs")
    return S.load(state_dir, job_id) or S.unreadable(state_dir, job_id)


def job_cgroup(st, job_id, backends=None):
    """The job's cgroup where its starter recorded it: each path must be
    <parent>/job-<id>, the parent where the starter puts jobs (the recorded
    --cgroup-parent, inside the hierarchy this host mounts for that role).
    Anything else is not ours: StarterError, and nothing is touched.
    backends: a dict to reuse probed backends in (metrics reads many jobs)."""
    from starter import cgroups
    from starter.cgroups.backend import JOB_PREFIX, check_parent

    paths, parents, setting = st.get("cgroup"), st.get("cgroup_parents"), st.get("cgroup_parent")

    def refuse(why):
        return StarterError(f"state entry of job {job_id!r}: {why}: not a cgroup this starter made; left alone")

    if not isinstance(paths, dict) or not isinstance(parents, dict) or set(paths) != set(parents):
        raise refuse("no cgroup parents recorded")
    try:
        check_parent("starter" if setting is None else setting)
        backend = backends.get(setting) if backends is not None else None
        if backend is None:
            backend = cgroups.open_backend(setting)
            if backends is not None:
                backends[setting] = backend
        import copy

        backend = copy.copy(backend)       # its parents become this job's below
    except StarterError as e:
        raise refuse(str(e)) from None
    if "cpuset" in paths and "cpuset" not in backend.roles():
        try:
            backend.add_cpuset()        # a job bound to CPUs (v1 layouts)
        except StarterError as e:
            raise refuse(str(e)) from None
    if set(paths) != set(backend.roles()):
        raise refuse(f"roles {sorted(paths)} are not this host's {sorted(backend.roles())}")
    for role, p in paths.items():
        parent = parents[role]
        mount = backend.mount_for(role).mount_point
        if not (isinstance(p, str) and isinstance(parent, str)) or p != parent + "/" + JOB_PREFIX + job_id \
                or os.path.normpath(parent) != parent or not parent.startswith(mount.rstrip("/") + "/"):
            raise refuse(f"{role} cgroup {p!r} is not <parent>/job-{job_id} under {mount}")
        want = (setting or "starter").strip("/")
        rel = parent[len(mount.rstrip("/")) + 1:]
        absolute = (setting or "").startswith("/")
        if not (rel == want or (not absolute and rel.endswith("/" + want))):
            raise refuse(f"{role} parent {parent!r} is not where --cgroup-parent {setting or 'starter'} puts jobs")
        if os.path.islink(parent) or os.path.islink(p):
            raise refuse(f"{p!r} is a symlink")
    backend.parents = dict(parents)        # prune what the job's starter used
    return backend.job_class(backend, job_id, dict(paths))
