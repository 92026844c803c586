"""The nft table through the kernel: what is sent, over which path.

    libnftables (starter._nft, native/build_nft.py), JSON commands
        Nft.run       the table made (nftrules.Table.create), its IPv6 guard
                      added, the table removed; table_exists, counter_names (gc)
    raw nf_tables netlink (nftwire), one NETLINK_NETFILTER socket kept open
        Nft.apply     one job's counters and set elements, added or removed
                      in one transaction
        read_counters, read_uplink_counters
                      NFT_MSG_GETOBJ, one named counter each

libnftables answers from a cache of the whole table (every object and set
element), so through it a job's change or a counter read costs O(jobs): ~8 ms
per read at 500 jobs here.  The kernel looks a named set or object up
directly, so the per-job work skips libnftables.  What is rendered lives in
nftrules.py, its netlink encoding in nftwire.py; this module only sends,
receives and reports errors.
"""

import errno
import json
import os
import threading

from starter.errors import NetworkError
from starter.net import netlink, nftrules, nftwire


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
        return nftrules.DEFAULT_MAX_FLOWS


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
                                           nftwire.NETLINK_NETFILTER)
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
        lambda first: b"".join(nftwire.getobj_request(table_name, n, first + i) for i, n in enumerate(names)),
        len(names), ack=False)
    return [err or nftwire.counter_of(replies[0][1]) for replies, err in answers]


def _counter(name, answer):
    """One counter's answer from _getobjs -> {"bytes", "packets"}, or None
    where there is no such table or counter; another error raises."""
    if not isinstance(answer, int):
        return answer
    if answer == -2:    # ENOENT
        return None
    raise NetworkError(f"nftables: reading counter {name} failed: {os.strerror(-answer)}")


def read_counters(table_name, key):
    """The job's counters straight from the kernel, or None if it has none.
    -> combine() of what was read."""
    names = [f"{key}_{c}" for c in nftrules.COUNTERS + nftrules.COUNTERS6]
    raw = {}
    for c, name, r in zip(nftrules.COUNTERS + nftrules.COUNTERS6, names, _getobjs(table_name, names)):
        r = _counter(name, r)
        if r is None:
            if c in nftrules.COUNTERS6:
                continue   # a job without IPv6
            return None
        raw[c] = r
    return combine(raw)


def combine(raw):
    """{lan_in.., drop, lan_in6..} as read -> the report's counters (pure):
    lan_in, lan_out, wan_in, wan_out both families together (what they
    always meant), dropped, "ipv4": the IPv4 share and, when the job had
    IPv6, "ipv6": its share."""
    zero = {"bytes": 0, "packets": 0}
    v4 = {z: dict(raw.get(z) or zero) for z in nftrules.ZONES}
    has6 = any(z + "6" in raw for z in nftrules.ZONES)
    v6 = {z: dict(raw.get(z + "6") or zero) for z in nftrules.ZONES} if has6 else None
    out = {}
    for z in nftrules.ZONES:
        out[z] = {k: v4[z][k] + (v6[z][k] if v6 else 0) for k in ("bytes", "packets")}
    out["dropped"] = dict(raw.get("drop") or zero)
    out["ipv4"] = v4
    if v6 is not None:
        out["ipv6"] = v6
    return out


def foreign_marks(table_name):
    """Packets of new job connections that a rule outside the table had
    marked first (the table's foreign_marks counter), or None where there
    is no such counter (no table, or one made before marks)."""
    (r,) = _getobjs(table_name, ["foreign_marks"])
    r = _counter("foreign_marks", r)
    return None if r is None else r["packets"]


def read_uplink_counters(table_name, uplinks):
    """-> {ifname: {"in": {bytes, packets}, "out": {...}}} node-wide, for the
    uplinks the table was built with; {} when there is no table."""
    pairs = [(u, d) for u in uplinks for d in nftrules.UPLINK_DIRECTIONS]
    if not pairs:
        return {}
    names = [nftrules.uplink_counter(u, d) for u, d in pairs]
    out = {}
    for (u, d), name, r in zip(pairs, names, _getobjs(table_name, names)):
        r = _counter(name, r)
        if r is not None:   # (none: no such table or counter, a table made before these existed)
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
    """The table through the kernel: run() sends JSON commands through one
    libnftables context (the table made, extended or removed; gc's
    listings); apply() sends a job's changes as raw nf_tables netlink.
    Thread-safe by a lock."""

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
        """Table.job_changes() in one nf_tables transaction, over netlink
        (nftwire.transaction), not through libnftables: the kernel finds
        each set and object by name, where libnftables would first build a
        cache of the table, whose cost grows with the number of jobs (at
        500 jobs here: +1.3 ms to add a job, +4 ms to remove one).  All or
        nothing; NftError names the first refused change."""
        try:
            answers = _NETFILTER.exchange(lambda first: nftwire.transaction(table.name, verb, changes, first),
                                          len(changes))
        except OSError as e:   # the batch refused as a whole, or no answer (TimeoutError)
            raise NftError(what, os.strerror(e.errno) if e.errno else str(e) or type(e).__name__) from None
        for i, (_replies, err) in enumerate(answers):
            if err:
                c = changes[i]
                raise NftError(what, f"{os.strerror(-err)} ({verb} {c[0]} {c[1]})")

    def add_job(self, table, key, address, address6=None, what="add job rules", mark=False):
        """apply() of Table.job_changes("add", ...): the job's counters and
        elements, its host veth named by its key (mark: its job_marks element)."""
        self.apply(table, "add", table.job_changes("add", key, key, address, address6, mark=mark), what)

    def has_element(self, table, set_name, parts):
        """Is this element in the set now?  (A get: see nftwire.getsetelem_request.)"""
        ((replies, err),) = _NETFILTER.exchange(
            lambda first: nftwire.getsetelem_request(table.name, set_name, parts, first), 1, ack=False)
        if err in (0, -errno.ENOENT):
            return not err and bool(replies)
        raise NftError(f"look up an element of {set_name}", os.strerror(-err))

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
            docs = self.run([{"list": {"counters": {"family": nftrules.FAMILY, "table": table.name}}}],
                            "list counters")
        except NftError as e:
            if e.enoent:
                return []
            raise
        return [item["counter"]["name"] for d in docs for item in d.get("nftables", ()) if "counter" in item]
