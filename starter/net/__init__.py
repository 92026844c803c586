"""A job's NAT network with LAN/WAN accounting: the cheap facade.

    setup(job_id, netns_fd, cfg)  -> NetLease     after clone, before release
    counters(job_id, cfg)         -> dict | None  live read (status)
    teardown(job_id, cfg)         -> dict | None  final counters; idempotent
    teardown_begin(job_id, cfg)   -> callable     the same, answered later
    gc(cfg, live_job_ids)         -> [removed]    reclaim what crashes left
    resolv_conf_text(cfg)         -> str          the job's /etc/resolv.conf
    serve(cfg, socket_path)                       the netd main loop

Each call goes to netd (the per-node helper holding the rtnetlink and
libnftables handle) when its socket answers, else runs in-process and pays
for the imports there.  Importing this module imports neither.

Counters: {"lan_in"|"lan_out"|"wan_in"|"wan_out"|"dropped": {"bytes", "packets"}},
both families together, plus "ipv4": {lan_in, lan_out, wan_in, wan_out} and,
for a job that had IPv6, "ipv6": the same per family.
"""

import os

DEFAULT_POOL = "10.213.0.0/16"
# A unique local (RFC 4193) /64 whose 40-bit global ID is the first 40 bits
# of sha256("starter job network"): pseudo-random as the RFC asks, and the
# same on every node, so a site sees one documented range.
DEFAULT_POOL6 = "fd70:7639:1864::/64"
SOCKET_NAME = "netd.sock"


class NetConfig:
    """The node's job-network settings.  Immutable; all jobs on a node share
    one table, so they must agree on everything but state_dir.

    state_dir         leases under <state_dir>/net/, netd socket <state_dir>/netd.sock
    pool              IPv4 CIDR cut into one /30 per job
    pool6             IPv6 unique local CIDR cut into one /126 per job; a job
                      gets slot n of both pools (one lease, two addresses)
    ipv6              "auto" (IPv6 where an uplink has it), "on" (required:
                      an error if an uplink lacks it), "off"; per job, jobs
                      on a node need not agree
    lan               CIDRs counted as LAN (everything else is WAN), both families
    uplink            interfaces to masquerade out of, a tuple (a single name
                      or None is accepted); each destination leaves by the
                      host's own routing, and only traffic routed out of one
                      of these is forwarded.  Empty: jobs reach only the
                      allow-listed host ports
    allow_host_ports  (("tcp", 3128), ...) host ports jobs may reach
    resolver          nameserver for the job's resolv.conf, or "gateway"
                      (a resolver on the host, reachable via allow_host_ports)
    table             the nft table (inet family); always starter*
    rate              ((zone, bits/s), ...) the job's bandwidth caps
                      (net/shaping.py); per job, not part of the table
    overlay           --net job: (vni, node, ((name, fabric address), ...),
                      transport, network id, node key path), the job's
                      network across its nodes (net/overlay.py);
                      per job, not part of the table; None: none
    """

    __slots__ = ("state_dir", "pool", "lan", "uplink", "allow_host_ports", "resolver", "table",
                 "pool6", "ipv6", "rate", "overlay")

    def __init__(self, state_dir, pool=DEFAULT_POOL, lan=(), uplink=None,
                 allow_host_ports=(), resolver=None, table="starter", pool6=DEFAULT_POOL6, ipv6="auto",
                 rate=(), overlay=None):
        s = object.__setattr__
        s(self, "state_dir", state_dir)
        s(self, "pool", pool)
        s(self, "pool6", pool6 or DEFAULT_POOL6)
        s(self, "ipv6", ipv6 or "auto")
        s(self, "lan", tuple(lan))
        s(self, "uplink", _names(uplink))
        s(self, "allow_host_ports", tuple((p, int(n)) for p, n in allow_host_ports))
        s(self, "resolver", resolver)
        s(self, "table", table)
        s(self, "rate", tuple((z, b) for z, b in rate or ()))
        s(self, "overlay", None if not overlay else
          (int(overlay[0]), str(overlay[1]), tuple((str(n), str(a)) for n, a in overlay[2]),
           *(tuple(str(x) for x in overlay[3:6]) or ("vxlan", "", ""))))

    def __setattr__(self, name, value):
        raise AttributeError("NetConfig is immutable")

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d):
        return cls(**{k: d[k] for k in cls.__slots__ if k in d})

    def __eq__(self, other):
        return isinstance(other, NetConfig) and self.as_dict() == other.as_dict()

    def __hash__(self):
        return hash(tuple(getattr(self, k) for k in self.__slots__))

    def __repr__(self):
        return "NetConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def _names(v):
    """None | "eth0" | ["eth0", "ib0"] -> ("eth0", "ib0"): one uplink or several."""
    if not v:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(dict.fromkeys(v))


class NetLease:
    """What the job got: its address, the gateway (host end) and the veth;
    address6/gateway6 None when the job has no IPv6; overlay: its part of
    a --net job network (a dict), else None."""

    __slots__ = ("job_id", "address", "gateway", "prefixlen", "host_ifname", "address6", "gateway6", "overlay")

    def __init__(self, job_id, address, gateway, prefixlen, host_ifname, address6=None, gateway6=None,
                 overlay=None):
        self.job_id, self.address, self.gateway = job_id, address, gateway
        self.prefixlen, self.host_ifname = prefixlen, host_ifname
        self.address6, self.gateway6 = address6, gateway6
        self.overlay = overlay      # --net job: overlay.setup()'s record

    @classmethod
    def from_record(cls, rec):
        return cls(rec["job_id"], rec["address"], rec["gateway"], rec["prefixlen"], rec["host_ifname"],
                   rec.get("address6"), rec.get("gateway6"), rec.get("overlay"))

    def __eq__(self, other):
        return isinstance(other, NetLease) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self):
        return "NetLease(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def config_for(spec):
    """NetConfig from a JobSpec (its `network` section and state_dir)."""
    return config_of(spec.network, spec.state_dir)


def config_of(n, state_dir):
    """NetConfig from a spec's Network and a state directory."""
    return NetConfig(state_dir=state_dir, pool=getattr(n, "pool", None) or DEFAULT_POOL,
                     lan=getattr(n, "lan", ()) or (), uplink=getattr(n, "uplink", ()),
                     allow_host_ports=getattr(n, "allow_host_ports", ()) or (),
                     resolver=getattr(n, "resolver", None),
                     pool6=getattr(n, "pool6", None) or DEFAULT_POOL6, ipv6=getattr(n, "ipv6", None) or "auto",
                     rate=getattr(n, "rate", None) or (), overlay=_overlay(getattr(n, "overlay", None)))


def _overlay(o):
    """A spec's Overlay -> NetConfig.overlay."""
    return None if o is None else (o.vni, o.node, o.peers, o.transport, o.net_id, o.key)


def socket_path(cfg):
    return os.path.join(cfg.state_dir, SOCKET_NAME)


# -- the four operations: netd first, in-process otherwise -------------------
def setup(job_id, netns_fd, cfg):
    """Give the job behind netns_fd its veth, address, route and counters.

    Raises errors.NetworkError (with a hint); on error nothing is left."""
    from starter.net import netd

    try:
        rec = netd.call(socket_path(cfg), {"op": "setup", "job_id": job_id, "cfg": cfg.as_dict()},
                        fds=[netns_fd])
    except netd.Unavailable:
        rec = _local().setup(job_id, netns_fd, cfg, os.getpid())
    if cfg.overlay and not rec.get("overlay"):
        from starter.errors import NetworkError

        teardown(job_id, cfg)
        raise NetworkError("netd did not make the job's network across its nodes (it predates --net job)",
                           "restart `starter netd` with this version")
    if cfg.rate and not rec.get("rate"):
        # A netd older than --net-rate ignores the caps: never a job without them.
        from starter.errors import NetworkError

        teardown(job_id, cfg)
        raise NetworkError("netd did not apply the job's --net-rate caps (it predates them)",
                           "restart `starter netd` with this version")
    return NetLease.from_record(rec)


def teardown(job_id, cfg):
    """Final counters (read before the rules go), then remove everything of
    the job.  Idempotent: None when nothing was left."""
    return _call("teardown", job_id, cfg)


def teardown_begin(job_id, cfg, netns_fd=None):
    """Start teardown() in netd and return at once -> a callable that waits
    for it and returns what teardown() returns.  Without netd, the callable
    does the teardown in-process.  netns_fd: a capped job's network
    namespace, where its outgoing shaper's figures are read."""
    return _ask("teardown", job_id, cfg, netns_fd)


def counters(job_id, cfg):
    """The job's counters now, or None if it has no network."""
    return _call("counters", job_id, cfg)


def gc(cfg, live_job_ids):
    """Reclaim leases, counters, set elements and veths of jobs not in
    live_job_ids; remove the table when no job remains.  -> what was removed."""
    from starter.net import netd

    live = sorted(live_job_ids)
    try:
        return netd.call(socket_path(cfg), {"op": "gc", "live": live, "cfg": cfg.as_dict()})
    except netd.Unavailable:
        return _local().gc(cfg, set(live))


def _call(op, job_id, cfg):
    return _ask(op, job_id, cfg)()


def _ask(op, job_id, cfg, netns_fd=None):
    """Send op to netd -> a callable returning its answer; without netd, one
    that does op in-process."""
    from starter.net import netd

    fds = [netns_fd] if netns_fd is not None else []
    try:
        pending = netd.ask(socket_path(cfg), {"op": op, "job_id": job_id, "cfg": cfg.as_dict()}, fds)
    except netd.Unavailable:
        return lambda: getattr(_local(), op)(job_id, cfg, *fds)
    return lambda: netd.answer(pending)


_wiring = None


def _local():
    global _wiring
    if _wiring is None:
        from starter.net.wiring import Wiring

        _wiring = Wiring()
    return _wiring


def resolv_conf_text(cfg, lease=None):
    """The job's /etc/resolv.conf.  No resolver configured: a comment only
    (the job has no DNS).  "gateway": the job's gateway, i.e. a resolver on
    the host opened with allow_host_ports (needs the lease)."""
    r = cfg.resolver
    if not r:
        return ("# starter: no resolver is configured for jobs on this node.\n"
                "# The site sets one with the network `resolver` option (an address the\n"
                "# job can reach through the NAT, or \"gateway\" plus allow-host-port udp:53).\n")
    if r == "gateway":
        if lease is None:
            return "# starter: resolver is the job's gateway, address not yet known\n"
        r = lease.gateway
    from starter.spec import values
    from starter.errors import NetworkError, SpecError

    try:
        addr = values.ip_address("resolver", r)
    except SpecError:
        raise NetworkError(f"resolver: {r!r} is not an IP address", "give the resolver's address") from None
    return f"# written by starter\nnameserver {addr}\noptions timeout:2 attempts:2\n"


def serve(cfg, socket_path=None):
    """Run netd: answer setup/teardown/counters/gc on a root-only socket."""
    from starter.net import netd

    if isinstance(cfg, str):
        cfg = NetConfig(state_dir=cfg)
    netd.serve(cfg, socket_path or globals()["socket_path"](cfg))
