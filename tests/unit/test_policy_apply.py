"""The node policy on text (starter/callers/policy.py, gate.py): the example
in docs/reference.md parses, defaults fill only what a job leaves out, and a
caller's caps, net-rate maxima and mounts are applied or refused.  Nothing is
started; the policy as callers meet it through `starter run` is in
tests/test_callers.py."""

import os

import pytest

from conftest import GID, REPO, UID
from starter.callers import gate

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def _policy(text):
    from starter.callers import policy as P

    return P.parse(text.encode(), "/etc/starter/starter.toml")


def test_reference_example_policy_parses():
    """The example in docs/reference.md is a policy this starter accepts."""
    text = open(os.path.join(REPO, "docs", "reference.md")).read()
    start = text.index("    # /etc/starter/starter.toml\n")
    block = []
    for line in text[start:].splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    pol = _policy("\n".join(block))
    assert pol.callers["net"] == ("none", "nat") and pol.callers["max_jobs"] == 32
    assert pol.defaults["execute-dir"] == "/var/lib/starter/execute"


def test_defaults_fill_only_what_is_not_given():
    pol = _policy('[defaults]\nmemory = "1G"\nuplink = ["eth9"]\nrlimits = { nofile = "100:200", core = 0 }\n'
                  'execute_dir = "/srv/x"\n')
    raw = pol.apply({"memory": "2G", "rlimit": ["nofile=10"]})
    assert raw["memory"] == "2G" and "uplink" not in raw          # not a NAT job
    assert raw["rlimit"] == ["core=0", "nofile=10"] and raw["execute-dir"] == "/srv/x"
    raw = pol.apply({"net": "nat", "scratch": "/tmp/s"})
    assert raw["uplink"] == ["eth9"] and "execute-dir" not in raw and raw["memory"] == "1G"


def test_caller_limits_capped_and_refused():
    from starter.callers.caller import Caller
    from starter.callers.policy import PolicyError

    pol = _policy('[callers]\nmax_memory = "1G"\nmax_cpus = 2\n')
    me = Caller(UID, GID, ())
    raw = gate.apply(pol, {}, me)
    assert raw["memory"] == "1G" and raw["cpus"] == 2
    assert gate.apply(pol, {"memory": "512M"}, me)["memory"] == "512M"
    with pytest.raises(PolicyError, match="callers.max_cpus"):
        gate.apply(pol, {"cpus": "2.5"}, me)
    with pytest.raises(PolicyError, match="line 2, key callers.max_memory"):
        gate.apply(pol, {"memory": "2G"}, me)


def test_net_rate_defaults_and_caller_maxima_per_zone():
    from starter.callers.caller import Caller
    from starter.callers.policy import PolicyError
    from starter.spec.options import parse_net_rate

    pol = _policy('[defaults]\nnet_rate = "wan=1gbit"\n[callers]\nnet = ["none", "nat"]\nmax_net_rate = "out=100mbit"\n')
    zones = lambda raw: dict(parse_net_rate("net-rate", raw["net-rate"]))   # noqa: E731
    assert "net-rate" not in pol.apply({})                                  # not a NAT job
    # root: the default fills the zones the job leaves out, no maximum
    assert zones(pol.apply({"net": "nat", "net-rate": "wan-in=2gbit,lan=10gbit"})) == {
        "wan_in": 2 * 10**9, "wan_out": 10**9, "lan_in": 10**10, "lan_out": 10**10}
    me = Caller(UID, GID, ())
    # a caller: at most the maximum where it is set, which it gets when it asks for nothing
    assert zones(gate.apply(pol, {"net": "nat", "net-rate": "lan-out=50mbit"}, me)) == {
        "wan_in": 10**9, "wan_out": 10**8, "lan_out": 5 * 10**7}
    with pytest.raises(PolicyError, match="lan-out 1gbit is above the maximum 100mbit .* line 5, key callers.max_net_rate"):
        gate.apply(pol, {"net": "nat", "net-rate": "lan=1gbit"}, me)
    with pytest.raises(PolicyError, match="line 2.*net_rate"):
        _policy('[defaults]\nnet_rate = "fast"\n')


@pytest.mark.parametrize("mount, ok", [
    (("ro-bind", "/cvmfs/sw"), True),
    (("ro-bind", "/cvmfs/sw:/tmp/sw"), True),
    (("ro-bind", "/cvmfs/sw:/usr/bin"), False),          # would cover /usr/bin for an admin's enter
    (("bind", "/cvmfs/sw"), False),                      # read-only only
    (("bind", "/scratch/u"), True),
    (("ro-bind", "/cvmfs-evil/x"), False),               # a prefix of the name is not a parent
    (("tmpfs", "/tmp/t"), True),
    (("tmpfs", "/usr"), False),
])
def test_caller_mounts(mount, ok):
    from starter.callers.caller import Caller
    from starter.errors import StarterError

    pol = _policy('[callers]\nro_bind = ["/cvmfs"]\nbind = ["/scratch"]\nmount_destinations = ["/tmp"]\n')
    try:
        gate.apply(pol, {"mounts": [mount]}, Caller(UID, GID, ()))
        assert ok
    except StarterError:
        assert not ok


def test_job_network_defaults_apply_to_net_job_only():
    """[defaults] net_transport and net_key (a site whose fabric is not
    trusted): given to every --net job job, none to any other."""
    pol = _policy('[defaults]\nnet_transport = "wireguard"\nnet_key = "/etc/site/net.key"\n')
    assert pol.apply({"net": "job"})["net-transport"] == "wireguard"
    assert pol.apply({"net": "job"})["net-key"] == "/etc/site/net.key"
    assert "net-transport" not in pol.apply({"net": "nat"}) and "net-key" not in pol.apply({})
    from starter.callers.policy import PolicyError

    for bad, what in (('net_transport = "gre"', "is not one of vxlan, wireguard"),
                      ('net_key = "rel/key"', "must be an absolute path")):
        with pytest.raises(PolicyError, match=what):
            _policy(f"[defaults]\n{bad}\n")
