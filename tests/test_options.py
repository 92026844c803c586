"""The option registry (starter/spec/registry.py): one table that the command
line, the job file and the node policy read.  A bad value gets the same
message from all three (only where it was given differs).  The registry
against the policy, the reference's table and the caller gate, on their
own: tests/unit/test_registry.py.
"""

import json
import re

import pytest

from starter.spec import registry as R

# One value per policy check that each of the three refuses.
BAD = {
    "size": "12Q", "cpus": "lots", "weight": "0", "count": "-1", "duration": "soon", "inodes": "1",
    "cidr": "10.0.0.0/33", "cidrs": ["10.0.0.0/33"], "ifnames": ["../x"], "ip": "1.2.3.999",
    "ports": ["tcp:99999"], "ipv6": "maybe", "dir": "/a/../b", "profile": "../x", "user": "$(id)",
    "rlimits": {"nofile": "lots"}, "netrate": "fast", "transport": "ipsec", "file": "/a/../b",
}
# What a --net job option needs beside it to be looked at (a job network).
JOB = {"cli": ["--net", "job", "--net-id", "5", "--peers", "n1=10.0.0.1", "--node", "n1"],
       "file": {"mode": "job", "net_id": "5", "peers": "n1=10.0.0.1", "node": "n1"}}
# [defaults] gpus takes only "slurm" (each job gets its step's GPUs): a
# different question from --gpus LIST, so a different answer.
NOT_THE_SAME = {"gpus"}


def _with_default():
    return [o for o in R.OPTIONS if o.default and o.name not in NOT_THE_SAME]


def _toml(v):
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def _message(stderr, where):
    """The one line, less the part that says where the value came from."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    m = re.match(r"starter: (?:node policy \S+ line \d+, key )?" + re.escape(where) + r": (.*)$", lines[0])
    assert m, (where, lines[0])
    return m.group(1)


@pytest.mark.parametrize("opt", _with_default(), ids=lambda o: o.name)
def test_a_bad_value_gets_the_same_message_from_the_cli_the_job_file_and_the_policy(opt, starter, tmp_path):
    key, check = opt.default
    bad = BAD[check]
    nat = opt.who == "nat" or opt.name == "net-rate"
    job = opt.who == "job"
    wg = ["--net-transport", "wireguard"] if opt.name == "net-key" else []
    if check == "rlimits":
        argv = ["--rlimit", "nofile=lots"]
    else:
        argv = [a for v in (bad if isinstance(bad, list) else [bad]) for a in ("--" + opt.name, v)]
    cli = starter("run", *(["--net", "nat"] if nat else []), *(JOB["cli"] + wg if job else []), *argv, "--", "true",
                  cwd=tmp_path)

    doc = {"network": {"mode": "nat"}} if nat else {"network": dict(JOB["file"], **(
        {"transport": "wireguard"} if wg else {}))} if job else {}
    section, _, name = opt.file.rpartition(".")
    (doc.setdefault(section, {}) if section else doc)[name] = bad
    job = tmp_path / "job.json"
    job.write_text(json.dumps(doc))
    from_file = starter("run", "--job", str(job), "--", "true", cwd=tmp_path)

    pol = tmp_path / "policy.toml"
    pol.write_text(f"[defaults]\n{key} = {_toml(bad)}\n")
    from_policy = starter("config", "check", str(pol))

    assert (cli.returncode, from_file.returncode, from_policy.returncode) == (125, 125, 125), \
        (cli.stderr, from_file.stderr, from_policy.stderr)
    said = _message(cli.stderr, opt.name)
    assert _message(from_file.stderr, opt.name) == said
    assert _message(from_policy.stderr, "defaults." + key) == said
    if opt.caller and opt.kind != "flag":        # a caller's cap is checked as its option is
        pol.write_text(f"[callers]\n{opt.caller} = {_toml(bad)}\n")
        assert _message(starter("config", "check", str(pol)).stderr, "callers." + opt.caller) == said
