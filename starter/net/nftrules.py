"""The nft table as data: what `inet starter` holds, rendered from a
configuration (pure: no I/O, no kernel).

Table.create() renders the whole table as JSON commands for libnftables
(applied by nft.Nft.run); Table.job_changes() renders what one job adds or
removes as plain tuples (counters and set elements, never rules), which
nftwire.py encodes as nf_tables netlink messages.  The table's shape (its
sets, maps, chains and the order of their rules) is drawn in docs/design.md,
"The nft table"; tests/test_nft.py checks that drawing against a live job's
table and this module's output against tests/fixtures/nft/.

The rules are fixed when the table is made: a job is added by adding its
named counters and elements to a few sets and maps in ONE transaction, so
neither the packet path nor the cost of adding a job grows with the number
of jobs.  A job id never appears here, only its hashed key (ipam.job_key).

Forwarding guards: IPv4 forwarding is decided by the INPUT device's
conf.<if>.forwarding, set on each job's host veth and on the uplink, where
replies come in.  If the uplink's flag was off, turning it on would also let
the host route foreign traffic arriving there; the forward chain's
guard_ifs rule (guard6_ifs for IPv6, whose forwarding is per interface
through force_forwarding: net/sysctl.py) drops that, only for uplinks we
opened.  An accept here does not override other tables: a site firewall
that drops forwarded traffic must allow the pool.
"""

import _socket

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
UPLINK_DIRECTIONS = ("in", "out")
# The job networks' VXLAN port (IANA's): no job sends to it, on any node,
# so none can put frames into another job's network (net/overlay.py).
VXLAN_PORT = 4789



def job_mark(address):
    """The conntrack mark of a job's connections: its IPv4 address as a
    32-bit number (pure).  Unique among live jobs (one lease per address),
    and far from the small marks sites give their own flows."""
    return int.from_bytes(_socket.inet_aton(address), "big")


# Protocols by number: a name makes libnftables call getprotobyname(), which
# needs /etc/protocols (Debian's netbase), and a node may not have it (the
# package's offline check found a minimal Debian 12 without it).
IPPROTO = {"tcp": 6, "udp": 17, "ipv6-icmp": 58}

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
# size (nf_conntrack_max) cannot be read; see nft.max_flows().
DEFAULT_MAX_FLOWS = 32768


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
        cmds.append({"add": {"counter": self._obj(name="foreign_marks")}})
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
            # per job (by its veth): the mark its connections get (job_mark),
            # by which teardown flushes them (conntrack.forget)
            self._set("job_marks", "ifname", map_="mark"),
            # per job (by its veth): its tracked connections, counted by the
            # kernel; filled from the packet path (nft makes it dynamic)
            {"add": {"set": self._obj(name="job_flows", type="ifname", size=65535)}},
            self._set("job_src", ["ifname", "ipv4_addr"]),
            self._set("job_src6", ["ifname", "ipv6_addr"]),
            self._set("host_allow", ["inet_proto", "inet_service"],
                      elem=[{"concat": [IPPROTO[p], int(n)]} for p, n in host_allow]),
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
            self._chain("output", "output"),
            self._chain("postrouting", "postrouting", type_="nat", prio=100),
            self._chain("nat_input", "input", type_="nat", prio=100),
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
            self._rule("job_ingress6", _match(_meta("l4proto"), IPPROTO["ipv6-icmp"]), {"jump": {"target": "job_icmp6"}}),
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
            self._rule("job_out", _match(_meta("l4proto"), IPPROTO["udp"]), _match(_payload("th", "dport"), VXLAN_PORT),
                       *drop_job),
            self._rule("job_out", *too_many_flows),
            self._rule("job_out", _ctr_map(oif, "ctr_uplink_out")),
            self._rule("job_out", _match(nfproto, "ipv6"), {"goto": {"target": "job_out6"}}),
            self._rule("job_out", _match(_payload("ip", "daddr"), "@lan"), _ctr_map(iif, "ctr_lan_out"), ACCEPT),
            self._rule("job_out", _ctr_map(iif, "ctr_wan_out"), ACCEPT),
            self._rule("job_out6", _icmpv6(ND + ROUTER_MSGS), *drop_job),
            self._rule("job_out6", _match(_payload("ip6", "daddr"), "@lan6"), _ctr_map(iif, "ctr_lan_out6"), ACCEPT),
            self._rule("job_out6", _ctr_map(iif, "ctr_wan_out6"), ACCEPT),
            # Only the kernel's own tunnel sockets (no owner) and root send to
            # the VXLAN port from the node: no user's process puts frames
            # into a job's network, here or on another node.
            self._rule("output", _match(_meta("l4proto"), IPPROTO["udp"]), _match(_payload("th", "dport"), VXLAN_PORT),
                       _match(_meta("skuid"), 0, "!="), {"counter": "dropped"}, DROP),
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
            # Every new connection of a job gets its mark, once (a nat
            # chain sees only a connection's first packet): made by the job
            # (in through its veth: routed out, or to the host) or by the
            # host towards it (out through its veth).  A mark a site's own
            # rule gave it first is kept and counted (foreign_marks): then
            # teardown finds the job's connections by address instead.
            *self._mark_rules("postrouting", iif),
            *self._mark_rules("postrouting", oif),
            *self._mark_rules("nat_input", iif),
            self._rule("postrouting", _match(_payload("ip", "saddr"), "@job_nets"),
                       _match(oif, "@uplinks"), {"masquerade": None}),
            self._rule("postrouting", _match(_payload("ip6", "saddr"), "@job_nets6"),
                       _match(oif, "@uplinks"), {"masquerade": None}),
        ]
        return cmds

    def _mark_rules(self, chain, dev):
        ct_mark = {"ct": {"key": "mark"}}
        return [self._rule(chain, _match(dev, "@job_ifs"), _match(ct_mark, 0, "!="), {"counter": "foreign_marks"}),
                self._rule(chain, _match(dev, "@job_ifs"), _match(ct_mark, 0),
                           {"mangle": {"key": ct_mark, "value": {"map": {"key": dev, "data": "@job_marks"}}}})]

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

    def job_changes(self, verb, key, ifname, address, address6=None, has6=None, mark=False):
        """What adding ("add") or removing ("delete") one job changes, in
        order: [("counter", name) | ("element", set, [element, ...])], an
        element being (key parts, counter name, Mark or None).  IPv6 counters and
        sources only for a job with address6 (has6: override for removal);
        its job_marks element only with mark (a table made with the marks
        for every job in it: wiring's table record says).
        Rendered as JSON (add_job, del_job) or as netlink (nftwire, for Nft.apply)."""
        names = COUNTERS + (COUNTERS6 if (address6 if has6 is None else has6) else ())
        counters = [("counter", f"{key}_{c}") for c in names]
        maps = [("element", "ctr_" + c, [((ifname,), f"{key}_{c}")]) for c in names]
        src = [("element", "job_src", [((ifname, Addr(address)), None)])] if address else []
        if address6:
            src.append(("element", "job_src6", [((ifname, Addr(address6)), None),
                                                ((ifname, Addr(JOB_LINK_LOCAL6)), None)]))
        if mark and address:
            src.append(("element", "job_marks", [((ifname,), Mark(job_mark(address)))]))
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

    def add_job(self, key, ifname, address, address6=None, mark=False):
        """The JSON commands of job_changes("add", ...)."""
        return self.to_json("add", self.job_changes("add", key, ifname, address, address6, mark=mark))

    def del_job(self, key, ifname, address, address6=None, has6=None, mark=False):
        """The JSON commands of job_changes("delete", ...)."""
        return self.to_json("delete", self.job_changes("delete", key, ifname, address, address6, has6, mark))


class Addr(str):
    """An address part of a set element's key (an ifname part is a plain str)."""


class Mark(int):
    """A map element's data that is a conntrack mark (not a counter's name)."""


# -- a multi-node job's own counters, in its network namespace ---------------
OVERLAY_TABLE = "starter_overlay"


def overlay_counter(index, direction):
    """The counter of what the job sent to (out) or got from (in) the peer
    node at this index of its peer list."""
    return f"p{index}_{direction}"


def overlay_table(ifname, peers, skip_port=None):
    """The job's own table in its network namespace: what crosses its
    overlay device, per peer node and direction, by the peer's address in
    the job network.  peers: [(index, address, address6 or None)], this
    node left out.  skip_port: UDP from that port to that port is not
    counted (the starters' heartbeats: net/liveness.py; no job can send
    from it, the starter holds it).  Pure: JSON commands for libnftables."""
    t = {"family": FAMILY, "table": OVERLAY_TABLE}
    obj = lambda **kw: dict(t, **kw)  # noqa: E731
    cmds = [{"add": {"table": {"family": FAMILY, "name": OVERLAY_TABLE}}}]
    for i, _a, _a6 in peers:
        cmds += [{"add": {"counter": obj(name=overlay_counter(i, d))}} for d in UPLINK_DIRECTIONS]
    for fam, typ, pos in (("4", "ipv4_addr", 1), ("6", "ipv6_addr", 2)):
        for d in UPLINK_DIRECTIONS:
            elem = [[p[pos], overlay_counter(p[0], d)] for p in peers if p[pos]]
            m = obj(name=f"{d}{fam}", type=typ, map="counter")
            if elem:
                m["elem"] = elem
            cmds.append({"add": {"map": m}})
    hooks = (("out", "output", "oifname", "daddr"), ("in", "input", "iifname", "saddr"))
    for d, hook, dev, field in hooks:
        cmds.append({"add": {"chain": obj(name=d, type="filter", hook=hook, prio=0, policy="accept")}})
        if skip_port:
            cmds.append({"add": {"rule": obj(chain=d, expr=[
                _match(_meta("l4proto"), IPPROTO["udp"]), _match(_payload("udp", "sport"), skip_port),
                _match(_payload("udp", "dport"), skip_port), {"return": None}])}})
        for fam, proto in (("4", "ip"), ("6", "ip6")):
            cmds.append({"add": {"rule": obj(chain=d, expr=[
                _match(_meta(dev), ifname), _match(_meta("nfproto"), "ipv4" if fam == "4" else "ipv6"),
                _ctr_map(_payload(proto, field), d + fam)])}})
    return cmds


# -- a pilot's job network (no root: net/usermode.py), in its namespace --------
USERMODE_TABLE = "starter_usermode"


def usermode_table(ifname, lan):
    """The job's own table in its network namespace, where a starter
    without root counts what crosses the user-mode stack's device `ifname`:
    the named counters ZONES (IPv4 and IPv6 together), LAN by the CIDRs
    `lan`, the rest WAN.  The job has no capability in its namespace and
    cannot change it.  Pure: JSON commands for libnftables."""
    t = {"family": FAMILY, "table": USERMODE_TABLE}
    obj = lambda **kw: dict(t, **kw)  # noqa: E731
    cmds = [{"add": {"table": {"family": FAMILY, "name": USERMODE_TABLE}}}]
    cmds += [{"add": {"counter": obj(name=z)}} for z in ZONES]
    lan4, lan6 = split_families(lan)
    for name, typ, cidrs in (("lan4", "ipv4_addr", lan4), ("lan6", "ipv6_addr", lan6)):
        s = obj(name=name, type=typ, flags=["interval"])
        if cidrs:
            s["elem"] = [_prefix(c) for c in cidrs]
        cmds.append({"add": {"set": s}})
    for d, hook, dev, field in (("out", "output", "oifname", "daddr"), ("in", "input", "iifname", "saddr")):
        cmds.append({"add": {"chain": obj(name=d, type="filter", hook=hook, prio=0, policy="accept")}})
        for proto, s in (("ip", "@lan4"), ("ip6", "@lan6")):
            cmds.append({"add": {"rule": obj(chain=d, expr=[
                _match(_meta(dev), ifname), _match(_payload(proto, field), s),
                {"counter": f"lan_{d}"}, {"return": None}])}})
        cmds.append({"add": {"rule": obj(chain=d, expr=[_match(_meta(dev), ifname), {"counter": f"wan_{d}"}])}})
    return cmds
