"""Slurm's text, parsed (pure: tests/unit/test_slurm_records.py tests it):
scontrol's one-line records and ExitCode values, which tests/slurm.py reads."""

import re


def parse_scontrol_record(text):
    """`scontrol show -o ...` one-line record -> dict of Key=Value.

    Values may contain spaces (JobName=, Command=, Reason=): a value runs up to the
    next ' Key=' (Key an identifier), so it stays whole unless it itself contains
    ' word=' -- unavoidable in this format, and never the case for JobState/ExitCode.
    """
    fields = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/]*=|\s*$)",
                         text.strip()):
        fields[m.group(1)] = m.group(2)
    return fields


def parse_exit_code(value):
    """Slurm's 'ExitCode=7:0' -> (7, 0): exit status and terminating signal."""
    code, _, sig = value.partition(":")
    return int(code), int(sig or 0)
