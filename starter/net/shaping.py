"""A job's bandwidth caps (--net-rate), enforced by the kernel's HTB shaper
on the two ends of its veth, spoken over rtnetlink (rtnl.py).

    direction   where                          classified by
    ---------   -----                          -------------
    out         the job's eth0, as it leaves   destination in the LAN ranges
                (in the job's netns)
    in          the host end, as it leaves     source in the LAN ranges
                towards the job

Each capped direction gets an HTB qdisc (handle 1:) with a leaf class per
capped zone: 1:1 LAN, 1:2 WAN, rate = ceil = the cap, no borrowing.  u32
filters send a packet from/to a LAN range to 1:1 (or, LAN uncapped, past
HTB: classid 1:0 is its direct queue); whatever no filter takes goes to the
default class, 1:2 when WAN is capped, else the direct queue.  Traffic
between the job and its gateway (the host's allow-listed ports) is never
shaped.  The job cannot remove any of it: both network namespaces belong
to the host's user namespace, where a job has no CAP_NET_ADMIN, and the
socket priorities it may set (0-6) name no class.

Why HTB and not a policer or nft limits: a shaper queues what is over the
rate and TCP slows to it (measured within a few % of the cap); a policer
drops, and TCP over drops lands anywhere below the cap.  fq's EDT pacing
would be cheaper per packet, but not every kernel has sch_fq (the
development host's does not); HTB and u32 are in every distribution
kernel.  Uncapped jobs get no qdisc at all: their packets never meet one.

What the report carries, per capped zone: the cap, the bytes and packets
that went through the class, the packets it dropped (its queue was full)
and its overlimits (how often a packet had to wait: shaped).
"""

import _socket
import struct

from starter.net import netlink

RTM_NEWQDISC, RTM_NEWTCLASS, RTM_GETTCLASS, RTM_NEWTFILTER = 36, 40, 42, 44
TCA_KIND, TCA_OPTIONS, TCA_STATS2 = 1, 2, 7
TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 3
TCA_HTB_PARMS, TCA_HTB_INIT, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 2, 6, 7
TCA_U32_CLASSID, TCA_U32_SEL = 1, 5
TC_U32_TERMINAL = 1
TC_H_ROOT = 0xFFFFFFFF
TC_LINKLAYER_ETHERNET = 1
HANDLE = 0x10000                    # 1:
CLASS = {"lan": 0x10001, "wan": 0x10002}
DIRECT = HANDLE                     # 1:0, HTB's direct queue
ETH_P_IP, ETH_P_IPV6 = 0x0800, 0x86DD
PRIO4, PRIO6 = 1, 2
PSCHED_SHIFT = 6                    # HTB's buffers are in 64 ns ticks
ZONES = ("lan_in", "lan_out", "wan_in", "wan_out")
MIN_RATE, MAX_RATE = 8_000, 10**12  # bits/s: 1 kB/s .. 1 Tbit/s
QUEUE_MS = 50

_TCMSG = "=BxHiIII"     # struct tcmsg: family, ifindex, handle, parent, info


def _tcmsg(ifindex, handle=0, parent=0, info=0):
    return struct.pack(_TCMSG, _socket.AF_UNSPEC, 0, ifindex, handle, parent, info)


def _kind(name):
    return netlink.attr(TCA_KIND, name.encode() + b"\0")


def burst_bytes(rate_bytes):
    """HTB's bucket: 5 ms at the rate, at least two full frames."""
    return max(rate_bytes // 200, 2 * 1514)


def qdisc(ifindex, default_zone=None):
    """HTB at the root of ifindex; unclassified packets go to the class of
    default_zone ("lan" | "wan"), or unshaped through the direct queue."""
    defcls = CLASS[default_zone] & 0xFFFF if default_zone else 0
    glob = struct.pack("=IIIII", 3, 10, defcls, 0, 0)     # version, rate2quantum, defcls, debug, direct_pkts
    body = _tcmsg(ifindex, HANDLE, TC_H_ROOT) + _kind("htb") + netlink.attr(TCA_OPTIONS, netlink.attr(TCA_HTB_INIT, glob))
    return RTM_NEWQDISC, netlink.NLM_F_CREATE | netlink.NLM_F_EXCL, body


def leaf(ifindex, zone, rate_bits):
    """One leaf class, rate = ceil = rate_bits/s."""
    rate = rate_bits // 8
    r32 = min(rate, 0xFFFFFFFF)
    # struct tc_ratespec: cell_log, linklayer (ethernet: no rate table
    # needed), overhead, cell_align, mpu, rate (bytes/s; 64-bit rates in
    # TCA_HTB_RATE64)
    spec = struct.pack("=BBHhHI", 0, TC_LINKLAYER_ETHERNET, 0, 0, 0, r32)
    ticks = min((burst_bytes(rate) * 10**9 // rate) >> PSCHED_SHIFT, 0xFFFFFFFF)
    quantum = min(max(rate // 10, 1600), 200_000)
    opt = spec + spec + struct.pack("=IIIII", ticks, ticks, quantum, 0, 0)   # buffer, cbuffer, quantum, level, prio
    opts = netlink.attr(TCA_HTB_PARMS, opt)
    if rate > 0xFFFFFFFF:
        opts += netlink.attr(TCA_HTB_RATE64, struct.pack("=Q", rate)) + netlink.attr(TCA_HTB_CEIL64, struct.pack("=Q", rate))
    body = _tcmsg(ifindex, CLASS[zone], HANDLE) + _kind("htb") + netlink.attr(TCA_OPTIONS, opts)
    return RTM_NEWTCLASS, netlink.NLM_F_CREATE | netlink.NLM_F_EXCL, body


def queue_bytes(rate_bytes):
    """A class's queue: QUEUE_MS at the rate, at least four 64 KiB (GSO) packets."""
    return max(rate_bytes * QUEUE_MS // 1000, 4 * 65536)


def leaf_queue(ifindex, zone, rate_bits):
    """The class's own queue, a bfifo of queue_bytes() (handle 11: for 1:1,
    12: for 1:2).  Without it a class gets a pfifo of the device's
    txqueuelen, 1000 packets, which at 50 Mbit/s holds seconds of traffic."""
    handle = (0x10 | (CLASS[zone] & 0xFFFF)) << 16
    body = (_tcmsg(ifindex, handle, CLASS[zone]) + _kind("bfifo")
            + netlink.attr(TCA_OPTIONS, struct.pack("=I", queue_bytes(rate_bits // 8))))
    return RTM_NEWQDISC, netlink.NLM_F_CREATE | netlink.NLM_F_EXCL, body


def u32_prefix(ifindex, cidr, field, classid):
    """A u32 filter: packets whose source or destination (field "src" |
    "dst") lies in cidr go to classid."""
    import ipaddress

    net = ipaddress.ip_network(cidr, strict=False)
    v6 = net.version == 6
    # offsets in the IP header: IPv4 saddr 12, daddr 16; IPv6 saddr 8, daddr 24
    base = (8 if field == "src" else 24) if v6 else (12 if field == "src" else 16)
    addr, mask = net.network_address.packed, net.netmask.packed
    keys = b""
    for i in range(0, len(addr), 4):
        m = mask[i:i + 4]
        if m == b"\0\0\0\0" and keys:
            break
        keys += struct.pack("=4s4sii", m, addr[i:i + 4], base + i, 0)    # mask, val (network order), off, offmask
    nkeys = len(keys) // 16
    sel = struct.pack("=BBBxHHhhI", TC_U32_TERMINAL, 0, nkeys, 0, 0, 0, 0, 0) + keys
    proto, prio = (ETH_P_IPV6, PRIO6) if v6 else (ETH_P_IP, PRIO4)
    info = (prio << 16) | _socket.htons(proto)
    opts = netlink.attr(TCA_U32_CLASSID, struct.pack("=I", classid)) + netlink.attr(TCA_U32_SEL, sel)
    body = _tcmsg(ifindex, 0, HANDLE, info) + _kind("u32") + netlink.attr(TCA_OPTIONS, opts)
    return RTM_NEWTFILTER, netlink.NLM_F_CREATE | netlink.NLM_F_EXCL, body


def requests(ifindex, direction, rates, lan, direct=()):
    """What caps one direction ("in" | "out") of a job on interface ifindex
    -> rtnl requests ([] when neither zone of that direction is capped).
    rates: {zone_direction: bits/s}; lan: the LAN CIDRs; direct: CIDRs
    never shaped (the job's own /30 and /126: its gateway)."""
    capped = {z: rates[f"{z}_{direction}"] for z in ("lan", "wan") if rates.get(f"{z}_{direction}")}
    if not capped:
        return []
    field = "src" if direction == "in" else "dst"
    reqs = [qdisc(ifindex, "wan" if "wan" in capped else None)]
    for z in ("lan", "wan"):
        if z in capped:
            reqs += [leaf(ifindex, z, capped[z]), leaf_queue(ifindex, z, capped[z])]
    # The gateway first (never shaped), then the LAN ranges: to 1:1, or
    # past the shaper when only WAN is capped.
    reqs += [u32_prefix(ifindex, c, field, DIRECT) for c in direct]
    to = CLASS["lan"] if "lan" in capped else DIRECT
    return reqs + [u32_prefix(ifindex, c, field, to) for c in lan]


def class_stats(messages):
    """RTM_NEWTCLASS replies (a dump) -> {classid: {"bytes", "packets",
    "dropped", "overlimits"}}."""
    out = {}
    for _t, body in messages:
        _fam, _pad, _ifindex, handle, _parent, _info = struct.unpack_from(_TCMSG, body)
        st = {}
        for kind, val, _raw in netlink.attrs(body[struct.calcsize(_TCMSG):]):
            if kind != TCA_STATS2:
                continue
            for k, v, _r in netlink.attrs(val):
                if k == TCA_STATS_BASIC and len(v) >= 12:
                    st["bytes"], st["packets"] = struct.unpack_from("=QI", v)
                elif k == TCA_STATS_QUEUE and len(v) >= 20:
                    _qlen, _backlog, drops, _requeues, overlimits = struct.unpack_from("=IIIII", v)
                    st["dropped"], st["overlimits"] = drops, overlimits
        if st:
            out[handle] = st
    return out


def dump_classes(rt, ifindex):
    """The classes on ifindex, through an rtnl.Rtnl -> class_stats()."""
    return class_stats(rt.dump(RTM_GETTCLASS, _tcmsg(ifindex)))


def report(rates, by_direction):
    """The report's "shaping": {zone: {"rate_bits", "bytes", "packets",
    "dropped", "overlimits"}} for each capped zone; by_direction: {"in" |
    "out": dump_classes() of that side, or None where it could not be read}."""
    out = {}
    for zone in ZONES:
        rate = rates.get(zone)
        if not rate:
            continue
        z, direction = zone.split("_")
        entry = {"rate_bits": rate}
        st = (by_direction.get(direction) or {}).get(CLASS[z])
        if st is not None:
            entry.update(st)
        out[zone] = entry
    return out
