"""--net job's pure parts: Slurm host lists, the peer list, the VNI, the
job network's plan (addresses, MACs, /etc/hosts) and its counter table.
The kernel side is tests/test_multinode.py."""

import pytest

from starter.errors import SpecError
from starter.net import nftrules, overlay
from starter.spec import jobspec, peers

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,7],gpu[08-10]", ["n1", "n2", "n7", "gpu08", "gpu09", "gpu10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b, a", ["a", "b"]),
    ("x[001-002]y", ["x001y", "x002y"]),
])
def test_slurm_host_lists_expand_in_order(text, names):
    assert peers.expand_hostlist("peers", text) == names


@pytest.mark.parametrize("text", ["", "n[1-3", "n1-3]", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-99999999999]",
                                  "n[0-5000]", "$(id)", "../x", "a/b", "n[1-2]x[1-3000]", ","])
def test_bad_host_lists_are_one_line_errors(text):
    with pytest.raises(SpecError) as e:
        peers.expand_hostlist("peers", text)
    assert "\n" not in str(e.value)


def test_peers_take_addresses_or_resolve_names_and_refuse_mixes():
    got = peers.parse("peers", "n[1-2],n3=10.0.0.3", lambda n: {"n1": "10.0.0.1", "n2": "10.0.0.2"}[n])
    assert got == (("n1", "10.0.0.1"), ("n2", "10.0.0.2"), ("n3", "10.0.0.3"))
    for bad in ("n1=10.0.0.1,n1=10.0.0.2", "n1=10.0.0.1,n2=fd00::2", "n1=nope", "n1=", "=10.0.0.1"):
        with pytest.raises(SpecError):
            peers.parse("peers", bad, lambda n: "10.0.0.9")


def test_the_vni_is_the_batch_job_id_or_a_hash_never_zero():
    assert peers.vni_of("net-id", "4242") == 4242
    assert peers.vni_of("net-id", str(peers.VNI_MAX)) == peers.VNI_MAX       # (0 is not a VNI)
    assert peers.vni_of("net-id", str(peers.VNI_MAX + 5)) == 5
    assert peers.vni_of("net-id", "job.a") == peers.vni_of("net-id", "job.a") != peers.vni_of("net-id", "job.b")
    for bad in ("a/b", "../x", "", "$(id)"):
        with pytest.raises(SpecError):
            peers.vni_of("net-id", bad)


def test_net_job_takes_what_slurm_gives_and_says_what_is_missing():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2"}
    raw = {"net": "job", "peers": "n1=10.0.0.1,n2=10.0.0.2"}
    n = jobspec.network_from(raw, env)
    assert (n.mode, n.overlay.vni, n.overlay.node, n.overlay.peers) == \
        ("job", 77, "n2", (("n1", "10.0.0.1"), ("n2", "10.0.0.2")))
    with pytest.raises(SpecError, match="needs the job network's id"):
        jobspec.network_from(raw, {})
    with pytest.raises(SpecError, match="is not one of the job's nodes"):
        jobspec.network_from(dict(raw, node="n9"), env)
    with pytest.raises(SpecError, match="only applies with --net job"):
        jobspec.network_from({"net": "nat", "peers": "n1"}, env)


def test_the_plan_is_the_same_on_every_node():
    ps = (("n1", "10.9.0.1"), ("n2", "10.9.0.2"), ("n3", "10.9.0.3"))
    a, b = overlay.Plan(4242, "n1", ps), overlay.Plan(4242, "n3", ps)
    assert (a.index, a.local, b.index, b.local) == (0, "10.9.0.1", 2, "10.9.0.3")
    assert [a.address(i) for i in range(3)] == ["10.214.0.1", "10.214.0.2", "10.214.0.3"]
    assert a.address(300) == "10.214.1.45" and a.address(2, 6) == "fd70:7639:1865::3"
    assert a.mac(1) == b.mac(1) == bytes.fromhex("020010920002")
    assert [i for i, _n, _a in a.others()] == [1, 2]
    assert a.hosts_text() == b.hosts_text() and "10.214.0.3\tn3\n" in a.hosts_text()
    assert "fd70" not in a.hosts_text(v6=False)


def test_the_job_networks_counters_render_per_peer_and_family():
    cmds = nftrules.overlay_table("vx0", [(1, "10.214.0.2", "fd70:7639:1865::2"), (2, "10.214.0.3", None)])
    maps = {c["add"]["map"]["name"]: c["add"]["map"].get("elem", []) for c in cmds if "map" in c.get("add", {})}
    assert maps["out4"] == [["10.214.0.2", "p1_out"], ["10.214.0.3", "p2_out"]]
    assert maps["in6"] == [["fd70:7639:1865::2", "p1_in"]]
    counters = [c["add"]["counter"]["name"] for c in cmds if "counter" in c.get("add", {})]
    assert counters == ["p1_in", "p1_out", "p2_in", "p2_out"]


def test_the_pmix_endpoints_are_the_loopback_tcp_ones_of_the_uris():
    import _socket

    from starter.net import bridge

    env = {"PMIX_SERVER_URI41": "pmix-server.20787;tcp4://127.0.0.1:52949",
           "PMIX_SERVER_URI2": "pmix-server.20787;tcp4://127.0.0.1:52949",
           "PMIX_SERVER_URI3": "pmix-server.1;tcp6://[::1]:4000",
           "PMIX_SERVER_URI4": "pmix-server.1;tcp4://10.0.0.1:4000",     # not the loopback: not bridged
           "PMIX_SERVER_URI21": "pmix-server.1;tcp4://127.0.0.1:99999",  # no such port
           "PMIX_RANK": "0"}
    assert bridge.endpoints(env) == {(_socket.AF_INET, "127.0.0.1", 52949), (_socket.AF_INET6, "::1", 4000)}
    assert bridge.endpoints({}) == set()


def test_env_pass_copies_names_and_prefixes_never_the_starters_own():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "PMIX_RANK": "1", "OMPI_X": "y", "HOME": "/h",
           "STARTER_TRACE": "1"}
    assert jobspec.passed_env(["SLURM_*", "HOME"], env) == {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "HOME": "/h"}
    assert jobspec.passed_env(["STARTER_*", "STARTER_TRACE"], env) == {}
    for bad in ("*", "A-B", "1X", "A*B*", "$(id)", ""):
        with pytest.raises(SpecError):
            jobspec.passed_env([bad], env)


# -- a caller's Slurm step (starter/callers/slurmstep.py) ----------------------

@pytest.mark.parametrize("cmdline, want", [
    (b"slurmstepd: [4242.0]\0\0\0", ("4242", "0")),
    (b"slurmstepd: [7.batch]", ("7", "batch")),
    (b"slurmstepd: [7.extern]\0", ("7", "extern")),
    (b"slurmstepd: [9.1+2]", ("9", "1+2")),
    (b"slurmstepd: [12]", ("12", None)),
    (b"slurmstepd: [x.0]", None),
    (b"slurmstepd [7.0]", None),
    (b"sh\0-c\0slurmstepd: [7.0]", None),
    (b"slurmstepd: [7.0", None),
    (b"slurmstepd: [7.a/b]", None),
    (b"slurmstepd: [99999999999.0]", None),
    (b"", None),
])
def test_slurmstepd_titles(cmdline, want):
    from starter.callers import slurmstep

    assert slurmstep.parse_title(cmdline) == want


def test_slurmstepd_titles_fuzzed():
    import random

    from starter.callers import slurmstep

    rng = random.Random(7)
    for _ in range(3000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        got = slurmstep.parse_title(b"slurmstepd: [" + raw if rng.random() < 0.5 else raw)
        assert got is None or (got[0].isdigit() and (got[1] is None or got[1].replace("+", "").isalnum()))


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A2C4 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 811 1 0000 100 0 0 10 0
   1: 00000000:1A0B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 812 1 0000 100 0 0 10 0
   2: 0100007F:A2C4 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 813 1 0000 20 4 30 10 -1
"""


def test_tcp_listeners_from_proc_net_tcp():
    from starter.callers import slurmstep

    assert slurmstep.tcp_listeners(PROC_NET_TCP, 0xA2C4) == {811}      # not the connection (813)
    assert slurmstep.tcp_listeners(PROC_NET_TCP, 0x1A0B) == {812}
    assert slurmstep.tcp_listeners(PROC_NET_TCP, 80) == set()
    assert slurmstep.tcp_listeners("garbage\nmore garbage here x y z w v u t s\n", 1) == set()


def test_a_callers_peers_must_be_in_the_nodes_lan():
    with pytest.raises(SpecError, match="is not in the node's LAN"):
        jobspec._peers_in_lan((("n1", "10.0.0.1"), ("n2", "192.168.1.1")), ("10.0.0.0/8",))
    with pytest.raises(SpecError, match=r"\[defaults\] lan"):
        jobspec._peers_in_lan((("n1", "10.0.0.1"),), ())
    with pytest.raises(SpecError, match="is not in the node's LAN"):
        jobspec._peers_in_lan((("n1", "fd00::1"),), ("10.0.0.0/8",))
    jobspec._peers_in_lan((("n1", "10.0.0.1"), ("n2", "fd00::2")), ("10.0.0.0/8", "fd00::/64"))


# -- the WireGuard transport (starter/net/wireguard.py) -------------------------

def test_x25519_rfc7748_vectors():
    from starter.net import wireguard as W

    a = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    b = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
    pa, pb = W.x25519(a), W.x25519(b)
    assert pa.hex() == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    assert pb.hex() == "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f"
    assert W.x25519(a, pb) == W.x25519(b, pa) == bytes.fromhex(
        "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")


def test_every_node_derives_the_same_keys_and_another_job_or_node_key_others():
    from starter.net import wireguard as W

    names = ["n1", "n2", "n3"]
    k1, k2 = W.Keys(b"k" * 32, "4242", "n1", names), W.Keys(b"k" * 32, "4242", "n2", names)
    assert k1.public["n2"] == W.x25519(k2.private) and k2.public["n1"] == W.x25519(k1.private)
    assert k1.psk == k2.psk and set(k1.public) == {"n2", "n3"}
    other_job, other_key = W.Keys(b"k" * 32, "4243", "n1", names), W.Keys(b"j" * 32, "4242", "n1", names)
    assert len({k1.private, other_job.private, other_key.private}) == 3
    assert len({k1.psk, other_job.psk, other_key.psk}) == 3


def test_wireguard_set_device_message():
    import struct

    from starter.net import netlink, wireguard as W

    keys = W.Keys(b"k" * 32, "7", "n1", ["n1", "n2"])
    fam, flags, body = W.set_device(0x1234, 5, keys, W.port_of(7), [(keys.public["n2"], "10.0.0.2", W.port_of(7),
                                                                      ["10.214.0.2", "fd70:7639:1865::2"])])
    assert fam == 0x1234 and body[:2] == bytes([W.WG_CMD_SET_DEVICE, 1])
    top = {k: v for k, v, _raw in netlink.attrs(body[4:])}
    assert struct.unpack("=I", top[W.WGDEVICE_A_IFINDEX])[0] == 5 and top[W.WGDEVICE_A_PRIVATE_KEY] == keys.private
    assert struct.unpack("=H", top[W.WGDEVICE_A_LISTEN_PORT])[0] == W.port_of(7) == W.PORT_BASE + 7
    (peer,) = [v for _k, v, _r in netlink.attrs(top[W.WGDEVICE_A_PEERS])]
    p = {k: v for k, v, _raw in netlink.attrs(peer)}
    assert p[W.WGPEER_A_PUBLIC_KEY] == keys.public["n2"] and p[W.WGPEER_A_PRESHARED_KEY] == keys.psk
    assert p[W.WGPEER_A_ENDPOINT][4:8] == bytes([10, 0, 0, 2]) and struct.unpack("!H", p[W.WGPEER_A_ENDPOINT][2:4])[0] \
        == W.port_of(7)
    masks = sorted(dict((k, v) for k, v, _r in netlink.attrs(a))[W.WGALLOWEDIP_A_CIDR_MASK][0]
                   for _k, a, _r in netlink.attrs(p[W.WGPEER_A_ALLOWEDIPS]))
    assert masks == [32, 128]


@pytest.mark.parametrize("raw, what", [
    ({"net-transport": "ipsec"}, "is not one of vxlan, wireguard"),
    ({"net-key": "/k"}, "only applies with --net-transport wireguard"),
])
def test_transport_options_are_checked(raw, what):
    base = {"net": "job", "net-id": "5", "peers": "n1=10.0.0.1", "node": "n1"}
    with pytest.raises(SpecError, match=what):
        jobspec.network_from({**base, **raw}, {})
    with pytest.raises(SpecError, match="only applies with --net job"):
        jobspec.network_from({"net": "nat", "net-transport": "wireguard"}, {})


def test_the_wireguard_overlay_record_carries_its_transport_and_key():
    n = jobspec.network_from({"net": "job", "net-id": "5", "peers": "n1=10.0.0.1", "node": "n1",
                              "net-transport": "wireguard"}, {})
    assert (n.overlay.transport, n.overlay.key) == ("wireguard", "/etc/starter/network.key")
    from starter import net

    cfg = net.config_of(n, "/run/starter")
    assert cfg.overlay[3:] == ("wireguard", "5", "/etc/starter/network.key")
    assert overlay.Plan.of(cfg.overlay).ifname == "wg0"
    assert overlay.Plan.of(cfg.overlay[:3]).ifname == "vx0"       # an entry from before transports
