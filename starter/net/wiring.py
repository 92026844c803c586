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
from starter.net.table import NodeTable, checked_pools, if_exists
from starter.state.store import QUICK_BUDGET_S, fault, is_live


def _has_marks(store):
    """Was the state dir's table made with job marks (its record)?"""
    return bool((store.table_record() or {}).get("marks"))


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


def _overlay_report(cfg, netns_fd):
    """A --net job job's part of its network for the report: where it was
    and, read in its namespace (kept open by its starter), the bytes per
    peer node ("peers": None where the namespace was not given or is gone)."""
    from starter.net import overlay

    plan = overlay.Plan.of(cfg.overlay)
    out = {"vni": plan.vni, "node": plan.node, "address": plan.address(plan.index), "transport": plan.transport}
    got = overlay.read(netns_fd, plan) if netns_fd is not None else None
    out.update(got or {"peers": None})
    return out


class Wiring(NodeTable):
    """Holds the handles (rtnetlink, libnftables) for its lifetime; the
    node's table is NodeTable's (table.py)."""

    def __init__(self, linger=None):
        super().__init__(linger)
        self._links = None
        self._nft = None
        # netd's TeardownWorker, or None: then a teardown does everything
        # before it returns.  With one, teardown answers once the rules and
        # counters are gone and leaves the rest to the worker (finish()).
        self.deferred = None

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

    def close(self):
        """Finish queued teardowns, remove lingering tables, drop the handles."""
        if self.deferred is not None:
            self.deferred.close()
            self.deferred = None
        self.expire_idle(force=True)
        if self._links is not None:
            self._links.close()
            self._links = None

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
                if cfg.overlay:
                    # (in the job's namespace only: it goes with the namespace)
                    from starter.net import overlay

                    lease = dict(lease, overlay=overlay.setup(self.links.rt, netns_fd, overlay.Plan.of(cfg.overlay),
                                                              nftrules.VXLAN_PORT))
                    fault("net-overlay")
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
            if job_id is None or ipam.owner_alive(lease) or is_live(cfg.state_dir, job_id) or if_exists(key):
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
                if other.get("key") != key and other.get("address") and if_exists(other["key"]):
                    self.nft.add_job(table, other["key"], other["address"], other.get("address6"), "re-add job")
            self.nft.add_job(table, key, address, address6)

    def counters(self, job_id, cfg):
        return nft.read_counters(cfg.table, ipam.job_key(job_id, cfg.table))

    def teardown(self, job_id, cfg, netns_fd=None):
        """netns_fd: the job's network namespace, kept open by its starter,
        where a capped job's outgoing shaper is read (else only the host
        end's)."""
        key = ipam.job_key(job_id, cfg.table)
        if self.deferred is not None and key in self.deferred.pending:
            return None  # torn down already; the worker is finishing it
        store = ipam.LeaseStore(cfg.state_dir)
        with store:
            lease = store.get_by_key(key)
            if lease is None and not if_exists(key):
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
        if counters is not None and cfg.overlay:
            counters["overlay"] = _overlay_report(cfg, netns_fd)
        # The IPv6 objects: by the lease, or (no lease: gc) by the counters found.
        address6 = lease.get("address6") if lease else None
        has6 = bool(address6) or bool(counters and "ipv6" in counters)
        # The veth can outlive the job (a socket of the job's network
        # namespace held by another process) until it is deleted, which netd
        # leaves to its worker: without its rules it would pass that
        # socket's traffic unchecked to the host and out.  Down first.
        if if_exists(key):
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
        if defer and self.deferred is not None:
            self.deferred.defer((cfg, key, lease))
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
        if if_exists(key):
            links.delete(key)

    def finish(self, links, items):
        """netd's worker thread (TeardownWorker), for [(cfg, key, lease)]: the veths without the lock,
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
        store.release(key, lease.get("slot") if lease else None)
        if keep_table or store.has_leases():
            return
        self._last_job_left(store, cfg, removed)

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
