"""The manifest's lines (starter/storage/manifest.py) as text: what
sha256sum writes is accepted, and each malformed line is refused with its
line number.  Staging verified inputs is in tests/test_manifest.py."""

import pytest

from starter.errors import StagingError
from starter.storage import manifest

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

H = "a" * 64


@pytest.mark.parametrize(
    "line, match",
    [
        ("nothex  x", "line 2: expected"),
        (f"{H} x", "line 2: expected"),  # no name after the mode char
        (f"{H}\tname", "line 2: expected"),
        (f"{H} ?name", "line 2: expected"),
        (f"{H[:-1]}  name", "line 2: expected"),
        (f"{H}  ../etc/passwd", "line 2: '../etc/passwd' is not a plain file name"),
        (f"{H}  /etc/passwd", "not a plain file name"),
        (f"{H}  a/b", "not a plain file name"),
        (f"{H}  ..", "not a plain file name"),
        (f"{H}  -rf", "not a plain file name"),
        (f"{H}  a\0b", "not a plain file name"),
        (f"\\{H}  a\\nb", "line 2: escaped file names"),
        (f"{H}  ok", "line 3: ok is listed twice"),
    ],
)
def test_malformed_lines(line, match):
    text = f"{'b' * 64}  first\n{line}\n"
    if "twice" in match:
        text = f"{'b' * 64}  first\n{H}  ok\n{line}\n"
    with pytest.raises(StagingError, match=match.replace("\\", "\\\\").replace("?", "\\?").replace(".", "\\.")):
        manifest.parse(text.encode())


def test_parse_accepts_sha256sum_output():
    text = f"{H}  plain\n{H.upper()} *bin\r\n{H} xexe\n\n# comment\n{H}  with space\n"
    assert manifest.parse(text.encode()) == [
        ("plain", H, False),
        ("bin", H, False),
        ("exe", H, True),
        ("with space", H, False),
    ]
    with pytest.raises(StagingError, match="UTF-8"):
        manifest.parse(b"\xff\xfe")
