"""Forget a dead job's connection-tracking entries, over ctnetlink.

Why: after a job ends, the host's conntrack table still holds its flows
(an established TCP flow lingers for days, a closing one for minutes).  If
its address is leased to the next job while they exist, late replies of the
old job's connections would be translated to the new job (data of one job
delivered to another), and the new job's connections may clash with them.
So teardown deletes them before the lease is released, and the address can
be handed out again at once.

By mark, one flush per job: every new connection of a job gets the job's
conntrack mark (nftrules.job_mark) in the table's nat chains, so one flush
filtered by that mark (IPCTNL_MSG_CT_DELETE with CTA_MARK, no tuple: the
kernel walks its table once and deletes the matches itself) takes all of a
job's entries, both families, with nothing for Python to parse: ~35x less
time than one dump of a small table or four filtered dumps of a big one
(scripts/bench.d/conntrack.py; docs/benchmarks.md).  The caller says which jobs' marks
can be trusted (wiring._marks: not where a site's rule marked a job's
connection first, nor in a table rebuilt under running jobs); the others
are found by address, below.

By address: only entries whose ORIGINAL tuple has one of the job's
addresses as source or destination.  Jobs cannot be reached from outside
(job_in drops new inbound flows), so every flow of a job starts at its
address (source) or, for the host talking to it, ends there (destination).
The host's own flows never carry a pool address, so they are never touched.

How: a dump walks every bucket of the kernel's hash table, entries or not
(262144 buckets here: ~10 ms of kernel CPU per walk with 8 entries).  So
while the table is small (at most SMALL_TABLE entries, from
nf_conntrack_count), ONE dump of every family serves all the addresses, and
the entries are matched here.  A bigger table is dumped per family,
address and direction with a filter in the kernel (CTA_FILTER in recent
kernels; an older one ignores the filter and dumps everything, which is why
every entry is checked again here), so Python never parses a big table.
Then one IPCTNL_MSG_CT_DELETE per match names the entry by the original
tuple exactly as the kernel sent it (plus its zone).  Family-agnostic: give
IPv4 and IPv6 addresses alike, of one job or of several.
Reads and deletes only; no conntrack tool, no pyroute2.
"""

import errno
import ipaddress
import socket
import struct

from starter.net import netlink

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_CTNETLINK = 1
_IPCTNL_MSG_CT_NEW, _IPCTNL_MSG_CT_GET, _IPCTNL_MSG_CT_DELETE = 0, 1, 2
_CTA_TUPLE_ORIG, _CTA_MARK, _CTA_ZONE, _CTA_MARK_MASK, _CTA_FILTER = 1, 8, 18, 21, 25
_CTA_TUPLE_IP = 1
_CTA_IP_V4_SRC, _CTA_IP_V4_DST, _CTA_IP_V6_SRC, _CTA_IP_V6_DST = 1, 2, 3, 4
_CTA_FILTER_ORIG_FLAGS = 1
_FILTER_IP_SRC, _FILTER_IP_DST = 1 << 0, 1 << 1
# family -> (source attribute, destination attribute)
_ATTRS = {socket.AF_INET: (_CTA_IP_V4_SRC, _CTA_IP_V4_DST), socket.AF_INET6: (_CTA_IP_V6_SRC, _CTA_IP_V6_DST)}


def _msg(mtype, flags, seq, family, attrs):
    body = struct.pack("=BBH", family, 0, 0) + attrs
    return netlink.message((_NFNL_SUBSYS_CTNETLINK << 8) | mtype, flags, seq, body)


def dump_request(family, packed_addr, direction, seq):
    """A dump of the entries whose original source (direction 0) or
    destination (1) is packed_addr, filtered by the kernel (pure)."""
    attr = _ATTRS[family][direction]
    tup = netlink.attr(_CTA_TUPLE_IP | netlink.NLA_F_NESTED, netlink.attr(attr, packed_addr))
    flt = netlink.attr(_CTA_FILTER_ORIG_FLAGS, struct.pack("=I", _FILTER_IP_SRC if direction == 0 else _FILTER_IP_DST))
    attrs = netlink.attr(_CTA_TUPLE_ORIG | netlink.NLA_F_NESTED, tup) + netlink.attr(_CTA_FILTER | netlink.NLA_F_NESTED, flt)
    return _msg(_IPCTNL_MSG_CT_GET, netlink.NLM_F_REQUEST | netlink.NLM_F_DUMP, seq, family, attrs)


def flush_mark_request(mark, seq):
    """A flush of every entry (both families) whose mark is `mark` (pure):
    a DELETE with no tuple is a flush; CTA_MARK with an all-ones
    CTA_MARK_MASK filters it."""
    attrs = netlink.attr(_CTA_MARK, struct.pack(">I", mark)) + netlink.attr(_CTA_MARK_MASK, struct.pack(">I", 0xffffffff))
    return _msg(_IPCTNL_MSG_CT_DELETE, netlink.NLM_F_REQUEST | netlink.NLM_F_ACK, seq, socket.AF_UNSPEC, attrs)


def parse_entries(data, family, packed_addrs):
    """-> ([raw CTA_TUPLE_ORIG + CTA_ZONE attributes of each matching entry],
    done, -errno or 0) from a chunk of dump replies (pure).  An entry matches
    if its original source or destination is one of packed_addrs."""
    src_attr, dst_attr = _ATTRS[family]
    out, done, err = [], False, 0
    for mtype, _seq, msg in netlink.messages(data):
        if mtype == netlink.NLMSG_DONE:
            done = True
        elif mtype == netlink.NLMSG_ERROR:
            err = netlink.error_code(msg)
            done = True
        elif mtype == (_NFNL_SUBSYS_CTNETLINK << 8) | _IPCTNL_MSG_CT_NEW and len(msg) >= 4:
            if msg[0] != family:
                continue
            orig = zone = None
            for kind, val, raw in netlink.attrs(msg[4:]):
                if kind == _CTA_TUPLE_ORIG:
                    orig = (val, raw)
                elif kind == _CTA_ZONE:
                    zone = raw
            if orig is None:
                continue
            addrs = set()
            for kind, val, _raw in netlink.attrs(orig[0]):
                if kind == _CTA_TUPLE_IP:
                    addrs |= {v for k, v, _r in netlink.attrs(val) if k in (src_attr, dst_attr)}
            if addrs & packed_addrs:
                out.append(orig[1] + (zone or b""))
    return out, done, err


SMALL_TABLE = 2048      # entries: below this, one unfiltered walk (see above)


def dump_all_request(seq):
    """A dump of every entry of every family (pure)."""
    return _msg(_IPCTNL_MSG_CT_GET, netlink.NLM_F_REQUEST | netlink.NLM_F_DUMP, seq, socket.AF_UNSPEC, b"")


def _table_size():
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def forget(addresses, marks=None):
    """Delete every conntrack entry of these addresses (IPv4 and/or IPv6) in
    the caller's network namespace.  marks: {mark: [the addresses whose
    entries all carry it]}: those go by one flush per mark, the rest by
    address.  -> how many were deleted by address (a flush does not say).
    A kernel without conntrack has nothing to forget (0)."""
    marks = marks or {}
    covered = {a for addrs in marks.values() for a in addrs}
    by_family = {}
    for a in addresses:
        if a in covered:
            continue
        ip = ipaddress.ip_address(a)
        fam = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        by_family.setdefault(fam, set()).add(ip.packed)
    if not by_family and not marks:
        return 0
    deleted = 0
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_NETFILTER)
    except OSError as e:
        if e.errno in (errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT):
            return 0
        raise
    with s:
        s.settimeout(5.0)
        s.bind((0, 0))
        seq = 1 << 20           # (above the dumps' and deletes' numbers)
        for mark in sorted(marks):
            seq += 1
            _flush(s, flush_mark_request(mark, seq), seq)
        if not by_family:
            return 0
        size = _table_size()
        if size is not None and size <= SMALL_TABLE:
            found = _dump_all(s, dump_all_request(1), by_family)
        else:
            found, seq = {fam: [] for fam in by_family}, 0
            for fam, packed in sorted(by_family.items()):
                for addr in sorted(packed):
                    for direction in (0, 1):
                        seq += 1
                        found[fam] += _dump(s, dump_request(fam, addr, direction, seq), fam, packed)
        deleted, seq = 0, 1 << 16       # (above the dumps' numbers)
        for fam, matches in sorted(found.items()):
            matches = list(dict.fromkeys(matches))      # a flow of two job addresses is dumped twice
            deleted += _delete(s, fam, matches, seq)
            seq += len(matches)
    return deleted


def _flush(s, request, seq):
    """Send one flush and wait for its ack (the kernel has walked its table
    and deleted the matches by then)."""
    s.send(request)
    ((_replies, err),) = netlink.collect(s, seq, 1)
    if err and err not in (-errno.ENOENT, -errno.EOPNOTSUPP, -errno.EPROTONOSUPPORT):
        raise OSError(-err, f"conntrack flush: {errno.errorcode.get(-err, -err)}")


def _dump_all(s, request, by_family):
    """Send a dump request -> {family: [entries matching by_family[family]]}.
    A namespace without conntrack has nothing to forget."""
    s.send(request)
    found = {fam: [] for fam in by_family}
    done = False
    while not done:
        data = s.recv(1 << 17)
        for fam, packed in by_family.items():
            got, done, err = parse_entries(data, fam, packed)
            found[fam] += got
    if err in (-errno.ENOENT, -errno.EOPNOTSUPP, -errno.EPROTONOSUPPORT):
        return {fam: [] for fam in by_family}
    if err:
        raise OSError(-err, f"conntrack dump: {errno.errorcode.get(-err, -err)}")
    return found


def _dump(s, request, family, packed):
    return _dump_all(s, request, {family: packed})[family]


def _delete(s, family, matches, seq):
    """One acked DELETE per entry; ENOENT (it timed out meanwhile) is fine."""
    if not matches:
        return 0
    msgs = [_msg(_IPCTNL_MSG_CT_DELETE, netlink.NLM_F_REQUEST | netlink.NLM_F_ACK, seq + 1 + i, family, attrs)
            for i, attrs in enumerate(matches)]
    # Batches small enough for the socket buffer; every request gets an ack.
    deleted = 0
    for start in range(0, len(msgs), 256):
        s.send(b"".join(msgs[start:start + 256]))
        for _replies, err in netlink.collect(s, seq + 1 + start, len(msgs[start:start + 256])):
            if err == 0:
                deleted += 1
            elif err != -errno.ENOENT:
                raise OSError(-err, f"conntrack delete: {errno.errorcode.get(-err, -err)}")
    return deleted
