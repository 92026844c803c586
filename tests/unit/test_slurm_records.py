"""Slurm's text, parsed (tests/slurmparse.py): a one-line `scontrol show`
record whose values hold spaces, and ExitCode values.  No Slurm runs; the
starter under a real Slurm is in tests/test_slurm.py."""

import pytest

from slurmparse import parse_exit_code, parse_scontrol_record

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

SCONTROL_JOB = (
    "JobId=1 JobName=exit seven UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "JobState=FAILED Reason=NonZeroExitCode Dependency=(null) ExitCode=7:0 "
    "RunTime=00:00:00 AllocNode:Sid=localhost:6689 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,node=1,billing=1 CPUs/Task=1 Command=/tmp/a dir/job.sh Power= \n")


def test_parse_scontrol_record():
    rec = parse_scontrol_record(SCONTROL_JOB)
    assert rec["JobState"] == "FAILED"
    assert rec["ExitCode"] == "7:0"
    assert rec["JobName"] == "exit seven"
    assert rec["AllocNode:Sid"] == "localhost:6689"
    assert rec["TRES"] == "cpu=1,node=1,billing=1"
    assert rec["CPUs/Task"] == "1"
    assert rec["Command"] == "/tmp/a dir/job.sh"
    assert rec["Power"] == ""


def test_parse_exit_code():
    assert parse_exit_code("7:0") == (7, 0)
    assert parse_exit_code("0:15") == (0, 15)
    assert parse_exit_code("3") == (3, 0)
