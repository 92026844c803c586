"""A multi-node job's peers (--net job): who they are and where (pure).

    expand_hostlist("n[1-3,7],gpu[01-02]")  -> ["n1", "n2", "n3", "n7", "gpu01", "gpu02"]
    parse("n1=10.0.0.1,n2", resolve)         -> (("n1", "10.0.0.1"), ("n2", <resolved>))
    vni_of("4242")                          -> 4242

The peer list is what the batch system already gives: Slurm's
SLURM_JOB_NODELIST, a hostlist expression, or --peers.  A peer is NAME
(looked up with the host's resolver) or NAME=ADDRESS (its fabric address:
what the harness and sites without DNS for their fabric use).  Every node of
a job expands the same list, so a node's index in it, and with that its
address in the job's network, is the same everywhere.
"""

from starter.errors import SpecError
from starter.spec import values as V

MAX_PEERS = 4096      # the job network's addresses: one /16, index + 1 each
VNI_MAX = (1 << 24) - 1


def expand_hostlist(field, text):
    """Slurm's hostlist syntax -> the names, in order, repeats dropped:
    comma-separated items, each with any number of [ranges] (a range is
    N, N-M; a zero-padded N keeps its width)."""
    text = V.string(field, text)
    if len(text) > 65536:
        raise SpecError(field, "the host list is too long")
    out = {}
    for item in _split_top(field, text):
        for name in _expand(field, item):
            out[V.hostname(field, name)] = None
            if len(out) > MAX_PEERS:
                raise SpecError(field, f"more than {MAX_PEERS} nodes")
    if not out:
        raise SpecError(field, "names no node")
    return list(out)


def _split_top(field, text):
    """Split at the commas outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SpecError(field, f"{V.show(text)}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SpecError(field, f"{V.show(text)}: a ']' without its '['")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SpecError(field, f"{V.show(text)}: a '[' without its ']'")
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def _expand(field, item):
    """One item with its bracket groups -> its names (the product of the groups)."""
    open_ = item.find("[")
    if open_ < 0:
        return [item]
    close = item.index("]", open_)
    head, body, tail = item[:open_], item[open_ + 1:close], item[close + 1:]
    rest = _expand(field, tail)
    out = []
    for part in body.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (dash and not (hi.isascii() and hi.isdigit())):
            raise SpecError(field, f"{V.show(item)}: {V.show(part)} is not N or N-M")
        if len(lo) > 9 or len(hi) > 9:
            raise SpecError(field, f"{V.show(item)}: {V.show(part)} is too large")
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise SpecError(field, f"{V.show(item)}: {V.show(part)} runs backwards")
        if (b - a + 1) * len(rest) > MAX_PEERS:
            raise SpecError(field, f"more than {MAX_PEERS} nodes")
        width = len(lo) if lo.startswith("0") else 0
        out += [f"{head}{n:0{width}d}{r}" for n in range(a, b + 1) for r in rest]
    return out


def parse(field, text, resolve):
    """--peers text (a hostlist whose items may carry =ADDRESS) -> ((name,
    address), ...) in order; resolve(name) -> address for a bare name
    (raises SpecError when it cannot).  All addresses of one family."""
    items = []
    for item in _split_top(field, V.string(field, text)):
        name, eq, addr = item.partition("=")
        if eq:
            items.append((V.hostname(field, name.strip()), V.ip_address(field, addr.strip())))
        else:
            items += [(n, None) for n in expand_hostlist(field, name)]
    seen, out = set(), []
    for name, addr in items:
        if name in seen:
            raise SpecError(field, f"node {name} is named twice")
        seen.add(name)
        out.append((name, addr if addr is not None else resolve(name)))
        if len(out) > MAX_PEERS:
            raise SpecError(field, f"more than {MAX_PEERS} nodes")
    if not out:
        raise SpecError(field, "names no node")
    if len({":" in a for _n, a in out}) > 1:
        raise SpecError(field, "mixes IPv4 and IPv6 addresses: the fabric is one family")
    return tuple(out)


def resolve(name):
    """A node's fabric address by the host's resolver (first answer, IPv4
    before IPv6 as getaddrinfo orders them)."""
    import _socket

    try:
        infos = _socket.getaddrinfo(name, None, 0, _socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as e:
        raise SpecError("peers", f"node {name}: no address ({e})",
                        "give it as NAME=ADDRESS, or fix the node's name resolution") from None
    return infos[0][4][0]


def vni_of(field, net_id):
    """The job network's VXLAN id from its id, the same on every node: a
    number (a batch job id) is itself, modulo 2^24 - 1 (0 is not a VNI);
    anything else hashed.  Two jobs whose ids map to one VNI would share a
    segment, so ids are expected to be the batch system's: unique while
    the jobs run."""
    net_id = V.string(field, net_id)
    if net_id.isascii() and net_id.isdigit() and len(net_id) <= 20:
        n = int(net_id) % VNI_MAX
        return n or VNI_MAX
    V.job_id(field, net_id)
    import hashlib

    n = int.from_bytes(hashlib.sha256(net_id.encode()).digest()[:3], "big")
    return n or VNI_MAX
