"""The starter's own user namespace, when it is not root (a pilot's).

enter() unshares a user namespace for the starter process and maps the
pilot's uid and gid to 0 there.  From then on the starter is root over what
it makes: the job's PID, mount, IPC, UTS and network namespaces (owned by
this one), the job's network namespace's nftables rules, and the cgroups
the pilot was delegated (its own files: 0 here is the pilot's uid outside).
It has no privilege over anything else of the host's: every file and
process of another uid is the kernel's "nobody" here.

Where the pilot has subordinate ids (/etc/subuid and /etc/subgid, and the
set-user-ID newuidmap and newgidmap from the uidmap package), 1..N map to
them too, and each job runs under one of those (a transient uid of the
pilot's namespace, starter/callers/uids.py): a uid that owns no file of the
pilot's and no process of another job's.  Without them the only id is 0,
the pilot's own: the job runs as it, without any capability (the shim
empties every set), and what then holds is docs/admin-guide.md's
"Pilots without root".

The maps are written before anything else runs: newuidmap needs our pid
seen from the pilot's own namespace, so a forked helper, still there, runs
it once we have unshared.  Python has no threads yet at this point (the
watchdog starts later), as unshare(CLONE_NEWUSER) requires.
"""

import os

from starter.errors import StarterError

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
MAP_TOOLS = ("/usr/bin/newuidmap", "/usr/bin/newgidmap")
PAYLOAD_FIRST = 1000    # a job's uid in the namespace: from here up (without subordinate ids: 0)


class Pilot:
    """Who runs the starter, outside its namespace: uid, gid, name, home, and
    its subordinate ranges ((first, count) or None); `ids`: how many ids the
    namespace maps (1 + the range's count)."""

    __slots__ = ("uid", "gid", "name", "home", "subuid", "subgid", "why_unmapped")

    def __init__(self, uid, gid, name, home, subuid=None, subgid=None):
        self.uid, self.gid, self.name, self.home = uid, gid, name, home
        self.subuid, self.subgid = subuid, subgid
        self.why_unmapped = None    # where not mapped: why (the report's not_enforced)

    @property
    def mapped(self):
        """Has the namespace ids beyond 0 (the payloads' own)?"""
        return self.subuid is not None and self.subgid is not None

    def payload_range(self):
        """The transient uids of the pilot's jobs, in its namespace: (first,
        last), or None where only 0 is mapped."""
        if not self.mapped:
            return None
        # (not 65534 and up: the kernel's overflow ids, what an unmapped id looks like)
        last = min(self.subuid[1], self.subgid[1], 65533)
        first = min(PAYLOAD_FIRST, last)
        return first, last


def subordinate(path, name, uid):
    """The first range of `path` (/etc/subuid's format: NAME-OR-ID:FIRST:COUNT
    per line) for this user -> (first, count), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return None
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] not in (name, str(uid)):
            continue
        try:
            first, count = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        if first > 0 and count > 0:
            return first, min(count, 0xFFFFFFFF - first)
    return None


def who():
    """The pilot, as the kernel and the account database say (before enter())."""
    import pwd

    uid, gid = os.getuid(), os.getgid()
    try:
        pw = pwd.getpwuid(uid)
        name, home = pw.pw_name, pw.pw_dir
    except KeyError:
        name, home = str(uid), os.environ.get("HOME") or "/"
    sub = [None, None]
    if os.environ.get("STARTER_NO_SUBIDS") == "1":
        why = "STARTER_NO_SUBIDS=1"
    elif not all(os.access(t, os.X_OK) for t in MAP_TOOLS):
        why = "no newuidmap and newgidmap (Debian's uidmap)"
    elif _no_new_privs():
        why = "no_new_privs is set (inside another job?): the set-user-ID newuidmap cannot help"
    else:
        sub = [subordinate(p, name, uid) for p in ("/etc/subuid", "/etc/subgid")]
        why = None if None not in sub else f"no range of {name}'s in /etc/subuid and /etc/subgid"
    p = Pilot(uid, gid, name, home, *sub)
    p.why_unmapped = why
    return p


def _no_new_privs():
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"NoNewPrivs:"):
                    return line.split()[1] != b"0"
    except OSError:
        pass
    return False


def enter(pilot):
    """Unshare the starter's user namespace and map it (module docstring),
    then a mount namespace of its own (owned by it, so that the starter may
    clone the mounts it binds into a job: open_tree).  Afterwards this
    process is uid and gid 0 there with every capability in it."""
    from starter._native import check, lib

    _map_own(pilot, check, lib)
    try:
        check(lib.shim_unshare(CLONE_NEWNS), "unshare")
    except OSError as e:
        raise StarterError(f"a mount namespace in the starter's user namespace: {e.strerror}") from None


def _map_own(pilot, check, lib):
    if not pilot.mapped:
        _unshare(check, lib)
        _write("/proc/self/uid_map", f"0 {pilot.uid} 1\n")
        _write("/proc/self/setgroups", "deny\n")
        _write("/proc/self/gid_map", f"0 {pilot.gid} 1\n")
        return
    r, w = os.pipe()
    back_r, back_w = os.pipe()
    pid = os.fork()
    if pid == 0:    # the helper: in the pilot's namespace still
        code = 1
        try:
            os.close(w)
            os.close(back_r)
            if os.read(r, 1) == b"u":
                target = str(os.getppid())
                msg = _map(MAP_TOOLS[0], target, pilot.uid, pilot.subuid) or \
                    _map(MAP_TOOLS[1], target, pilot.gid, pilot.subgid)
                os.write(back_w, msg.encode()[:2000])
                code = 0
        finally:
            os._exit(code)
    os.close(r)
    os.close(back_w)
    try:
        _unshare(check, lib)
        os.write(w, b"u")
    finally:
        os.close(w)
        msg = os.read(back_r, 4096).decode("utf-8", "replace")
        os.close(back_r)
        _, status = os.waitpid(pid, 0)
    if msg or status != 0:
        raise StarterError(f"mapping the subordinate ids of {pilot.name} failed: {msg.strip() or 'no answer'}",
                           "check /etc/subuid and /etc/subgid, or run with STARTER_NO_SUBIDS=1 "
                           "(the job then runs as the pilot's own uid)")
    if os.geteuid() != 0:
        raise StarterError("newuidmap left this process unmapped", "check /etc/subuid and /etc/subgid")


def redump():
    """The starter dumpable again (its children are copies of it): a
    helper that shared its memory changed its uid (native/uidkill.c), which
    made the memory non-dumpable, and a non-dumpable process can be looked
    at (/proc/PID/ns) only with a capability in the user namespace its
    memory was made in, the host's."""
    from starter._native import check, lib

    check(lib.shim_set_dumpable(1), "prctl(PR_SET_DUMPABLE)")


def _unshare(check, lib):
    try:
        check(lib.shim_unshare(CLONE_NEWUSER), "unshare")
    except OSError as e:
        raise StarterError(f"starter run without root needs a user namespace, and the kernel refused one: "
                           f"{e.strerror}",
                           "user namespaces are turned off here (user.max_user_namespaces, "
                           "kernel.unprivileged_userns_clone, or an AppArmor or SELinux policy); "
                           "ask the site, or run the job as root") from None


def _write(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    except OSError as e:
        raise StarterError(f"writing {path} ({text.strip()}) failed: {e.strerror}") from None
    finally:
        os.close(fd)


def _map(tool, target, own, sub):
    """Run newuidmap or newgidmap for the process `target`: 0 -> own, 1.. ->
    the subordinate range.  -> "" or its error, in one line."""
    first, count = sub
    argv = [tool, target, "0", str(own), "1", "1", str(first), str(count)]
    err_r, err_w = os.pipe()
    try:
        null = os.open("/dev/null", os.O_RDWR)
        pid = os.posix_spawn(tool, argv, {"PATH": "/usr/bin:/bin"},
                             file_actions=[(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1),
                                           (os.POSIX_SPAWN_DUP2, err_w, 2)])
        os.close(null)
    except OSError as e:
        os.close(err_r)
        os.close(err_w)
        return f"{tool}: {e.strerror}"
    os.close(err_w)
    out = b""
    while True:
        b = os.read(err_r, 4096)
        if not b:
            break
        out += b
    os.close(err_r)
    _, status = os.waitpid(pid, 0)
    if status == 0:
        return ""
    text = " ".join(out.decode("utf-8", "replace").split())
    return f"{os.path.basename(tool)} {' '.join(argv[2:])}: {text or 'exit status ' + str(status >> 8)}"
