"""A job network's WireGuard transport (--net-transport wireguard): keys
and the kernel's configuration, over generic netlink (no `wg` tool, no
library).

Where the fabric is not trusted, each node's part of a job network is a
WireGuard device (wg0) instead of a VXLAN one: every packet between two
nodes' parts is authenticated and encrypted, so neither a host on the
fabric nor root on a third node can read or inject a job's traffic.

Keys, the same on every node, from nothing but the node network key (a file
of root's, the same on the job's nodes, as munge's key is) and the job
network's id:

    job secret     HMAC-SHA256(node key, "starter job network v1\\0" + id)
    node i's key   HMAC-SHA256(job secret, "wireguard node\\0" + name_i),
                   as an X25519 private key (clamped); its public key by
                   X25519 from it: every node derives every peer's
    preshared key  HMAC-SHA256(job secret, "wireguard psk")

Another job's secret, and with it its keys, cannot be had without the node
key: a job cannot join another job's network, and a node without the key
cannot join any.  The public keys are computed here (x25519, RFC 7748) in
Python: about a millisecond per peer.

Each part's device listens on a UDP port of the host's (its socket stays
in the namespace it was made in, as vx0's does) derived from the VXLAN id:
PORT_BASE + vni % PORT_SPAN, the same on every node, so a peer's endpoint
is known without asking.  Two job networks on one node whose ids map to
one port cannot both run there: the second is refused (EADDRINUSE).
"""

import hmac
import struct

from starter.net import netlink

PORT_BASE = 28000
PORT_SPAN = 4096            # 28000-32095: below the kernel's ephemeral ports
OVERHEAD = {4: 20 + 8 + 32, 6: 40 + 8 + 32}     # outer IP + UDP + WireGuard's header and tag

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 1, 2
FAMILY = b"wireguard"
WG_CMD_SET_DEVICE = 1
WGDEVICE_A_IFINDEX, WGDEVICE_A_PRIVATE_KEY, WGDEVICE_A_FLAGS = 1, 3, 5
WGDEVICE_A_LISTEN_PORT, WGDEVICE_A_PEERS = 6, 8
WGDEVICE_F_REPLACE_PEERS = 1
WGPEER_A_PUBLIC_KEY, WGPEER_A_PRESHARED_KEY, WGPEER_A_FLAGS, WGPEER_A_ENDPOINT = 1, 2, 3, 4
WGPEER_A_ALLOWEDIPS = 9
WGPEER_F_REPLACE_ALLOWEDIPS = 2
WGALLOWEDIP_A_FAMILY, WGALLOWEDIP_A_IPADDR, WGALLOWEDIP_A_CIDR_MASK = 1, 2, 3

# -- X25519 (RFC 7748) --------------------------------------------------------
_P = 2 ** 255 - 19
_A24 = 121665


def clamp(k):
    k = bytearray(k)
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    return bytes(k)


def x25519(k, u=(9).to_bytes(32, "little")):
    """The X25519 function: scalar k (32 bytes, clamped here) times the
    point with u-coordinate u (default: the base point: a public key)."""
    k = int.from_bytes(clamp(k), "little")
    x1 = int.from_bytes(u, "little") & ((1 << 255) - 1)
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    for t in range(254, -1, -1):
        bit = (k >> t) & 1
        if swap ^ bit:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = x2 + z2, x2 - z2
        aa, bb = a * a % _P, b * b % _P
        e = aa - bb
        c, d = x3 + z3, x3 - z3
        da, cb = d * a % _P, c * b % _P
        x3, z3 = (da + cb) ** 2 % _P, x1 * (da - cb) ** 2 % _P
        x2, z2 = aa * bb % _P, e * (aa + _A24 * e) % _P
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, _P - 2, _P) % _P).to_bytes(32, "little")


# -- keys ---------------------------------------------------------------------
class Keys:
    """A job network's keys on one node (pure): private (this node's),
    public {name: key} of every node, psk."""

    __slots__ = ("private", "public", "psk")

    def __init__(self, node_key, net_id, node, names):
        secret = hmac.new(node_key, b"starter job network v1\0" + net_id.encode(), "sha256").digest()
        priv = {n: clamp(hmac.new(secret, b"wireguard node\0" + n.encode(), "sha256").digest()) for n in names}
        self.private = priv[node]
        self.public = {n: x25519(k) for n, k in priv.items() if n != node}
        self.psk = hmac.new(secret, b"wireguard psk", "sha256").digest()


def port_of(vni):
    return PORT_BASE + int(vni) % PORT_SPAN


def read_node_key(path):
    """The node network key: a regular file of root's that no one else may
    read or write (not followed through a link), 32 bytes at least."""
    import os
    import stat

    from starter.errors import NetworkError

    hint = f"make it: head -c 32 /dev/urandom > {path}; chmod 600 {path} (the same file on every node)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise NetworkError(f"the node network key {path}: {e.strerror}", hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise NetworkError(f"the node network key {path} must be a regular file of root's, mode 0600", hint)
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(data) < 32:
        raise NetworkError(f"the node network key {path} holds {len(data)} bytes, fewer than 32", hint)
    return data


# -- generic netlink ------------------------------------------------------------
def _genl(cmd, attrs):
    return struct.pack("=BBH", cmd, 1, 0) + attrs


def family_request():
    """CTRL_CMD_GETFAMILY for "wireguard" (as an Rtnl.run request)."""
    return GENL_ID_CTRL, 0, _genl(CTRL_CMD_GETFAMILY, netlink.attr(CTRL_ATTR_FAMILY_NAME, FAMILY + b"\0"))


def family_id(reply_body):
    for kind, payload, _raw in netlink.attrs(reply_body[4:]):
        if kind == CTRL_ATTR_FAMILY_ID:
            return struct.unpack("=H", payload[:2])[0]
    raise ValueError("no family id in the reply")


def _sockaddr(address, port):
    import _socket

    if ":" in address:
        return struct.pack("=H", _socket.AF_INET6) + struct.pack("!HI", port, 0) \
            + _socket.inet_pton(_socket.AF_INET6, address) + struct.pack("=I", 0)
    return struct.pack("=H", _socket.AF_INET) + struct.pack("!H", port) \
        + _socket.inet_pton(_socket.AF_INET, address) + b"\0" * 8


def _allowed(address):
    import _socket

    fam, bits = (_socket.AF_INET6, 128) if ":" in address else (_socket.AF_INET, 32)
    return netlink.attr(0 | netlink.NLA_F_NESTED, netlink.attr(WGALLOWEDIP_A_FAMILY, struct.pack("=H", fam))
                        + netlink.attr(WGALLOWEDIP_A_IPADDR, _socket.inet_pton(fam, address))
                        + netlink.attr(WGALLOWEDIP_A_CIDR_MASK, struct.pack("=B", bits)))


def set_device(family, ifindex, keys, port, peers):
    """WG_CMD_SET_DEVICE (an Rtnl.run request): the device's key and port,
    and its peers replacing any: [(public key, fabric address, port,
    [addresses in the job network])]."""
    nest = b""
    for pub, fabric, peer_port, addresses in peers:
        p = (netlink.attr(WGPEER_A_PUBLIC_KEY, pub) + netlink.attr(WGPEER_A_PRESHARED_KEY, keys.psk)
             + netlink.attr(WGPEER_A_FLAGS, struct.pack("=I", WGPEER_F_REPLACE_ALLOWEDIPS))
             + netlink.attr(WGPEER_A_ENDPOINT, _sockaddr(fabric, peer_port))
             + netlink.attr(WGPEER_A_ALLOWEDIPS | netlink.NLA_F_NESTED, b"".join(_allowed(a) for a in addresses)))
        nest += netlink.attr(0 | netlink.NLA_F_NESTED, p)
    body = (netlink.attr(WGDEVICE_A_IFINDEX, struct.pack("=I", ifindex))
            + netlink.attr(WGDEVICE_A_PRIVATE_KEY, keys.private)
            + netlink.attr(WGDEVICE_A_LISTEN_PORT, struct.pack("=H", port))
            + netlink.attr(WGDEVICE_A_FLAGS, struct.pack("=I", WGDEVICE_F_REPLACE_PEERS))
            + netlink.attr(WGDEVICE_A_PEERS | netlink.NLA_F_NESTED, nest))
    return family, 0, _genl(WG_CMD_SET_DEVICE, body)
