"""Syscall filter profiles as data (starter/isolate/seccomp/profile.py): the
default profile's shape, actions, flags and pseudo-syscalls on fixture
text, each parse error, dropping the user-namespace rules, and compiling a
profile to BPF with libseccomp (no privilege needed).  The filter in a
running job is in tests/test_seccomp.py."""

import errno

import pytest

from starter.isolate.seccomp import profile as P
from test_seccomp import DEFAULT     # the default profile's path, shared with the root tests

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

NUMBERS = {"keyctl": 250, "unshare": 272, "clone": 56, "setns": 308, "bpf": 321, "vm86": -10001}


def parse(text):
    return P.parse(text.encode(), "t.json", resolve=lambda n: NUMBERS.get(n, -1))


def test_parse_default_profile_shape():
    prof = P.parse(open(DEFAULT, "rb").read(), "default")
    assert prof.default_action == P.ACT_ALLOW and prof.flags == 0
    actions = {n: r.action for r in prof.rules for n, _ in r.names}
    assert actions["clone3"] == P.ACT_ERRNO | errno.ENOSYS
    assert actions["keyctl"] == P.ACT_ERRNO | errno.EPERM
    (newuser,) = [r for r in prof.rules if ("unshare", 272) in r.names]
    assert newuser.args == ((0, P.OPS["SCMP_CMP_MASKED_EQ"], P.CLONE_NEWUSER, P.CLONE_NEWUSER),)


def test_parse_actions_flags_and_pseudo_syscalls():
    prof = parse('''{"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
        "flags": ["SECCOMP_FILTER_FLAG_LOG"], "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [{"names": ["keyctl", "vm86"], "action": "SCMP_ACT_ALLOW", "comment": "x"},
                     {"names": ["bpf"], "action": "SCMP_ACT_KILL_PROCESS"},
                     {"names": ["setns"], "action": "SCMP_ACT_LOG",
                      "args": [{"index": 1, "value": 18446744073709551615, "op": "SCMP_CMP_NE"}]}]}''')
    assert prof.default_action == P.ACT_ERRNO | 38 and prof.flags == 2
    assert [r.names for r in prof.rules] == [(("keyctl", 250), ("vm86", -10001)), (("bpf", 321),), (("setns", 308),)]
    assert [r.action for r in prof.rules] == [P.ACT_ALLOW, 0x80000000, 0x7FFC0000]
    assert prof.rules[2].args == ((1, 1, 2**64 - 1, 0),)


@pytest.mark.parametrize("text,message", [
    ('{"defaultAction": "SCMP_ACT_ALLOW"} x', "extra data"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"args": [{"index": 0, "value": NaN, "op": "SCMP_CMP_EQ"}]}]}', "NaN is not a number"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": [], "action": "SCMP_ACT_ERRNO"}]}',
     "syscalls[0].names: must be a non-empty list"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"]}]}', "syscalls[0].action: missing"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_TRAP", "errnoRet": 1}]}',
     "errnoRet: only applies to SCMP_ACT_ERRNO"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"args": [{"index": 0, "value": -1, "op": "SCMP_CMP_EQ"}]}]}', "value: -1 is not an integer"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"args": [{"index": 0, "value": 1, "op": "EQ"}]}]}', "op: 'EQ' is not one of"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["bpf"], "action": "SCMP_ACT_ERRNO", '
     '"includes": {}}]}', "syscalls[0].includes: unknown key"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "flags": ["SECCOMP_FILTER_FLAG_TSYNC"]}', "flags[0]"),
    ('{"defaultAction": "SCMP_ACT_TRACE"}', "SCMP_ACT_TRACE is not supported"),
    (b'{"defaultAction": "\xff"}', "not UTF-8"),
])
def test_parse_errors(text, message):
    data = text if isinstance(text, bytes) else text.encode()
    with pytest.raises(P.SpecError) as e:
        P.parse(data, "t.json", resolve=lambda n: NUMBERS.get(n, -1))
    assert str(e.value).startswith("seccomp: t.json: ") and message in str(e.value), str(e.value)


def test_without_userns_drops_only_user_namespace_rules():
    prof = parse('''{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["unshare", "clone"], "action": "SCMP_ACT_ERRNO",
         "args": [{"index": 0, "value": 268435456, "valueTwo": 268435456, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["setns", "keyctl"], "action": "SCMP_ACT_ERRNO"},
        {"names": ["clone"], "action": "SCMP_ACT_ERRNO",
         "args": [{"index": 0, "value": 1073741824, "valueTwo": 1073741824, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["unshare"], "action": "SCMP_ACT_ALLOW"}]}''')
    out = P.without_userns(prof)
    assert [[n for n, _ in r.names] for r in out.rules] == [["keyctl"], ["clone"], ["unshare"]]


def test_compiling_to_bpf_needs_no_root():
    """native/seccomp.c compiles in the parent with libseccomp: no privilege,
    so it is in the fast tier.  One sock_filter is 8 bytes; dropping the
    user-namespace rules makes a different, shorter program."""
    from starter.isolate import seccomp

    data = open(DEFAULT, "rb").read()
    full, userns = seccomp.compile_bytes(data, "default"), seccomp.compile_bytes(data, "default", allow_userns=True)
    assert full.bpf and len(full.bpf) % 8 == 0 and full.flags == 0
    assert len(userns.bpf) < len(full.bpf)
    with pytest.raises(P.SpecError, match="seccomp: bad.json: "):
        seccomp.compile_bytes(b'{"defaultAction": "SCMP_ACT_NOPE"}', "bad.json")
