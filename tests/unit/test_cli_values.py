"""The command line's pure parts: one validator per value class
(starter/spec/values.py), the job id rule that other modules share,
relative paths in a spec resolved against the caller's directory, and a
subcommand's OSError as one line on stderr.  Nothing is started; the real
CLI, its errors and its fuzz are in tests/test_cli.py."""

import pytest

from starter.cli import main as cli
from starter.errors import SpecError
from starter.spec import values

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


# ------------------------------------------------------------ value classes

# Networks and addresses are parsed with inet_pton (not `ipaddress`, +4 ms per
# NAT start); `ipaddress` stays the oracle for the forms both accept.
@pytest.mark.parametrize("text", [
    "10.0.0.0/8", "10.0.0.0/08", "10.0.0.0/255.0.0.0", "0.0.0.0/0", "1.2.3.4", "192.168.7.0/24",
    "fd00::/64", "FD00:0:0::/64", "::/0", "::1", "2001:db8:0:0:1:0:0:1/128", "1:0:2:3:4:5:6:7/128",
    "fd70:7639:1864::/64"])
def test_cidr_matches_ipaddress(text):
    import ipaddress

    assert values.cidr("lan", text) == str(ipaddress.ip_network(text, strict=True))


@pytest.mark.parametrize("text, why", [
    ("10.0.0.1/8", "host bits set"), ("fd00::1/64", "host bits set"), ("10.0.0.0/33", "at most 32"),
    ("fd00::/129", "at most 128"), ("10.0.0.0/255.0.255.0", "not a valid netmask"),
    ("010.0.0.0/8", "does not appear"), ("10.0.0.0/", "prefix length"), ("/8", "does not appear"),
    ("10.0.0.0/+8", "prefix length"), ("10.0.0.0 /8", "does not appear"), ("256.0.0.0/8", "does not appear"),
    ("fe80::%eth0/64", "does not appear"), ("1.2.3", "does not appear"), ("10.0.0.0/1234", "prefix length"),
    ("١.2.3.4/8", "ASCII"), ("10.0.0.0/" + "9" * 100, "ASCII")])
def test_cidr_refused(text, why):
    with pytest.raises(SpecError, match=why):
        values.cidr("lan", text)


@pytest.mark.parametrize("text, canon", [("1.2.3.4", "1.2.3.4"), ("FE80::1", "fe80::1"), ("::1", "::1")])
def test_ip_address_canonical(text, canon):
    assert values.ip_address("resolver", text) == canon
    for bad in ("01.2.3.4", "1.2.3.4/32", " 1.2.3.4", "fe80::1%eth0", "x"):
        with pytest.raises(SpecError):
            values.ip_address("resolver", bad)


@pytest.mark.parametrize("good", ["a", "job-1", "cluster42.proc7", "A_b.c-d", "x" * 64])
def test_job_id_accepted(good):
    assert values.job_id("id", good) == good


@pytest.mark.parametrize("bad", ["", ".", "..", "a..b", "-x", ".x", "a/b", "../x", "$(id)", "a b",
                                 "x" * 65, "é", "a\nb", "a\0b", None, 5, ["a"]])
def test_job_id_refused(bad):
    with pytest.raises(SpecError):
        values.job_id("id", bad)


def test_the_other_modules_use_the_same_job_id_rule():
    from starter.storage import scratch
    from starter.cgroups import check_job_id
    from starter.net import netd

    for bad in ("../x", "a/b", "$(id)", "x" * 65, "-x", "a..b"):
        for check in (check_job_id, lambda j: scratch.create_in("/nonexistent-x", j, 0, 0),
                      netd._check_job_id):
            with pytest.raises(SpecError):
                check(bad)
    assert check_job_id("x" * 64) == "x" * 64


@pytest.mark.parametrize("bad", ["²", "١", "١٢", "+1", " 1", "1_0", "0x10", "4294967295", "-1", ""])
def test_numeric_ids_are_ascii_digits(bad):
    assert not values.is_numeric_id(bad) or int(bad) > values.MAX_NUMERIC_ID
    with pytest.raises(SpecError):
        values.numeric_id("user", bad)


def test_numeric_id_range():
    assert values.numeric_id("user", "0") == 0
    assert values.numeric_id("user", "4294967294") == 4294967294


@pytest.mark.parametrize("text,want", [("512M", 512 << 20), ("2G", 2 << 30), ("1.5g", 3 << 29),
                                       ("64MiB", 64 << 20), ("1048576", 1 << 20), (4096, 4096),
                                       ("1P", None), ("1e3", 1000)])
def test_size(text, want):
    if want is None:
        with pytest.raises(SpecError):
            values.size("memory", text)
    else:
        assert values.size("memory", text) == want


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "1e400", "Infinity", "0", "-1", "", "M", "１G",
                                 "²", "1 G G", True, float("inf"), float("nan"), 10**400, [1]])
def test_size_refused(bad):
    with pytest.raises(SpecError):
        values.size("memory", bad)


@pytest.mark.parametrize("bad", ["inf", "nan", "1e400", "١", "1_0", "0x10", float("nan"), float("inf"),
                                 True, None, [], "", 10**400])
def test_number_refused(bad):
    with pytest.raises(SpecError):
        values.number("cpus", bad, 0.01, 4096)


def test_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert values.host_path("report", "r.json") == str(tmp_path / "r.json")
    assert values.host_path("report", "./sub/r.json") == str(tmp_path / "sub/r.json")
    assert values.host_path("report", "/abs") == "/abs"
    for bad in ("../r.json", "a/../../b", "a\0b", "/x/../y"):
        with pytest.raises(SpecError):
            values.host_path("report", bad)
    with pytest.raises(SpecError):
        values.path("cwd", "relative")


# ------------------------------------------------------------ never a traceback

def test_oserror_in_a_subcommand_is_one_line(monkeypatch, capsys):
    from starter.admin import jobs as admin

    def broken(*a, **kw):
        raise OSError(28, "No space left on device", "/run/starter/x.json")

    monkeypatch.setattr(admin, "ps", broken)
    assert cli.main(["ps"]) == 125
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ENOSPC" in err and "/run/starter/x.json" in err, err


# ------------------------------------------------------------ relative paths

def test_relative_paths_resolve_against_the_callers_cwd(tmp_path, monkeypatch):
    from starter.spec import jobspec as spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "in").mkdir()
    (tmp_path / "sig.sha256").write_text("")
    js = spec.build({"command": ["true"], "user": "nobody", "report": "r.json", "events": "ev/e.jsonl",
                     "manifest": "sig.sha256", "manifest-digest": "0" * 64, "inputs": "in",
                     "scratch": "s", "state-dir": "st", "mounts": [("ro-bind", "data:/srv/data"),
                                                                   ("bind", "data")],
                     "cwd": "/srv"})
    t = str(tmp_path)
    assert (js.report, js.events, js.manifest, js.inputs, js.scratch, js.state_dir) == (
        t + "/r.json", t + "/ev/e.jsonl", t + "/sig.sha256", t + "/in", t + "/s", t + "/st")
    assert [(m.src, m.dst) for m in js.mounts] == [(t + "/data", "/srv/data"), (t + "/data", t + "/data")]
    assert js.cwd == "/srv"
    assert spec.build({"command": ["true"], "user": "nobody", "events": "fd:3"}).events == "fd:3"
    with pytest.raises(SpecError):
        spec.build({"command": ["true"], "user": "nobody", "cwd": "relative"})   # the job's view
