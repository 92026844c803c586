"""One validator per value class: every id, name, number and path that comes
from a command line, a job file or a peer is checked by a function here, and
only here.

A leaf module: it imports nothing of the starter but errors.py, so spec/jobspec.py,
mounts.py, cgroups/, net/, scratch.py and spool/store.py can all use it without an
import cycle, and nothing heavy is loaded on the run path.

Every check raises SpecError(field, message, hint) and returns the value,
normalized where that is the point (a size in bytes, a number as int/float).
The rules:

    job id          1..64 of [A-Za-z0-9_.-], not starting with '-' or '.',
                    no '..'  (becomes file, cgroup and nft names)
    user/group name 1..32 of [A-Za-z0-9_.-], not starting with '-' or '.',
                    no '..'
    numeric id      ASCII digits only, 0..2^32-2 ((uid_t)-1 means "unchanged")
    size            a positive integer of bytes, or a decimal with a unit
                    (K, M, G, T; optional B/iB), ASCII, finite, at most 1 PiB
    number          int or finite float in [lo, hi]; strings ASCII only
    path            absolute, no '..' component, no NUL, at most 4096 bytes;
                    host_path() also takes a relative one and resolves it
                    against the caller's working directory
    file name       one path component: not empty, '.', '..', no '/' or NUL,
                    at most 255 bytes
    interface name  1..15 of [A-Za-z0-9_.-], not starting with '-', not . or ..
    host name       1..64 of [A-Za-z0-9_.-], not starting with '-' or '.'
    env name        [A-Za-z_][A-Za-z0-9_]*
    CIDR, IP        inet_pton's addresses; a network is strict (no host
                    bits), with a prefix length or an IPv4 netmask; ASCII
    SHA-256 digest  64 hex digits, optionally "sha256:" first
    CPU/node list   the kernel's list format (0,2-3): ASCII digits, ',' and
                    '-', ranges low-high, ids below 8192 (cpuset.cpus/mems)

Python's str.isdigit(), int() and float() accept non-ASCII digits ('²', '١'):
every numeric check here requires ASCII first.
"""

import os

from starter.errors import SpecError

MAX_ID = 64
MAX_NAME = 32
MAX_PATH = 4096
MAX_FILENAME = 255
MAX_IFNAME = 15
MAX_HOSTNAME = 64
MAX_NUMERIC_ID = 2**32 - 2
MAX_SIZE = 1 << 50            # 1 PiB: anything above is a typo
MAX_CPU_ID = 8191             # NR_CPUS of the largest x86_64/arm64 configs

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
NAME_CHARS = frozenset(_ALNUM + "_.-")
_ENV_FIRST = frozenset(_ALNUM[:52] + "_")
_ENV_CHARS = frozenset(_ALNUM + "_")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
HEX_DIGITS = frozenset("0123456789abcdef")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def show(value, limit=60):
    """repr() for a message: short, so a 1 MiB hostile value makes a short line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "a huge number"
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def string(field, value):
    """A str without NUL bytes (NUL would cut it short in C) that encodes to
    bytes as the OS does (a JSON "\\ud800" does not; the escapes of a
    command line's non-UTF-8 bytes do)."""
    if not isinstance(value, str):
        raise SpecError(field, f"must be a string, got {type(value).__name__}")
    if "\0" in value:
        raise SpecError(field, "contains a NUL byte")
    if not value.isascii():
        try:
            value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise SpecError(field, f"{show(value)} holds a lone surrogate, not text") from None
    return value


def _token(field, value, max_len, what, leading="-."):
    value = string(field, value)
    if not 1 <= len(value) <= max_len:
        raise SpecError(field, f"{what} must be 1..{max_len} characters, got {len(value)}")
    bad = set(value) - NAME_CHARS
    if bad:
        raise SpecError(field, f"{show(value)} has characters outside [A-Za-z0-9_.-]: {show(''.join(sorted(bad)))}")
    if value[0] in leading or ".." in value:
        raise SpecError(field, f"{show(value)} may not start with {' or '.join(map(repr, leading))} or contain '..'")
    return value


def job_id(field, value):
    """Job ids become file, cgroup and nft names: a strict alphabet."""
    return _token(field, value, MAX_ID, "a job id")


def name(field, value):
    """A user or group name (the portable subset the system databases allow)."""
    return _token(field, value, MAX_NAME, "a user or group name")


def ifname(field, value):
    """A network interface name (IFNAMSIZ - 1); reaches /proc/sys paths and nft."""
    return _token(field, value, MAX_IFNAME, "an interface name", leading="-")


def hostname(field, value):
    return _token(field, value, MAX_HOSTNAME, "a host name")


def is_numeric_id(value):
    """'1000' yes; '²', '١', '+1', ' 1', '1_0' no."""
    return isinstance(value, str) and value.isascii() and value.isdigit()


def numeric_id(field, value):
    """A uid or gid given as digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif is_numeric_id(value) and len(value) <= 20:     # int() of 5000 digits is an error of its own
        n = int(value)
    else:
        raise SpecError(field, f"{show(value)} is not a numeric id (ASCII digits)")
    if not 0 <= n <= MAX_NUMERIC_ID:
        raise SpecError(field, f"{show(value)} is out of range (0 .. {MAX_NUMERIC_ID})")
    return n


def user_or_id(field, value):
    """A user or group given by name or number: -> the name, or the id as int."""
    value = string(field, value)
    if is_numeric_id(value):
        return numeric_id(field, value)
    try:
        return name(field, value)
    except SpecError as e:
        raise SpecError(field, e.detail, "give a name of [A-Za-z0-9_.-] or a numeric id in ASCII digits") from None


def _ascii_number(field, value, what):
    value = string(field, value).strip()
    if not value or not value.isascii() or set(value) - _NUMBER_CHARS:
        raise SpecError(field, f"{show(value)} is not {what}")
    return value


def _finite(field, f, shown):
    if f != f or f in (float("inf"), float("-inf")):
        raise SpecError(field, f"{show(shown)} is not a finite number")
    return f


def size(field, value, max_bytes=MAX_SIZE):
    """512M, 2G, 1.5g, 1048576, 64MiB -> bytes (int)."""
    if isinstance(value, bool):
        raise SpecError(field, "must be a size like 512M, not a boolean")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        n = int(_finite(field, value, value))
    else:
        s = string(field, value).strip().lower()
        if not s.isascii():
            raise SpecError(field, f"{show(value)} is not a size (e.g. 512M, 2G)")
        if s.endswith("ib"):
            s = s[:-2]
        elif s.endswith("b") and len(s) > 1 and not s[-2].isdigit():
            s = s[:-1]
        unit = s[-1:] if s[-1:] in _SIZE_UNITS and not s[-1:].isdigit() else ""
        num = s[: len(s) - len(unit)]
        if not num or set(num) - _NUMBER_CHARS:
            raise SpecError(field, f"{show(value)} is not a size (e.g. 512M, 2G)")
        try:
            f = float(num)
        except ValueError:
            raise SpecError(field, f"{show(value)} is not a size (e.g. 512M, 2G)") from None
        if f != f or not -max_bytes <= f <= max_bytes:     # nan, +-inf, 1e400, or just too big
            raise SpecError(field, f"{show(value)} is out of range (1 byte .. {_bytes(max_bytes)})")
        n = int(f * _SIZE_UNITS[unit])
    if not 0 < n <= max_bytes:
        raise SpecError(field, f"{show(value)} is out of range (1 byte .. {_bytes(max_bytes)})")
    return n


def _bytes(n):
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def number(field, value, lo, hi, integer=False):
    """An int (integer=True) or a finite float in [lo, hi]; strings are parsed."""
    what = "an integer" if integer else "a number"
    if isinstance(value, bool):
        raise SpecError(field, f"must be {what}, not a boolean")
    if isinstance(value, str):
        s = _ascii_number(field, value, what)
        try:
            value = int(s) if integer else float(s)
        except ValueError:
            raise SpecError(field, f"{show(s)} is not {what}") from None
    if not isinstance(value, (int, float)):
        raise SpecError(field, f"must be {what}, got {type(value).__name__}")
    if integer and not isinstance(value, int):
        raise SpecError(field, f"{show(value)} must be an integer")
    if isinstance(value, float):
        _finite(field, value, value)
    if not lo <= value <= hi:
        raise SpecError(field, f"{show(value)} is out of range ({lo} .. {hi})")
    return value


def duration(field, value, lo, hi):
    """Seconds, as a finite number in [lo, hi]."""
    return number(field, value, lo, hi)


def path(field, value, must_exist=False):
    """An absolute path without '..' components."""
    value = string(field, value)
    if not value.startswith("/"):
        raise SpecError(field, f"{show(value)} must be an absolute path")
    if len(value) > MAX_PATH:
        raise SpecError(field, "path too long")
    if "/../" in value + "/":
        raise SpecError(field, f"{show(value)} may not contain '..'")
    if must_exist and not os.path.exists(value):
        raise SpecError(field, f"{show(value)} does not exist")
    return value


def host_path(field, value, must_exist=False):
    """A path in the caller's view: a relative one is resolved against the
    caller's working directory ("r.json" -> "/home/alice/r.json")."""
    value = string(field, value)
    if value and not value.startswith("/"):
        if "/../" in "/" + value + "/":
            raise SpecError(field, f"{show(value)} may not contain '..'")
        try:
            cwd = os.getcwd()
        except OSError:
            raise SpecError(field, f"{show(value)} is relative and the current directory is gone",
                            "give an absolute path") from None
        value = os.path.normpath(os.path.join(cwd, value))
    return path(field, value, must_exist)


def filename(field, value):
    """One path component, as a name inside a directory."""
    value = string(field, value)
    if value in ("", ".", "..") or "/" in value or len(value.encode("utf-8", "surrogateescape")) > MAX_FILENAME:
        raise SpecError(field, f"{show(value)} is not a plain file name",
                        "no '/', not empty, '.' or '..', at most 255 bytes")
    return value


def env_name(field, value):
    value = string(field, value)
    if not value or value[0] not in _ENV_FIRST or set(value) - _ENV_CHARS:
        raise SpecError(field, f"{show(value)} is not a valid variable name")
    return value


def _parse_ip(text):
    """-> (family, packed bytes) or None.  inet_pton, not `ipaddress`: that
    module pulls in functools and collections, +4 ms on every NAT start.
    Both refuse IPv4 octets with leading zeros and IPv6 zone suffixes here."""
    import _socket

    for family in (_socket.AF_INET, _socket.AF_INET6):
        try:
            return family, _socket.inet_pton(family, text)
        except OSError:
            pass
    return None


def _ntop(family, packed):
    import _socket

    return _socket.inet_ntop(family, packed)


def cidr(field, value):
    """A network, strictly (no host bits): "10.0.0.0/8", "fd00::/64", an
    address alone (a /32 or /128), or an IPv4 netmask ("10.0.0.0/255.0.0.0").
    -> its canonical text, "address/prefixlen"."""
    value = string(field, value)
    if not value.isascii() or len(value) > 64:
        raise SpecError(field, f"{show(value)} is not a network (ASCII, like 10.0.0.0/8)")
    addr, slash, plen = value.partition("/")
    ip = _parse_ip(addr)
    if ip is None:
        raise SpecError(field, f"{show(addr)} does not appear to be an IPv4 or IPv6 address",
                        "give a network such as 10.0.0.0/8 or fd00::/64")
    family, packed = ip
    bits = len(packed) * 8
    if not slash:
        prefixlen = bits
    elif plen.isdigit() and len(plen) <= 3:
        prefixlen = int(plen)
    elif len(packed) == 4 and (mask := _parse_ip(plen)) is not None and len(mask[1]) == 4:
        m = int.from_bytes(mask[1], "big")
        prefixlen = 32 - ((~m & 0xFFFFFFFF).bit_length())
        if m != (0xFFFFFFFF << (32 - prefixlen)) & 0xFFFFFFFF:
            raise SpecError(field, f"{show(plen)} is not a valid netmask")
    else:
        raise SpecError(field, f"{show(plen)} is not a valid netmask or prefix length")
    if prefixlen > bits:
        raise SpecError(field, f"{show(plen)} is not a valid prefix length (at most {bits})")
    if int.from_bytes(packed, "big") & ((1 << (bits - prefixlen)) - 1):
        raise SpecError(field, f"{value} has host bits set",
                        "give the network's first address, e.g. " + ("10.0.0.0/8" if bits == 32 else "fd00::/64"))
    return f"{_ntop(family, packed)}/{prefixlen}"


def ip_address(field, value):
    """An IPv4 or IPv6 address -> its canonical text."""
    value = string(field, value)
    if not value.isascii() or len(value) > 64:
        raise SpecError(field, f"{show(value)} is not an IP address")
    ip = _parse_ip(value)
    if ip is None:
        raise SpecError(field, f"{show(value)} does not appear to be an IPv4 or IPv6 address")
    return _ntop(*ip)


def sha256_digest(field, value):
    """64 hex digits, any case, optionally "sha256:" first (as some tools
    print it) -> lower case, no prefix."""
    text = string(field, value).strip().lower()
    if text.startswith("sha256:"):
        text = text[7:]
    if len(text) != 64 or set(text) - HEX_DIGITS:
        raise SpecError(field, f"{show(value)} is not a SHA-256 digest",
                        "give 64 hex digits, e.g. from `sha256sum FILE`")
    return text


RLIM_INFINITY = 2**64 - 1


def rlimit_value(field, name, text):
    """One side of a resource limit: a count, a size (64M) or 'unlimited'."""
    t = text.strip().lower()
    if t in ("unlimited", "infinity"):
        return RLIM_INFINITY
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and t[-1:] else ""
    num = t[: len(t) - len(unit)]
    if not (num.isascii() and num.isdigit()):
        raise SpecError(field, f"{name}: {show(text)} is not a number, a size (64M) or 'unlimited'")
    if len(num) > 20 or int(num) * _SIZE_UNITS[unit] >= RLIM_INFINITY:
        raise SpecError(field, f"{name}: {show(text)} is too large (use 'unlimited')")
    return int(num) * _SIZE_UNITS[unit]


def id_list(field, value, what="CPU"):
    """The kernel's list format ("0,2-3", as cpuset.cpus reads) -> a sorted
    tuple of distinct ids.  An int is one id.  Empty is refused: a cpuset
    with no CPU runs nothing."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    s = string(field, value).strip()
    ids = set()
    for part in s.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo or (dash and not hi) or not (lo + hi).isascii() or not (lo + hi).isdigit() \
                or len(lo) > 5 or len(hi) > 5:
            raise SpecError(field, f"{show(value)} is not a {what} list like 0,2-3")
        a, b = int(lo), int(hi) if dash else int(lo)
        if a > b or b > MAX_CPU_ID:
            raise SpecError(field, f"{show(value)}: {part.strip()} is not a range of {what} ids (0..{MAX_CPU_ID})")
        ids.update(range(a, b + 1))
    return tuple(sorted(ids))


def format_id_list(ids):
    """(0, 2, 3) -> "0,2-3" (what cpuset.cpus takes and shows)."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)
