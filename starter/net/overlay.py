"""A multi-node job's own network (--net job): one VXLAN segment per job,
across its nodes, beside its NAT network.

A node's part of the job is one device in the job's network namespace:

    vx0   VXLAN, id = the job's VNI (spec/peers.py: from the job network's
          id, the same on every node), made from the host's namespace with
          IFLA_NET_NS_FD: the device is born in the job's namespace, its UDP
          socket (this node's fabric address, port 4789) stays in the host's;
          MTU: the fabric link's, less the encapsulation
          address  10.214.0.0/16 and fd70:7639:1865::/64, host number = the
          node's index in the peer list + 1: the same plan on every node
          neighbours  one permanent entry per peer (its fixed MAC: 02, the
          VNI, the index) and one forwarding entry (that MAC -> the peer's
          fabric address): no flooding, no learning, no ARP on the fabric

With --net-transport wireguard the device is wg0, a WireGuard device made
the same way (its socket too stays in the host's namespace), with one peer
per other node (its public key, fabric address and port, and its two
addresses in the job network as allowed IPs): every packet between nodes
authenticated and encrypted with the job's own keys (net/wireguard.py).
Addresses, /etc/hosts and counters are the same as with VXLAN.

Jobs do not see each other's segments: each job has its own VNI and its own
namespace, so the same addresses serve every job.  Nothing of it lives on
the host: the device, its entries and the job's counters (an nft table in
the job's namespace, per peer node and direction: nftrules.overlay_table)
die with the namespace, so a crashed starter leaves nothing of it for gc.
The host's table drops job traffic to the VXLAN port (nftrules.VXLAN_PORT):
no job writes frames into another job's segment, here or on another node.
"""

import errno
import os
import time

from starter.errors import NetworkError

NET4 = "10.214.0.0/16"
NET6 = "fd70:7639:1865::/64"
IFNAME = "vx0"
WG_IFNAME = "wg0"
GONE_WAIT = 3.0     # s a new part waits for the device of one that just ended
# outer IP + UDP + VXLAN + inner Ethernet headers
OVERHEAD = {4: 20 + 8 + 8 + 14, 6: 40 + 8 + 8 + 14}


class Plan:
    """The job network as every node computes it (pure).

    vni, node (this node's name), peers ((name, fabric address), ...),
    index (this node's place in peers), local (its fabric address),
    transport (vxlan, wireguard), net_id and key (wireguard's: the job
    network's id and the node network key's path), ifname (its device)."""

    def __init__(self, vni, node, peers, transport="vxlan", net_id="", key=""):
        self.vni, self.node = int(vni), node
        self.transport, self.net_id, self.key = transport, net_id, key
        self.ifname = WG_IFNAME if transport == "wireguard" else IFNAME
        self.peers = tuple((str(n), str(a)) for n, a in peers)
        names = [n for n, _a in self.peers]
        self.index = names.index(node)
        self.local = self.peers[self.index][1]

    @classmethod
    def of(cls, overlay):
        """From NetConfig.overlay (or a state entry's "overlay"): (vni, node,
        peers[, transport, net_id, key])."""
        return cls(*overlay)

    def address(self, i, family=4):
        """Node i's address in the job network: host number i + 1."""
        import _socket

        fam, size = (_socket.AF_INET, 4) if family == 4 else (_socket.AF_INET6, 16)
        base = int.from_bytes(_socket.inet_pton(fam, (NET4 if family == 4 else NET6).split("/")[0]), "big")
        return _socket.inet_ntop(fam, (base + i + 1).to_bytes(size, "big"))

    def mac(self, i):
        """Node i's MAC in the job network: locally administered, unicast."""
        return bytes([0x02]) + self.vni.to_bytes(3, "big") + (i + 1).to_bytes(2, "big")

    def others(self):
        """[(index, name, fabric address)] of the other nodes."""
        return [(i, n, a) for i, (n, a) in enumerate(self.peers) if i != self.index]

    def hosts_text(self, v6=True):
        """The job's /etc/hosts: every node of the job by its name, at its
        address in the job network (MPI and PMIx find ranks by name)."""
        lines = ["# written by starter: the job's nodes in its network", "127.0.0.1\tlocalhost",
                 "::1\tlocalhost ip6-localhost ip6-loopback"]
        for i, (name, _a) in enumerate(self.peers):
            lines.append(f"{self.address(i)}\t{name}")
        if v6:
            lines += [f"{self.address(i, 6)}\t{name}" for i, (name, _a) in enumerate(self.peers)]
        return "\n".join(lines) + "\n"


def has_ipv6():
    return os.path.isdir("/proc/sys/net/ipv6")


def setup(rt, netns_fd, plan, port):
    """Make the job's part of its network in the namespace behind netns_fd.
    rt: an rtnl.Rtnl in the host's namespace (where the fabric is); port:
    VXLAN's.  -> the record the report keeps.  On error: NetworkError; what
    was made lies in the job's namespace, which the failed start removes."""
    from starter.net import rtnl, veth
    from starter.net.rtnl import RtnlError

    family = 6 if ":" in plan.local else 4
    wg = plan.transport == "wireguard"
    if wg:
        from starter.net import wireguard

        # (the key first: a node without it makes nothing)
        keys = wireguard.Keys(wireguard.read_node_key(plan.key), plan.net_id, plan.node, [n for n, _a in plan.peers])
        mtu = _fabric_mtu(rt, plan.local, family) - wireguard.OVERHEAD[family]
        make = rtnl.new_wireguard(plan.ifname, netns_fd, mtu)
    else:
        mtu = _fabric_mtu(rt, plan.local, family) - OVERHEAD[family]
        make = rtnl.new_vxlan(plan.ifname, plan.vni, plan.local, port, netns_fd, mtu, plan.mac(plan.index))
    _retry_gone(lambda: rt.run([make]), errno.EEXIST, plan)
    v6 = has_ipv6()
    sysctls = ((plan.ifname, "addr_gen_mode", "1", True), (plan.ifname, "accept_dad", "0", True),
               (plan.ifname, "accept_ra", "0", True)) if v6 else ()
    job = rtnl.Rtnl(veth.netlink_socket_in(netns_fd, sysctls))
    try:
        (got,) = job.run([rtnl.get_link(plan.ifname)])
        idx = rtnl.link_info(got[0][1])[0]
        reqs = [rtnl.add_address(idx, plan.address(plan.index), 16)]
        if v6:
            reqs.append(rtnl.add_address(idx, plan.address(plan.index, 6), 64, nodad=True))
        for i, _name, fabric in plan.others() if not wg else ():
            reqs += [rtnl.add_neigh(idx, plan.address(i), plan.mac(i)), rtnl.add_fdb(idx, plan.mac(i), fabric)]
            if v6:
                reqs.append(rtnl.add_neigh(idx, plan.address(i, 6), plan.mac(i)))
        if wg:
            job.run(reqs)
            reqs = []
            _configure_wireguard(netns_fd, plan, keys, idx, v6)
        job.run(reqs + [rtnl.set_up(idx)])
    except RtnlError as e:
        raise NetworkError(f"configuring the job network's {plan.ifname} failed: {os.strerror(e.code)}") from None
    finally:
        job.close()
    _in_job(netns_fd, lambda nft: nft.run(_counter_table(plan, v6), "the job network's counters"))
    return {"vni": plan.vni, "node": plan.node, "address": plan.address(plan.index),
            "address6": plan.address(plan.index, 6) if v6 else None, "mtu": mtu, "transport": plan.transport}


def _retry_gone(work, code, plan):
    """work(), again while it fails with `code` for at most GONE_WAIT: the
    part before this one on the node ended just now, and its device (with
    its socket) goes with its namespace, which the kernel finishes a moment
    later."""
    from starter.net.rtnl import RtnlError

    deadline = time.monotonic() + GONE_WAIT
    while True:
        try:
            return work()
        except RtnlError as e:
            if e.code != code or time.monotonic() > deadline:
                raise _error(e, plan) from None
            time.sleep(0.02)


def _configure_wireguard(netns_fd, plan, keys, idx, v6):
    """wg0's key, port and peers, over generic netlink from a socket in the
    job's namespace (where its ifindex is)."""
    import _socket

    from starter.net import rtnl, veth, wireguard

    sock = veth.in_netns(netns_fd, lambda: _socket.socket(
        _socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, wireguard.NETLINK_GENERIC))
    genl = rtnl.Rtnl(sock)
    try:
        try:
            (got,) = genl.run([wireguard.family_request()])
            fam = wireguard.family_id(got[0][1])
        except (rtnl.RtnlError, ValueError, IndexError):
            raise NetworkError("the kernel's WireGuard does not answer (no wireguard family)",
                               "modprobe wireguard") from None
        port = wireguard.port_of(plan.vni)
        peers = [(keys.public[name], fabric, port,
                  [plan.address(i)] + ([plan.address(i, 6)] if v6 else [])) for i, name, fabric in plan.others()]
        _retry_gone(lambda: genl.run([wireguard.set_device(fam, idx, keys, port, peers)]), errno.EADDRINUSE, plan)
    finally:
        genl.close()


def _counter_table(plan, v6):
    from starter.net import nftrules

    from starter.net import liveness

    return nftrules.overlay_table(plan.ifname, [(i, plan.address(i), plan.address(i, 6) if v6 else None)
                                           for i, _n, _a in plan.others()], liveness.PORT)


def read(netns_fd, plan):
    """The job's bytes in its network, per peer node: {name: {"in": {bytes,
    packets}, "out": ...}} plus "in" and "out" totals; None where its
    namespace or table is gone.  One round trip of NFT_MSG_GETOBJ on a
    netlink socket made in the job's namespace (nftwire), no libnftables."""
    import _socket

    from starter.net import netlink, nftrules, nftwire, veth

    names = [nftrules.overlay_counter(i, d) for i, _n, _a in plan.others() for d in nftrules.UPLINK_DIRECTIONS]
    try:
        sock = veth.in_netns(netns_fd, lambda: _socket.socket(
            _socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, nftwire.NETLINK_NETFILTER))
    except OSError:
        return None
    try:
        sock.settimeout(5.0)
        sock.send(b"".join(nftwire.getobj_request(nftrules.OVERLAY_TABLE, n, 1 + k) for k, n in enumerate(names)))
        answers = netlink.collect(sock, 1, len(names), ack=False)
    except OSError:
        return None
    finally:
        sock.close()
    found = {n: nftwire.counter_of(replies[0][1]) for n, (replies, err) in zip(names, answers) if not err and replies}
    peers, total = {}, {d: {"bytes": 0, "packets": 0} for d in nftrules.UPLINK_DIRECTIONS}
    for i, name, _a in plan.others():
        row = {}
        for d in nftrules.UPLINK_DIRECTIONS:
            c = found.get(nftrules.overlay_counter(i, d)) or {}
            row[d] = {"bytes": int(c.get("bytes", 0)), "packets": int(c.get("packets", 0))}
            for k in ("bytes", "packets"):
                total[d][k] += row[d][k]
        peers[name] = row
    if not found and names:
        return None
    return {"peers": peers, **total}


def read_live(entry):
    """A running job's read() (`starter status`, the metrics), in the job
    network namespace its starter recorded (its state entry's "namespaces"),
    opened from its main process and checked as `starter enter` checks it;
    its peers from the entry's "overlay".  None where the job is gone, or
    made no part (a task that joined another's)."""
    from starter.errors import StarterError
    from starter.isolate import nsidentity

    if not entry.get("overlay"):
        return None
    try:
        fds = nsidentity.open_recorded(entry, ("net",))
    except StarterError:
        return None
    try:
        return read(fds["net"], Plan.of(entry["overlay"]))
    finally:
        nsidentity.close_namespaces(fds)


def _in_job(netns_fd, work):
    """work(nft) with a libnftables context made inside the job's namespace
    (its netlink socket lives where it was opened)."""
    from starter.net import nft, veth

    return veth.in_netns(netns_fd, lambda: work(nft.Nft()))


def _fabric_mtu(rt, local, family):
    """The MTU of the host link holding this node's fabric address; an
    error where the host has no such address (the wrong --node, or a peer
    list that gives this node another address)."""
    import _socket

    fam = _socket.AF_INET6 if family == 6 else _socket.AF_INET
    for cidr, index in rt.addresses(fam):
        if cidr.split("/")[0] == local:
            for idx, _name, mtu in rt.links():
                if idx == index:
                    return mtu
    raise NetworkError(f"this node's fabric address {local} is not an address of this host",
                       "give this node's name with --node, or its own address in --peers")


def _error(e, plan):
    if e.code == errno.EADDRINUSE:
        from starter.net import wireguard

        return NetworkError(f"the job network's WireGuard port {wireguard.port_of(plan.vni)} is taken on this node",
                            "another job network whose id maps to that port runs here: start the job once it ends")
    if e.code == errno.EEXIST:
        return NetworkError(f"the job network {plan.vni} (VXLAN id) already has a part on this node",
                            "one part per node: another job with the same --net-id runs here")
    if e.code == errno.EOPNOTSUPP:
        if plan.transport == "wireguard":
            return NetworkError("the kernel lacks WireGuard support", "modprobe wireguard (Linux 5.6 or later)")
        return NetworkError("the kernel lacks VXLAN support", "modprobe vxlan")
    return NetworkError(f"creating the job network's {plan.ifname} failed: {os.strerror(e.code)}")
