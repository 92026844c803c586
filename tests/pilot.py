"""The pilot of tests/test_rootless.py: an ordinary account (scripts/pilot-account:
starter-pilot, with a home and subordinate ids, no sudo), the starter
installed into a venv in its home from the wheelhouse with `pip install
--no-index`, and the cgroup a batch system delegates to it.

    with Delegated() as d:                 # <own>/starter/pilot-XXXX in every hierarchy, the pilot's
        p = as_pilot(["starter", "run", "--", "id"], cgroup=d)
    as_pilot(...)                          # no cgroup of its own: the test's (root's)

Everything runs as the pilot with setpriv (no PAM, no login), its
environment empty but for HOME, USER, PATH (the venv's bin first) and
XDG_RUNTIME_DIR (a directory of its home's: su gives none).
"""

import errno
import os
import pwd
import secrets
import shutil
import subprocess

NAME = "starter-pilot"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def account():
    """The pilot's passwd entry, or None where scripts/pilot-account has not run."""
    try:
        return pwd.getpwnam(NAME)
    except KeyError:
        return None


def venv():
    return os.path.join(account().pw_dir, "venv")


def runtime_dir():
    return os.path.join(account().pw_dir, "run")


def install(wheelhouse):
    """The wheelhouse's starter into the pilot's venv, as the pilot, from
    nothing but the wheelhouse (pip --no-index); again only when the
    wheels changed."""
    pw = account()
    stamp = os.path.join(venv(), ".wheelhouse")
    want = " ".join(sorted(f"{f}:{os.stat(os.path.join(wheelhouse, f)).st_size}" for f in os.listdir(wheelhouse)))
    try:
        with open(stamp) as f:
            if f.read() == want:
                return
    except OSError:
        pass
    shutil.rmtree(venv(), ignore_errors=True)
    os.makedirs(runtime_dir(), exist_ok=True)
    os.chown(runtime_dir(), pw.pw_uid, pw.pw_gid)
    os.chmod(runtime_dir(), 0o700)
    for argv in (["/usr/bin/python3", "-m", "venv", venv()],
                 [os.path.join(venv(), "bin", "pip"), "install", "-q", "--no-compile", "--no-index",
                  "--find-links", wheelhouse, "starter"]):
        r = as_pilot(argv, check=False, timeout=600)
        assert r.returncode == 0, (argv, r.stdout, r.stderr)
    r = as_pilot(["sh", "-c", f"echo -n '{want}' > {stamp}"], check=False)
    assert r.returncode == 0, r.stderr


def env(extra=None):
    pw = account()
    e = {"HOME": pw.pw_dir, "USER": NAME, "LOGNAME": NAME, "XDG_RUNTIME_DIR": runtime_dir(),
         "PATH": f"{venv()}/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}
    e.update(extra or {})
    return e


def as_pilot(argv, cgroup=None, check=True, timeout=120, extra_env=None, popen=False, netns=None, **kw):
    """argv as the pilot (its uid, gid and groups, as a login would give), in the
    delegated cgroup `cgroup` (a Delegated) if given, in the network
    namespace netns (an fd-holding nethosts.Netns) if given."""
    pw = account()
    pre = []
    if netns is not None:
        pre = ["nsenter", f"--net=/proc/{netns.pid}/ns/net"]
    cmd = pre + ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", "--"] + list(argv)

    def enter():
        if cgroup is not None:
            cgroup.enter(os.getpid())

    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    kw.setdefault("cwd", pw.pw_dir)
    if popen:
        return subprocess.Popen(cmd, env=env(extra_env), preexec_fn=enter, **kw)
    r = subprocess.run(cmd, env=env(extra_env), preexec_fn=enter, timeout=timeout, **kw)
    if check:
        assert r.returncode == 0, (argv, r.returncode, r.stdout, r.stderr)
    return r


def _own(role):
    """The test's own cgroup in a hierarchy (/proc/self/cgroup)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            if (role == "unified" and ctrl == "") or role in ctrl.split(","):
                return path
    return None


def _mounts():
    """{role: mount point} of the host's cgroup hierarchies."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _src, opts = right.split()[:3]
            point = left.split()[4]
            if fstype == "cgroup2":
                out.setdefault("unified", point)
            elif fstype == "cgroup":
                for o in opts.split(","):
                    if o in ("memory", "pids", "cpu", "cpuacct", "blkio"):
                        out.setdefault(o, point)
    return out


class Delegated:
    """A cgroup made by root under the project's parent (<own>/starter) in
    every hierarchy and handed to the pilot, as a batch system delegates a
    slot's: the directory and the files that move processes and enable
    controllers are the pilot's (systemd's Delegate=yes does the same).
    On v2, the memory, pids and cpu controllers are enabled down to it."""

    FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "tasks")

    def __init__(self):
        self.name = "pilot-" + secrets.token_hex(4)
        self.dirs = []
        self.parents = []       # the project's parents this made (removed again when empty)

    def __enter__(self):
        pw = account()
        for role, point in sorted(_mounts().items()):
            own = _own(role)
            if own is None:
                continue
            parent = os.path.join(point + own, "starter")
            if not os.path.isdir(parent):
                os.mkdir(parent)
                self.parents.append(parent)
            if role == "unified":
                _enable(point, own, parent)
            d = os.path.join(parent, self.name)
            os.mkdir(d)
            self.dirs.append(d)
            os.chown(d, pw.pw_uid, pw.pw_gid)
            for f in self.FILES:
                p = os.path.join(d, f)
                if os.path.exists(p):
                    os.chown(p, pw.pw_uid, pw.pw_gid)
        return self

    def enter(self, pid):
        """Put `pid` in the delegated cgroup, or, on v2 once the pilot's
        starter enabled controllers in it (no internal processes then), in a
        leaf of it, the pilot's own (as a pilot keeps its processes)."""
        for d in self.dirs:
            try:
                with open(os.path.join(d, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                leaf = os.path.join(d, "pilot-procs")
                if not os.path.isdir(leaf):
                    os.mkdir(leaf)
                    pw = account()
                    for x in (leaf, *(os.path.join(leaf, f) for f in self.FILES)):
                        if os.path.exists(x):
                            os.chown(x, pw.pw_uid, pw.pw_gid)
                with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                    f.write(str(pid))

    def __exit__(self, *exc):
        for d in self.dirs:
            for root, dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
                try:
                    os.rmdir(root)
                except OSError:
                    pass
        for p in self.parents:
            try:
                os.rmdir(p)
            except OSError:
                pass        # (a job of another test's there now)
        left = [d for d in self.dirs if os.path.exists(d)]
        assert not left, f"delegated cgroups left: {left}"


def _enable(point, own, parent):
    """v2 with controllers: enable memory, pids and cpu from the test's own
    cgroup down to the project's parent (where the host has them)."""
    try:
        with open(os.path.join(point + own, "cgroup.controllers")) as f:
            have = set(f.read().split())
    except OSError:
        return
    want = [c for c in ("memory", "pids", "cpu") if c in have]
    for d in (point + own, parent):
        try:
            with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join("+" + c for c in want))
        except OSError:
            pass
