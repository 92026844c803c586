"""How the supervisor classifies a job's end (starter/job/supervisor.py,
classify): an OOM kill, a helper as the OOM victim, a plain signal, a
timeout and unkillable processes, under each OOM policy.  On stand-in
outcomes; the OOM policy through `starter run` is in tests/test_oom.py."""

import pytest

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


class _Out:
    def __init__(self, status=0, reason=None, unkillable=()):
        self.status, self.reason, self.unkillable, self.job_status = status, reason, list(unkillable), None


def test_classify():
    from starter.job.supervisor import classify

    killed = 9  # raw wait status of a SIGKILLed process
    assert classify(_Out(killed), 1) == ("oom", 137, 9)
    assert classify(_Out(killed), 1, "continue") == ("oom", 137, 9)
    assert classify(_Out(0), 1) == ("oom", 0, None)          # a helper was the victim
    assert classify(_Out(0), 1, "continue") == ("exited", 0, None)
    assert classify(_Out(killed), 0) == ("signaled", 137, 9)
    assert classify(_Out(killed, "timeout"), 1) == ("timeout", 137, 9)
    assert classify(_Out(None, "timeout", [{"pid": 5}]), 0) == ("unkillable", 125, None)
