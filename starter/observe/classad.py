"""The final report as HTCondor job ClassAd attributes (`--report-format
classad`): one `Name = value` line per attribute, the "long" form that
`condor_q -l` prints and `condor_chirp set_job_attr` takes.

HTCondor's own attribute names and units where it has one (job ClassAd
attributes in the HTCondor manual), ours for the rest: the table is
MAPPING below and, for people, docs/reference.md "The report as a ClassAd".  A report
field this table does not know (a newer starter's) is still written, as
Starter<CamelCase> (nested objects flattened), so nothing is lost silently.

Strings are written in that old syntax: a double quote is escaped as \\",
a backslash is literal.  The old syntax cannot say a line break or a
backslash right before a quote; those (only ever in the `error` text) become
a space and a slash.
"""

import math

MIB, KIB = 1 << 20, 1 << 10


def _ceil_div(n, d):
    return None if n is None else -(-int(n) // d)


def _floor_div(n, d):
    return None if n is None else int(n) // d


def _int(v):
    return None if v is None else int(math.floor(v))


# report field -> [(attribute, conversion)], in output order.  Conversions
# are exactly what docs/reference.md documents (the tests check the values against the
# JSON report with the same rules).
MAPPING = {
    "job_id": [("StarterJobId", None)],
    "reason": [("StarterReason", None), ("StarterOomKilled", lambda r: r == "oom")],
    "exit_code": [("StarterExitCode", None)],
    "error": [("StarterError", None)],
    "started_at": [("JobCurrentStartDate", _int), ("StarterStartedAt", None)],
    "ended_at": [("CompletionDate", _int), ("StarterEndedAt", None)],
    "wall_s": [("RemoteWallClockTime", None)],
    "cpu_user_s": [("RemoteUserCpu", None)],
    "cpu_system_s": [("RemoteSysCpu", None)],
    "memory_peak_bytes": [("MemoryUsage", lambda v: _ceil_div(v, MIB)),
                          ("ResidentSetSize", lambda v: _ceil_div(v, KIB)),
                          ("StarterMemoryPeakBytes", None)],
    "memory_current_bytes": [("StarterMemoryCurrentBytes", None)],
    "pids_peak": [("StarterPidsPeak", None)],
    "pids_current": [("StarterPidsCurrent", None)],
    "io_read_bytes": [("BlockReadKbytes", lambda v: _floor_div(v, KIB)), ("StarterIoReadBytes", None)],
    "io_write_bytes": [("BlockWriteKbytes", lambda v: _floor_div(v, KIB)), ("StarterIoWriteBytes", None)],
    "oom_kills": [("StarterOomKills", None)],
    "cgroup": [("StarterCgroup", None)],
    "teardown_error": [("StarterTeardownError", None)],
    "scratch_bytes": [("DiskUsage", lambda v: _ceil_div(v, KIB)), ("StarterScratchBytes", None)],
}
NETWORK = {"lan_in": "NetworkLanInput", "lan_out": "NetworkLanOutput",
           "wan_in": "NetworkWanInput", "wan_out": "NetworkWanOutput", "dropped": "NetworkDropped"}


# --delegate: the per-sub-cgroup figures as parallel lists (a ClassAd has no
# list of records that HTCondor's tools show well).
PAYLOAD_LISTS = {"name": "StarterPayloadNames", "cpu_s": "StarterPayloadCpuSeconds",
                 "memory_peak_bytes": "StarterPayloadMemoryPeakBytes",
                 "oom_kill": "StarterPayloadOomKills", "oom_group_kill": "StarterPayloadOomGroupKills"}


def quote(s):
    s = "".join(" " if (ord(c) < 0x20 or ord(c) == 0x7F) else c for c in str(s))
    s = s.replace("\\\"", "/\"")
    if s.endswith("\\"):
        s = s[:-1] + "/"
    return '"' + s.replace('"', '\\"') + '"'


def value(v):
    """A Python value as a ClassAd literal."""
    if v is None:
        return "undefined"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return "undefined"
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "{ " + ", ".join(value(x) for x in v) + " }" if v else "{ }"
    return quote(v)


def camel(key):
    return "".join(p[:1].upper() + p[1:] for p in str(key).replace("-", "_").split("_") if p)


def attributes(report):
    """The report -> [(name, python value)] in output order (pure)."""
    out = []
    sig = report.get("signal")
    if report.get("exit_code") is not None:
        out.append(("ExitBySignal", sig is not None))
        out.append(("ExitSignal", sig) if sig is not None else ("ExitCode", report["exit_code"]))
    for field, attrs in MAPPING.items():
        if field not in report or report[field] is None:
            continue
        for name, conv in attrs:
            v = conv(report[field]) if conv else report[field]
            if v is not None:
                out.append((name, v))
    net = report.get("network")
    if isinstance(net, dict):
        # the combined figures, then the IPv6 share (NetworkIpv6LanInputBytes ...)
        # when the job had IPv6; IPv4's is the difference
        for sub, infix in ((net, ""), (net.get("ipv6"), "Ipv6")):
            if not isinstance(sub, dict):
                continue
            for key, prefix in NETWORK.items():
                c = sub.get(key)
                if isinstance(c, dict):
                    for unit in ("bytes", "packets"):
                        if c.get(unit) is not None:
                            out.append(("Network" + infix + prefix[len("Network"):] + camel(unit), c[unit]))
    survivors = report.get("unkillable")
    if isinstance(survivors, list):       # [{pid, state, wchan}]: the pids, and where they hang
        out.append(("StarterUnkillable", [s.get("pid") if isinstance(s, dict) else s for s in survivors]))
        out.append(("StarterUnkillableWchan", [str(s.get("wchan")) if isinstance(s, dict) else "" for s in survivors]))
    payloads = report.get("payloads")
    if isinstance(payloads, list):        # --delegate: one list per figure, in the same order
        for key, name in PAYLOAD_LISTS.items():
            out.append((name, [p.get(key) if isinstance(p, dict) else None for p in payloads]))
    known = set(MAPPING) | {"signal", "network", "unkillable", "payloads"}
    for field in report:
        if field not in known:
            _flatten(out, "Starter" + camel(field), report[field])
    return out


def _flatten(out, name, v):
    if isinstance(v, dict):
        for k, x in v.items():
            _flatten(out, name + camel(k), x)
    elif v is not None:
        out.append((name, v))


def render(report):
    return "".join(f"{name} = {value(v)}\n" for name, v in attributes(report))
