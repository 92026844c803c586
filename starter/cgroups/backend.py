"""The host's cgroup setup (Backend), probed once per process: where each
hierarchy's `starter` parent is, which optional kernel files exist
(supports_*), making a job's cgroups (create) and finding them again
(open_job, list_jobs), pruning empty parents, the job's cgroup namespace
view.  The interface it implements is described in base.py; the v2, v1 and
hybrid subclasses provide its hooks.
"""

import errno
import os
from abc import abstractmethod   # in sys.modules already: see base.py

from ..errors import CgroupError, SpecError
from . import files, hierarchy
from .base import DELEGATE_V1_HINT, DELEGATE_V1_REFUSAL, JOB_PREFIX, JobCgroup, check_job_id, require_hooks
from .dirs import mkdir, rmdir_quiet


# The files of a cgroup that move processes into it: cgroup.procs (both
# versions), tasks (v1: threads) and cgroup.threads (v2: threads).
MOVERS = ("cgroup.procs", "tasks", "cgroup.threads")


def _ownership(d, what):
    """lstat of cgroup `d` and of each of its MOVERS it has -> (its stat,
    [(name, stat)], those of them not root's alone).  CgroupError naming
    `what` if `d` or its cgroup.procs cannot be looked at."""
    try:
        st = os.lstat(d)
    except OSError as e:
        raise CgroupError(f"cannot check {what} {d}: {e.strerror}") from None
    movers = []
    for f in MOVERS:
        try:
            movers.append((f, os.lstat(os.path.join(d, f))))
        except FileNotFoundError:
            if f == "cgroup.procs":
                raise CgroupError(f"cannot check {what} {d}: it has no cgroup.procs (removed?)") from None
        except OSError as e:
            raise CgroupError(f"cannot check {what} {d}: {e.strerror}") from None
    return st, movers, [(f, m) for f, m in movers if m.st_uid != 0 or m.st_mode & 0o022]


class Backend:
    """The host's cgroup setup, probed once.  Subclasses: V2Backend,
    V1Backend, HybridBackend.

    `parents` maps each role this backend uses to its parent directory
    (default: <hierarchy>/<starter's own cgroup>/starter).
    """

    kind = None         # every backend names its kind: "v2", "v1", "hybrid"
    job_class = None    # ... and its JobCgroup subclass
    cpuset = False      # v1 layouts: is the job's cgroup made in the cpuset hierarchy too?
    _verify_parents = False     # check_caller_parents() found a directory its user owns
    watch_roles = ()            # ... v1 hierarchies where its user may move processes (Supervisor)
    reference_role = None       # ... where none may: what moved_out() compares with (None: the tracking one)

    def __init_subclass__(cls, abstract=False, **kw):
        super().__init_subclass__(**kw)
        if abstract:
            return
        require_hooks(cls, Backend)
        if not isinstance(cls.kind, str):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} lacks the Backend hook kind: "
                            "a class attribute naming the layout (\"v2\", \"v1\", \"hybrid\")")
        if not (isinstance(cls.job_class, type) and issubclass(cls.job_class, JobCgroup)):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} lacks the Backend hook job_class: "
                            "a class attribute naming its JobCgroup subclass")

    def __init__(self, layout, parent=None):
        self.layout = layout
        self.parent_setting = parent
        self.parents = {}
        for role in self.roles():
            self.parents[role] = self._parent_dir(role, parent)

    def __repr__(self):
        return f"<{type(self).__name__} {self.parents}>"

    # -- which hierarchies ------------------------------------------------
    @abstractmethod
    def roles(self):
        """-> the roles ("unified", v1 controller names) a job's cgroup is made in, tracking first."""

    def add_cpuset(self):
        """A job bound to CPUs or NUMA nodes (--cpuset, --mems).  On v2 the
        cpuset controller sits in the job's one directory; v1 layouts
        (V1ResourcesBackend) add the cpuset hierarchy for this job only."""
        return self

    def mount_for(self, role):
        return self.layout.unified if role == "unified" else self.layout.v1[role]

    def _parent_dir(self, role, parent):
        """parent None -> <own>/starter; "name" (relative) -> <own>/name;
        "/a/b" (absolute) -> that cgroup, in every hierarchy."""
        m = self.mount_for(role)
        parent = check_parent("starter" if parent is None else parent)
        if parent.startswith("/"):
            return hierarchy.join(m.mount_point, parent)
        own = self.layout.own.get(role)
        if own is None:
            raise CgroupError(
                f"cannot find the starter's own {role} cgroup under {m.mount_point}",
                "set the cgroup parent to an absolute cgroup path like /starter",
            )
        return hierarchy.join(m.mount_point, own, parent)

    def view(self):
        """What a job sees at /sys/fs/cgroup inside its cgroup namespace:
        [(fstype, path below /sys/fs/cgroup or "", mount options)], one fresh
        mount per hierarchy the job is attached to (mounted inside the
        namespace, each shows only the job's own subtree).  One cgroup2
        hierarchy is mounted at /sys/fs/cgroup itself; several go below a
        tmpfs there.  Hierarchies the job is not in (name=systemd, cpuset unless
        bound: add_cpuset, devices on hybrid hosts) are left out: their
        namespace root would be the starter's cgroup."""
        mounts = []
        for role in self.roles():
            m = self.mount_for(role)
            if m not in mounts:
                mounts.append(m)
        if len(mounts) == 1 and mounts[0].fstype == "cgroup2":
            return [("cgroup2", "", "")]
        out = [("tmpfs", "", "mode=755,size=64k")]
        for m in mounts:
            if m.mount_point.startswith("/sys/fs/cgroup/"):
                rel = m.mount_point[len("/sys/fs/cgroup/"):]
            else:
                rel = "unified" if m.fstype == "cgroup2" else ",".join(m.controllers)
            opts = ",".join(m.controllers + ((f"name={m.name}",) if m.name else ()))
            out.append((m.fstype, rel, "" if m.fstype == "cgroup2" else opts))
        return out

    def distinct_parents(self):
        return list(dict.fromkeys(self.parents.values()))

    def check_caller_parents(self):
        """For a caller that is not root (starter/callers/caller.py): its job's
        cgroups go under the caller's own cgroup in every hierarchy, which
        must be root's all the way up.  A cgroup the caller may write (one
        delegated to it, say by systemd's user@.service) would let it move
        the job's processes out of the job's cgroup, past its limits and
        its kill.  And no job may start one: the caller's cgroup is not
        inside a job's (the set-user-ID bit already does nothing there,
        under no_new_privs)."""
        import stat

        refused = {}        # v1 role -> why its caller's cgroup is not root's alone
        for role in self.roles():
            m, own = self.mount_for(role), self.layout.own.get(role)
            if own is None:
                continue
            parts = [c for c in own.split("/") if c]
            if any(a.startswith("starter") and b.startswith("job-") for a, b in zip(parts, parts[1:])):
                raise CgroupError(f"a process inside a job cannot start a job (its {role} cgroup is {own})")
            d = m.mount_point
            for name in [""] + parts:
                d = os.path.join(d, name) if name else d
                st, movers, bad = _ownership(d, "the caller's cgroup")
                # cgroup2 moves a process only for a writer of the common
                # ancestor's cgroup.procs (v2.py's docstring): a directory
                # the user owns is safe there while those files are root's.
                # Its user may then remove an empty cgroup in it, or make one
                # first: the parents are checked once they hold the job.
                dir_ok = st.st_uid == 0 and not st.st_mode & 0o022
                if not dir_ok and role == "unified" and not bad and stat.S_ISDIR(st.st_mode):
                    self._verify_parents = True
                    continue
                if stat.S_ISDIR(st.st_mode) and dir_ok and not bad:
                    continue
                if not stat.S_ISDIR(st.st_mode) or role == "unified":
                    self._refuse_caller_cgroup(d, st, bad, movers)
                # A v1 hierarchy the user may move processes in (Slurm's
                # cgroup/v1 chowns the step's directories: memory with
                # ConstrainRAMSpace, freezer with proctrack/cgroup): no kernel
                # rule stops a move there.  Watched, if a v1 hierarchy the
                # user cannot move processes in holds the job too (below).
                refused.setdefault(role, (d, st, bad, movers))
        watched = tuple(r for r in self.roles() if r in refused)
        if not watched:
            return
        # The job's processes are listed, and killed, in every hierarchy it
        # is in: one the user cannot move them out of keeps every one of them
        # in sight (the tracking one, or on v1-only hosts where the batch
        # system gave the user the freezer directory, another: pids).  The
        # supervisor compares the watched ones with it every second and ends
        # the job on a difference ("escaped"); the batch system's own limits
        # above still hold meanwhile.
        reference = next((r for r in self.roles() if r not in refused), None)
        if reference is None:
            self._refuse_caller_cgroup(*refused[watched[0]])
        self.watch_roles = watched
        self.reference_role = reference if reference != self.roles()[0] else None

    @staticmethod
    def _refuse_caller_cgroup(d, st, bad, movers):
        import stat

        f, fst = bad[0] if bad else movers[0] if movers else (d, st)
        raise CgroupError(
            f"the caller's cgroup {d} is not root's alone (owner uid {st.st_uid}, "
            f"{f} owner uid {fst.st_uid}, mode {stat.S_IMODE(fst.st_mode):o}): a job of "
            "its user could leave its own cgroup",
            "something gave this cgroup to the user: systemd's user@.service, or a batch system "
            "(Slurm's cgroup/v1 chowns the step's directory with ConstrainRAMSpace; see "
            "docs/admin-guide.md); start the job from a cgroup only root may write")

    def verify_parents(self):
        """Each parent of the job's cgroups is root's, as are the files that
        move processes into it.  Called by create() once the parents hold
        the job's cgroup (they can no longer be removed and made again),
        where check_caller_parents() found a directory its user owns."""
        import stat

        for p in self.distinct_parents():
            st, _movers, bad = _ownership(p, "cgroup parent")
            if st.st_uid != 0 or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode) or bad:
                path, fst = (os.path.join(p, bad[0][0]), bad[0][1]) if bad else (p, st)
                raise CgroupError(f"cgroup parent {path} is not root's alone (owner uid {fst.st_uid}): "
                                  "someone made it before the starter could",
                                  f"remove it (rmdir {p}) once nothing runs in it")

    def check_delegation(self, mountinfo=None):
        """Raise CgroupError unless jobs can get a delegated subtree here."""
        raise CgroupError(DELEGATE_V1_REFUSAL, DELEGATE_V1_HINT)

    # -- capabilities (probed from files, cached once known) ---------------
    def _probe_dirs(self, role):
        """Existing non-root cgroups of `role` to look for optional files in."""
        m = self.mount_for(role)
        cands = [self.parents[role]]
        own = self.layout.own.get(role)
        if own and own != "/":
            cands.append(hierarchy.join(m.mount_point, own))
        try:
            with os.scandir(m.mount_point) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        cands.append(e.path)
                        if len(cands) > 8:
                            break
        except OSError:
            pass
        return [c for c in cands if os.path.isdir(c)]

    def _probe_file(self, role, name):
        """Does a non-root cgroup of `role` have file `name`?  Cached.

        Looks in cgroups that exist; if there are none (a fresh node where
        the starter runs in the root cgroup), makes a short-lived probe-<pid>
        cgroup inside the parent and removes it (and the parent, if made)."""
        key = (role, name)
        cache = self.__dict__.setdefault("_probed", {})
        if key in cache:
            return cache[key]
        if role not in self.parents:
            return False
        dirs = self._probe_dirs(role)
        if dirs:
            found = any(os.path.exists(os.path.join(d, name)) for d in dirs)
        else:
            parent = self.parents[role]
            probe = os.path.join(parent, f"probe-{os.getpid()}")
            made_parent = self._make_parent(parent)
            try:
                mkdir(probe)
                found = os.path.exists(os.path.join(probe, name))
            finally:
                rmdir_quiet(probe)
                if made_parent:
                    try:
                        os.rmdir(parent)
                    except OSError:
                        pass
        cache[key] = found
        return found

    @property
    @abstractmethod
    def supports_memory_peak(self):
        """Will stats() report memory_peak_bytes (not None) for this host's jobs?"""

    @property
    @abstractmethod
    def supports_pids_peak(self):
        """Will stats() report pids_peak (not None) for this host's jobs?"""

    @property
    def supports_kill(self):
        """cgroup.kill exists: the whole tree dies in one write."""
        return "unified" in self.parents and self._probe_file("unified", "cgroup.kill")

    @property
    def supports_oom_group(self):
        """memory.oom.group: the kernel itself ends a job on an OOM kill."""
        return "unified" in self.parents and self._probe_file("unified", "memory.oom.group")

    @property
    def supports_psi(self):
        if "unified" not in self.parents:
            return False
        m = self.layout.unified.mount_point
        return files.read_text_or_none(os.path.join(m, "cpu.pressure")) is not None

    # -- jobs ---------------------------------------------------------------
    def job_paths(self, job_id):
        check_job_id(job_id)
        return {role: os.path.join(p, JOB_PREFIX + job_id) for role, p in self.parents.items()}

    def create(self, job_id, limits=None):
        """Make job-<id> in every hierarchy and apply `limits`.

        Fails closed: on any error everything made here is removed and
        CgroupError (or SpecError for an invalid limit) is raised."""
        if limits is not None:
            limits.validate()
        paths = self.job_paths(job_id)
        job = self.job_class(self, job_id, paths)
        made = []
        try:
            for attempt in range(5):
                try:
                    self._ensure_parents()
                    for d in job.dirs():
                        if not mkdir(d):
                            raise CgroupError(
                                f"cgroup {d} already exists: job {job_id} is running or was not cleaned up",
                                "run `starter gc` or pick another job id",
                            )
                        made.append(d)
                    break
                except CgroupError as e:
                    # A concurrent prune() removed a parent between our mkdirs.
                    if getattr(e, "errno", None) == errno.ENOENT and attempt < 4:
                        for d in reversed(made):
                            rmdir_quiet(d)
                        made.clear()
                        continue
                    raise
            if self._verify_parents:
                self.verify_parents()
            if limits is not None and not limits.empty():
                job.set_limits(limits)
        except BaseException:
            for d in reversed(made):
                rmdir_quiet(d)
            self.prune()
            raise
        return job

    def _ensure_parents(self):
        for p in self.distinct_parents():
            self._make_parent(p)

    @property
    def parent_is_absolute(self):
        return str(self.parent_setting or "").startswith("/")

    def _make_parent(self, p):
        """A relative parent (NAME, below the starter's own cgroup) is made
        when missing and pruned when empty.  An absolute --cgroup-parent /PATH
        is the admin's: it must exist, and is never created or removed (the
        starter never makes cgroups at arbitrary places in a hierarchy)."""
        if not self.parent_is_absolute:
            return mkdir(p)
        if not os.path.isdir(p):
            raise CgroupError(f"cgroup parent {p} does not exist",
                              f"create {self.parent_setting} in every hierarchy (delegated to the starter), "
                              "or give a relative NAME to use a cgroup below the starter's own")
        return False

    def open_job(self, job_id, must_exist=True):
        job = self.job_class(self, job_id, self.job_paths(job_id))
        if must_exist and not job.exists():
            raise CgroupError(f"no cgroup for job {job_id} under {self.distinct_parents()}")
        return job

    def list_jobs(self):
        """Job ids with a cgroup under any parent (sorted)."""
        ids = set()
        for p in self.distinct_parents():
            try:
                with os.scandir(p) as it:
                    for e in it:
                        if e.name.startswith(JOB_PREFIX) and e.is_dir(follow_symlinks=False):
                            ids.add(e.name[len(JOB_PREFIX) :])
            except (FileNotFoundError, NotADirectoryError):
                pass
        return sorted(ids)

    def prune(self):
        """Remove the `starter` parents that hold no job.  Returns True when
        none is left.  A parent still in use (EBUSY) or already gone (ENOENT)
        is fine: another starter may be using it right now."""
        clean = True
        for p in self.distinct_parents():
            self._prune_extra(p)
            if self.parent_is_absolute:
                continue
            try:
                os.rmdir(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno in (errno.EBUSY, errno.ENOTEMPTY, errno.EEXIST):
                    clean = False
                else:
                    raise CgroupError(f"cannot remove {p}: {os.strerror(e.errno)}", files.hint_for(e.errno))
        return clean

    def _prune_extra(self, parent):
        """Hook: remove backend-specific leftovers inside a parent."""

    def close(self):
        """Undo what this process did to its own cgroup, then prune()."""
        return self.prune()


def check_parent(parent):
    """A cgroup parent: absolute ("/htcondor/starter", from the hierarchy's
    root) or relative ("starter", below the starter's own cgroup)."""
    if not isinstance(parent, str):
        raise SpecError("cgroup parent", f"{parent!r} must be a cgroup path like /starter or starter")
    parts = [p for p in parent.split("/") if p]
    if not parts or any(p in (".", "..") or p.startswith(JOB_PREFIX) for p in parts) or "\0" in parent:
        raise SpecError(
            "cgroup parent",
            f"{parent!r} must name a cgroup below the root, without '.', '..' or a job-* component",
        )
    return ("/" if parent.startswith("/") else "") + "/".join(parts)
