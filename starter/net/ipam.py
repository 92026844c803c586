"""Address leases: the pool cut into per-job /30s, one lease per live job;
a job with IPv6 also gets slot n of the IPv6 pool (a /126), in the same lease.

Layout under <state_dir>/net/ (root-only, 0700), present only while a NAT
job runs (an empty state directory means nothing runs):

    slots/<n>            symlink -> job key: slot n of the pool is taken.
                         symlink() is atomic and fails with EEXIST, so a slot
                         can never be handed to two jobs even without the lock
    leases/<key>.json    the lease: job id, slot, addresses, and the owner
                         (starter pid + its start time from /proc/PID/stat, so
                         a recycled pid is not mistaken for the owner)
    table.json           written when this state dir created the nft table:
                         the config it was built with, and the uplinks whose
                         forwarding sysctl we turned on (restored at the end)

Every change to the node's network state (leases, the nft table, uplink
sysctls) happens under flock() on the state directory itself: it outlives
net/, so the lock never sits on a file that someone might unlink while
another process waits on it.

A job gets the lowest free slot.  A dead job's address may be handed out
again at once: teardown deletes its conntrack entries before the lease goes
(wiring._forget_flows), so no late reply of its flows reaches the next job.
When every slot is taken, setup first reclaims one dead job's lease (bounded
like gc at start, wiring.Wiring._reclaim_one) before it refuses the job.

Names derive from the job id (and the table name, so two state dirs with
separate tables do not collide): key = "stj" + 12 hex digits of sha256, which
is also the host end of the veth (15 chars, IFNAMSIZ-1) and the prefix of the
job's nft counters.  gc can find every piece from a job id alone.
"""

import errno
import fcntl
import hashlib
import json
import os

from starter.errors import NetworkError
from starter.fileio import unlink_quiet
from starter.state.store import process_start_time as proc_starttime, write_atomic

KEY_PREFIX = "stj"
SLOT_PREFIXLEN = 30  # network, gateway (.1), job (.2), broadcast


def job_key(job_id, table="starter"):
    """The job's short key: host veth name and counter-name prefix."""
    h = hashlib.sha256(f"{table}\0{job_id}".encode()).hexdigest()
    return KEY_PREFIX + h[:12]


def check_ifname(field, name):
    """Interface names reach /proc/sys paths and nft sets (rule: values.ifname)."""
    from starter.spec import values
    from starter.errors import SpecError

    try:
        return values.ifname(field, name)
    except SpecError as e:
        raise NetworkError(str(e), "use at most 15 characters from [A-Za-z0-9_.-]") from None


def is_job_key(name):
    return (len(name) == len(KEY_PREFIX) + 12 and name.startswith(KEY_PREFIX)
            and all(c in "0123456789abcdef" for c in name[len(KEY_PREFIX):]))


class Pool:
    """An IPv4 CIDR cut into /30 slots of four addresses: network (unused),
    gateway (+1, the host end), the job (+2), broadcast (unused).  Pure
    arithmetic, no state.  Pool6 is the same for IPv6."""

    __slots__ = ("cidr", "base", "prefixlen", "size")
    FIELD, VERSION, SLOT = "pool", 4, SLOT_PREFIXLEN
    WANT = "give an IPv4 network such as 10.213.0.0/16"
    LARGER = "give a network of /30 or larger, e.g. 10.213.0.0/16"

    def __init__(self, cidr):
        import ipaddress

        kind = ipaddress.IPv4Network if self.VERSION == 4 else ipaddress.IPv6Network
        try:
            net = kind(cidr, strict=True)
        except ValueError as e:
            raise NetworkError(f"{self.FIELD}: {e}", self.WANT) from None
        self._check(net, cidr)
        if net.prefixlen > self.SLOT:
            raise NetworkError(f"{self.FIELD}: {cidr} is smaller than one /{self.SLOT}", self.LARGER)
        self.cidr = str(net)
        self.base = int(net.network_address)
        self.prefixlen = net.prefixlen
        self.size = 1 << (self.SLOT - net.prefixlen)

    def _check(self, net, cidr):
        """Hook: refuse a network of the right family that is still wrong."""

    def slot(self, n):
        """-> (gateway, address, network) of slot n, as strings."""
        import ipaddress

        if not 0 <= n < self.size:
            raise ValueError(f"slot {n} outside {self.FIELD} {self.cidr}")
        a = ipaddress.IPv4Address if self.VERSION == 4 else ipaddress.IPv6Address
        net = self.base + 4 * n
        return str(a(net + 1)), str(a(net + 2)), f"{a(net)}/{self.SLOT}"

    def overlaps(self, cidr):
        """Whether cidr (either family; host bits allowed) shares an address
        with the pool.  A network of the other family never does."""
        import ipaddress

        other = ipaddress.ip_network(cidr, strict=False)
        return other.version == self.VERSION and ipaddress.ip_network(self.cidr).overlaps(other)


SLOT_PREFIXLEN6 = 126  # the same four addresses: ::0 unused, gateway ::1, job ::2, ::3 unused
# The job's link-local address, the same on every job's link (link-locals
# are per link): a fixed one, not one made from the MAC, so the rules know
# the only two sources a job may use (this and its address6), neighbour
# discovery included.
JOB_LINK_LOCAL6 = "fe80::2"
ULA = "fc00::/7"


class Pool6(Pool):
    """An IPv6 unique local CIDR cut into /126 slots, slot n beside the IPv4
    pool's slot n."""

    __slots__ = ()
    FIELD, VERSION, SLOT = "pool6", 6, SLOT_PREFIXLEN6
    WANT = "give an IPv6 unique local network such as fd70:7639:1864::/64"
    LARGER = "give a network of /126 or larger, e.g. a /64"

    def _check(self, net, cidr):
        import ipaddress

        if not net.subnet_of(ipaddress.IPv6Network(ULA)):
            raise NetworkError(f"pool6: {cidr} is not a unique local network (inside {ULA})",
                               "job addresses must not be routable from outside: give a ULA prefix "
                               "such as fd70:7639:1864::/64")


class PoolExhausted(NetworkError):
    """Every slot of the pool is taken."""


def owner_alive(lease):
    st = proc_starttime(lease.get("owner_pid", 0))
    return st is not None and st == lease.get("owner_start")


_UNREAD = object()


class LeaseStore:
    """The leases of one state directory."""

    def __init__(self, state_dir):
        self.state_dir = state_dir
        self.dir = os.path.join(state_dir, "net")
        self.leases = os.path.join(self.dir, "leases")
        self.slots = os.path.join(self.dir, "slots")
        self._lockfd = None
        self._depth = 0
        self._record = _UNREAD     # the table record, read once per hold of the lock

    # -- locking -------------------------------------------------------
    def _ensure_dirs(self):
        for d in (self.dir, self.leases, self.slots):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass

    def _remove_dirs_if_idle(self):
        """No lease and no table: leave the state dir as we found it."""
        if os.path.exists(os.path.join(self.dir, "table.json")):
            return
        for d in (self.leases, self.slots, self.dir):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return
                raise

    def __enter__(self):
        """Hold the node-wide network lock (reentrant within one object)."""
        if self._depth == 0:
            os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
            fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._ensure_dirs()
            except BaseException:
                os.close(fd)
                raise
            self._lockfd = fd
            self._record = _UNREAD
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            try:
                self._remove_dirs_if_idle()
            finally:
                os.close(self._lockfd)  # closing releases the flock
                self._lockfd = None

    # -- queries -------------------------------------------------------
    def _path(self, key):
        return os.path.join(self.leases, key + ".json")

    def get_by_key(self, key):
        try:
            with open(self._path(key)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            # A torn write cannot happen (atomic rename); a corrupt file is
            # treated as a lease of unknown owner so gc can still remove it.
            return {"key": key, "job_id": None, "corrupt": True}

    def all(self):
        """Every lease on record (for gc and the first/last-job decision)."""
        out = []
        try:
            names = os.listdir(self.leases)
        except FileNotFoundError:
            return out
        for n in names:
            if n.endswith(".json") and is_job_key(n[:-5]):
                lease = self.get_by_key(n[:-5])
                if lease is not None:
                    out.append(lease)
        return out

    def count(self):
        try:
            return sum(1 for n in os.listdir(self.leases) if n.endswith(".json"))
        except FileNotFoundError:
            return 0

    def has_leases(self):
        """Is any lease on record?  Stops at the first: the first and last
        job's decisions need no count (a listing of 2000 leases: ~0.6 ms)."""
        try:
            with os.scandir(self.leases) as it:
                return any(e.name.endswith(".json") for e in it)
        except FileNotFoundError:
            return False

    # -- changes -------------------------------------------------------
    def acquire(self, job_id, key, pool, owner_pid, pool6=None, extra=None):
        """Take a free slot for job_id; with pool6, the job also gets the
        IPv6 addresses of the same slot; extra: more of the job's settings
        to keep in the lease (its caps).  Call with the lock held."""
        if self.get_by_key(key) is not None:
            raise NetworkError(f"job {job_id!r} already holds a network lease",
                               "job ids must be unique among running jobs; if that job is gone, run `starter gc`")
        # Lowest free first: one listdir, then symlink() decides (EEXIST: a
        # slot taken meanwhile by a writer without the lock; try the next).
        taken = set()
        for name in os.listdir(self.slots):
            if name.isdigit():
                taken.add(int(name))
        for n in range(pool.size):
            if n in taken:
                continue
            try:
                os.symlink(key, os.path.join(self.slots, str(n)))
            except FileExistsError:
                continue
            break
        else:
            raise PoolExhausted(f"address pool {pool.cidr} is exhausted ({pool.size} jobs)",
                                "run `starter gc` to reclaim leases of crashed jobs, or configure a larger pool")
        gateway, address, network = pool.slot(n)
        lease = {
            "job_id": job_id, "key": key, "slot": n, "pool": pool.cidr,
            "address": address, "gateway": gateway, "prefixlen": SLOT_PREFIXLEN,
            "network": network, "host_ifname": key,
            "owner_pid": owner_pid, "owner_start": proc_starttime(owner_pid),
        }
        if pool6 is not None:
            gateway6, address6, network6 = pool6.slot(n)
            lease.update(pool6=pool6.cidr, address6=address6, gateway6=gateway6,
                         prefixlen6=SLOT_PREFIXLEN6, network6=network6)
        if extra:
            lease.update(extra)
        try:
            write_atomic(self._path(key), json.dumps(lease))
        except BaseException:
            unlink_quiet(self._path(key))
            unlink_quiet(os.path.join(self.slots, str(n)))
            raise
        return lease

    def release(self, key, slot=None):
        """Remove the lease and its slot.  Idempotent."""
        lease = self.get_by_key(key)
        if slot is None and lease is not None:
            slot = lease.get("slot")
        unlink_quiet(self._path(key))
        if slot is not None:
            p = os.path.join(self.slots, str(slot))
            try:
                if os.readlink(p) == key:
                    os.unlink(p)
            except FileNotFoundError:
                pass

    def remove_temp_files(self):
        """Temp files of writers killed mid-write.  Call with the lock held:
        every writer of net/ holds it, so none is being written now."""
        out = []
        for d in (self.dir, self.leases):
            try:
                names = [n for n in os.listdir(d) if n.endswith(".tmp")]
            except FileNotFoundError:
                continue
            for n in names:
                unlink_quiet(os.path.join(d, n))
                out.append(f"temp file {n}")
        return out

    def orphan_slots(self):
        """Slots whose lease file is gone (a crash between the two writes)."""
        out = []
        try:
            names = os.listdir(self.slots)
        except FileNotFoundError:
            return out
        for n in names:
            p = os.path.join(self.slots, n)
            try:
                key = os.readlink(p)
            except OSError:
                continue
            if not os.path.exists(self._path(key)):
                out.append((n, p))
        return out

    # -- the table record ----------------------------------------------
    def table_record(self):
        """The record (a copy: change it through set_table_record), or None.
        Read from the file once while the lock is held: only a holder writes it."""
        rec = self._record
        if rec is _UNREAD:
            try:
                with open(os.path.join(self.dir, "table.json")) as f:
                    rec = json.load(f)
            except (FileNotFoundError, ValueError):
                rec = None
            if self._depth:
                self._record = rec
        return dict(rec) if rec is not None else None

    def set_table_record(self, rec):
        p = os.path.join(self.dir, "table.json")
        if rec is None:
            unlink_quiet(p)
        else:
            write_atomic(p, json.dumps(rec))
        if self._depth:
            self._record = dict(rec) if rec is not None else None
