"""The report's fields: the typed Report (starter/observe/report.py) and the
reference's table of them (docs/reference.md, "The report") name the same
ones, and a name that is not a field is refused at once."""

import os
import re

import pytest

from starter.observe.report import Report

pytestmark = pytest.mark.fast

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "reference.md")


def _documented():
    with open(REFERENCE) as f:
        text = f.read()
    section = text.split("\n## The report\n", 1)[1]
    table = section.split("| field | meaning |", 1)[1].split("\n\n", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        names.update(re.findall(r"`([a-z_]+)`", row.split("|")[1]))
    return names


def test_the_reference_lists_every_field_and_no_other():
    assert _documented() == set(Report.FIELDS)


def test_only_fields_are_set_and_they_keep_their_order():
    r = Report(reason="exited", job_id="j", signal=None)
    r.set(exit_code=3)
    assert r.as_dict() == {"job_id": "j", "reason": "exited", "exit_code": 3, "signal": None}
    assert list(r.as_dict()) == ["job_id", "reason", "exit_code", "signal"]
    assert "signal" in r and "error" not in r and r.get("error", 5) == 5
    with pytest.raises(AttributeError):
        r.set(memroy_peak_bytes=1)
