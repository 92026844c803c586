"""The per-interface network sysctls (/proc/sys/net/...): the one reader and
writer, and their paths (IPv4 forwarding; IPv6 keys such as disable_ipv6 and
the per-interface IPv6 forwarding).

An interface that is gone has no sysctl directory: read gives None and write
False instead of raising, so a teardown after the veth or uplink vanished
still completes.  The interface name is checked before it becomes a path.
"""

from starter.net.ipam import check_ifname


def forwarding_path(ifname):
    return f"/proc/sys/net/ipv4/conf/{check_ifname('ifname', ifname)}/forwarding"


def ipv6_path(ifname, key):
    """/proc/sys/net/ipv6/conf/<ifname>/<key> (ifname "all" included)."""
    if ifname != "all":
        check_ifname("ifname", ifname)
    return f"/proc/sys/net/ipv6/conf/{ifname}/{key}"


def forwarding6_path(ifname):
    """IPv6 forwarding of ONE interface.  conf.<if>.forwarding does not do
    that for IPv6 (the kernel forwards by conf.all.forwarding, which sets
    every interface's flag, and a flag set makes accept_ra=1 ignore router
    advertisements: the host could lose its RA-learnt default route).
    force_forwarding (Linux 6.17) forwards what arrives on that interface,
    like IPv4's per-interface flag, and leaves RA handling alone."""
    return ipv6_path(ifname, "force_forwarding")


def ipv6_forwarding_mode():
    """How this node can forward IPv6 for jobs: "all" (the admin turned on
    conf.all.forwarding: nothing to do), "per-interface" (force_forwarding
    exists), or None (neither: no IPv6 for jobs)."""
    if read_sysctl(ipv6_path("all", "forwarding")) == "1":
        return "all"
    if read_sysctl(ipv6_path("all", "force_forwarding")) is not None:
        return "per-interface"
    return None


def read_sysctl(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def write_sysctl(path, value):
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        return False
    return True
