"""The job's veth pair over rtnetlink (rtnl.py), and the per-interface sysctls.

The peer is created directly inside the job's network namespace
(RTM_NEWLINK kind veth, the peer's IFLA_NET_NS_FD = the job's netns fd) and
named eth0 there: creating it on the host and moving it costs 16-34 ms.

The job-side address, link state and default route need a netlink socket
INSIDE the job's namespace.  A socket stays in the namespace it was created
in, so a short-lived thread setns()es into the job's netns, creates the
socket, and setns()es back (in_netns()); setns(CLONE_NEWNET) changes only
the calling thread.  Because the peer is named eth0, exactly like the host's uplink, the
socket's namespace is verified (SIOCGSKNS) before anything is sent through it.

A job's network is three batches of requests (rtnl.Rtnl.run): make the pair
and look it up; address the host end and bring it up; in the job's
namespace, address the peer, bring it and lo up, add the default routes.
"""

import _socket
import errno
import fcntl
import os
import threading

from starter.errors import NetworkError
from starter.net import rtnl
from starter.net.rtnl import RtnlError
from starter.net.ipam import JOB_LINK_LOCAL6
from starter.net.sysctl import forwarding6_path, forwarding_path, ipv6_path, write_sysctl
from starter.isolate.ns import setns

CLONE_NEWNET = 0x40000000
SIOCGSKNS = 0x894C
JOB_IFNAME = "eth0"
LOOPBACK_IFINDEX = 1  # the kernel gives lo index 1 in every netns
IFA_F_NODAD = 0x02


def in_netns(netns_fd, work):
    """work() run by a short-lived thread inside the namespace behind
    netns_fd -> its result (its exception raised here).  setns(CLONE_NEWNET)
    changes only the calling thread, which returns home before it ends; a
    socket it made stays in the job's namespace."""
    box = {}

    def run():
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(netns_fd, CLONE_NEWNET)
            try:
                box["value"] = work()
            finally:
                try:
                    setns(home, CLONE_NEWNET)
                except OSError:  # pragma: no cover - cannot happen with a valid fd
                    # A thread stuck in the job's namespace must not live on.
                    os._exit(125)
        except BaseException as e:  # noqa: BLE001 - carried to the caller
            box["error"] = e
        finally:
            os.close(home)

    t = threading.Thread(target=run, name="in-netns")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def netlink_socket_in(netns_fd, sysctls=()):
    """A NETLINK_ROUTE socket living in the namespace behind netns_fd.

    sysctls: ((ifname, key, value, required), ...) IPv6 settings of the
    job's own interfaces (a missing one is an error only if required),
    written from the same thread while it is in the job's
    namespace: /proc/sys/net shows the namespace of the thread that opens
    it, and the job's interface is named eth0 like the host's, so the
    thread's namespace is checked first (a write must never reach the host's
    eth0)."""
    want = os.fstat(netns_fd).st_ino

    def work():
        sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, rtnl.NETLINK_ROUTE)
        try:
            if sysctls:
                if os.stat("/proc/thread-self/ns/net").st_ino != want:  # pragma: no cover
                    raise NetworkError("the sysctl writer is not in the job's network namespace")
                for ifname, key, value, required in sysctls:
                    if not write_sysctl(ipv6_path(ifname, key), value) and required:
                        raise NetworkError(f"the job's net.ipv6.conf.{ifname}.{key} is missing",
                                           "is IPv6 disabled on this kernel (ipv6.disable=1)?")
        except BaseException:
            sock.close()
            raise
        return sock

    sock = in_netns(netns_fd, work)
    try:
        nsfd = fcntl.ioctl(sock.fileno(), SIOCGSKNS)
        try:
            same = os.fstat(nsfd).st_ino == os.fstat(netns_fd).st_ino
        finally:
            os.close(nsfd)
        if not same:  # pragma: no cover - defensive
            raise NetworkError("netlink socket is not in the job's network namespace")
    except BaseException:
        sock.close()
        raise
    return sock


class Links:
    """The host-side rtnetlink handle (one per thread: netd's main thread and
    its teardown worker each have their own)."""

    def __init__(self):
        self.rt = rtnl.Rtnl()

    def close(self):
        self.rt.close()

    def create(self, host_ifname, netns_fd, gateway, address, prefixlen, forward, v6=None, shape=None):
        """Make the pair, address both ends, route the job via the host end.

        v6: None (no IPv6: disabled on both ends) or (gateway6, address6,
        prefixlen6, forward6): the same for IPv6, with forward6 turning on
        the host end's own IPv6 forwarding (force_forwarding).  Both ends
        get accept_ra=0 and accept_dad=0 (the addresses also IFA_F_NODAD):
        no router advertisement is taken from the other side, and the job
        can use its address at once.  The job's link-local is the fixed
        ipam.JOB_LINK_LOCAL6 (addr_gen_mode 1: none made from the MAC).

        shape: None, or (rates, lan, direct) for shaping.requests(): the
        job's bandwidth caps, in the same batches (the host end's "in",
        the job's eth0 "out").

        On error the pair is deleted again (deleting the host end deletes the
        peer) and NetworkError is raised."""
        rt = self.rt
        try:
            # One get with the create: our index and, in IFLA_LINK, the
            # peer's index in the job's namespace.
            _, got = rt.run([rtnl.new_veth(host_ifname, JOB_IFNAME, netns_fd), rtnl.get_link(host_ifname)])
        except RtnlError as e:
            if e.index == 1:        # made, but not found again: gone already
                self.delete(host_ifname)
            raise _error(f"create veth {host_ifname}", e) from None
        try:
            idx, _name, peer_idx = rtnl.link_info(got[0][1])
            # Before it goes up: without IPv6, no IPv6 link-local for the
            # job to talk to; with it, no RA taken from the job, no DAD wait.
            if v6 is None:
                write_sysctl(ipv6_path(host_ifname, "disable_ipv6"), "1")
            else:
                write_sysctl(ipv6_path(host_ifname, "accept_ra"), "0")
                write_sysctl(ipv6_path(host_ifname, "accept_dad"), "0")
                if v6[3]:
                    write_sysctl(forwarding6_path(host_ifname), "1")
            if forward:
                write_sysctl(forwarding_path(host_ifname), "1")
            host = [rtnl.add_address(idx, gateway, prefixlen)]
            if v6 is not None:
                host.append(rtnl.add_address(idx, v6[0], v6[2], nodad=True))
            host_tc = job_tc = []
            if shape is not None:
                from starter.net import shaping

                host_tc = shaping.requests(idx, "in", *shape)
                job_tc = shaping.requests(peer_idx, "out", *shape)
            host.append(rtnl.set_up(idx))
            try:
                rt.run(host + host_tc)
            except RtnlError as e:
                raise _shaper_error(e, len(host)) from None
            self._configure_job_side(netns_fd, peer_idx, gateway, address, prefixlen, v6, job_tc)
        except RtnlError as e:
            self.delete(host_ifname)
            raise _error(f"configure veth {host_ifname}", e) from None
        except BaseException:
            self.delete(host_ifname)
            raise

    @staticmethod
    def _configure_job_side(netns_fd, peer_idx, gateway, address, prefixlen, v6=None, extra=()):
        if not peer_idx:
            raise NetworkError("the veth peer's index is unknown")
        if v6 is None:
            # (a kernel booted with ipv6.disable=1 has no such file: fine)
            sysctls = ((JOB_IFNAME, "disable_ipv6", "1", False),)
        else:
            # no link-local made from the MAC: the fixed one below
            sysctls = ((JOB_IFNAME, "addr_gen_mode", "1", True), (JOB_IFNAME, "accept_dad", "0", True),
                       (JOB_IFNAME, "accept_ra", "0", True))
        job = rtnl.Rtnl(netlink_socket_in(netns_fd, sysctls))
        try:
            reqs = [rtnl.add_address(peer_idx, address, prefixlen)]
            if v6 is not None:
                reqs += [rtnl.add_address(peer_idx, JOB_LINK_LOCAL6, 64, nodad=True),
                         rtnl.add_address(peer_idx, v6[1], v6[2], nodad=True)]
            reqs += [rtnl.set_up(peer_idx), rtnl.set_up(LOOPBACK_IFINDEX), rtnl.add_default_route(gateway, peer_idx)]
            if v6 is not None:
                reqs.append(rtnl.add_default_route(v6[0], peer_idx))
            try:
                job.run(reqs + list(extra))
            except RtnlError as e:
                raise _shaper_error(e, len(reqs)) from None
        finally:
            job.close()

    def shaping_stats(self, host_ifname, netns_fd=None):
        """The caps' classes -> {"in": dump of the host end, "out": dump of
        the job's eth0 (None without netns_fd, or where it is gone)}."""
        from starter.net import shaping

        out = {"in": None, "out": None}
        try:
            (got,) = self.rt.run([rtnl.get_link(host_ifname)])
            idx, _name, peer_idx = rtnl.link_info(got[0][1])
            out["in"] = shaping.dump_classes(self.rt, idx)
        except RtnlError:
            return out
        if netns_fd is not None and peer_idx:
            try:
                job = rtnl.Rtnl(netlink_socket_in(netns_fd))
            except OSError:
                return out
            try:
                out["out"] = shaping.dump_classes(job, peer_idx)
            except RtnlError:
                pass
            finally:
                job.close()
        return out

    def _on_link(self, request, what):
        """One request about a link that may be gone already (ENODEV ok):
        -> whether it was there."""
        try:
            self.rt.run([request])
        except RtnlError as e:
            if e.code not in (errno.ENODEV, errno.ENOENT):
                raise _error(what, e) from None
            return False
        return True

    def set_down(self, host_ifname):
        """Take the pair's host end down: it takes no packet from its peer
        any more (a down device drops what is forwarded to it)."""
        return self._on_link(rtnl.set_down(host_ifname), f"take veth {host_ifname} down")

    def delete(self, host_ifname):
        """Delete the pair by its host end.  Idempotent."""
        return self._on_link(rtnl.del_link(host_ifname), f"delete veth {host_ifname}")

    def host_addresses(self, family=_socket.AF_INET):
        """[(cidr, ifname)] of the host's addresses of one family (pool
        overlap check; AF_INET6: also which uplinks have IPv6)."""
        names = self.rt.link_names()
        return [(cidr, names.get(index, "?")) for cidr, index in self.rt.addresses(family)]


def _shaper_error(e, first_tc):
    """A batch's error as it is: a veth request's (raised on as RtnlError),
    or, from request first_tc on, the --net-rate shaper's (NetworkError:
    its hint names the modules)."""
    if e.index < first_tc:
        return e
    return NetworkError(f"setting up the --net-rate shaper failed: {errno.errorcode.get(e.code, e.code)} "
                        f"({os.strerror(e.code)})",
                        "the kernel needs sch_htb, sch_fifo and cls_u32 (modprobe them; "
                        "every distribution kernel has them)")


def _error(what, e):
    code = getattr(e, "code", 0)
    hints = {
        errno.EEXIST: "an interface of that name exists: a crashed job? run `starter gc`",
        errno.EPERM: "run as root (CAP_NET_ADMIN)",
        errno.EOPNOTSUPP: "the kernel lacks veth support (modprobe veth)",
        errno.ENOENT: "the job's network namespace is gone",
    }
    return NetworkError(f"{what} failed: {errno.errorcode.get(code, code)} ({os.strerror(code) if code else e})",
                        hints.get(code))
