"""Parse and check a seccomp profile: a small subset of the OCI runtime
spec's seccomp format (what runc, crun and docker read), so profiles and
knowledge carry over.

    {"defaultAction": "SCMP_ACT_ALLOW",          required
     "defaultErrnoRet": 1,                       with SCMP_ACT_ERRNO only
     "flags": ["SECCOMP_FILTER_FLAG_LOG"],       optional
     "architectures": [...],                     accepted, ignored: every ABI
                                                 of the machine is covered
     "syscalls": [{"names": ["keyctl"], "action": "SCMP_ACT_ERRNO",
                   "errnoRet": 1,
                   "args": [{"index": 0, "value": 268435456,
                             "valueTwo": 268435456,
                             "op": "SCMP_CMP_MASKED_EQ"}],
                   "comment": "..."}],
     "comment": "..."}

Checked strictly: the first problem is one error line naming the file and
the place (`syscalls[3].names[1]: unknown syscall 'kexec_lod'`).  Unlike
runc, a syscall name libseccomp does not know is an error, not skipped: a
typo in a deny-list would silently allow the call.  A name libseccomp knows
that this machine's ABIs lack (vm86 on x86_64) is fine.

Only a job whose profile is not in the cache (starter/seccomp) gets here.
Still lean: JSON is read with the C scanner in `_json`, not `import json`
(which pulls in `re`, ~10 ms).
"""

from starter.errors import SpecError

MAX_BYTES = 1 << 20
MAX_RULES = 4096                  # (syscall, rule) pairs: far more than BPF would hold
CLONE_NEWUSER = 0x10000000
USERNS_CALLS = ("unshare", "clone", "setns")

# SECCOMP_RET_* values, which are also libseccomp's SCMP_ACT_* values.
ACT_ALLOW = 0x7FFF0000
ACT_ERRNO = 0x00050000
ACTIONS = {
    "SCMP_ACT_ALLOW": ACT_ALLOW,
    "SCMP_ACT_ERRNO": ACT_ERRNO,
    "SCMP_ACT_KILL": 0x00000000,          # kill the thread (OCI's meaning)
    "SCMP_ACT_KILL_THREAD": 0x00000000,
    "SCMP_ACT_KILL_PROCESS": 0x80000000,
    "SCMP_ACT_TRAP": 0x00030000,
    "SCMP_ACT_LOG": 0x7FFC0000,
}
UNSUPPORTED_ACTIONS = {
    "SCMP_ACT_TRACE": "needs a ptrace supervisor, and the starter is none",
    "SCMP_ACT_NOTIFY": "needs a user-space supervisor, and the starter is none",
}
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
       "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
FLAGS = {"SECCOMP_FILTER_FLAG_LOG": 2, "SECCOMP_FILTER_FLAG_SPEC_ALLOW": 4}
_TOP_KEYS = {"defaultAction", "defaultErrnoRet", "flags", "architectures", "syscalls", "comment"}
_RULE_KEYS = {"names", "action", "errnoRet", "args", "comment"}
_ARG_KEYS = {"index", "value", "valueTwo", "op"}


class Rule:
    """One syscalls[] entry: names, a SECCOMP_RET_* action (errno included),
    and argument conditions (index, op, value, value2) that must all hold."""

    __slots__ = ("where", "names", "action", "args")

    def __init__(self, where, names, action, args):
        self.where = where        # "syscalls[3]", for error messages
        self.names = names        # tuple of (name, number)
        self.action = action
        self.args = args          # tuple of (index, op, value, value2)

    def __repr__(self):
        return f"Rule({self.where}, {[n for n, _ in self.names]}, {self.action:#x}, {self.args})"


class Profile:
    __slots__ = ("default_action", "flags", "rules")

    def __init__(self, default_action, flags, rules):
        self.default_action = default_action
        self.flags = flags        # SECCOMP_FILTER_FLAG_* bits
        self.rules = rules        # tuple of Rule


def parse(data, source, resolve=None):
    """bytes of a profile -> Profile, or SpecError("seccomp", "SOURCE: WHERE: problem").
    resolve(name) -> syscall number, -1 if unknown (default: libseccomp's)."""
    if resolve is None:
        from starter._native import lib

        def resolve(name):
            return lib.shim_seccomp_resolve(name.encode())

    def bad(where, problem):
        return SpecError("seccomp", f"{source}: {where}{': ' if where else ''}{problem}")

    if len(data) > MAX_BYTES:
        raise bad("", f"larger than {MAX_BYTES >> 20} MiB")

    def no_dups(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise bad("", f"duplicate key {k!r}")
            seen[k] = v
        return seen

    def no_const(name):
        raise bad("", f"{name} is not a number")

    try:
        doc = loads(data.decode("utf-8"), no_dups, no_const)
    except UnicodeDecodeError:
        raise bad("", "not UTF-8") from None
    except ValueError as e:
        raise bad("", f"not valid JSON: {e}") from None
    except RecursionError:
        raise bad("", "nested too deeply") from None
    if not isinstance(doc, dict):
        raise bad("", "must be a JSON object")
    _keys(doc, _TOP_KEYS, "", bad)

    default, derrno = doc.get("defaultAction"), doc.get("defaultErrnoRet")
    if default is None:
        raise bad("defaultAction", "missing (e.g. \"SCMP_ACT_ALLOW\")")
    default_action = _action(default, derrno, "defaultAction", "defaultErrnoRet", bad)

    flags = 0
    raw_flags = doc.get("flags", [])
    if not isinstance(raw_flags, list):
        raise bad("flags", "must be a list")
    for i, f in enumerate(raw_flags):
        if not isinstance(f, str) or f not in FLAGS:
            raise bad(f"flags[{i}]", f"{f!r} is not one of {', '.join(FLAGS)}")
        flags |= FLAGS[f]

    archs = doc.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise bad("architectures", "must be a list of strings (ignored: every ABI of this machine is filtered)")

    syscalls = doc.get("syscalls", [])
    if not isinstance(syscalls, list):
        raise bad("syscalls", "must be a list")
    rules, count, unconditional = [], 0, {}
    for where, r in _objects(syscalls, "syscalls", _RULE_KEYS, "{names, action[, errnoRet, args, comment]}", bad):
        names = r.get("names")
        if not isinstance(names, list) or not names:
            raise bad(where + ".names", "must be a non-empty list of syscall names")
        resolved = []
        for j, n in enumerate(names):
            if not isinstance(n, str) or not n or len(n) > 64 or not n.isascii() or "\0" in n:
                raise bad(f"{where}.names[{j}]", f"{n!r} is not a syscall name")
            nr = resolve(n)
            if nr == -1:
                raise bad(f"{where}.names[{j}]", f"unknown syscall {n!r} (libseccomp does not know it)")
            resolved.append((n, nr))
        if "action" not in r:
            raise bad(where + ".action", "missing")
        action = _action(r["action"], r.get("errnoRet"), where + ".action", where + ".errnoRet", bad)
        args = r.get("args") or []
        if not isinstance(args, list) or len(args) > 6:
            raise bad(where + ".args", "must be a list of at most 6 conditions")
        conds = []
        for aw, a in _objects(args, where + ".args", _ARG_KEYS, "{index, value, valueTwo, op}", bad):
            index = a.get("index")
            if type(index) is not int or not 0 <= index <= 5:
                raise bad(aw + ".index", f"{index!r} is not an argument index 0..5")
            op = a.get("op")
            if not isinstance(op, str) or op not in OPS:
                raise bad(aw + ".op", f"{op!r} is not one of {', '.join(OPS)}")
            vals = []
            for key in ("value", "valueTwo"):
                v = a.get(key, 0)
                if type(v) is not int or not 0 <= v < 1 << 64:
                    raise bad(f"{aw}.{key}", f"{v!r} is not an integer 0 .. 2^64-1")
                vals.append(v)
            if "value" not in a:
                raise bad(aw + ".value", "missing")
            conds.append((index, OPS[op], vals[0], vals[1]))
        if not conds:
            # libseccomp keeps the first and ignores the rest: say so instead.
            for j, (n, _nr) in enumerate(resolved):
                if n in unconditional:
                    raise bad(f"{where}.names[{j}]", f"{n!r} already has a rule without conditions "
                              f"in {unconditional[n]}")
                unconditional[n] = where
        count += len(resolved)
        if count > MAX_RULES:
            raise bad("syscalls", f"more than {MAX_RULES} syscall rules")
        rules.append(Rule(where, tuple(resolved), action, tuple(conds)))
    return Profile(default_action, flags, tuple(rules))


class _ScanContext:
    """What _json.make_scanner reads from json.JSONDecoder."""

    strict = True
    object_hook = None
    parse_float = float
    parse_int = int
    memo = None

    def __init__(self, object_pairs_hook, parse_constant):
        self.object_pairs_hook = object_pairs_hook
        self.parse_constant = parse_constant


def loads(text, object_pairs_hook, parse_constant):
    """json.loads without importing json: one value, whitespace around it."""
    import _json

    scan = _json.make_scanner(_ScanContext(object_pairs_hook, parse_constant))
    ws = " \t\n\r"
    start = len(text) - len(text.lstrip(ws))
    try:
        obj, end = scan(text, start)
    except StopIteration as e:
        raise ValueError(f"expecting a value at character {e.value}") from None
    except SpecError:
        raise  # from a hook
    except Exception:
        # Malformed: _json raises json.decoder's error class, but finds it
        # only if json is imported (else a SystemError): let json say it.
        import json

        return json.loads(text, object_pairs_hook=object_pairs_hook, parse_constant=parse_constant)
    if text[end:].strip(ws):
        raise ValueError(f"extra data after the value at character {end}")
    return obj


def without_userns(profile):
    """--allow-userns: drop unshare, clone and setns from every rule that
    does not allow them and is about user namespaces: no argument conditions,
    or a condition on the CLONE_NEWUSER bit."""
    rules = []
    for r in profile.rules:
        if r.action != ACT_ALLOW and (not r.args or any(_tests_newuser(c) for c in r.args)):
            names = tuple(n for n in r.names if n[0] not in USERNS_CALLS)
            if not names:
                continue
            r = Rule(r.where, names, r.action, r.args)
        rules.append(r)
    return Profile(profile.default_action, profile.flags, tuple(rules))


S_ISUID, S_ISGID = 0o4000, 0o2000
O_CREAT, O_TMPFILE_BIT = 0o100, 0o20000000
ENOSYS = 38
# Where a mode is given to a call that can make a file set-id: (names, the
# mode's argument index, (index, mask) conditions that must also hold).
_SETID_CALLS = (
    (("chmod", "fchmod", "creat"), 1, ()),
    (("fchmodat", "fchmodat2"), 2, ()),
    (("mknod",), 1, ()), (("mknodat",), 2, ()),
    (("open",), 2, ((1, O_CREAT),)), (("open",), 2, ((1, O_TMPFILE_BIT),)),
    (("openat",), 3, ((2, O_CREAT),)), (("openat",), 3, ((2, O_TMPFILE_BIT),)),
)


def without_setid(profile, resolve=None):
    """A transient uid's job: no set-user-ID or set-group-ID file of its
    making (what systemd's RestrictSUIDSGID= does).  A copy with either bit,
    left where the host reaches it, would run as the uid once the job is
    over, and the uid is leased again.  chmod and friends, and a file
    created with either bit (open, openat, creat, mknod), fail EPERM;
    openat2, whose mode seccomp cannot read, fails ENOSYS (callers fall
    back to openat).  A call the profile already has a rule for is left to
    that rule (an admin's allow list)."""
    if resolve is None:
        from starter._native import lib

        def resolve(name):
            return lib.shim_seccomp_resolve(name.encode())

    have = {n for r in profile.rules for n, _ in r.names}
    mask_eq = OPS["SCMP_CMP_MASKED_EQ"]
    rules = list(profile.rules)
    for names, mode_arg, also in _SETID_CALLS:
        known = tuple((n, nr) for n in names if n not in have and (nr := resolve(n)) != -1)
        if not known:
            continue
        for bit in (S_ISUID, S_ISGID):
            conds = tuple((i, mask_eq, m, m) for i, m in also) + ((mode_arg, mask_eq, bit, bit),)
            rules.append(Rule("no set-id files", known, ACT_ERRNO | 1, conds))
    if "openat2" not in have and (nr := resolve("openat2")) != -1:
        rules.append(Rule("no set-id files", (("openat2", nr),), ACT_ERRNO | ENOSYS, ()))
    return Profile(profile.default_action, profile.flags, tuple(rules))


def _tests_newuser(cond):
    _index, op, value, value2 = cond
    if op == OPS["SCMP_CMP_MASKED_EQ"]:
        return bool(value & CLONE_NEWUSER)
    return bool((value | value2) & CLONE_NEWUSER)


def _action(name, errno_ret, where, errno_where, bad):
    if not isinstance(name, str):
        raise bad(where, f"{name!r} is not one of {', '.join(ACTIONS)}")
    if name in UNSUPPORTED_ACTIONS:
        raise bad(where, f"{name} is not supported: it {UNSUPPORTED_ACTIONS[name]}")
    if name not in ACTIONS:
        raise bad(where, f"{name!r} is not one of {', '.join(ACTIONS)}")
    action = ACTIONS[name]
    if action == ACT_ERRNO:
        if errno_ret is None:
            errno_ret = 1  # EPERM, as runc
        if type(errno_ret) is not int or not 1 <= errno_ret <= 4095:
            raise bad(errno_where, f"{errno_ret!r} is not an errno 1..4095")
        return action | errno_ret
    if errno_ret is not None:
        raise bad(errno_where, f"only applies to SCMP_ACT_ERRNO, not {name}")
    return action


def _keys(obj, known, prefix, bad):
    for k in obj:
        if k not in known:
            raise bad(prefix + k, f"unknown key (known: {', '.join(sorted(known))})")


def _objects(items, where, known, shape, bad):
    """-> (where[i], item) for each item of a list that must hold objects
    with only `known` keys."""
    for i, obj in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(obj, dict):
            raise bad(w, f"must be an object {shape}")
        _keys(obj, known, w + ".", bad)
        yield w, obj
