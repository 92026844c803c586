"""The state entries' JSON codec (starter/state/store.py, loads and dumps),
which the start path uses instead of the json module: what it reads, what
it refuses, and that what it writes json reads back the same.  The state
directory's protocol is in tests/test_state.py."""

import pytest

from starter.state import store as S

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def test_loads_without_the_json_module():
    assert S.loads(' {"a": [1, 2.5, null, true, "\\u00e9"]} \n') == {"a": [1, 2.5, None, True, "é"]}
    for bad in ("", "{", "NaN", '{"a": 1} x'):
        with pytest.raises(ValueError):
            S.loads(bad)


def test_dumps_writes_strings_json_reads_back():
    import json
    import random

    rnd = random.Random(13)
    pool = [chr(i) for i in range(0x300)] + ["\ud800", "\udcff", "\uffff", "\U0001f600", "\U0010ffff"]
    for _ in range(5000):
        s = "".join(rnd.choice(pool) for _ in range(rnd.randint(0, 10)))
        text = S.dumps({s: [s]})
        assert text.isascii() and json.loads(text) == {s: [s]} == S.loads(text), (s, text)
        if s.isascii() and s.isprintable():
            assert S.dumps(s) == json.dumps(s)
    assert S.dumps(["a\n", "é", '"\\', 1, None, True, 1.5]) == \
        '["a\\u000a", "\\u00e9", "\\"\\\\", 1, null, true, 1.5]'
