"""The nft table as data, against fixture text (tests/fixtures/nft/): the
rule renderer (nftrules), a job's changes as nf_tables netlink messages
(nftwire), the counter reader's messages and sums, and the per-job flow cap
(nft).  No table is made; design.md's drawing against a live job's table is
in tests/test_nft.py."""

import json
import os
import struct

import pytest

from conftest import REPO
from starter.errors import NetworkError
from starter.net import netlink, nft, nftrules, nftwire

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

FIX = os.path.join(REPO, "tests", "fixtures", "nft")
# The configuration tests/fixtures/nft/table.json was rendered from: both
# families, two uplinks (one guarded per family), two host ports, a flow cap.
FIXTURE_CFG = dict(pool="10.213.0.0/16", lan=("10.77.0.0/16", "2001:db8:1::/48"), uplinks=("up0", "ib0"),
                   guard_ifs=("up0",), host_allow=(("tcp", 3128), ("udp", 53)), pool6="fd70:7639:1864::/64",
                   guard6_ifs=("ib0",), max_flows=4096)
FIXTURE_JOB = ("stj0123456789ab", "stj0123456789ab", "10.213.0.2", "fd70:7639:1864::2")


def _cmds(cmds):
    """Commands as (verb, object kind) pairs."""
    return [(verb, next(iter(obj))) for c in cmds for verb, obj in c.items()]


def test_the_table_renders_as_its_fixture():
    """The whole table as JSON commands for libnftables, one per line of
    table.json.  A change to the rules changes this file: regenerate it
    (json.dumps(cmd, sort_keys=True) per line) and say why in the commit."""
    with open(os.path.join(FIX, "table.json")) as f:
        want = json.load(f)
    got = json.loads(json.dumps(nftrules.Table("starter").create(**FIXTURE_CFG)))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (i, g, w)


def test_a_jobs_changes_encode_as_their_fixture():
    """A dual-stack job's add and delete as nf_tables messages numbered from
    100, one per line of job.netlink: `verb kind name hex`."""
    t = nftrules.Table("starter")
    got = []
    for verb in ("add", "delete"):
        changes = t.job_changes(verb, *FIXTURE_JOB, mark=True)
        msgs = nftwire.job_messages(t.name, verb, changes, 100)
        got += [f"{verb} {c[0]} {c[1]} {m.hex()}" for c, m in zip(changes, msgs)]
    with open(os.path.join(FIX, "job.netlink")) as f:
        assert got == f.read().splitlines()


def test_rule_rendering_table():
    t = nftrules.Table("starter")
    cmds = t.create("10.213.0.0/16", lan=("10.77.0.0/16",), uplinks=("up0",), guard_ifs=("up0",),
                    host_allow=(("tcp", 3128), ("udp", 53)))
    kinds = _cmds(cmds)
    # replaces a leftover table atomically: add, delete, add; never the ruleset
    assert kinds[:3] == [("add", "table"), ("delete", "table"), ("add", "table")]
    assert all(k != "flush" for k, _ in kinds)
    text = json.dumps(cmds)
    assert '"ruleset"' not in text
    assert all(o.get("table", o.get("name")) == "starter"
               for c in cmds for v in c.values() for o in v.values())
    # the chains hook where the design says
    hooks = {o["name"]: (o.get("hook"), o.get("prio")) for c in cmds for v in c.values()
             for k, o in v.items() if k == "chain" and "hook" in o}
    assert hooks == {"prerouting": ("prerouting", -300), "input": ("input", 0),
                     "forward": ("forward", 0), "output": ("output", 0), "postrouting": ("postrouting", 100),
                     "nat_input": ("input", 100)}
    rules = [o for c in cmds for v in c.values() for k, o in v.items() if k == "rule"]
    # every new connection of a job gets its mark, in the nat chains only
    # (their first packet), unless a site's rule marked it first
    marking = [r for r in rules if '"@job_marks"' in json.dumps(r)]
    assert [(r["chain"], r["expr"][0]["match"]["left"]["meta"]["key"]) for r in marking] == \
        [("postrouting", "iifname"), ("postrouting", "oifname"), ("nat_input", "iifname")]
    assert all(r["expr"][1] == {"match": {"op": "==", "left": {"ct": {"key": "mark"}}, "right": 0}} for r in marking)
    assert nftrules.job_mark("10.213.0.2") == 0x0AD50002
    # per-job dispatch is by map: every counter in a rule is a map lookup or a global one
    for r in rules:
        for e in r["expr"]:
            if "counter" in e:
                assert e["counter"] in ("dropped", "foreign_marks") or e["counter"]["map"]["data"].startswith("@ctr_")
    sets = {o["name"]: o for c in cmds for v in c.values() for k, o in v.items() if k in ("set", "map")}
    assert sets["host_allow"]["elem"] == [{"concat": [6, 3128]}, {"concat": [17, 53]}]  # by number: no /etc/protocols needed
    assert sets["lan"]["elem"] == [{"prefix": {"addr": "10.77.0.0", "len": 16}}]
    assert {"prefix": {"addr": "169.254.0.0", "len": 16}} in sets["blocked"]["elem"]
    assert {"prefix": {"addr": "127.0.0.0", "len": 8}} in sets["blocked"]["elem"]
    # new connections beyond the job's share of the conntrack table: dropped, out and to the host
    capped = {r["chain"] for r in rules if '"ct count": {"val": 32768, "inv": true}' in json.dumps(r)}
    assert capped == {"job_out", "job_to_host"}


def test_rule_rendering_job_adds_no_rules():
    t = nftrules.Table("starter")
    add = t.add_job("stj0123456789ab", "stj0123456789ab", "10.213.0.2")
    kinds = _cmds(add)
    assert ("add", "rule") not in kinds
    assert kinds.count(("add", "counter")) == 5 and kinds[-1] == ("add", "element")
    # job_ifs is filled last, so packets see the job only when it is complete
    assert add[-1]["add"]["element"]["name"] == "job_ifs"
    names = [c["add"]["counter"]["name"] for c in add if "counter" in c["add"]]
    assert names == [f"stj0123456789ab_{c}" for c in ("lan_in", "lan_out", "wan_in", "wan_out", "drop")]
    dele = t.del_job("stj0123456789ab", "stj0123456789ab", "10.213.0.2")
    dk = _cmds(dele)
    # elements go before the counters they reference
    assert dk.index(("delete", "counter")) > max(i for i, k in enumerate(dk) if k == ("delete", "element"))
    assert len(dele) == len(add)


def test_job_changes_as_netlink():
    """The per-job transaction over netlink: the keys as nf_tables stores them
    (`nft --debug=netlink add element ... { "stjabc" . 10.1.2.3 }` shows
    ifname NUL-padded to 16 bytes, then the address packed), the counter
    maps' elements naming their counter, flags, order and numbering."""
    t = nftrules.Table("starter")
    changes = t.job_changes("add", "stjabc", "stjabc", "10.1.2.3", "fd70:7639:1864::2")
    msgs = nftwire.job_messages("starter", "add", changes, 5)
    assert len(msgs) == len(changes) == len(t.add_job("stjabc", "stjabc", "10.1.2.3", "fd70:7639:1864::2"))
    for i, (m, c) in enumerate(zip(msgs, changes)):
        length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", m)
        assert (length, seq, flags) == (len(m), 5 + i, 1 | 4 | 0x400)       # request, ack, create
        assert mtype == (10 << 8) | (18 if c[0] == "counter" else 12)          # NEWOBJ, NEWSETELEM
    src = msgs[[c[1] for c in changes].index("job_src")]
    assert b"stjabc" + b"\0" * 10 + bytes([10, 1, 2, 3]) in src
    src6 = msgs[[c[1] for c in changes].index("job_src6")]
    assert b"stjabc" + b"\0" * 10 + bytes.fromhex("fd707639186400000000000000000002") in src6
    assert b"stjabc" + b"\0" * 10 + bytes.fromhex("fe800000000000000000000000000002") in src6
    lan_in = msgs[[c[1] for c in changes].index("ctr_lan_in")]
    assert b"stjabc_lan_in\0" in lan_in                                       # the objref
    gone = nftwire.job_messages("starter", "delete", t.job_changes("delete", "stjabc", "stjabc", "10.1.2.3"), 1)
    types = [struct.unpack_from("=H", m, 4)[0] & 0xFF for m in gone]
    assert types == [14] * 7 + [20] * 5                                          # DELSETELEM, then DELOBJ
    assert all(b"stjabc_lan_in\0" not in m for m in gone[:7])                   # no objref on delete
    with pytest.raises(NetworkError, match="longer than 15"):
        nftwire.job_messages("starter", "add", t.job_changes("add", "k", "x" * 16, "10.1.2.3"), 1)


def test_counter_read_messages():
    req = nftwire.getobj_request("starter", "stjaaaaaaaaaaaa_lan_in", 7)
    length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, mtype, flags, seq) == (len(req), (10 << 8) | 19, 1, 7)
    assert b"starter\0" in req and b"stjaaaaaaaaaaaa_lan_in\0" in req and len(req) % 4 == 0
    # a NEWOBJ answer (bytes/packets are big-endian u64 in a nested attribute)
    data = netlink.attr(1, struct.pack(">Q", 1500)) + netlink.attr(2, struct.pack(">Q", 3))
    body = struct.pack("=BBH", 1, 0, 0) + netlink.attr(1, b"starter\0") + netlink.attr(4 | 0x8000, data)
    ok = struct.pack("=IHHII", 16 + len(body), (10 << 8) | 18, 0, 1, 0) + body
    err = struct.pack("=IHHII", 36, 2, 0, 2, 0) + struct.pack("=i", -2) + req[:16]
    assert nftwire.parse_getobj_replies(ok + err) == {1: {"bytes": 1500, "packets": 3}, 2: -2}
    # is a job's connection count there? A get (no batch: nothing to abort), its key the veth name padded
    req = nftwire.getsetelem_request("starter", "job_flows", ("stjaaaaaaaaaaaa",), 9)
    length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, mtype, flags, seq) == (len(req), (10 << 8) | 13, 1, 9)
    assert b"job_flows\0" in req and b"stjaaaaaaaaaaaa\0" in req and len(req) % 4 == 0


def test_rule_rendering_ipv6():
    t = nftrules.Table("starter")
    cmds = t.create("10.213.0.0/16", lan=("10.77.0.0/16", "2001:db8:1::/48"), uplinks=("up0",),
                    pool6="fd70:7639:1864::/64", guard6_ifs=("up0",))
    sets = {o["name"]: o for c in cmds for v in c.values() for k, o in v.items() if k in ("set", "map")}
    assert sets["lan"]["elem"] == [{"prefix": {"addr": "10.77.0.0", "len": 16}}]
    assert sets["lan6"]["elem"] == [{"prefix": {"addr": "2001:db8:1::", "len": 48}}]
    assert sets["job_nets6"]["elem"] == [{"prefix": {"addr": "fd70:7639:1864::", "len": 64}}]
    assert sets["guard6_ifs"]["elem"] == ["up0"]
    for blocked in ("fe80::", "fd00:ec2::", "ff00::", "::"):
        assert any(e["prefix"]["addr"] == blocked for e in sets["blocked6"]["elem"]), blocked
    text = json.dumps(cmds)
    # router messages from the job are counted drops; NAT66 out of the uplinks
    assert '"nd-router-advert"' in text and '"masquerade"' in text
    rules = [o for c in cmds for v in c.values() for k, o in v.items() if k == "rule"]
    masq = [r for r in rules if r["chain"] == "postrouting" and '"masquerade"' in json.dumps(r)]
    assert len(masq) == 2 and "job_nets6" in json.dumps(masq[1])
    # a job with IPv6: four more counters and one more element, still no rule
    add = t.add_job("stj0123456789ab", "stj0123456789ab", "10.213.0.2", "fd70:7639:1864::2")
    kinds = _cmds(add)
    assert ("add", "rule") not in kinds and kinds.count(("add", "counter")) == 9
    assert add[-1]["add"]["element"]["name"] == "job_ifs"
    assert {"concat": ["stj0123456789ab", "fd70:7639:1864::2"]} in \
        next(c["add"]["element"]["elem"] for c in add if c["add"].get("element", {}).get("name") == "job_src6")
    dele = t.del_job("stj0123456789ab", "stj0123456789ab", "10.213.0.2", "fd70:7639:1864::2")
    assert len(dele) == len(add)
    # a job without: exactly what it was before IPv6
    assert _cmds(t.add_job("stj0123456789ab", "stj0123456789ab", "10.213.0.2")).count(("add", "counter")) == 5


def test_counters_combined_and_per_family():
    c = lambda b, p: {"bytes": b, "packets": p}  # noqa: E731
    raw = {"lan_in": c(100, 1), "lan_out": c(0, 0), "wan_in": c(10, 1), "wan_out": c(5, 1), "drop": c(3, 1),
           "lan_in6": c(200, 2), "lan_out6": c(1, 1), "wan_in6": c(0, 0), "wan_out6": c(7, 1)}
    out = nft.combine(raw)
    assert out["lan_in"] == c(300, 3) and out["wan_out"] == c(12, 2) and out["dropped"] == c(3, 1)
    assert out["ipv4"]["lan_in"] == c(100, 1) and out["ipv6"]["lan_in"] == c(200, 2)
    no6 = nft.combine({k: v for k, v in raw.items() if not k.endswith("6")})
    assert "ipv6" not in no6 and no6["lan_in"] == c(100, 1)


def test_max_flows_from_the_environment_or_the_conntrack_table(tmp_path):
    f = tmp_path / "nf_conntrack_max"
    f.write_text("262144\n")
    assert nft.max_flows({}, str(f)) == 32768
    f.write_text("4096\n")
    assert nft.max_flows({}, str(f)) == 1024                 # never below
    assert nft.max_flows({}, str(tmp_path / "none")) == nftrules.DEFAULT_MAX_FLOWS
    assert nft.max_flows({"STARTER_NET_MAX_FLOWS": "7"}, str(f)) == 7
    for bad in ("0", "-1", "1e3", "²", "x"):
        with pytest.raises(NetworkError, match="STARTER_NET_MAX_FLOWS"):
            nft.max_flows({"STARTER_NET_MAX_FLOWS": bad}, str(f))
