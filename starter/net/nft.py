"""nftables rules and counters for job networks, through libnftables' JSON API.

One table (`inet starter` by default) holds everything; nothing else in the
ruleset is read or changed.  The rules are fixed when the table is made;
a job is added by adding five named counters and elements to a few sets and
maps in ONE transaction, never by adding rules, so neither the packet path nor
the cost of adding a job grows with the number of jobs.

    table inet starter {
      set job_nets   { ipv4_addr, interval }     the address pool
      set lan        { ipv4_addr, interval }     site LAN CIDRs
      set blocked    { ipv4_addr, interval }     0/8 127/8 169.254/16 224/4 240/4
      set uplinks    { ifname }                  masquerade out of these
      set guard_ifs  { ifname }                  uplinks whose forwarding WE turned on
      set job_ifs    { ifname }                  host ends of job veths
      set job_flows  { ifname }, dynamic         each job's tracked connections (ct count)
      set job_src    { ifname . ipv4_addr }      the one source address each may use
      set job_nets6, lan6, blocked6 { ipv6_addr, interval }   the same for IPv6
                     (blocked6: ::/127, ::ffff:0:0/96, fe80::/10, fec0::/10,
                     ff00::/8, fd00:ec2::/32, fd20:ce::254)
      set job_src6   { ifname . ipv6_addr }      a job with IPv6: its address6 and its
                                                 fixed link-local fe80::2 (ipam.JOB_LINK_LOCAL6)
      set guard6_ifs { ifname }                  uplinks whose IPv6 forwarding WE turned on
      set host_allow { inet_proto . inet_service }   host ports open to jobs
      map ctr_lan_in, ctr_lan_out, ctr_wan_in, ctr_wan_out, ctr_drop
                     { ifname : counter }        per-job named counters <key>_<name>
      counter dropped                            drops not attributable to a job
      map ctr_uplink_in, ctr_uplink_out          { ifname : counter }, node-wide,
                     one pair of counters uplink_<ifname>_in|out per uplink

      chain prerouting  (filter, prerouting, raw -300: before conntrack)
        iifname @job_ifs jump job_ingress
      chain job_ingress
        meta nfproto ipv6                     -> goto job_ingress6
        meta nfproto != ipv4                  -> count to the job, drop
        iifname . ip saddr != @job_src        -> count, drop   (spoofing)
        ip daddr @blocked                     -> count, drop   (loopback, metadata)
      chain job_ingress6
        meta l4proto ipv6-icmp                -> jump job_icmp6, then on:
          icmpv6 RS, RA, redirect             -> count, drop   (router messages)
          icmpv6 MLD                          -> drop          (the job kernel's chatter)
          icmpv6 NS, NA, hoplimit 255,
            iifname . ip6 saddr @job_src6     -> accept        (neighbour discovery)
        iifname . ip6 saddr != @job_src6      -> count, drop   (spoofing)
        ip6 daddr @blocked6                   -> count, drop
      chain input       (filter, input, 0)
        iifname @job_ifs jump job_to_host
      chain job_to_host
        icmpv6 NS, NA                         -> accept
        ct state new, over max_flows in @job_flows -> count, drop (see below)
        meta l4proto . th dport @host_allow   -> accept        (site proxy, resolver)
                                              -> count, drop   (the host itself)
      chain forward     (filter, forward, 0)
        iifname @job_ifs jump job_out
        oifname @job_ifs jump job_in
        iifname @guard_ifs                    -> count, drop   (see below)
      chain job_out
        oifname != @uplinks                   -> count, drop   (other jobs, other host nets)
        ct state new, over max_flows in @job_flows -> count, drop
        counter oifname map @ctr_uplink_out      (which uplink routing chose)
        meta nfproto ipv6                     -> goto job_out6 (ND/router msgs: drop;
                                                 ip6 daddr @lan6: lan_out6, else wan_out6)
        ip daddr @lan                         -> lan_out, accept
                                              -> wan_out, accept
      chain job_in
        ct state established,related goto job_in_count
                                              -> dropped, drop (no inbound connections)
      chain job_in_count
        counter iifname map @ctr_uplink_in       (a miss: not via an uplink)
        meta nfproto ipv6                     -> goto job_in_count6 (lan_in6 / wan_in6)
        ip saddr @lan                         -> lan_in, accept
                                              -> wan_in, accept
      chain postrouting (nat, postrouting, srcnat)
        ip saddr @job_nets oifname @uplinks masquerade
        ip6 saddr @job_nets6 oifname @uplinks masquerade      (NAT66)
    }

A job with IPv6 has four more counters (<key>_lan_in6 ...): IPv6 bytes are
counted there only, and the report's lan_in etc. are the sums.  The guard
rules are per family (guard_ifs for IPv4, guard6_ifs for IPv6).  IPv6
forwarding is per interface through force_forwarding (see net/sysctl.py).

IPv4 forwarding is decided by the INPUT device's conf.<if>.forwarding; we set
it on each job's host veth (it dies with the veth) and on the uplink, where
replies come in.  If the uplink's flag was off, turning it on would also let
the host route foreign traffic arriving there; the guard_ifs rule drops that
(only for uplinks we opened, so a site that routes already is not disturbed).
An accept here does not override other tables: a site firewall that drops
forwarded traffic must allow the pool.
"""

import json
import os
import threading

from starter.errors import NetworkError
from starter.net import netlink
from starter.net.ipam import JOB_LINK_LOCAL6

FAMILY = "inet"
COUNTERS = ("lan_in", "lan_out", "wan_in", "wan_out", "drop")
# IPv6 traffic is counted apart (a job without IPv6 has none of these); the
# report's combined figures are the sums.
ZONES = ("lan_in", "lan_out", "wan_in", "wan_out")
COUNTERS6 = tuple(z + "6" for z in ZONES)
BLOCKED = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
# unspecified and loopback, IPv4-mapped, link-local, old site-local,
# multicast; the clouds' metadata/DNS/NTP services (AWS fd00:ec2::/32, e.g.
# fd00:ec2::254; GCP fd20:ce::254)
BLOCKED6 = ("::/127", "::ffff:0.0.0.0/96", "fe80::/10", "fec0::/10", "ff00::/8",
            "fd00:ec2::/32", "fd20:ce::254/128")
ND = ["nd-neighbor-solicit", "nd-neighbor-advert"]
ROUTER_MSGS = ["nd-router-solicit", "nd-router-advert", "nd-redirect"]
# the job kernel's own multicast listener reports: dropped, not counted
MLD = ["mld-listener-query", "mld-listener-report", "mld-listener-done", "mld2-listener-report"]
JOB_SETS = ("job_ifs", "job_src", "job_src6")
UPLINK_DIRECTIONS = ("in", "out")


def uplink_counter(ifname, direction):
    """The node-wide counter of one uplink: what jobs sent out of it (out)
    and what came back in through it (in).  No per-job objects: the per-job
    split stays LAN/WAN, by address."""
    return f"uplink_{ifname}_{direction}"


# -- expression helpers (pure) ---------------------------------------------
def _meta(key):
    return {"meta": {"key": key}}


def _payload(proto, field):
    return {"payload": {"protocol": proto, "field": field}}


def _match(left, right, op="=="):
    return {"match": {"op": op, "left": left, "right": right}}


def _ctr_map(key_expr, name):
    return {"counter": {"map": {"key": key_expr, "data": "@" + name}}}


def _prefix(cidr):
    addr, _, plen = cidr.partition("/")
    return {"prefix": {"addr": addr, "len": int(plen or (128 if ":" in addr else 32))}}


def split_families(cidrs):
    """CIDR strings -> (IPv4 ones, IPv6 ones), order kept (pure)."""
    return [c for c in cidrs if ":" not in c], [c for c in cidrs if ":" in c]


def _icmpv6(types):
    return _match(_payload("icmpv6", "type"), {"set": list(types)})


ACCEPT = {"accept": None}
DROP = {"drop": None}
# Tracked connections one job may hold: the default when the host's table
# size (nf_conntrack_max) cannot be read; see max_flows().
DEFAULT_MAX_FLOWS = 32768


def max_flows(env=None, conntrack_max_path="/proc/sys/net/netfilter/nf_conntrack_max"):
    """The per-job cap on tracked connections: $STARTER_NET_MAX_FLOWS, else an
    eighth of the host's connection-tracking table (at least 1024)."""
    env = os.environ if env is None else env
    v = env.get("STARTER_NET_MAX_FLOWS")
    if v:
        if not (v.isascii() and v.isdigit()) or not 0 < int(v) <= 1 << 31:
            raise NetworkError(f"STARTER_NET_MAX_FLOWS={v!r} is not a number of connections (1 or more)")
        return int(v)
    from starter.net.sysctl import read_sysctl

    try:
        return max(1024, int(read_sysctl(conntrack_max_path)) // 8)
    except (OSError, ValueError, TypeError):    # TypeError: None, no such sysctl
        return DEFAULT_MAX_FLOWS


class Table:
    """Renders the JSON commands for one table.  Pure: no I/O."""

    def __init__(self, name="starter"):
        self.name = name
        self._t = {"family": FAMILY, "table": name}

    def _obj(self, **kw):
        return dict(self._t, **kw)

    def _rule(self, chain, *expr):
        return {"add": {"rule": self._obj(chain=chain, expr=list(expr))}}

    def _set(self, name, type_, flags=(), elem=(), map_=None):
        s = self._obj(name=name, type=type_)
        if flags:
            s["flags"] = list(flags)
        if elem:
            s["elem"] = list(elem)
        if map_:
            s["map"] = map_
            return {"add": {"map": s}}
        return {"add": {"set": s}}

    def _chain(self, name, hook=None, type_="filter", prio=0):
        c = self._obj(name=name)
        if hook:
            c.update(type=type_, hook=hook, prio=prio, policy="accept")
        return {"add": {"chain": c}}

    def table_obj(self):
        return {"family": FAMILY, "name": self.name}

    def create(self, pool, lan=(), uplinks=(), guard_ifs=(), host_allow=(), pool6=None, guard6_ifs=(),
               max_flows=DEFAULT_MAX_FLOWS):
        """The whole table, replacing any leftover of the same name atomically
        (add + delete + add in one transaction; other tables untouched).
        lan holds both families; pool6 None: no IPv6 pool (nothing matches).
        max_flows: the connection-tracking entries one job may hold at once
        (its new connections beyond are dropped and counted as dropped)."""
        t = self.table_obj()
        lan4, lan6 = split_families(lan)
        iif, oif = _meta("iifname"), _meta("oifname")
        cmds = [{"add": {"table": t}}, {"delete": {"table": t}}, {"add": {"table": t}}]
        cmds.append({"add": {"counter": self._obj(name="dropped")}})
        cmds += [
            self._set("job_nets", "ipv4_addr", ["interval"], [_prefix(pool)]),
            self._set("job_nets6", "ipv6_addr", ["interval"], [_prefix(pool6)] if pool6 else []),
            self._set("lan", "ipv4_addr", ["interval"], [_prefix(c) for c in lan4]),
            self._set("lan6", "ipv6_addr", ["interval"], [_prefix(c) for c in lan6]),
            self._set("blocked", "ipv4_addr", ["interval"], [_prefix(c) for c in BLOCKED]),
            self._set("blocked6", "ipv6_addr", ["interval"], [_prefix(c) for c in BLOCKED6]),
            self._set("uplinks", "ifname", elem=list(uplinks)),
            self._set("guard_ifs", "ifname", elem=list(guard_ifs)),
            self._set("guard6_ifs", "ifname", elem=list(guard6_ifs)),
            self._set("job_ifs", "ifname"),
            # per job (by its veth): its tracked connections, counted by the
            # kernel; filled from the packet path (nft makes it dynamic)
            {"add": {"set": self._obj(name="job_flows", type="ifname", size=65535)}},
            self._set("job_src", ["ifname", "ipv4_addr"]),
            self._set("job_src6", ["ifname", "ipv6_addr"]),
            self._set("host_allow", ["inet_proto", "inet_service"],
                      elem=[{"concat": [p, int(n)]} for p, n in host_allow]),
        ]
        cmds += [self._set("ctr_" + c, "ifname", map_="counter") for c in COUNTERS + COUNTERS6]
        cmds += [{"add": {"counter": self._obj(name=uplink_counter(u, d))}}
                 for u in uplinks for d in UPLINK_DIRECTIONS]
        cmds += [self._set("ctr_uplink_" + d, "ifname", map_="counter",
                           elem=[[u, uplink_counter(u, d)] for u in uplinks]) for d in UPLINK_DIRECTIONS]
        cmds += [
            self._chain("prerouting", "prerouting", prio=-300),
            self._chain("job_ingress"),
            self._chain("job_ingress6"),
            self._chain("job_icmp6"),
            self._chain("input", "input"),
            self._chain("job_to_host"),
            self._chain("forward", "forward"),
            self._chain("job_out"),
            self._chain("job_out6"),
            self._chain("job_in"),
            self._chain("job_in_count"),
            self._chain("job_in_count6"),
            self._chain("postrouting", "postrouting", type_="nat", prio=100),
        ]
        drop_job = [_ctr_map(iif, "ctr_drop"), DROP]
        nfproto = _meta("nfproto")
        # A job holding more of the host's conntrack table than this drops
        # its new connections: no job fills the table (or the masquerade's
        # ports to one destination) for the other jobs and the host.
        too_many_flows = [_match({"ct": {"key": "state"}}, ["new"], "in"),
                          {"set": {"op": "add", "elem": iif, "set": "@job_flows",
                                   "stmt": [{"ct count": {"val": int(max_flows), "inv": True}}]}},
                          *drop_job]
        cmds += [
            self._rule("prerouting", _match(iif, "@job_ifs"), {"jump": {"target": "job_ingress"}}),
            self._rule("job_ingress", _match(nfproto, "ipv6"), {"goto": {"target": "job_ingress6"}}),
            self._rule("job_ingress", _match(nfproto, "ipv4", "!="), *drop_job),
            self._rule("job_ingress", _match({"concat": [iif, _payload("ip", "saddr")]}, "@job_src", "!="),
                       *drop_job),
            self._rule("job_ingress", _match(_payload("ip", "daddr"), "@blocked"), *drop_job),
            # IPv6: router messages from a job are an attack, counted; its
            # kernel's MLD reports are noise, dropped quietly; neighbour
            # discovery (hop limit 255: never forwarded) passes; then the
            # same source and destination checks as IPv4.
            # (ICMPv6 in a chain of its own: data packets pass one test, not three)
            self._rule("job_ingress6", _match(_meta("l4proto"), "ipv6-icmp"), {"jump": {"target": "job_icmp6"}}),
            self._rule("job_icmp6", _icmpv6(ROUTER_MSGS), *drop_job),
            self._rule("job_icmp6", _icmpv6(MLD), DROP),
            self._rule("job_icmp6", _icmpv6(ND), _match(_payload("ip6", "hoplimit"), 255),
                       _match({"concat": [iif, _payload("ip6", "saddr")]}, "@job_src6"), ACCEPT),
            self._rule("job_ingress6", _match({"concat": [iif, _payload("ip6", "saddr")]}, "@job_src6", "!="),
                       *drop_job),
            self._rule("job_ingress6", _match(_payload("ip6", "daddr"), "@blocked6"), *drop_job),
            self._rule("input", _match(iif, "@job_ifs"), {"jump": {"target": "job_to_host"}}),
            self._rule("job_to_host", _icmpv6(ND), ACCEPT),
            self._rule("job_to_host", *too_many_flows),
            self._rule("job_to_host", _match({"concat": [_meta("l4proto"), _payload("th", "dport")]},
                                             "@host_allow"), ACCEPT),
            self._rule("job_to_host", *drop_job),
            self._rule("forward", _match(iif, "@job_ifs"), {"jump": {"target": "job_out"}}),
            self._rule("forward", _match(oif, "@job_ifs"), {"jump": {"target": "job_in"}}),
            self._rule("forward", _match(nfproto, "ipv4"), _match(iif, "@guard_ifs"), {"counter": "dropped"}, DROP),
            self._rule("forward", _match(nfproto, "ipv6"), _match(iif, "@guard6_ifs"), {"counter": "dropped"}, DROP),
            self._rule("job_out", _match(oif, "@uplinks", "!="), *drop_job),
            self._rule("job_out", *too_many_flows),
            self._rule("job_out", _ctr_map(oif, "ctr_uplink_out")),
            self._rule("job_out", _match(nfproto, "ipv6"), {"goto": {"target": "job_out6"}}),
            self._rule("job_out", _match(_payload("ip", "daddr"), "@lan"), _ctr_map(iif, "ctr_lan_out"), ACCEPT),
            self._rule("job_out", _ctr_map(iif, "ctr_wan_out"), ACCEPT),
            self._rule("job_out6", _icmpv6(ND + ROUTER_MSGS), *drop_job),
            self._rule("job_out6", _match(_payload("ip6", "daddr"), "@lan6"), _ctr_map(iif, "ctr_lan_out6"), ACCEPT),
            self._rule("job_out6", _ctr_map(iif, "ctr_wan_out6"), ACCEPT),
            self._rule("job_in", _match({"ct": {"key": "state"}}, ["established", "related"], "in"),
                       {"goto": {"target": "job_in_count"}}),
            self._rule("job_in", {"counter": "dropped"}, DROP),
            self._rule("job_in_count", _ctr_map(iif, "ctr_uplink_in")),
            self._rule("job_in_count", _match(nfproto, "ipv6"), {"goto": {"target": "job_in_count6"}}),
            self._rule("job_in_count6", _match(_payload("ip6", "saddr"), "@lan6"), _ctr_map(oif, "ctr_lan_in6"),
                       ACCEPT),
            self._rule("job_in_count6", _ctr_map(oif, "ctr_wan_in6"), ACCEPT),
            self._rule("job_in_count", _match(_payload("ip", "saddr"), "@lan"), _ctr_map(oif, "ctr_lan_in"), ACCEPT),
            self._rule("job_in_count", _ctr_map(oif, "ctr_wan_in"), ACCEPT),
            self._rule("postrouting", _match(_payload("ip", "saddr"), "@job_nets"),
                       _match(oif, "@uplinks"), {"masquerade": None}),
            self._rule("postrouting", _match(_payload("ip6", "saddr"), "@job_nets6"),
                       _match(oif, "@uplinks"), {"masquerade": None}),
        ]
        return cmds

    def add_guard6(self, ifnames):
        """Uplinks whose IPv6 forwarding we turned on later (the first job
        with IPv6): foreign traffic arriving there is not routed."""
        return [self._elem("add", "guard6_ifs", list(ifnames))] if ifnames else []

    def delete(self):
        """Remove the table whether or not it exists (add is a no-op if it does)."""
        t = self.table_obj()
        return [{"add": {"table": t}}, {"delete": {"table": t}}]

    def _elem(self, verb, set_name, elems):
        return {verb: {"element": self._obj(name=set_name, elem=elems)}}

    def job_changes(self, verb, key, ifname, address, address6=None, has6=None):
        """What adding ("add") or removing ("delete") one job changes, in
        order: [("counter", name) | ("element", set, [element, ...])], an
        element being (key parts, counter name or None).  IPv6 counters and
        sources only for a job with address6 (has6: override for removal).
        Rendered as JSON (add_job, del_job) or netlink (Nft.apply)."""
        names = COUNTERS + (COUNTERS6 if (address6 if has6 is None else has6) else ())
        counters = [("counter", f"{key}_{c}") for c in names]
        maps = [("element", "ctr_" + c, [((ifname,), f"{key}_{c}")]) for c in names]
        src = [("element", "job_src", [((ifname, Addr(address)), None)])] if address else []
        if address6:
            src.append(("element", "job_src6", [((ifname, Addr(address6)), None),
                                                ((ifname, Addr(JOB_LINK_LOCAL6)), None)]))
        ifs = [("element", "job_ifs", [((ifname,), None)])]
        if verb == "add":
            # Counters first (map elements refer to them); job_ifs last: the
            # job's packets hit the chains only once everything they refer
            # to exists.
            return counters + maps + src + ifs
        # The reverse: elements before the counters they name.
        return ifs + src + maps + counters

    def to_json(self, verb, changes):
        cmds = []
        for change in changes:
            if change[0] == "counter":
                cmds.append({verb: {"counter": self._obj(name=change[1])}})
                continue
            elems = []
            for parts, ref in change[2]:
                k = parts[0] if len(parts) == 1 else {"concat": list(parts)}
                elems.append([k, ref] if ref is not None and verb == "add" else k)
            cmds.append(self._elem(verb, change[1], elems))
        return cmds

    def add_job(self, key, ifname, address, address6=None):
        """The JSON commands of job_changes("add", ...)."""
        return self.to_json("add", self.job_changes("add", key, ifname, address, address6))

    def del_job(self, key, ifname, address, address6=None, has6=None):
        """The JSON commands of job_changes("delete", ...)."""
        return self.to_json("delete", self.job_changes("delete", key, ifname, address, address6, has6))

    def to_netlink(self, verb, changes, seq):
        """job_changes() as nf_tables messages (NEWOBJ/NEWSETELEM or
        DELSETELEM/DELOBJ), numbered from seq, each acked (pure)."""
        import struct

        table = netlink.attr(1, self.name.encode() + b"\0")     # NFTA_{OBJ,SET_ELEM_LIST}_TABLE
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
                elems = b""
                for parts, ref in change[2]:
                    e = netlink.attr(_NFTA_SET_ELEM_KEY | netlink.NLA_F_NESTED,
                                     netlink.attr(_NFTA_DATA_VALUE, b"".join(_key_part(p) for p in parts)))
                    if ref is not None and add:
                        e += netlink.attr(_NFTA_SET_ELEM_OBJREF, ref.encode() + b"\0")
                    elems += netlink.attr(_NFTA_LIST_ELEM | netlink.NLA_F_NESTED, e)
                body = (head + table + netlink.attr(_NFTA_SET_ELEM_LIST_SET, change[1].encode() + b"\0")
                        + netlink.attr(_NFTA_SET_ELEM_LIST_ELEMENTS | netlink.NLA_F_NESTED, elems))
                mtype = _NFT_MSG_NEWSETELEM if add else _NFT_MSG_DELSETELEM
            flags = netlink.NLM_F_REQUEST | netlink.NLM_F_ACK | (netlink.NLM_F_CREATE if add else 0)
            out.append(netlink.message((_NFNL_SUBSYS_NFTABLES << 8) | mtype, flags, seq + i, body))
        return out


class Addr(str):
    """An address part of a set element's key (an ifname part is a plain str)."""


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


# -- reading counters: one NFT_MSG_GETOBJ per counter ------------------------
# libnftables answers `list counter` from a full cache of the table (every
# object and set element), so a read costs O(jobs): ~8 ms at 500 jobs here.
# The kernel looks a named object up directly; these few lines ask it that
# way.  Reads only: every change still goes through libnftables.
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_NEWOBJ, _NFT_MSG_GETOBJ = 18, 19
_NFTA_OBJ_TABLE, _NFTA_OBJ_NAME, _NFTA_OBJ_TYPE, _NFTA_OBJ_DATA = 1, 2, 3, 4
_NFTA_COUNTER_BYTES, _NFTA_COUNTER_PACKETS = 1, 2
_NFT_OBJECT_COUNTER = 1
_NFPROTO_INET = 1
_NETLINK_NETFILTER = 12
# the per-job changes (Table.to_netlink, Nft.apply)
_NFT_MSG_NEWSETELEM, _NFT_MSG_DELSETELEM, _NFT_MSG_DELOBJ = 12, 14, 20
_NFTA_SET_ELEM_LIST_SET, _NFTA_SET_ELEM_LIST_ELEMENTS = 2, 3
_NFTA_LIST_ELEM, _NFTA_SET_ELEM_KEY, _NFTA_SET_ELEM_OBJREF, _NFTA_DATA_VALUE = 1, 1, 9, 1
_NFNL_MSG_BATCH_BEGIN, _NFNL_MSG_BATCH_END = 16, 17


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
            out[seq] = _counter_of(msg)
    return out


def _counter_of(body):
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


class _Netfilter:
    """The process's one NETLINK_NETFILTER socket for nf_tables, kept open.

    Closing such a socket makes the kernel first finish nf_tables' pending
    destroy work, an RCU grace period whenever the last transaction removed
    anything (NETLINK_URELEASE -> nf_tables_trans_destroy_flush_work): a
    socket per job teardown cost 5-15 ms here on its close.  libnftables
    keeps its socket for the same reason."""

    def __init__(self):
        self._sock = None
        self._seq = 0
        self._lock = threading.Lock()

    def exchange(self, build, count, ack=True):
        """build(first_seq) -> the bytes of `count` requests numbered from
        first_seq (a batch's begin and end may use first_seq - 1 and
        first_seq + count).  -> netlink.collect()'s [(replies, error)].  An
        error about the batch as a whole raises OSError."""
        import socket

        with self._lock:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                           _NETLINK_NETFILTER)
            s = self._sock
            first = self._seq + 2
            self._seq += count + 3
            try:
                s.setblocking(False)
                while True:         # what an interrupted exchange left behind
                    s.recv(65536)
            except BlockingIOError:
                pass
            s.settimeout(5.0)
            s.send(build(first))
            return netlink.collect(s, first, count, ack)


_NETFILTER = _Netfilter()


def _getobjs(table_name, names):
    """Ask the kernel for these named counters in one round trip -> the
    answer for each name, in order: {"bytes", "packets"} or -errno."""
    answers = _NETFILTER.exchange(
        lambda first: b"".join(getobj_request(table_name, n, first + i) for i, n in enumerate(names)),
        len(names), ack=False)
    return [err or _counter_of(replies[0][1]) for replies, err in answers]


def _counter_error(name, err):
    return NetworkError(f"nftables: reading counter {name} failed: {os.strerror(-err)}")


def read_counters(table_name, key):
    """The job's counters straight from the kernel, or None if it has none.
    -> combine() of what was read."""
    names = [f"{key}_{c}" for c in COUNTERS + COUNTERS6]
    raw = {}
    for c, name, r in zip(COUNTERS + COUNTERS6, names, _getobjs(table_name, names)):
        if isinstance(r, int):
            if r == -2:  # ENOENT: no such table or counter
                if c in COUNTERS6:
                    continue   # a job without IPv6
                return None
            raise _counter_error(name, r)
        raw[c] = r
    return combine(raw)


def combine(raw):
    """{lan_in.., drop, lan_in6..} as read -> the report's counters (pure):
    lan_in, lan_out, wan_in, wan_out both families together (what they
    always meant), dropped, "ipv4": the IPv4 share and, when the job had
    IPv6, "ipv6": its share."""
    zero = {"bytes": 0, "packets": 0}
    v4 = {z: dict(raw.get(z) or zero) for z in ZONES}
    has6 = any(z + "6" in raw for z in ZONES)
    v6 = {z: dict(raw.get(z + "6") or zero) for z in ZONES} if has6 else None
    out = {}
    for z in ZONES:
        out[z] = {k: v4[z][k] + (v6[z][k] if v6 else 0) for k in ("bytes", "packets")}
    out["dropped"] = dict(raw.get("drop") or zero)
    out["ipv4"] = v4
    if v6 is not None:
        out["ipv6"] = v6
    return out


def read_uplink_counters(table_name, uplinks):
    """-> {ifname: {"in": {bytes, packets}, "out": {...}}} node-wide, for the
    uplinks the table was built with; {} when there is no table."""
    pairs = [(u, d) for u in uplinks for d in UPLINK_DIRECTIONS]
    if not pairs:
        return {}
    names = [uplink_counter(u, d) for u, d in pairs]
    out = {}
    for (u, d), name, r in zip(pairs, names, _getobjs(table_name, names)):
        if isinstance(r, int):
            if r == -2:
                continue   # no such table or counter (a table made before these existed)
            raise _counter_error(name, r)
        out.setdefault(u, {})[d] = r
    return out


# -- the library ------------------------------------------------------------
_lib = None


def _load():
    global _lib
    if _lib is None:
        try:
            from starter import _nft
        except ImportError as e:
            raise NetworkError(f"libnftables could not be loaded: {e}",
                               "install the nftables library (Debian: apt install libnftables1) "
                               "and rebuild the native modules with scripts/setup") from None
        _lib = _nft
    return _lib


class NftError(NetworkError):
    """The nftables library or the kernel refused a command."""

    def __init__(self, what, detail):
        self.detail = detail
        hint = None
        low = detail.lower()
        if "operation not permitted" in low:
            hint = "run as root (CAP_NET_ADMIN)"
        elif "no such file or directory" in low and "table" in what:
            hint = "the table is gone; run `starter gc` to resynchronise"
        elif "not supported" in low or "protocol not supported" in low:
            hint = "the kernel lacks nf_tables support (modprobe nf_tables nft_nat nft_ct nft_fib)"
        super().__init__(f"nftables: {what} failed: {detail.strip() or 'unknown error'}", hint)

    @property
    def enoent(self):
        return "no such file or directory" in self.detail.lower()


class Nft:
    """One libnftables context, JSON in and out.  Thread-safe by a lock."""

    def __init__(self):
        mod = _load()
        self._ffi, self._lib = mod.ffi, mod.lib
        ctx = self._lib.nft_ctx_new(self._lib.NFT_CTX_DEFAULT)
        if ctx == self._ffi.NULL:
            raise NetworkError("nftables: nft_ctx_new failed", "out of memory?")
        self._ctx = self._ffi.gc(ctx, self._lib.nft_ctx_free)
        self._lib.nft_ctx_output_set_flags(ctx, self._lib.NFT_CTX_OUTPUT_JSON)
        if self._lib.nft_ctx_buffer_output(ctx) or self._lib.nft_ctx_buffer_error(ctx):
            raise NetworkError("nftables: cannot buffer output")
        self._lock = threading.Lock()

    def run(self, cmds, what="transaction"):
        """Run a list of JSON commands as one batch -> list of output documents."""
        buf = json.dumps({"nftables": cmds}).encode()
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, buf)
            out = self._ffi.string(self._lib.nft_ctx_get_output_buffer(self._ctx)).decode()
            err = self._ffi.string(self._lib.nft_ctx_get_error_buffer(self._ctx)).decode()
        if rc != 0:
            raise NftError(what, err)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def apply(self, table, verb, changes, what="transaction"):
        """Table.job_changes() in one nf_tables transaction, over netlink.
        The kernel finds each set and object by name; libnftables would
        first build a cache of the table, whose cost grows with the number
        of jobs (at 500 jobs here: +1.3 ms to add a job, +4 ms to remove
        one).  All or nothing; NftError names the first refused change."""
        import socket
        import struct

        batch = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(_NFNL_SUBSYS_NFTABLES))

        def build(first):   # one ack or error per change, sent once the whole batch ran
            return (netlink.message(_NFNL_MSG_BATCH_BEGIN, netlink.NLM_F_REQUEST, first - 1, batch)
                    + b"".join(table.to_netlink(verb, changes, first))
                    + netlink.message(_NFNL_MSG_BATCH_END, netlink.NLM_F_REQUEST, first + len(changes), batch))

        try:
            answers = _NETFILTER.exchange(build, len(changes))
        except OSError as e:   # the batch refused as a whole, or no answer (TimeoutError)
            raise NftError(what, os.strerror(e.errno) if e.errno else str(e) or type(e).__name__) from None
        for i, (_replies, err) in enumerate(answers):
            if err:
                c = changes[i]
                raise NftError(what, f"{os.strerror(-err)} ({verb} {c[0]} {c[1]})")

    def add_job(self, table, key, address, address6=None, what="add job rules"):
        """apply() of Table.job_changes("add", ...): the job's counters and
        elements, its host veth named by its key."""
        self.apply(table, "add", table.job_changes("add", key, key, address, address6), what)

    def table_exists(self, table):
        try:
            self.run([{"list": {"table": table.table_obj()}}], "list table")
            return True
        except NftError as e:
            if e.enoent:
                return False
            raise

    def counter_names(self, table):
        """Names of every named counter in the table (for gc)."""
        try:
            docs = self.run([{"list": {"counters": {"family": FAMILY, "table": table.name}}}],
                            "list counters")
        except NftError as e:
            if e.enoent:
                return []
            raise
        return [item["counter"]["name"] for d in docs for item in d.get("nftables", ()) if "counter" in item]
