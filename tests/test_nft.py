"""docs/design.md's drawing of the nft table against a live job's table:
every set and map with its type and flags, the counters, the chain hooks,
each chain's rules in order.  The table as data, on fixture text, is in
tests/unit/test_nft_render.py."""

import json
import os
import re
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
from starter import net  # noqa: E402
from starter.net import nftrules  # noqa: E402

DESIGN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design.md")
ZONE_WORDS = {z + s for z in ("lan_in", "lan_out", "wan_in", "wan_out") for s in ("", "6")}


def _rule_shape(refs, target, verdict):
    return (tuple(sorted(refs)), target, verdict)


def _drawn_rule(text):
    """A rule line of the drawing -> (the sets, maps and counters it names,
    its jump/goto, its verdict).  After '->': `count` is the job's drop
    counter, a zone word (lan_out ...) its counter of that zone, `dropped`
    the table's own counter; parenthesised text is a comment."""
    text = re.sub(r"\([^)]*\)", " ", text)
    match, _, action = text.partition("->")
    refs = set(re.findall(r"@(\w+)", text))
    words = re.findall(r"[\w]+", action)
    refs |= {"ctr_drop" for w in words if w == "count"} | {"ctr_" + w for w in words if w in ZONE_WORDS}
    refs |= {w for w in words if w in ("dropped", "foreign_marks")}      # the table's own counters
    jump = re.search(r"\b(jump|goto) (\w+)", text)
    verdict = next((w for w in ("accept", "drop", "masquerade") if re.search(rf"\b{w}\b", text)), None)
    return _rule_shape(refs, jump and f"{jump[1]} {jump[2]}", verdict)


def _drawing():
    """design.md's "The nft table" drawing -> {"sets": {name: (type, flags)},
    "counters": {names}, "chains": {name: (hook tuple or None, [rule shapes])}}."""
    with open(DESIGN) as f:
        doc = f.read()
    section = doc[doc.index("### The nft table"):doc.index("### Where a job's bytes are counted")]
    lines = section[section.index("    table inet starter {"):section.index("\n    }\n")].splitlines()[1:]
    sets, counters, chains, chain = {}, set(), {}, None
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        body = line.strip()
        if not body:
            continue
        kw = body.split()[0]
        if kw in ("set", "map") and line.startswith("      " + kw):
            while "{" not in body:          # the names go on over the next line
                body += " " + lines[i].strip()
                i += 1
            names, _, rest = body[len(kw):].partition("{")
            inner = rest.split("}")[0].strip()
            if kw == "map":
                key, _, data = inner.partition(":")
                shape = (key.strip(), data.strip(), ())
            else:
                typ, *flags = [p.strip() for p in inner.split(",")]
                shape = (typ, None, tuple(sorted(flags)))
            for n in names.split(","):
                sets[n.strip()] = shape
        elif kw == "counter" and line.startswith("      counter"):
            counters.add(body.split()[1])
        elif kw == "chain":
            m = re.match(r"chain (\w+)\s*(?:\((\w+), (\w+), (-?\d+))?", body)
            chain = m[1]
            chains[chain] = ((m[2], m[3], int(m[4])) if m[2] else None, [])
        elif chain and line.startswith("        "):
            while body.endswith(","):       # a rule that goes on over the next line
                body += " " + lines[i].strip()
                i += 1
            chains[chain][1].append(_drawn_rule(body))
    return {"sets": sets, "counters": counters, "chains": chains}


def _live_rule(expr):
    refs, target, verdict = set(), None, None

    def walk(e):
        nonlocal target, verdict
        if isinstance(e, dict):
            for k, v in e.items():
                if k in ("jump", "goto"):
                    target = f"{k} {v['target']}"
                elif k in ("accept", "drop", "masquerade"):
                    verdict = k
                elif k == "counter" and isinstance(v, str):
                    refs.add(v)
                walk(v)
        elif isinstance(e, list):
            for x in e:
                walk(x)
        elif isinstance(e, str) and e.startswith("@"):
            refs.add(e[1:])

    walk(expr)
    return _rule_shape(refs, target, verdict)


def _live_sets(text):
    """`nft list table`'s text -> {name: (key type, data type, flags)} (the
    JSON listing of nft 1.0.6 leaves out a set's dynamic flag)."""
    sets = {}
    for kind, name, body in re.findall(r"\n\t(set|map) (\w+) \{\n(.*?)\n\t\}", text, re.S):
        typ = re.search(r"type ([^\n]+)", body)[1]
        flags = re.search(r"flags ([^\n]+)", body)
        key, _, data = typ.partition(" : ")
        sets[name] = (key, data or None, tuple(sorted(flags[1].split(","))) if flags and kind == "set" else ())
    return sets


def _live(table):
    def nft(*argv):
        return subprocess.run(["nft", *argv, "list", "table", "inet", table], capture_output=True, text=True,
                              check=True).stdout

    items = [next(iter(o.items())) for o in json.loads(nft("-j"))["nftables"]]
    sets, counters, chains = _live_sets(nft()), set(), {}
    for kind, o in items:
        if kind == "counter":
            counters.add(o["name"])
        elif kind == "chain":
            chains[o["name"]] = ((o["type"], o["hook"], o["prio"]) if "hook" in o else None, [])
    for kind, o in items:
        if kind == "rule":
            chains[o["chain"]][1].append(_live_rule(o["expr"]))
    return {"sets": sets, "counters": counters, "chains": chains}


@pytest.mark.net
def test_design_docs_drawing_is_a_live_jobs_table(tmp_path):
    """docs/design.md's drawing of the table against `nft -j list table` of
    a live NAT job: the same sets and maps (type, flags), named counters
    (a job's and an uplink's by their pattern), chains (hook, priority) and,
    chain by chain, the same rules in the same order."""
    drawn = _drawing()
    with nethosts.site() as site:
        cfg = net.NetConfig(state_dir=str(tmp_path / "state"), pool=f"10.{216 + secrets.randbelow(32)}.0.0/16",
                            lan=(site.lan_cidr,), uplink=site.uplink, table="starter_t" + secrets.token_hex(3))
        job = site.job()
        try:
            lease = nethosts.net_setup(job, "drawn", cfg)
            live = _live(cfg.table)
        finally:
            net.teardown("drawn", cfg)
            net.gc(cfg, set())
    assert sorted(live["sets"]) == sorted(drawn["sets"])
    for name, shape in drawn["sets"].items():
        assert live["sets"][name] == shape, name
    per_job = re.compile(rf"{lease.host_ifname}_({'|'.join(nftrules.COUNTERS + nftrules.COUNTERS6)})")
    uplink = re.compile(rf"uplink_{site.uplink}_(in|out)")
    assert {c for c in live["counters"] if not per_job.fullmatch(c) and not uplink.fullmatch(c)} == drawn["counters"]
    assert list(live["chains"]) == list(drawn["chains"])
    for name, (hook, rules) in drawn["chains"].items():
        assert live["chains"][name][0] == hook, name
        assert live["chains"][name][1] == rules, name
