"""The names of the spool's files: what this module owns.

An entry is ``exe-<EscapedOwner>-<CmdHash>``, with the escaping of the
shared-spool proposal (docs/design.md, Background): every byte outside
``[A-Za-z0-9_.]`` becomes ``%XX``, so ``-`` (the separator) and ``%`` (the
escape) never appear raw inside a key or value and the name maps back to
exactly one (owner, attributes) list.  A CmdHash is
``KEY1-VALUE1-KEY2-VALUE2`` (e.g. ``CmdHashSHA256-<hex>``), or ``invalid``:
no hash, a private copy.  Beside the entries: the lock (``.lock``), the
link state (``.linkstate``, spool/links.py) and temp files
(``.tmp-<pid>-<random>``).

Pure: no file is opened here (spool/store.py is the store, spool/links.py the link
state); a leaf but for values.py and errors.py.
"""

from starter.spec import values
from starter.errors import SpecError

INVALID = "invalid"
PREFIX = "exe-"
LOCK_NAME = ".lock"
LINKSTATE_NAME = ".linkstate"
TMP_PREFIX = ".tmp-"
NAME_MAX = 255

#: hash attribute name -> hashlib constructor name
HASH_ATTRS = {
    "CmdHashSHA256": "sha256",
    "CmdHashSHA512": "sha512",
    "CmdHashSHA1": "sha1",
    "CmdHashMD5": "md5",
}

# The name characters (values.NAME_CHARS) but "-", which separates the parts.
_SAFE = frozenset("".join(values.NAME_CHARS - {"-"}).encode())
_HEX = "0123456789ABCDEF"


def escape(value):
    """The proposal's escaping: bytes outside [A-Za-z0-9_.] become %XX (uppercase hex).

    Non-ASCII text is escaped byte by byte of its UTF-8 encoding.  Injective:
    '%' itself is escaped, so unescape() recovers the input exactly.
    """
    data = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)
    out = []
    for b in data:
        if b in _SAFE:
            out.append(chr(b))
        else:
            out.append("%" + _HEX[b >> 4] + _HEX[b & 15])
    return "".join(out)


def unescape(text):
    """Inverse of escape(); raises ValueError on text escape() cannot produce."""
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "%":
            h = text[i + 1 : i + 3]
            if len(h) != 2 or any(x not in _HEX for x in h):
                raise ValueError(f"bad escape at offset {i} in {text!r}")
            out.append(int(h, 16))
            i += 3
        elif ord(c) < 128 and ord(c) in _SAFE:
            out.append(ord(c))
            i += 1
        else:
            raise ValueError(f"unescaped character {c!r} at offset {i} in {text!r}")
    return out.decode("utf-8", "surrogateescape")


def encode_cmdhash(pairs):
    """[(key, value), ...] -> "KEY1-VALUE1-KEY2-VALUE2" with every part escaped."""
    pairs = list(pairs)
    if not pairs:
        return INVALID
    return "-".join(escape(k) + "-" + escape(v) for k, v in pairs)


def decode_cmdhash(cmdhash):
    """Inverse of encode_cmdhash(); ValueError if it is not one."""
    parts = cmdhash.split("-")
    if cmdhash == INVALID or len(parts) % 2:
        raise ValueError(f"not a CmdHash: {cmdhash!r}")
    vals = [unescape(p) for p in parts]
    return list(zip(vals[0::2], vals[1::2]))


def hash_name(owner, cmdhash):
    """File name of the spool entry: exe-<EscapedOwner>-<CmdHash>."""
    return PREFIX + escape(check_owner(owner)) + "-" + cmdhash


def parse_name(name):
    """exe-<EscapedOwner>-<CmdHash> -> (owner, cmdhash); ValueError otherwise."""
    if not name.startswith(PREFIX):
        raise ValueError(f"not a spool entry: {name!r}")
    esc_owner, sep, cmdhash = name[len(PREFIX) :].partition("-")
    if not sep:
        raise ValueError(f"not a spool entry: {name!r}")
    decode_cmdhash(cmdhash)
    return unescape(esc_owner), cmdhash


def check_owner(owner):
    """Any owner that is a plain file name (values.filename); escape() makes
    it safe and injective."""
    return values.filename("owner", owner)


def check_cmdhash(cmdhash):
    if cmdhash == INVALID:
        return cmdhash
    try:
        decode_cmdhash(cmdhash)
    except ValueError as e:
        raise SpecError("cmdhash", str(e), hint="pass the value `starter spool add` printed, or 'invalid'") from None
    return cmdhash


def check_attrs(hash_attrs):
    """The hash attribute names asked for, as a list; SpecError for an unknown one."""
    attrs = [hash_attrs] if isinstance(hash_attrs, str) else list(hash_attrs)
    for a in attrs:
        if a not in HASH_ATTRS:
            raise SpecError("hash_attrs", f"unknown hash attribute {a!r}", hint="use one of " + ", ".join(HASH_ATTRS))
    return attrs
