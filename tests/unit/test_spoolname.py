"""The spool's names (starter/spool/names.py): the escaping, CmdHash encoding and
entry names.  Pure: the fast tier."""

import random

import pytest

from starter.spool import names as sn

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


@pytest.mark.parametrize(
    "raw, escaped",
    [
        ("de-smet", "de%2Dsmet"),
        ("+", "%2B"),
        (":", "%3A"),
        ("/", "%2F"),
        ("%", "%25"),
        ("\\", "%5C"),
        ("adesmet", "adesmet"),
        ("a b", "a%20b"),
        ("CmdHashMD5", "CmdHashMD5"),
        ("d41d8cd98f00b204e9800998ecf8427e", "d41d8cd98f00b204e9800998ecf8427e"),
        ("x_y.z", "x_y.z"),
        ("", ""),
    ],
)
def test_escape_seed_examples(raw, escaped):
    assert sn.escape(raw) == escaped
    assert sn.unescape(escaped) == raw


def test_escape_every_ascii_character():
    allowed = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.")
    for code in range(128):
        c = chr(code)
        want = c if c in allowed else "%%%02X" % code
        assert sn.escape(c) == want, (code, sn.escape(c))
        assert sn.unescape(want) == c


def test_escape_non_ascii_is_per_utf8_byte():
    assert sn.escape("é") == "%C3%A9"
    assert sn.escape("日") == "%E6%97%A5"
    assert sn.escape(b"\xff\x00") == "%FF%00"
    for s in ["é", "日本", "ünïcødé-x", "\U0001f600"]:
        assert sn.unescape(sn.escape(s)) == s
        assert all(ord(c) < 128 for c in sn.escape(s))


def test_unescape_rejects_what_escape_cannot_produce():
    for bad in ["%", "%2", "%zz", "a-b", "a b", "%2d"]:  # lowercase hex is never produced
        with pytest.raises(ValueError):
            sn.unescape(bad)


def test_cmdhash_format_and_seed_example():
    md5 = "d41d8cd98f00b204e9800998ecf8427e"
    assert sn.encode_cmdhash([("CmdHashMD5", md5)]) == f"CmdHashMD5-{md5}"
    assert sn.hash_name("adesmet", f"CmdHashMD5-{md5}") == f"exe-adesmet-CmdHashMD5-{md5}"
    assert sn.hash_name("de-smet", "K-V") == "exe-de%2Dsmet-K-V"
    assert sn.parse_name("exe-de%2Dsmet-K-V") == ("de-smet", "K-V")
    assert sn.encode_cmdhash([]) == sn.INVALID
    assert sn.encode_cmdhash([("a-b", "c"), ("d", "")]) == "a%2Db-c-d-"


def test_separator_tricks_do_not_collide():
    # owner "a-b" + hash "c-d" must differ from owner "a" + hash "b-c-d"
    names = {
        sn.hash_name("a-b", sn.encode_cmdhash([("c", "d")])),
        sn.hash_name("a", sn.encode_cmdhash([("b", "c-d")])),
        sn.hash_name("a", sn.encode_cmdhash([("b-c", "d")])),
        sn.hash_name("a%2Db", sn.encode_cmdhash([("c", "d")])),
        sn.hash_name("a", sn.encode_cmdhash([("b", "c"), ("d", "")])),
    }
    assert len(names) == 5


def test_escape_injective_randomized():
    rnd = random.Random(31)
    alphabet = "aZ9_.-%+:/ é\x00\x7f-%2D"
    seen = {}
    for _ in range(20000):
        owner = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6)))
        if owner in (".", "..") or "/" in owner or "\0" in owner:
            continue
        pairs = [
            ("".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 4))),
             "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 4))))
            for _ in range(rnd.randint(1, 3))
        ]
        name = sn.hash_name(owner, sn.encode_cmdhash(pairs))
        key = (owner, tuple(pairs))
        assert seen.setdefault(name, key) == key, f"collision: {seen[name]} vs {key}"
        o, ch = sn.parse_name(name)
        assert (o, sn.decode_cmdhash(ch)) == (owner, pairs)
        assert "/" not in name and "\0" not in name
