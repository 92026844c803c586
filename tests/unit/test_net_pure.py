"""Job networks' pure logic, both families, on data (no veth, no table):
pools and their slots, job keys, interface names, the configuration and
its spec keys, leases, resolv.conf, uplinks, conntrack's messages, the
ClassAd's IPv6 share, and what importing the facade loads.  The nft table's
pure logic is in test_nft_render.py; the kernel side in tests/test_net.py
and tests/test_ipv6.py."""

import json
import os
import socket
import struct
import subprocess

import pytest

from conftest import PYTHON as PY
from starter import net
from starter.errors import NetworkError
from starter.net import conntrack, ipam, netlink, nft, table

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


# ---------------------------------------------------------------- IPv4, and both

def test_pool_cutting():
    p = ipam.Pool("10.213.0.0/16")
    assert p.size == 16384
    assert p.slot(0) == ("10.213.0.1", "10.213.0.2", "10.213.0.0/30")
    assert p.slot(1) == ("10.213.0.5", "10.213.0.6", "10.213.0.4/30")
    assert p.slot(16383) == ("10.213.255.253", "10.213.255.254", "10.213.255.252/30")
    with pytest.raises(ValueError):
        p.slot(16384)
    assert ipam.Pool("192.168.7.0/30").size == 1
    for bad in ("10.213.0.1/16", "10.0.0.0/31", "fd00::/64", "nonsense"):
        with pytest.raises(NetworkError, match="pool"):
            ipam.Pool(bad)
    assert not p.overlaps("192.0.2.0/24")
    assert p.overlaps("10.213.7.0/24")


def test_job_key_derivation():
    k = ipam.job_key("job-1")
    assert k == ipam.job_key("job-1") and len(k) == 15 and k.startswith("stj")
    assert ipam.is_job_key(k)
    assert k != ipam.job_key("job-2")
    assert k != ipam.job_key("job-1", table="starter_other")
    assert not ipam.is_job_key("stjXYZ") and not ipam.is_job_key("eth0")
    # any id maps to a safe name: nothing of the id reaches nft or /proc/sys
    assert ipam.is_job_key(ipam.job_key('x"; flush ruleset; ../../etc'))


def test_ifname_validation():
    assert ipam.check_ifname("uplink", "eth0.100") == "eth0.100"
    for bad in ("", "a" * 16, "..", "../x", "a b", "-x", None, "eth0\n"):
        with pytest.raises(NetworkError, match="uplink"):
            ipam.check_ifname("uplink", bad)


def test_config_validation(tmp_path):
    from starter.net.table import validate

    ok = net.NetConfig(state_dir=str(tmp_path), lan=("10.77.0.0/16",), uplink="up0",
                       allow_host_ports=(("tcp", 3128),))
    assert validate(ok).cidr == "10.213.0.0/16"
    cases = [
        (dict(lan=("10.213.5.0/24",)), "lan: .*overlaps"),
        (dict(lan=("10.77.0.1/16",)), "lan:"),
        (dict(uplink="bad/name"), "uplink"),
        (dict(allow_host_ports=(("sctp", 1),)), r"allow_host_ports\[0\]"),
        (dict(allow_host_ports=(("tcp", 0),)), r"allow_host_ports\[0\]"),
        (dict(table="filter"), "table"),
        (dict(table="starter;x"), "table"),
    ]
    for kw, msg in cases:
        with pytest.raises(NetworkError, match=msg):
            validate(net.NetConfig(state_dir=str(tmp_path), **kw))


def test_netconfig_is_immutable_and_roundtrips(tmp_path):
    c = net.NetConfig(state_dir=str(tmp_path), lan=["10.0.0.0/8"], allow_host_ports=[["tcp", "3128"]])
    assert c.lan == ("10.0.0.0/8",) and c.allow_host_ports == (("tcp", 3128),)
    with pytest.raises(AttributeError):
        c.pool = "x"
    d = json.loads(json.dumps(c.as_dict()))
    assert net.NetConfig.from_dict(d) == c and hash(net.NetConfig.from_dict(d)) == hash(c)


def test_resolv_conf_text(tmp_path):
    c = net.NetConfig(state_dir=str(tmp_path))
    text = net.resolv_conf_text(c)
    assert "nameserver" not in text and text.startswith("#")
    assert "nameserver 10.77.0.53\n" in net.resolv_conf_text(net.NetConfig(state_dir="x", resolver="10.77.0.53"))
    lease = net.NetLease("j", "10.213.0.2", "10.213.0.1", 30, "stjx")
    assert "nameserver 10.213.0.1\n" in net.resolv_conf_text(net.NetConfig(state_dir="x", resolver="gateway"), lease)
    with pytest.raises(NetworkError, match="resolver"):
        net.resolv_conf_text(net.NetConfig(state_dir="x", resolver="nameserver 1.1.1.1\nevil"))


def test_lease_store(tmp_path):
    store = ipam.LeaseStore(str(tmp_path))
    pool = ipam.Pool("10.215.0.0/29")  # two slots
    with store:
        a = store.acquire("a", "stjaaaaaaaaaaaa", pool, os.getpid())
        assert (a["address"], a["gateway"], a["slot"]) == ("10.215.0.2", "10.215.0.1", 0)
        assert a["owner_start"] == ipam.proc_starttime(os.getpid()) and ipam.owner_alive(a)
        with pytest.raises(NetworkError, match="already holds"):
            store.acquire("a", "stjaaaaaaaaaaaa", pool, os.getpid())
        b = store.acquire("b", "stjbbbbbbbbbbbb", pool, os.getpid())
        assert b["address"] == "10.215.0.6"
        with pytest.raises(NetworkError, match="exhausted"):
            store.acquire("c", "stjcccccccccccc", pool, os.getpid())
        store.release("stjaaaaaaaaaaaa")
        store.release("stjaaaaaaaaaaaa")  # idempotent
        c = store.acquire("c", "stjcccccccccccc", pool, os.getpid())
        assert c["slot"] == 0 and store.count() == 2
        # a crash between slot and lease file leaves an orphan slot gc can see
        os.unlink(os.path.join(store.leases, "stjcccccccccccc.json"))
        assert [n for n, _ in store.orphan_slots()] == ["0"]
    # an owner whose pid was recycled is not alive
    assert not ipam.owner_alive(dict(c, owner_start=c["owner_start"] + 1))
    assert not ipam.owner_alive(dict(c, owner_pid=2 ** 22 + 1))


def test_lowest_free_slot_first(tmp_path):
    store = ipam.LeaseStore(str(tmp_path))
    pool = ipam.Pool("10.215.0.0/16")
    with store:
        a = store.acquire("a", ipam.job_key("a"), pool, os.getpid())
        b = store.acquire("b", ipam.job_key("b"), pool, os.getpid())
        assert (a["slot"], b["slot"]) == (0, 1)
        store.release(a["key"])
        # a dead job's address is handed out again at once (teardown has
        # deleted its conntrack entries): the lowest free slot
        c = store.acquire("c", ipam.job_key("c"), pool, os.getpid())
        assert c["slot"] == 0 and c["address"] == a["address"]
        d = store.acquire("d", ipam.job_key("d"), pool, os.getpid())
        assert d["slot"] == 2
        for x in (b, c, d):
            store.release(x["key"])
    # and with nothing leased, net/ is gone: the state dir is as we found it
    assert os.listdir(tmp_path) == []


def test_uplinks_config():
    one = net.NetConfig(state_dir="x", uplink="up0")
    assert one.uplink == ("up0",) and net.NetConfig(state_dir="x").uplink == ()
    two = net.NetConfig(state_dir="x", uplink=["ib0", "up0", "ib0"])
    assert two.uplink == ("ib0", "up0")
    assert net.NetConfig.from_dict(json.loads(json.dumps(two.as_dict()))) == two
    # one fingerprint per node, whatever order the jobs name the uplinks in;
    # one uplink keeps the form tables recorded before several were allowed
    fp = table.cfg_fingerprint
    assert fp(two)["uplink"] == fp(net.NetConfig(state_dir="x", uplink=("up0", "ib0")))["uplink"] == ["ib0", "up0"]
    assert fp(one)["uplink"] == "up0" and fp(net.NetConfig(state_dir="x"))["uplink"] is None
    with pytest.raises(NetworkError, match="uplink"):
        table.validate(net.NetConfig(state_dir="x", uplink=("up0", "bad/name")))


def test_uplink_option_and_job_file_key():
    """--uplink repeats; the job file's network.uplink is a name or a list;
    flags add to the file's, repeats are dropped; hostile names refused."""
    from starter.spec import jobspec as spec
    from starter.errors import SpecError

    job = {"network": {"mode": "nat", "uplink": ["ib0", "eth0"]}, "command": ["x"]}
    s = spec.build({"command": ["true"], "user": "nobody", "uplink": ["eth0", "eth1"]}, job)
    assert s.network.uplink == ("ib0", "eth0", "eth1")
    s = spec.build({"command": ["true"], "user": "nobody"}, {"network": {"mode": "nat", "uplink": "eth0"}, "command": ["x"]})
    assert s.network.uplink == ("eth0",)
    assert spec.build({"command": ["true"], "user": "nobody"}).network.uplink == ()
    for bad in ("a/b", "x" * 16, "$(id)"):
        with pytest.raises(SpecError, match="uplink"):
            spec.build({"command": ["true"], "user": "nobody", "net": "nat", "uplink": ["eth0", bad]})
    with pytest.raises(SpecError, match="only applies with --net nat"):
        spec.build({"command": ["true"], "user": "nobody", "uplink": ["eth0"]})


def test_conntrack_messages():
    """The dump request and the parsing of its answers, on hand-made bytes."""
    a, other = socket.inet_aton("198.18.5.2"), socket.inet_aton("198.18.9.9")
    req = conntrack.dump_request(socket.AF_INET, a, 0, 7)
    length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, mtype, flags & 0x300, seq) == (len(req), (1 << 8) | 1, 0x300, 7)
    assert a in req and req[16] == socket.AF_INET

    def entry(src, dst, zone=None, family=socket.AF_INET):
        ip = netlink.attr(1, src) + netlink.attr(2, dst)
        proto = netlink.attr(1, bytes([6, 0, 0, 0]))
        tup = netlink.attr(1 | 0x8000, netlink.attr(1 | 0x8000, ip) + netlink.attr(2 | 0x8000, proto))
        body = struct.pack("=BBH", family, 0, 0) + tup + netlink.attr(2 | 0x8000, b"")
        if zone is not None:
            body += netlink.attr(18, struct.pack(">H", zone))
        return struct.pack("=IHHII", 16 + len(body), (1 << 8) | 0, 2, 7, 0) + body, tup

    m1, t1 = entry(a, other)
    m2, _ = entry(other, other)             # an old kernel ignored the filter: not ours
    m3, t3 = entry(other, a, zone=3)        # the host talking to the job
    m4, _ = entry(a, other, family=socket.AF_INET6)   # another family: skipped
    done = struct.pack("=IHHII", 20, 3, 2, 7, 0) + struct.pack("=i", 0)
    got, fin, err = conntrack.parse_entries(m1 + m2 + m3 + m4 + done, socket.AF_INET, {a})
    assert fin and err == 0
    assert got == [t1, t3 + netlink.attr(18, struct.pack(">H", 3))]
    e = struct.pack("=IHHII", 20, 2, 0, 7, 0) + struct.pack("=i", -95)
    assert conntrack.parse_entries(e, socket.AF_INET, {a}) == ([], True, -95)
    assert conntrack.forget([]) == 0
    # the flush by mark: a DELETE with no tuple (a flush), both families,
    # acked, filtered by the mark under an all-ones mask (ctnetlink's u32s
    # are big-endian)
    req = conntrack.flush_mark_request(0x0AD50002, 9)
    length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, mtype, flags, seq) == (len(req), (1 << 8) | 2, 0x5, 9)
    assert req[16:20] == struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)
    assert req[20:] == netlink.attr(8, b"\x0a\xd5\x00\x02") + netlink.attr(21, b"\xff" * 4)


def test_facade_import_is_cheap():
    code = ("import sys, starter.net; "
            "assert 'pyroute2' not in sys.modules and 'starter._nft' not in sys.modules, "
            "[m for m in sys.modules if 'pyroute2' in m or '_nft' in m]")
    subprocess.run([PY, "-c", code], check=True)


# ---------------------------------------------------------------- IPv6
def test_pool6_cutting():
    p = ipam.Pool6("fd70:7639:1864::/64")
    assert p.slot(0) == ("fd70:7639:1864::1", "fd70:7639:1864::2", "fd70:7639:1864::/126")
    assert p.slot(3) == ("fd70:7639:1864::d", "fd70:7639:1864::e", "fd70:7639:1864::c/126")
    assert p.size == 1 << 62
    assert p.overlaps("fd70:7639:1864::1/128") and not p.overlaps("fd70:7639:1865::/64")
    assert not p.overlaps("10.0.0.0/8")
    for bad, msg in (("2001:db8::/64", "not a unique local"), ("fd00::1/64", "host bits"),
                     ("fd00::/127", "smaller than one /126"), ("10.0.0.0/8", "pool6"), ("fd00::/zz", "pool6")):
        with pytest.raises(NetworkError, match=msg):
            ipam.Pool6(bad)
    assert net.DEFAULT_POOL6 == "fd70:7639:1864::/64"
    assert ipam.Pool6(net.DEFAULT_POOL6)


def test_lease_has_both_addresses_of_one_slot(tmp_path):
    store = ipam.LeaseStore(str(tmp_path))
    with store:
        a = store.acquire("a", ipam.job_key("a"), ipam.Pool("10.9.0.0/24"), os.getpid(), ipam.Pool6("fd01::/64"))
        b = store.acquire("b", ipam.job_key("b"), ipam.Pool("10.9.0.0/24"), os.getpid())
    assert (a["slot"], a["address"], a["address6"], a["gateway6"], a["prefixlen6"]) == \
        (0, "10.9.0.2", "fd01::2", "fd01::1", 126)
    assert "address6" not in b      # a job without IPv6
    lease = net.NetLease.from_record(a)
    assert (lease.address6, lease.gateway6) == ("fd01::2", "fd01::1")
    assert net.NetLease.from_record(b).address6 is None


def test_config_validation_ipv6(tmp_path):
    from starter.net.table import validate

    sd = str(tmp_path)
    assert validate(net.NetConfig(state_dir=sd, lan=("192.168.0.0/16", "2001:db8::/32"))).cidr == net.DEFAULT_POOL
    for kw, msg in (({"lan": ("2001:db8::1/32",)}, "lan: .*host bits"),
                    ({"lan": ("fd70:7639:1864::/48",)}, "lan: .*overlaps the job address pool fd70"),
                    ({"pool6": "2001:db8::/64"}, "not a unique local"),
                    ({"pool": "10.0.0.0/8", "pool6": "fd00::/110"}, "fewer /126 slots"),
                    ({"ipv6": "maybe"}, "ipv6")):
        with pytest.raises(NetworkError, match=msg):
            validate(net.NetConfig(state_dir=sd, **kw))
    c = net.NetConfig(state_dir=sd, pool6="fd00:1::/64", ipv6="off")
    assert net.NetConfig.from_dict(c.as_dict()) == c


def test_ipv6_option_and_job_file_keys():
    from starter.spec import jobspec as spec
    from starter.errors import SpecError

    base = {"command": ["true"], "user": "nobody"}
    s = spec.build(dict(base, net="nat", ipv6="off", pool6="fd00:1::/64", lan=["2001:db8::/32"],
                        resolver="2001:db8::53"))
    cfg = net.config_for(s)
    assert (cfg.ipv6, cfg.pool6, cfg.lan, cfg.resolver) == ("off", "fd00:1::/64", ("2001:db8::/32",), "2001:db8::53")
    s = spec.build(base, {"network": {"mode": "nat", "ipv6": "on", "pool6": "fd00:2::/64"}, "command": ["x"]})
    assert (s.network.ipv6, s.network.pool6) == ("on", "fd00:2::/64")
    assert net.config_for(spec.build(dict(base, net="nat"))).ipv6 == "auto"
    with pytest.raises(SpecError, match="ipv6: 'maybe' is not one of auto, on, off"):
        spec.build(dict(base, net="nat", ipv6="maybe"))
    with pytest.raises(SpecError, match="pool6"):
        spec.build(dict(base, net="nat", pool6="fd00::/zz"))
    with pytest.raises(SpecError, match="only applies with --net nat"):
        spec.build(dict(base, ipv6="on"))


def test_resolv_conf_names_an_ipv6_resolver(tmp_path):
    text = net.resolv_conf_text(net.NetConfig(state_dir=str(tmp_path), resolver="2001:db8::53"))
    assert "nameserver 2001:db8::53\n" in text


def test_classad_has_the_ipv6_share():
    from starter.observe import classad

    c = lambda b, p: {"bytes": b, "packets": p}  # noqa: E731
    ad = dict(classad.attributes({"network": nft.combine({"lan_in": c(100, 1), "drop": c(0, 0),
                                                          "lan_in6": c(200, 2)})}))
    assert ad["NetworkLanInputBytes"] == 300 and ad["NetworkIpv6LanInputBytes"] == 200
    assert ad["NetworkIpv6LanInputPackets"] == 2 and "NetworkIpv6DroppedBytes" not in ad
    no6 = dict(classad.attributes({"network": nft.combine({"lan_in": c(100, 1), "drop": c(0, 0)})}))
    assert not any(k.startswith("NetworkIpv6") for k in no6)


# ---------------------------------------------------------------- --net-rate

@pytest.mark.parametrize("text, zones", [
    ("100mbit", {"lan_in": 10**8, "lan_out": 10**8, "wan_in": 10**8, "wan_out": 10**8}),
    ("out=1gbit,lan-out=100mbit", {"lan_out": 10**8, "wan_out": 10**9}),      # the specific wins, any order
    ("lan-out=100mbit,out=1gbit", {"lan_out": 10**8, "wan_out": 10**9}),
    ("WAN = 1.5Gbit", {"wan_in": 15 * 10**8, "wan_out": 15 * 10**8}),
    ("in=10mbps", {"lan_in": 8 * 10**7, "wan_in": 8 * 10**7}),              # bytes/s, as tc
    ("8kbit", None), ("1tbit", None),
])
def test_net_rate_parses(text, zones):
    from starter.spec.options import parse_net_rate

    got = dict(parse_net_rate("net-rate", text))
    assert got == zones or (zones is None and len(got) == 4)


@pytest.mark.parametrize("text", ["", "100", "fast", "7kbit", "2tbit", "1e9bit", "-1mbit", "x=1mbit", "in=1mbit,in=2mbit",
                                  "in=", "=1mbit", "1..2mbit", "$(id)", "lan/in=1mbit", "1mbit\0"])
def test_net_rate_refuses(text):
    from starter.errors import SpecError
    from starter.spec.options import parse_net_rate

    with pytest.raises(SpecError) as e:
        parse_net_rate("net-rate", text)
    assert "\n" not in str(e.value)


def test_net_rate_only_for_nat_and_reaches_the_config():
    from starter.spec import jobspec as spec
    from starter.errors import SpecError

    with pytest.raises(SpecError, match="--net nat"):
        spec.build({"command": ["true"], "user": "nobody", "net-rate": "1mbit"})
    s = spec.build({"command": ["true"], "user": "nobody", "net": "nat", "net-rate": "wan=5mbit"})
    cfg = net.config_for(s)
    assert cfg.rate == (("wan_in", 5 * 10**6), ("wan_out", 5 * 10**6))
    assert net.NetConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg
    assert table.cfg_fingerprint(cfg) == table.cfg_fingerprint(net.config_for(spec.build(
        {"command": ["true"], "user": "nobody", "net": "nat"})))       # per job: not the table's business
    with pytest.raises(NetworkError, match="rate"):
        table.validate(net.NetConfig("/run/x", rate=[("lan_up", 10**6)]))
    with pytest.raises(NetworkError, match="rate"):
        table.validate(net.NetConfig("/run/x", rate=[("lan_in", 1)]))


def _tc(req):
    """An rtnl request -> (type, tcmsg fields, {attr: payload}, {option attr: payload})."""
    from starter.net import shaping

    mtype, _flags, body = req
    hdr = struct.unpack_from(shaping._TCMSG, body)
    top = {k: v for k, v, _ in netlink.attrs(body[20:])}
    opts = {k: v for k, v, _ in netlink.attrs(top.get(shaping.TCA_OPTIONS, b""))}
    return mtype, hdr, top, opts


def test_shaping_requests():
    from starter.net import shaping

    assert shaping.requests(7, "in", {"lan_out": 10**6}, ["10.0.0.0/8"]) == []      # nothing capped that way
    # only WAN out capped: default class 1:2, LAN and the gateway past the shaper (1:0)
    reqs = [_tc(r) for r in shaping.requests(7, "out", {"wan_out": 10**8}, ["10.0.0.0/8", "fd00::/8"],
                                             ["10.213.0.0/30"])]
    kinds = [(t, top[shaping.TCA_KIND]) for t, _h, top, _o in reqs]
    assert kinds == [(shaping.RTM_NEWQDISC, b"htb\0"), (shaping.RTM_NEWTCLASS, b"htb\0"),
                     (shaping.RTM_NEWQDISC, b"bfifo\0")] + [(shaping.RTM_NEWTFILTER, b"u32\0")] * 3
    _t, (_f, _p, ifindex, handle, parent, _i), _top, opts = reqs[0]
    assert (ifindex, handle, parent) == (7, 0x10000, 0xFFFFFFFF)
    assert struct.unpack("=IIIII", opts[shaping.TCA_HTB_INIT])[2] == 2                # defcls 1:2
    _t, (_f, _p, _x, handle, parent, _i), _top, opts = reqs[1]
    parms = opts[shaping.TCA_HTB_PARMS]
    assert (handle, parent) == (0x10002, 0x10000) and struct.unpack_from("=BBHhHI", parms)[5] == 10**8 // 8
    filters = [(h[5], o[shaping.TCA_U32_CLASSID], o[shaping.TCA_U32_SEL]) for _t, h, _top, o in reqs[3:]]
    # gateway first, IPv4 (prio 1), destination (offset 16), to 1:0
    info, classid, sel = filters[0]
    assert info == (1 << 16) | socket.htons(0x0800) and struct.unpack("=I", classid)[0] == 0x10000
    assert struct.unpack_from("=4s4sii", sel, 16) == (socket.inet_aton("255.255.255.252"),
                                                      socket.inet_aton("10.213.0.0"), 16, 0)
    # IPv6 LAN: prio 2, one key for a /8 (the other words' masks are 0)
    info, classid, sel = filters[2]
    assert info == (2 << 16) | socket.htons(0x86DD) and sel[2] == 1
    assert struct.unpack_from("=4s4sii", sel, 16)[2] == 24
    # both zones of "in" capped: LAN by source (offset 12) to 1:1, default 1:2
    reqs = [_tc(r) for r in shaping.requests(3, "in", {"lan_in": 10**9, "wan_in": 4 * 10**10}, ["10.0.0.0/8"])]
    assert struct.unpack("=IIIII", reqs[0][3][shaping.TCA_HTB_INIT])[2] == 2
    _t, _h, _top, o = reqs[-1]
    assert struct.unpack("=I", o[shaping.TCA_U32_CLASSID])[0] == 0x10001
    assert struct.unpack_from("=4s4sii", o[shaping.TCA_U32_SEL], 16)[2] == 12
    # a rate above 4 GB/s travels in TCA_HTB_RATE64
    wan = [o for t, h, _top, o in reqs if t == shaping.RTM_NEWTCLASS and h[3] == 0x10002][0]
    assert struct.unpack("=Q", wan[shaping.TCA_HTB_RATE64])[0] == 5 * 10**9


def test_shaping_stats_and_report():
    from starter.net import shaping

    def cls(handle, nbytes, packets, drops, over):
        basic = netlink.attr(shaping.TCA_STATS_BASIC, struct.pack("=QI4x", nbytes, packets))
        queue = netlink.attr(shaping.TCA_STATS_QUEUE, struct.pack("=IIIII", 0, 0, drops, 0, over))
        body = struct.pack(shaping._TCMSG, 0, 0, 5, handle, 0x10000, 0) + netlink.attr(shaping.TCA_KIND, b"htb\0")
        return 42, body + netlink.attr(shaping.TCA_STATS2, basic + queue)

    st = shaping.class_stats([cls(0x10001, 10**9, 700000, 3, 1200), cls(0x10002, 5, 1, 0, 0)])
    assert st[0x10001] == {"bytes": 10**9, "packets": 700000, "dropped": 3, "overlimits": 1200}
    rep = shaping.report({"lan_in": 10**8, "wan_out": 10**7}, {"in": st, "out": None})
    assert rep == {"lan_in": {"rate_bits": 10**8, "bytes": 10**9, "packets": 700000, "dropped": 3, "overlimits": 1200},
                   "wan_out": {"rate_bits": 10**7}}


def test_a_shaper_error_names_the_modules():
    from starter.net import rtnl, veth

    e = rtnl.RtnlError(2, 1)                       # the veth's own request: passed on as it is
    assert veth._shaper_error(e, 3) is e
    err = veth._shaper_error(rtnl.RtnlError(2, 4), 3)   # ENOENT from a tc request: "unknown qdisc kind"
    assert isinstance(err, NetworkError) and "--net-rate shaper" in str(err) and "sch_htb" in err.hint
