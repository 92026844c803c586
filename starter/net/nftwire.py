"""The nf_tables wire format: the netlink messages the starter sends to
nf_tables itself, and the parsing of the kernel's answers (pure: bytes in,
bytes out; nft.py sends them).

Two kinds: one job's changes as one transaction (a batch of NEWOBJ and
NEWSETELEM, or DELSETELEM and DELOBJ, messages: the kernel finds each set
and object by name, where libnftables would first build a cache of the
whole table), and NFT_MSG_GETOBJ, one named counter asked of the kernel
directly.  The table itself is made through libnftables (nft.Nft.run).
"""

from starter.errors import NetworkError
from starter.net import netlink
from starter.net.nftrules import Addr, Mark

NETLINK_NETFILTER = 12     # the socket's protocol
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_NEWOBJ, _NFT_MSG_GETOBJ = 18, 19
_NFTA_OBJ_TABLE, _NFTA_OBJ_NAME, _NFTA_OBJ_TYPE, _NFTA_OBJ_DATA = 1, 2, 3, 4
_NFTA_COUNTER_BYTES, _NFTA_COUNTER_PACKETS = 1, 2
_NFT_OBJECT_COUNTER = 1
_NFPROTO_INET = 1
# the per-job changes (job_messages, transaction)
_NFT_MSG_NEWSETELEM, _NFT_MSG_GETSETELEM, _NFT_MSG_DELSETELEM, _NFT_MSG_DELOBJ = 12, 13, 14, 20
_NFTA_SET_ELEM_LIST_SET, _NFTA_SET_ELEM_LIST_ELEMENTS = 2, 3
_NFTA_LIST_ELEM, _NFTA_SET_ELEM_KEY, _NFTA_SET_ELEM_DATA, _NFTA_SET_ELEM_OBJREF, _NFTA_DATA_VALUE = 1, 1, 2, 9, 1
_NFNL_MSG_BATCH_BEGIN, _NFNL_MSG_BATCH_END = 16, 17


def job_messages(table_name, verb, changes, seq):
    """nftrules.Table.job_changes() as nf_tables messages (NEWOBJ/NEWSETELEM
    or DELSETELEM/DELOBJ), numbered from seq, each acked (pure)."""
    import struct

    table = netlink.attr(1, table_name.encode() + b"\0")     # NFTA_{OBJ,SET_ELEM_LIST}_TABLE
    head = struct.pack("=BBH", _NFPROTO_INET, 0, 0)
    add = verb == "add"
    out = []
    for i, change in enumerate(changes):
        if change[0] == "counter":
            body = (head + table + netlink.attr(_NFTA_OBJ_NAME, change[1].encode() + b"\0")
                    + netlink.attr(_NFTA_OBJ_TYPE, struct.pack(">I", _NFT_OBJECT_COUNTER)))
            if add:
                body += netlink.attr(_NFTA_OBJ_DATA | netlink.NLA_F_NESTED,
                                     netlink.attr(_NFTA_COUNTER_BYTES, struct.pack(">Q", 0))
                                     + netlink.attr(_NFTA_COUNTER_PACKETS, struct.pack(">Q", 0)))
            mtype = _NFT_MSG_NEWOBJ if add else _NFT_MSG_DELOBJ
        else:
            body = head + table + _elements(change[1], change[2], add)
            mtype = _NFT_MSG_NEWSETELEM if add else _NFT_MSG_DELSETELEM
        flags = netlink.NLM_F_REQUEST | netlink.NLM_F_ACK | (netlink.NLM_F_CREATE if add else 0)
        out.append(netlink.message((_NFNL_SUBSYS_NFTABLES << 8) | mtype, flags, seq + i, body))
    return out


def _elements(set_name, items, add):
    """A set's name and its elements [(key parts, counter name, Mark or
    None)] as NFTA_SET_ELEM_LIST attributes (the data only when adding: a
    mark as nf_tables keeps one, host-endian)."""
    import struct

    elems = b""
    for parts, ref in items:
        e = netlink.attr(_NFTA_SET_ELEM_KEY | netlink.NLA_F_NESTED,
                         netlink.attr(_NFTA_DATA_VALUE, b"".join(_key_part(p) for p in parts)))
        if isinstance(ref, Mark) and add:
            e += netlink.attr(_NFTA_SET_ELEM_DATA | netlink.NLA_F_NESTED,
                              netlink.attr(_NFTA_DATA_VALUE, struct.pack("=I", ref)))
        elif ref is not None and add:
            e += netlink.attr(_NFTA_SET_ELEM_OBJREF, ref.encode() + b"\0")
        elems += netlink.attr(_NFTA_LIST_ELEM | netlink.NLA_F_NESTED, e)
    return (netlink.attr(_NFTA_SET_ELEM_LIST_SET, set_name.encode() + b"\0")
            + netlink.attr(_NFTA_SET_ELEM_LIST_ELEMENTS | netlink.NLA_F_NESTED, elems))


def getsetelem_request(table_name, set_name, parts, seq):
    """Ask whether one element is in a set (pure).  A get, not a
    transaction: where it is not, the answer is ENOENT, with none of the
    RCU grace period a refused (aborted) transaction costs (~10 ms here)."""
    import struct

    body = (struct.pack("=BBH", _NFPROTO_INET, 0, 0) + netlink.attr(1, table_name.encode() + b"\0")
            + _elements(set_name, [(parts, None)], False))
    return netlink.message((_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETSETELEM, netlink.NLM_F_REQUEST, seq, body)


def transaction(table_name, verb, changes, first):
    """job_messages() numbered from first, framed as one nf_tables batch
    (BATCH_BEGIN first - 1, BATCH_END first + len(changes)): all or
    nothing; one ack or error per change, sent once the whole batch ran."""
    import socket
    import struct

    batch = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(_NFNL_SUBSYS_NFTABLES))
    return (netlink.message(_NFNL_MSG_BATCH_BEGIN, netlink.NLM_F_REQUEST, first - 1, batch)
            + b"".join(job_messages(table_name, verb, changes, first))
            + netlink.message(_NFNL_MSG_BATCH_END, netlink.NLM_F_REQUEST, first + len(changes), batch))


def _key_part(p):
    """One part of a concatenated key, as nf_tables stores it: an ifname
    NUL-padded to IFNAMSIZ, an address packed; each 32-bit aligned."""
    import _socket

    if isinstance(p, Addr):
        return _socket.inet_pton(_socket.AF_INET6 if ":" in p else _socket.AF_INET, p)
    b = p.encode()
    if len(b) > 15:
        raise NetworkError(f"interface name {p!r} is longer than 15 bytes")
    return b.ljust(16, b"\0")


def getobj_request(table, name, seq):
    """The netlink message asking for one named counter (pure)."""
    import struct

    body = struct.pack("=BBH", _NFPROTO_INET, 0, 0)
    body += netlink.attr(_NFTA_OBJ_TABLE, table.encode() + b"\0")
    body += netlink.attr(_NFTA_OBJ_NAME, name.encode() + b"\0")
    body += netlink.attr(_NFTA_OBJ_TYPE, struct.pack(">I", _NFT_OBJECT_COUNTER))
    return netlink.message((_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETOBJ, netlink.NLM_F_REQUEST, seq, body)


def parse_getobj_replies(data):
    """-> {seq: {"bytes", "packets"} | -errno} from the kernel's answers (pure)."""
    out = {}
    for mtype, seq, msg in netlink.messages(data):
        if mtype == netlink.NLMSG_ERROR:
            out[seq] = netlink.error_code(msg)
        elif mtype == (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWOBJ:
            out[seq] = counter_of(msg)
    return out


def counter_of(body):
    """A NEWOBJ message's body -> {"bytes", "packets"} of the counter (pure)."""
    import struct

    c = {}
    for kind, val, _raw in netlink.attrs(body[4:]):
        if kind == _NFTA_OBJ_DATA:
            for k2, v2, _raw2 in netlink.attrs(val):
                if k2 == _NFTA_COUNTER_BYTES:
                    c["bytes"] = struct.unpack(">Q", v2)[0]
                elif k2 == _NFTA_COUNTER_PACKETS:
                    c["packets"] = struct.unpack(">Q", v2)[0]
    return c
