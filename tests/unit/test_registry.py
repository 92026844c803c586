"""The option registry (starter/spec/registry.py) against what reads it: the
policy checks a caller's cap as its option and a flag as a switch, the
reference's table of where each option is set is the registry's, and every
[callers] key has its rule in the caller gate, whose functions exist.  The
same bad value through the CLI, the job file and the policy is in
tests/test_options.py."""

import os
import re

import pytest

from conftest import REPO
from starter.callers import policy as P
from starter.spec import registry as R

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)


def test_the_policy_checks_a_cap_as_its_option_and_a_flag_as_a_switch():
    for o in R.OPTIONS:
        if not o.caller:
            continue
        kind, _ = P.CALLER_KEYS[o.caller]
        assert kind == ("bool" if o.kind == "flag" else o.default[1]), (o.name, o.caller, kind)


def test_the_references_table_of_where_options_are_set_is_the_registrys():
    with open(os.path.join(REPO, "docs", "reference.md")) as f:
        reference = f.read()
    assert R.markdown_table() in reference, "docs/reference.md: rerun `python -m starter.spec.registry`"


def test_every_callers_key_has_a_rule_in_the_gate_and_every_rule_names_code_that_is_there():
    """The caller gate (starter/callers/gate.py) is the one list a reviewer
    reads: each [callers] key of the policy has its rule there, no rule
    names a key the policy lacks, and every function a rule names (Python,
    or the launcher's C) exists."""
    import importlib

    from starter.callers import gate

    keys = {key for _what, key, _where in gate.RULES if key}
    assert keys == set(P.CALLER_KEYS), (sorted(set(P.CALLER_KEYS) - keys), sorted(keys - set(P.CALLER_KEYS)))
    for what, _key, where in gate.RULES:
        module, _, name = where.partition(":")
        if module.startswith("native/"):
            with open(os.path.join(REPO, module)) as f:
                assert re.search(r"^\w[\w *]*\b%s\(" % re.escape(name), f.read(), re.M), (what, where)
            continue
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)            # AttributeError names what is gone
