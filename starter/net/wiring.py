"""One job's network, start to end: lease, table, veth, rules; in that order,
released in reverse.  Used by netd and, when netd is not running, in-process.

All changes happen under the state dir's network lock (ipam.LeaseStore), so
the first job's table creation, the last job's table removal and everything
in between are serialised between starters and netd.  Each step's undo is
registered right after the step; every undo tolerates "already gone", which
is what lets teardown and gc share them on half-built or crashed jobs.
"""

import contextlib
import os

from starter.errors import NetworkError
from starter.net import ipam, nft, nftrules
from starter.net.sysctl import forwarding6_path, forwarding_path, ipv6_forwarding_mode, read_sysctl, write_sysctl
from starter.state.store import QUICK_BUDGET_S, fault, is_live


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


def _has_marks(store):
    """Was the state dir's table made with job marks (its record)?"""
    return bool((store.table_record() or {}).get("marks"))


def _if_exists(ifname):
    return os.path.exists(f"/sys/class/net/{ipam.check_ifname('ifname', ifname)}")


# The lease fields holding the job's addresses (one per family), whose
# conntrack entries teardown deletes.
JOB_ADDRESS_KEYS = ("address", "address6")


def _forget_flows(*items):
    """Delete the dead jobs' conntrack entries (both families) before their
    leases go, so their addresses can be leased again at once: one flush
    by mark per job, or by address where its marks are not trusted.  items:
    (cfg, lease).  A failure keeps the leases (raised): `starter gc` retries."""
    addrs = [lease[k] for _cfg, lease in items for k in JOB_ADDRESS_KEYS if lease and lease.get(k)]
    if addrs:
        from starter.net import conntrack

        try:
            conntrack.forget(addrs, _marks(items))
        except OSError as e:
            raise NetworkError(f"deleting the conntrack entries of {', '.join(addrs)} failed: {e}",
                               "the lease is kept; `starter gc` retries") from None


def _marks(items):
    """{mark: addresses} of the jobs whose every connection carries their mark:
    their table was made with marks before its jobs (its record says so) and
    no site rule marked a job's connection first (foreign_marks is 0)."""
    out, trusted = {}, {}
    for cfg, lease in items:
        if not lease or not lease.get("address"):
            continue
        if cfg.table not in trusted:
            rec = ipam.LeaseStore(cfg.state_dir).table_record() or {}
            with contextlib.suppress(NetworkError):     # unread: untrusted
                trusted[cfg.table] = bool(rec.get("marks")) and nft.foreign_marks(cfg.table) == 0
            trusted.setdefault(cfg.table, False)
        if trusted[cfg.table]:
            out[nftrules.job_mark(lease["address"])] = [lease[k] for k in JOB_ADDRESS_KEYS if lease.get(k)]
    return out


PINNED = float("inf")   # an idle table's "since": never expires (Wiring.pin)


class Wiring:
    """Holds the handles (rtnetlink, libnftables) for its lifetime."""

    def __init__(self, defer=False, linger=None):
        self._links = None
        self._nft = None
        # netd sets linger (seconds): the table outlives its last job by that
        # long (expire_idle), so the next job does not pay for making it
        # (8-11 ms here: the ruleset, the uplink checks, the IPv6 probe).
        # A table made by another process, or one whose settings differ from
        # the next job's, is rebuilt as before.
        self._linger = linger
        self._idle = {}  # (state_dir, table) -> (cfg, monotonic time its last job left, or PINNED)
        self._pinned = {}  # (state_dir, table) -> fingerprint of the node's own settings (pin())
        # netd sets defer: teardown answers once the rules and counters are
        # gone; deleting the veth (15-30 ms here, nearly all of it waiting for
        # RCU in unregister_netdevice, outside the RTNL lock), releasing the
        # lease and removing an unused table happen on a worker thread with
        # its own netlink socket, so neither the starter nor netd's next
        # request waits for them.  The lease is released only after the
        # veth is gone, so its addresses cannot be handed out twice.
        self._queue = None
        self._worker = None
        self._pending = set()  # keys whose teardown the worker has yet to finish
        self._later = []       # deferred work of the request being answered
        if defer:
            import queue
            import threading

            self._queue = queue.Queue()
            self._worker = threading.Thread(target=self._work, name="net-teardown", daemon=True)
            self._worker.start()

    @property
    def links(self):
        if self._links is None:
            from starter.net.veth import Links  # only when a veth is touched

            self._links = Links()
        return self._links

    @property
    def nft(self):
        if self._nft is None:
            self._nft = nft.Nft()
        return self._nft

    def start_deferred(self):
        """Hand the current request's deferred work to the worker.  netd calls
        this after it has sent the reply: the worker's Python (netlink, the
        conntrack walk) would otherwise hold the GIL while the reply waits."""
        for item in self._later:
            self._queue.put(item)
        self._later.clear()

    def close(self):
        """Finish queued teardowns, remove lingering tables, drop the handles."""
        if self._worker is not None:
            self.start_deferred()
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self.expire_idle(force=True)
        if self._links is not None:
            self._links.close()
            self._links = None

    def _work(self):
        import queue
        import sys

        from starter.net.veth import Links

        links = None
        stop = False
        while not stop:
            items = [self._queue.get()]
            while items[-1] is not None:      # and whatever else is queued: one conntrack walk
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if items[-1] is None:
                stop = True
                items.pop()
            try:
                if items:
                    if links is None:
                        links = Links()  # a netlink socket of its own: not shared between threads
                    self._finish(links, items)
            except Exception as e:  # noqa: BLE001 - gc reclaims whatever is left
                sys.stderr.write(f"netd: finishing the teardown of {', '.join(i[1] for i in items)} failed: {e}\n")
            finally:
                for item in items:
                    self._pending.discard(item[1])
                    self._queue.task_done()
        if links is not None:
            links.close()

    def wait_idle(self):
        if self._queue is not None:
            self._queue.join()

    # -- the table -------------------------------------------------------
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
            if not _if_exists(name):
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
            if _if_exists(ifname):
                write_sysctl(forwarding_path(ifname), "0")
        for ifname in (rec.get("v6") or {}).get("guard6", ()):
            if _if_exists(ifname):
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

    # -- one job ---------------------------------------------------------
    def setup(self, job_id, netns_fd, cfg, owner_pid):
        pool, pool6 = checked_pools(cfg)
        key = ipam.job_key(job_id, cfg.table)
        table = nftrules.Table(cfg.table)
        store = ipam.LeaseStore(cfg.state_dir)
        with store, contextlib.ExitStack() as undo:
            try:
                # The table first: whether the job gets IPv6 is the node's
                # answer, recorded with the table.
                if not store.has_leases():
                    if not self._reuse_idle_table(store, cfg):
                        self._create_table(store, cfg, table)
                else:
                    self._check_table_matches(store, cfg)
                forward6 = self._ipv6_for_job(store, cfg, table)
                lease = self._acquire(store, cfg, job_id, key, pool, owner_pid,
                                      pool6 if forward6 is not None else None,
                                      {"rate": dict(cfg.rate)} if cfg.rate else None)
                undo.callback(store.release, key, lease["slot"])
                fault("net-lease")
                v6 = None
                if lease.get("address6"):
                    v6 = (lease["gateway6"], lease["address6"], lease["prefixlen6"], forward6)
                shape = None
                if cfg.rate:
                    # (the job's own /30 and /126, its gateway, never shaped)
                    shape = (dict(cfg.rate), cfg.lan, [c for c in (lease["network"], lease.get("network6")) if c])
                self.links.create(key, netns_fd, lease["gateway"], lease["address"],
                                  lease["prefixlen"], forward=bool(cfg.uplink), v6=v6, shape=shape)
                undo.callback(self.links.delete, key)
                fault("net-veth")
                self._add_job(store, cfg, table, key, lease["address"], lease.get("address6"))
                fault("net-nft")
                undo.pop_all()
            except BaseException:
                undo.close()
                # Only a table this state dir recorded: a job that failed
                # before making one must not delete another's of that name.
                if not store.has_leases() and store.table_record() is not None:
                    with contextlib.suppress(Exception):
                        self._delete_table(store, table)
                raise
        return lease

    def _acquire(self, store, cfg, job_id, key, pool, owner_pid, pool6=None, extra=None):
        """A lease; a full pool first gives up one dead job's lease."""
        try:
            return store.acquire(job_id, key, pool, owner_pid, pool6, extra)
        except ipam.PoolExhausted:
            if not self._reclaim_one(store, cfg):
                raise
        return store.acquire(job_id, key, pool, owner_pid, pool6, extra)

    def _reclaim_one(self, store, cfg):
        """The pool is full: reclaim the lease of one dead job, if a scan
        bounded like gc at start (state.QUICK_BUDGET_S) finds one.  At most
        one reclaim, and never a wait: only a lease whose starter is gone,
        whose job entry is not live, and whose veth is gone already (the
        job's namespace died with it; deleting a veth waits for RCU, and a
        veth that still exists may still carry a process of the job: both
        are left to `starter gc`).  Lock held.  -> whether one was freed."""
        import time

        deadline = time.monotonic() + QUICK_BUDGET_S
        try:
            names = [n[:-5] for n in os.listdir(store.leases) if n.endswith(".json")]
        except FileNotFoundError:
            return False
        k = os.getpid() % len(names) if names else 0   # a different start each time
        for key in names[k:] + names[:k]:
            if time.monotonic() >= deadline:
                break
            if not ipam.is_job_key(key):
                continue
            lease = store.get_by_key(key)
            job_id = lease.get("job_id") if lease else None
            if job_id is None or ipam.owner_alive(lease) or is_live(cfg.state_dir, job_id) or _if_exists(key):
                continue
            # A key netd's worker is still finishing (its starter has left)
            # may be taken here too: both sides tolerate the other's removal.
            # The table stays: this setup is about to use it (and the IPv6
            # decision recorded with it).
            self._teardown_key(store, cfg, key, lease, keep_table=True)
            return True
        return False

    def _add_job(self, store, cfg, table, key, address, address6=None):
        try:
            self.nft.add_job(table, key, address, address6, mark=_has_marks(store))
        except nft.NftError as e:
            if not e.enoent or self.nft.table_exists(table):
                raise
            # Someone removed our table under running jobs (nft flush ruleset):
            # rebuild it with every live lease, then add this job.
            self._create_table(store, cfg, table)       # (without marks: jobs run)
            for other in store.all():
                if other.get("key") != key and other.get("address") and _if_exists(other["key"]):
                    self.nft.add_job(table, other["key"], other["address"], other.get("address6"), "re-add job")
            self.nft.add_job(table, key, address, address6)

    def counters(self, job_id, cfg):
        return nft.read_counters(cfg.table, ipam.job_key(job_id, cfg.table))

    def teardown(self, job_id, cfg, netns_fd=None):
        """netns_fd: the job's network namespace, kept open by its starter,
        where a capped job's outgoing shaper is read (else only the host
        end's)."""
        key = ipam.job_key(job_id, cfg.table)
        if key in self._pending:
            return None  # torn down already; the worker is finishing it
        store = ipam.LeaseStore(cfg.state_dir)
        with store:
            lease = store.get_by_key(key)
            if lease is None and not _if_exists(key):
                # Nothing on record: done before (or never set up).  Skip nft:
                # a failing nft command costs ~8 ms (and grows with the
                # ruleset); stray counters are gc's business.
                return None
            return self._teardown_key(store, cfg, key, lease, defer=True, netns_fd=netns_fd)

    def _teardown_key(self, store, cfg, key, lease, removed=None, defer=False, keep_table=False, netns_fd=None):
        """Read the counters, then remove rules, counters, veth, lease, and the
        table if this was the last job.  Every step tolerates absence."""
        table = nftrules.Table(cfg.table)
        address = lease.get("address") if lease else None
        counters = nft.read_counters(cfg.table, key)
        if counters is not None and lease and lease.get("rate"):
            from starter.net import shaping

            counters["shaping"] = shaping.report(lease["rate"], self.links.shaping_stats(key, netns_fd))
        # The IPv6 objects: by the lease, or (no lease: gc) by the counters found.
        address6 = lease.get("address6") if lease else None
        has6 = bool(address6) or bool(counters and "ipv6" in counters)
        # The veth can outlive the job (a socket of the job's network
        # namespace held by another process) until it is deleted, which netd
        # leaves to its worker: without its rules it would pass that
        # socket's traffic unchecked to the host and out.  Down first.
        if _if_exists(key):
            self.links.set_down(key)
        if counters is not None or address:
            changes = table.job_changes("delete", key, key, address, address6, has6, mark=_has_marks(store))
            # Its connection count, made by its first connection (if it had
            # one): a set that only grew would fill up after 65535 jobs.
            # Asked first, and removed in the same transaction: deleting an
            # element that is not there aborts the transaction, and an
            # aborted one costs an RCU grace period (~10 ms here).
            with contextlib.suppress(nft.NftError):
                if self.nft.has_element(table, "job_flows", (key,)):
                    changes = [("element", "job_flows", [((key,), None)])] + changes
            try:
                self.nft.apply(table, "delete", changes, "remove job rules")
            except nft.NftError:
                # Half-built job: remove what exists, one object at a time.
                for change in changes:
                    with contextlib.suppress(nft.NftError):
                        self.nft.apply(table, "delete", [change], "remove job rule")
        if defer and self._queue is not None:
            self._pending.add(key)
            self._later.append((cfg, key, lease))   # queued by start_deferred()
        else:
            self._delete_veth(self.links, key)
            _forget_flows((cfg, lease))
            self._release(store, cfg, key, lease, removed, keep_table)
        return counters

    @staticmethod
    def _delete_veth(links, key):
        # Usually the job's netns died with the job and took the veth along;
        # if it still exists (the netns is kept alive, or is still dying),
        # delete it now.
        if _if_exists(key):
            links.delete(key)

    def _finish(self, links, items):
        """Worker thread, for [(cfg, key, lease)]: the veths without the lock,
        the conntrack entries of them all, then the bookkeeping with it."""
        for _cfg, key, _lease in items:
            self._delete_veth(links, key)
        _forget_flows(*((cfg, lease) for cfg, _key, lease in items))
        for cfg, key, lease in items:
            store = ipam.LeaseStore(cfg.state_dir)
            with store:
                self._release(store, cfg, key, lease, None)

    def _release(self, store, cfg, key, lease, removed, keep_table=False):
        """The lease, and the table if no job is left.  Lock held."""
        table = nftrules.Table(cfg.table)
        store.release(key, lease.get("slot") if lease else None)
        if keep_table or store.has_leases():
            return
        key = (cfg.state_dir, cfg.table)
        if self._pinned.get(key) == cfg_fingerprint(cfg) and store.table_record() is not None:
            self._idle[key] = (cfg, PINNED)
            return
        if self._linger is not None and store.table_record() is not None:
            import time

            self._idle[key] = (cfg, time.monotonic())
            return
        if store.table_record() is not None or self.nft.table_exists(table):
            self._delete_table(store, table)
            if removed is not None:
                removed.append(f"table {nftrules.FAMILY} {cfg.table}")

    def gc(self, cfg, live_job_ids):
        table = nftrules.Table(cfg.table)
        store = ipam.LeaseStore(cfg.state_dir)
        removed = []
        with store:
            removed += store.remove_temp_files()
            live_keys = set()
            for lease in store.all():
                job_id = lease.get("job_id")
                # A job whose entry is locked (its starter lives) is never gc's:
                # live_job_ids was listed before we took the lock, and a job may
                # have started since (its entry is made before its lease).
                if job_id is not None and (job_id in live_job_ids or is_live(cfg.state_dir, job_id)):
                    live_keys.add(lease["key"])
                    continue
                removed.append(f"job {job_id}: lease {lease.get('address')}, veth {lease['key']}, counters")
                self._teardown_key(store, cfg, lease["key"], lease, removed)
            for name, path in store.orphan_slots():
                os.unlink(path)
                removed.append(f"slot {name}")
            stray = {n[:15] for n in self.nft.counter_names(table) if ipam.is_job_key(n[:15])}
            for key in sorted(stray - live_keys):
                removed.append(f"counters and veth of {key}")
                self._teardown_key(store, cfg, key, None, removed)
            # (A table netd keeps for the next job is not a leftover.)
            if not store.has_leases() and (cfg.state_dir, cfg.table) not in self._idle and \
                    (store.table_record() is not None or self.nft.table_exists(table)):
                self._delete_table(store, table)
                removed.append(f"table {nftrules.FAMILY} {cfg.table}")
        return removed
