"""The per-interface network sysctls (/proc/sys/net/...): the one reader and
writer, and their paths (forwarding, disable_ipv6).

An interface that is gone has no sysctl directory: read gives None and write
False instead of raising, so a teardown after the veth or uplink vanished
still completes.  The interface name is checked before it becomes a path.
"""

from starter.net.ipam import check_ifname


def forwarding_path(ifname):
    return f"/proc/sys/net/ipv4/conf/{check_ifname('ifname', ifname)}/forwarding"


def disable_ipv6_path(ifname):
    return f"/proc/sys/net/ipv6/conf/{check_ifname('ifname', ifname)}/disable_ipv6"


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
