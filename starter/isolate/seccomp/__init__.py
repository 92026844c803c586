"""The job's syscall filter: a profile (JSON, see profile.py and docs/reference.md,
"Syscall filter profiles") compiled with libseccomp (native/seccomp.c) into a
BPF program in the starter, which the shim installs as the job's very last
step before execve.

    --seccomp default   starter/isolate/seccomp/default.json (the default)
    --seccomp off       no filter
    --seccomp FILE      an admin's profile
    --allow-userns      drop the user-namespace rules from the profile

Per job this must stay well under a millisecond.  Parsing and compiling
costs ~1.5 ms in a fresh process (importing the JSON scanner, profile.py,
libseccomp's work for three ABIs), so the compiled program is cached on disk
in <state_dir>.seccomp/ (a root-only sibling of the state directory, 0700),
keyed by the SHA-256 of the profile's bytes, the --allow-userns choice, the
libseccomp version and the native architecture.  A job with a cached profile
reads the profile (to hash it) and one small file; it imports no JSON code
and does not call libseccomp.  A cache file is used only if it and its
directory are owned by root and not accessible to anyone else; it is as
trustworthy as the profile next to the starter's code.
"""

import os

from starter.errors import SpecError, StarterError
from starter.fileio import NotRegular, TooLarge, read_regular, unlink_best_effort, write_all

DEFAULT = os.path.join(os.path.dirname(__file__), "default.json")
MAX_PROFILE = 1 << 20
CACHE_SUFFIX = ".seccomp"         # <state_dir>.seccomp/
CACHE_KEEP = 64                   # more files than this: the others go
_MAGIC = b"starter-seccomp-2 "    # cache file: magic, ident, newline, 4 bytes flags, 4 bytes length, BPF
_memo = {}


class Filter:
    """A compiled filter: `bpf` (struct sock_filter[] bytes) and the
    SECCOMP_FILTER_FLAG_* bits to install it with."""

    __slots__ = ("bpf", "flags")

    def __init__(self, bpf, flags):
        self.bpf = bpf
        self.flags = flags

    def __repr__(self):
        return f"Filter({len(self.bpf) // 8} instructions, flags={self.flags:#x})"


def load(choice, allow_userns=False, state_dir=None, no_setid=False):
    """-> Filter for the job, or None for `off`.  Raises SpecError (one line)
    for a profile that cannot be read, parsed or compiled: call it before
    anything is created for the job.  With a state_dir, use and fill the
    on-disk cache next to it.  no_setid: a transient uid's job, which may
    make no set-id file (profile.without_setid)."""
    if choice == "off":
        return None
    path = DEFAULT if choice == "default" else choice
    data = _read_profile(path)
    key = _key(data, allow_userns, no_setid)
    cache = state_dir.rstrip("/") + CACHE_SUFFIX if state_dir and state_dir.rstrip("/") else None
    f = _memo.get(key)
    if f is None and cache:
        f = _cache_get(cache, key)
    if f is None:
        f = compile_bytes(data, path, allow_userns, no_setid)
        if cache:
            _cache_put(cache, key, f)
    _memo[key] = f
    return f


def compile_bytes(data, source, allow_userns=False, no_setid=False):
    from starter.isolate.seccomp import profile as P

    prof = P.parse(data, source)
    if allow_userns:
        prof = P.without_userns(prof)
    if no_setid:
        prof = P.without_setid(prof)
    return compile_profile(prof, source)


def compile_profile(prof, source="profile"):
    """Profile -> Filter, through libseccomp (native/seccomp.c)."""
    from starter._native import ffi, lib

    flat = [(r, name, nr) for r in prof.rules for name, nr in r.names
            if r.action != prof.default_action]  # as runc: a rule that changes nothing is skipped
    rules = ffi.new("struct shim_seccomp_rule[]", max(len(flat), 1))
    for i, (r, _name, nr) in enumerate(flat):
        c = rules[i]
        c.nr = nr
        c.action = r.action
        c.nargs = len(r.args)
        for j, (index, op, value, value2) in enumerate(r.args):
            c.args[j].index = index
            c.args[j].op = op
            c.args[j].value = value
            c.args[j].value2 = value2
    failed = ffi.new("int *")
    cap = lib.SHIM_SECCOMP_MAX_BYTES
    buf = ffi.new("unsigned char[]", cap)
    n = lib.shim_seccomp_compile(prof.default_action, rules, len(flat), failed, buf, cap)
    if n == -7:  # E2BIG
        raise SpecError("seccomp", f"{source}: too large: the filter exceeds 4096 BPF instructions",
                        "list several names in one syscalls[] entry, or fewer conditions")
    if n < 0:
        if failed[0] >= 0:
            r, name, _nr = flat[failed[0]]
            raise SpecError("seccomp", f"{source}: {r.where}: libseccomp refused the rule for "
                            f"{name!r}: {os.strerror(-n)}",
                            "a syscall may be in several rules only with different argument conditions")
        raise StarterError(f"compiling the seccomp filter failed: {os.strerror(-n)}")
    return Filter(bytes(ffi.buffer(buf, n)), prof.flags)


# ---- reading and caching ------------------------------------------------------

def _is_reg(st):
    return st.st_mode & 0o170000 == 0o100000


def _read_profile(path):
    """The profile's bytes.  The last component is not followed (no
    symlinks), and it must be a regular file (a FIFO must not block us)."""
    try:
        return read_regular(path, MAX_PROFILE)
    except NotRegular:
        raise SpecError("seccomp", f"profile {path} is not a regular file") from None
    except TooLarge:
        raise SpecError("seccomp", f"{path}: larger than {MAX_PROFILE >> 20} MiB") from None
    except OSError as e:
        hint = "give the real path, not a symbolic link" if e.errno == 40 else None
        raise SpecError("seccomp", f"cannot read profile {path}: {e.strerror}", hint) from None


_ident = None


def _cache_ident():
    """libseccomp version and native architecture: a cached program is only
    valid for the library and machine that made it."""
    global _ident
    if _ident is None:
        from starter._native import ffi, lib

        v = ffi.new("unsigned int[3]")
        lib.shim_seccomp_version(v)
        _ident = b"libseccomp-%d.%d.%d arch-%x" % (v[0], v[1], v[2], lib.shim_seccomp_native_arch())
    return _ident


def _key(data, allow_userns, no_setid=False):
    try:
        from _sha256 import sha256        # built in up to 3.11: no OpenSSL load (~3 ms)
    except ImportError:
        try:
            from _sha2 import sha256      # 3.12+
        except ImportError:
            from hashlib import sha256
    h = sha256(b"userns=%d\n" % bool(allow_userns) + (b"nosetid\n" if no_setid else b""))
    h.update(data)
    return h.hexdigest()[:40]


def _root_only(st):
    return st.st_uid == 0 and not st.st_mode & 0o077


def _cache_get(cache_dir, key):
    try:
        dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _root_only(os.fstat(dfd)):
            return None
        return _cache_read(dfd, key + ".bpf")
    finally:
        os.close(dfd)


def _cache_read(dfd, name):
    """The Filter a cache file holds, or None: only a file of root's alone,
    whole (its length as written), for this libseccomp and machine."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _is_reg(st) or not _root_only(st) or st.st_size > 65536:
            return None
        data = os.read(fd, 65537)
    except OSError:
        return None
    finally:
        os.close(fd)
    head = _MAGIC + _cache_ident() + b"\n"
    if not data.startswith(head) or len(data) < len(head) + 8:
        return None
    size = int.from_bytes(data[len(head) + 4:len(head) + 8], "little")
    body = data[len(head) + 8:]
    if not body or len(body) != size or size % 8:
        return None
    return Filter(body, int.from_bytes(data[len(head):len(head) + 4], "little"))


def check_cache(state_dir):
    """gc: remove every file of the filter cache next to `state_dir` that is
    not a whole cache file of this libseccomp and machine (cut short,
    stale, planted); a later job compiles and writes it again.  -> the
    names removed."""
    cache = state_dir.rstrip("/") + CACHE_SUFFIX
    try:
        dfd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    removed = []
    try:
        if not _root_only(os.fstat(dfd)):
            return []
        for n in sorted(os.listdir(dfd)):
            if n.endswith(".bpf") and _cache_read(dfd, n) is not None:
                continue
            try:
                os.unlink(n, dir_fd=dfd)
            except IsADirectoryError:
                continue
            except OSError:
                continue
            removed.append(n)
    finally:
        os.close(dfd)
    return removed


def _cache_put(cache_dir, key, f):
    """Best effort: a job runs the same with or without a cache entry."""
    try:
        os.mkdir(cache_dir, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return  # e.g. no parent directory yet: the next job tries again
    try:
        dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    tmp = f"{key}.{os.getpid()}.tmp"
    try:
        if not _root_only(os.fstat(dfd)):
            return
        names = os.listdir(dfd)
        if len(names) >= CACHE_KEEP:  # profiles that changed often: start over
            for n in names:
                unlink_best_effort(n, dfd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            write_all(fd, _MAGIC + _cache_ident() + b"\n" + f.flags.to_bytes(4, "little")
                      + len(f.bpf).to_bytes(4, "little") + f.bpf)
        finally:
            os.close(fd)
        os.rename(tmp, key + ".bpf", src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        unlink_best_effort(tmp, dfd)
    finally:
        os.close(dfd)
