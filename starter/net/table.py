"""The node's nft table: one per state dir, shared by its NAT jobs.  The
first job makes it (or netd pins it at start), each job is checked against
the settings it was made from (cfg_fingerprint), netd keeps it a while after
its last job (linger), and the last job's teardown removes it.  NodeTable is
the half of Wiring (wiring.py) that owns it; validate() and checked_pools()
check every setting that reaches nft or /proc/sys.
"""

import os

from starter.errors import NetworkError
from starter.net import ipam, nft, nftrules
from starter.net.sysctl import forwarding6_path, forwarding_path, ipv6_forwarding_mode, read_sysctl, write_sysctl


def cfg_fingerprint(cfg):
    """What the shared table is built from; jobs on one node must agree."""
    return {
        "pool": cfg.pool, "lan": sorted(cfg.lan), "uplink": _uplink_fingerprint(cfg.uplink),
        "allow_host_ports": sorted([p, int(n)] for p, n in cfg.allow_host_ports),
        "table": cfg.table, "pool6": cfg.pool6,
    }


def _uplink_fingerprint(uplinks):
    """One uplink stays a name (what tables recorded before several were
    allowed), several are a sorted list: the routing, not the order, decides."""
    if not uplinks:
        return None
    return uplinks[0] if len(uplinks) == 1 else sorted(uplinks)


def validate(cfg):
    """-> Pool.  Everything that reaches nft or /proc/sys is checked here."""
    return checked_pools(cfg)[0]


def checked_pools(cfg):
    """validate(), and -> (Pool, Pool6): setup needs both, cut once."""
    import ipaddress

    pool = ipam.Pool(cfg.pool)
    pool6 = ipam.Pool6(cfg.pool6)
    if pool6.size < pool.size:
        raise NetworkError(f"pool6: {pool6.cidr} has fewer /{ipam.SLOT_PREFIXLEN6} slots than pool {pool.cidr} "
                           f"has /{ipam.SLOT_PREFIXLEN}s", "a job gets slot n of both: give a /64")
    if cfg.ipv6 not in ("auto", "on", "off"):
        raise NetworkError(f"ipv6: {cfg.ipv6!r} is not one of auto, on, off")
    for c in cfg.lan:
        try:
            net = ipaddress.ip_network(c, strict=True)
        except ValueError as e:
            raise NetworkError(f"lan: {e}", "give networks such as 10.0.0.0/8 or 2001:db8::/32") from None
        p = pool if net.version == 4 else pool6
        if p.overlaps(str(net)):
            raise NetworkError(f"lan: {c} overlaps the job address pool {p.cidr}",
                               "choose a pool that is not used on the site network")
    for name in cfg.uplink:
        ipam.check_ifname("uplink", name)
    for i, item in enumerate(cfg.allow_host_ports):
        try:
            proto, port = item
        except (TypeError, ValueError):
            raise NetworkError(f"allow_host_ports[{i}]: {item!r} is not (proto, port)") from None
        if proto not in ("tcp", "udp") or not isinstance(port, int) or not 1 <= port <= 65535:
            raise NetworkError(f"allow_host_ports[{i}]: {item!r} must be ('tcp'|'udp', 1..65535)")
    from starter.net import shaping

    for item in cfg.rate:
        zone, bits = item
        if zone not in shaping.ZONES or type(bits) is not int or not shaping.MIN_RATE <= bits <= shaping.MAX_RATE:
            raise NetworkError(f"rate: {item!r} is not (zone, bits/s)")
    if not cfg.table.startswith("starter") or not 1 <= len(cfg.table) <= 64 or \
            set(cfg.table) - set("abcdefghijklmnopqrstuvwxyz0123456789_"):
        raise NetworkError(f"table: {cfg.table!r} must be starter[a-z0-9_]*",
                           "the project only ever touches tables named starter*")
    return pool, pool6


def if_exists(ifname):
    """Is there a link of this name in our network namespace?  Asked of the
    kernel (SIOCGIFINDEX), not of /sys/class/net, which shows the namespace
    of whoever mounted /sys: a starter run in a namespace of its own (the
    multi-node harness, a container's netd) would see the host's links."""
    import _socket

    try:
        _socket.if_nametoindex(ipam.check_ifname("ifname", ifname))
    except OSError:
        return False
    return True


PINNED = float("inf")   # an idle table's "since": never expires (Wiring.pin)


class NodeTable:
    """The table's half of Wiring: made, reused while idle, pinned, checked,
    removed after its last job.  Uses the Wiring's handles (links, nft)."""

    def __init__(self, linger=None):
        # netd sets linger (seconds): the table outlives its last job by that
        # long (expire_idle), so the next job does not pay for making it
        # (8-11 ms here: the ruleset, the uplink checks, the IPv6 probe).
        # A table made by another process, or one whose settings differ from
        # the next job's, is rebuilt as before.
        self._linger = linger
        self._idle = {}  # (state_dir, table) -> (cfg, monotonic time its last job left, or PINNED)
        self._pinned = {}  # (state_dir, table) -> fingerprint of the node's own settings (pin())

    def _last_job_left(self, store, cfg, removed):
        """The state dir's last job has gone (lock held): the table is kept
        idle (pinned by netd, or lingering), else removed (named in
        `removed`)."""
        table = nftrules.Table(cfg.table)
        key = (cfg.state_dir, cfg.table)
        recorded = store.table_record() is not None
        if recorded and self._pinned.get(key) == cfg_fingerprint(cfg):
            self._idle[key] = (cfg, PINNED)
            return
        if recorded and self._linger is not None:
            import time

            self._idle[key] = (cfg, time.monotonic())
            return
        if recorded or self.nft.table_exists(table):
            self._delete_table(store, table)
            if removed is not None:
                removed.append(f"table {nftrules.FAMILY} {cfg.table}")

    def _check_pool_is_free(self, cfg, own=()):
        """The pools must not overlap any host address (the site's own nets);
        `own`: veths of this state dir's leases (a table rebuilt under them)."""
        import socket

        for which, p, family in (("pool", ipam.Pool(cfg.pool), socket.AF_INET),
                                 ("pool6", ipam.Pool6(cfg.pool6), socket.AF_INET6)):
            for cidr, ifname in self.links.host_addresses(family):
                if not p.overlaps(cidr) or ifname in own:
                    continue
                hint = ("a job veth left by a crash or by a starter with another state dir: "
                        "run `starter gc`" if ipam.is_job_key(ifname)
                        else f"configure a job address {which} that is not used on this node")
                raise NetworkError(f"{which}: {getattr(cfg, which)} overlaps {cidr} on {ifname}", hint)

    def _create_table(self, store, cfg, table):
        self._check_pool_is_free(cfg, own={lease.get("key") for lease in store.all()})
        # A table rebuilt under running jobs keeps the record's IPv6 decision
        # and the uplinks whose forwarding it turned on (now "1": ours to undo).
        old = store.table_record() or {}
        guard = []
        for name in cfg.uplink:
            if not if_exists(name):
                raise NetworkError(f"uplink: interface {name!r} does not exist",
                                   "set the uplink to the interface that reaches the LAN/WAN "
                                   "(`ip route get <address>` names it)")
            if name in old.get("guard", ()) or read_sysctl(forwarding_path(name)) == "0":
                guard.append(name)
        # Record first: a crash after the sysctl write must still restore it.
        # "marks": every connection of its jobs carries the job's mark (see
        # _marks); not so in a table rebuilt under running jobs' connections.
        v6 = old.get("v6")
        store.set_table_record({"cfg": cfg_fingerprint(cfg), "guard": guard, "v6": v6,
                                "marks": not store.has_leases()})
        try:
            self.nft.run(table.create(cfg.pool, cfg.lan, list(cfg.uplink), guard, cfg.allow_host_ports,
                                      cfg.pool6, (v6 or {}).get("guard6", ()), nft.max_flows()),
                         "create table")
            for ifname in guard:
                write_sysctl(forwarding_path(ifname), "1")
        except BaseException:
            self._delete_table(store, table)
            raise

    def _reuse_idle_table(self, store, cfg):
        """No job runs: keep the table a lingering netd holds if it was built
        for these settings (True); else remove whatever was recorded (the
        uplink sysctls go back) so that it is built anew (False).  A table
        removed under us (nft flush ruleset) is rebuilt by _add_job."""
        idle = self._idle.pop((cfg.state_dir, cfg.table), None)
        rec = store.table_record()
        if rec is None:
            return False
        if idle is not None and rec.get("cfg") == cfg_fingerprint(cfg):
            return True
        self._delete_table(store, nftrules.Table(cfg.table))
        return False

    def pin(self, cfg):
        """Make the table for cfg now, before any job needs it, and keep it
        while this Wiring lives (netd: the node policy's network, so no
        job on the node pays for making the table).  A job with other
        settings may still replace it while no job runs; the next job with
        these settings then makes it again, and keeps it from then on."""
        checked_pools(cfg)
        key = (cfg.state_dir, cfg.table)
        self._pinned[key] = cfg_fingerprint(cfg)
        store = ipam.LeaseStore(cfg.state_dir)
        with store:
            if store.has_leases():
                return      # jobs run: the table is theirs; _release pins it when they are done
            if not self._reuse_idle_table(store, cfg):
                self._create_table(store, cfg, nftrules.Table(cfg.table))
            self._idle[key] = (cfg, PINNED)

    def expire_idle(self, now=None, force=False):
        """Remove the tables whose last job left more than linger seconds ago
        (force: all idle ones; netd calls this as it stops)."""
        import time

        now = time.monotonic() if now is None else now
        for k, (cfg, since) in list(self._idle.items()):
            if not force and (since == PINNED or now - since < self._linger):
                continue
            store = ipam.LeaseStore(cfg.state_dir)
            with store:
                # still idle? (a job may have taken it meanwhile: setup pops it)
                if self._idle.get(k, (None, None))[1] != since:
                    continue
                del self._idle[k]
                if not store.has_leases() and store.table_record() is not None:
                    self._delete_table(store, nftrules.Table(cfg.table))

    def next_expiry(self):
        """Seconds until expire_idle() has work (None: no idle table)."""
        import time

        expiring = [since for _, since in self._idle.values() if since != PINNED]
        if not expiring:
            return None
        return max(0.0, min(expiring) + self._linger - time.monotonic())

    def _delete_table(self, store, table):
        """Remove the table and undo the uplink sysctls.  Idempotent."""
        rec = store.table_record() or {}
        self.nft.run(table.delete(), "delete table")
        for ifname in rec.get("guard", ()):
            if if_exists(ifname):
                write_sysctl(forwarding_path(ifname), "0")
        for ifname in (rec.get("v6") or {}).get("guard6", ()):
            if if_exists(ifname):
                write_sysctl(forwarding6_path(ifname), "0")
        store.set_table_record(None)

    # -- IPv6 --------------------------------------------------------------
    def _ipv6_for_job(self, store, cfg, table):
        """Whether this job gets IPv6: None (no), else whether its host veth
        needs its own IPv6 forwarding flag.  Lock held, table made.  The
        node's answer (which uplinks have IPv6, how to forward) is worked
        out once, by the first job that asks, and kept in the table record
        until the table goes: later jobs pay one file read."""
        if cfg.ipv6 == "off" or (cfg.ipv6 == "auto" and not cfg.uplink):
            return None     # no uplink: nowhere to send IPv6 (and no netlink dump to pay)
        rec = store.table_record() or {}
        v6 = rec.get("v6")
        if v6 is None:
            v6 = self._enable_ipv6(store, cfg, table, rec)
        usable = v6.get("uplinks") or []
        if cfg.ipv6 == "on":
            if v6.get("mode") is None:
                raise NetworkError("ipv6 on: this kernel cannot forward IPv6 per interface (net.ipv6.conf.*."
                                   "force_forwarding, Linux 6.17) and net.ipv6.conf.all.forwarding is 0",
                                   "set net.ipv6.conf.all.forwarding=1 (with accept_ra=2 on uplinks that learn "
                                   "their route from router advertisements), or run jobs with --ipv6 off")
            if not cfg.uplink:
                raise NetworkError("ipv6 on: no uplink is configured", "give --uplink IFACE, or --ipv6 off")
            missing = [u for u in cfg.uplink if u not in usable]
            if missing:
                raise NetworkError(f"ipv6 on: uplink {missing[0]!r} has no global IPv6 address",
                                   "give the uplink an IPv6 address, or run with --ipv6 auto (IPv6 where an "
                                   "uplink has it) or --ipv6 off")
        elif not usable or v6.get("mode") is None:
            return None
        return v6["mode"] == "per-interface"

    def _enable_ipv6(self, store, cfg, table, rec):
        import ipaddress
        import socket

        mode = ipv6_forwarding_mode()
        have = set()
        for cidr, ifname in self.links.host_addresses(socket.AF_INET6):
            a = ipaddress.ip_interface(cidr).ip
            if not (a.is_link_local or a.is_loopback or a.is_multicast):
                have.add(ifname)
        uplinks = [u for u in cfg.uplink if u in have]
        guard6 = []
        if mode == "per-interface":
            guard6 = [u for u in uplinks if read_sysctl(forwarding6_path(u)) == "0"]
        v6 = {"mode": mode, "uplinks": uplinks, "guard6": guard6}
        rec["v6"] = v6
        store.set_table_record(rec)   # first: a crash must still restore the sysctls
        if guard6:
            self.nft.run(table.add_guard6(guard6), "add IPv6 guard")
            for u in guard6:
                write_sysctl(forwarding6_path(u), "1")
        return v6

    def _check_table_matches(self, store, cfg):
        rec = store.table_record()
        if rec is not None and rec.get("cfg") != cfg_fingerprint(cfg):
            raise NetworkError(
                "network configuration differs from the one the running jobs use "
                f"(running: {rec.get('cfg')}, this job: {cfg_fingerprint(cfg)})",
                "all jobs on a node share one table: give every job the same pool, lan, uplink "
                "and allow-list (or wait until no NAT job runs)")
