"""What the starter shows, as text: metrics rendering and label escaping,
a job's samples from fixture values, ClassAd values, top's escaping of
control characters, the metrics endpoint's default address, and `starter
metrics` past broken or hostile state entries.  No job runs; metrics of
live jobs, promtool, node_exporter and the event stream are in
tests/test_observability.py."""

import os
import subprocess

import pytest

from conftest import STARTER
from starter.observe import classad as CA
from starter.observe import metrics as M
from starter.observe import top as T

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def test_label_values_are_escaped_per_the_exposition_format():
    assert M.escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    text = M.render({"starter_job_pids": [(M.labels(job_id='x"y', user="a\\b\nc"), 3)]})
    assert text.splitlines() == [
        "# HELP starter_job_pids " + M.FAMILIES["starter_job_pids"][1],
        "# TYPE starter_job_pids gauge",
        'starter_job_pids{job_id="x\\"y",user="a\\\\b\\nc"} 3',
    ]


def test_job_samples_from_fixture_values():
    entry = {"id": "j1", "user": None, "uid": 65534, "state": "suspended", "started_at": 1700000000.5}
    usage = {"cpu_user_s": 1.5, "cpu_system_s": 0.25, "memory_current_bytes": 4096, "memory_peak_bytes": 8192,
             "pids_current": 2, "pids_peak": 5, "io_read_bytes": 10, "io_write_bytes": 20, "oom_kills": 0,
             "psi": {"memory": {"some": 2_000_000, "full": 1_000_000}}}
    net = {"lan_in": {"bytes": 100, "packets": 2}, "lan_out": {"bytes": 1, "packets": 1},
           "wan_in": {"bytes": 0, "packets": 0}, "wan_out": {"bytes": 7, "packets": 1},
           "dropped": {"bytes": 60, "packets": 1}}
    out, state = M.job_samples(entry, True, usage, net)
    assert state == "suspended"
    flat = {(name, lab): v for name, rows in out.items() for lab, v in rows}
    key = lambda name, **kw: (name, M.labels(job_id="j1", user=65534, **kw))  # noqa: E731
    assert flat[key("starter_job_state", state="suspended")] == 1
    assert flat[key("starter_job_state", state="running")] == 0
    assert flat[key("starter_job_cpu_seconds_total", mode="user")] == 1.5
    assert flat[key("starter_job_pressure_stall_seconds_total", resource="memory", kind="full")] == 1.0
    assert flat[key("starter_job_network_bytes_total", zone="lan", direction="in")] == 100
    assert flat[key("starter_job_network_dropped_packets_total")] == 1
    # dead: the lock is free, whatever the entry says
    assert M.job_samples(entry, False, None, None)[1] == "dead"


def test_classad_strings_and_values():
    assert CA.value("plain") == '"plain"'
    assert CA.value('say "hi"') == '"say \\"hi\\""'
    assert CA.value("two\nlines\ttab") == '"two lines tab"'
    assert CA.value("back\\slash") == '"back\\slash"'
    assert CA.value(True) == "true" and CA.value(None) == "undefined"
    assert CA.value([1, 2]) == "{ 1, 2 }"
    assert CA.value(1.5) == "1.5"


def test_metrics_serves_the_other_jobs_past_a_broken_or_hostile_entry(tmp_path):
    # Entries not as the starter writes them (found by fuzzing): a value that
    # is not a number, a FIFO and a link to /dev/zero in its place.  Each is
    # a read error; nothing hangs, no internal error.
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    for job_id in ("bad", "fifo", "zero", "list"):
        (d / f"{job_id}.lock").write_text("")
    (d / "bad.json").write_text('{"id": "bad", "started_at": ""}')
    os.mkfifo(d / "fifo.json")
    os.symlink("/dev/zero", d / "zero.json")
    (d / "list.json").write_text("[1]")
    p = subprocess.run([STARTER, "metrics", "--state-dir", str(d)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "starter_metrics_read_errors 1" in p.stdout, p.stdout
    for cmd in (["ps"], ["gc"]):
        q = subprocess.run([STARTER, *cmd, "--state-dir", str(d)], capture_output=True, text=True, timeout=30)
        assert "Traceback" not in q.stderr and "internal error" not in q.stderr, (cmd, q.stderr)


def test_top_replaces_control_characters():
    assert T.printable("a\x1b]0;owned\x07b\x9bc") == "a?]0;owned?b?c"
    # a right-to-left override and an isolate reorder what follows on the line
    assert T.printable("ok\u202egnp.exe\u2066x\u200by\u2028z é") == "ok?gnp.exe?x?y?z é"


def test_listen_address_defaults_to_loopback():
    assert M.parse_listen("9110") == ("127.0.0.1", 9110, True)
    assert M.parse_listen("[::1]:9110") == ("::1", 9110, True)
    assert M.parse_listen("10.0.0.1:80")[2] is False
    for bad in ("localhost:80", "１２", "1_000", " 80", "-0"):
        with pytest.raises(M.StarterError):
            M.parse_listen(bad)
