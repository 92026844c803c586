"""The start path's parts that run as any user: the v1 warm-up's target on
fixture layouts, `python -m starter` passing main's exit code, and the
bundle the launcher's interpreter reads the package's modules from (a
changed or damaged module comes from its source; a starter upgraded under
a running one keeps its own version).  The imports of a real `starter run`,
its trace and the launcher are in tests/test_start_path.py."""

import os
import subprocess
import sys

import pytest

from conftest import PYTHON as PY, REPO
from starter import cgroups
from starter.cgroups import hierarchy

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

FIX = os.path.join(REPO, "tests", "fixtures", "cgroup")


def _layout(name):
    with open(os.path.join(FIX, f"mountinfo.{name}")) as m, open(os.path.join(FIX, f"proc_cgroup.{name}")) as c:
        return hierarchy.detect_layout(m.read(), c.read())


def test_warm_up_target_is_a_v1_tasks_file_only_where_jobs_join_v1():
    assert cgroups._warm_target(_layout("v2")) is None
    for name in ("hybrid", "v1"):
        lay = _layout(name)
        target = cgroups._warm_target(lay)
        assert target is not None and target.endswith("/tasks"), target
        role = next(r for r in sorted(hierarchy.V1_RESOURCE_CONTROLLERS) if r in lay.v1 and r in lay.own)
        assert target == hierarchy.join(lay.v1[role].mount_point, lay.own[role], "tasks")


@pytest.mark.parametrize("cmd", [["--version"], ["ps", "--help"]])
def test_entry_exits_with_mains_code_and_flushes(cmd):
    p = subprocess.run([sys.executable, "-m", "starter", *cmd], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip(), p


BUNDLE_PROBE = """
import sys
sys.path[:0] = [{top!r}]
import starter.errors, starter.spec.values
for m in (starter.errors, starter.spec.values):
    print(m.__name__, "bundle" if "_serve_bundle" in repr(m.__loader__) else "pyc", m.__file__)
print(getattr(starter.spec.values, "CHANGED", None))
"""


def _bundle(top):
    """scripts/setup's bundle step, in the tree `top`."""
    subprocess.run([PY, "-I", os.path.join(top, "starter", "bundle.py")], check=True, timeout=60)


def _bundled_copy(tmp_path):
    """A copy of the package's sources under tmp_path, with its bundle -> its top."""
    import shutil

    top = str(tmp_path / "tree")
    shutil.copytree(os.path.join(REPO, "starter"), os.path.join(top, "starter"), copy_function=shutil.copy2,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    _bundle(top)
    return top


def _bundle_probe(top, flags):
    p = subprocess.run([PY, *flags, "-c", BUNDLE_PROBE.format(top=top)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_the_launchers_interpreter_reads_modules_from_the_bundle_while_their_source_is_unchanged(tmp_path):
    """python -I -S (as the launcher runs it) takes the package's modules
    from the bundle scripts/setup made; a module whose source changed since
    comes from its source, as do all of them without -I -S."""
    top = _bundled_copy(tmp_path)
    pkg = os.path.join(top, "starter")
    assert _bundle_probe(top, ["-IS"]) == [f"starter.errors bundle {pkg}/errors.py",
                                           f"starter.spec.values bundle {pkg}/spec/values.py", "None"]
    assert [l.split()[1] for l in _bundle_probe(top, ["-I"])[:2]] == ["pyc", "pyc"]
    with open(os.path.join(pkg, "spec", "values.py"), "a") as f:
        f.write("\nCHANGED = 1\n")
    assert _bundle_probe(top, ["-IS"]) == [f"starter.errors bundle {pkg}/errors.py",
                                           f"starter.spec.values pyc {pkg}/spec/values.py", "1"]
    # starter.errors' code damaged in the bundle: compiled from its source instead.
    import marshal

    bundle = os.path.join(pkg, "__pycache__", "bundle." + sys.implementation.cache_tag)
    with open(bundle, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = marshal.loads(f.read(n))["starter.errors"]
        f.seek(8 + n + entry[3])
        f.write(b"\xff" * entry[4])
    p = subprocess.run([PY, "-IS", "-c", f"import sys; sys.path[:0] = [{top!r}]; import starter.errors as e; "
                        "print(e.StarterError.__name__)"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "StarterError\n"), p.stderr


UPGRADE_PROBE = """
import sys
sys.path[:0] = [{top!r}]
import starter.errors
print("ready", flush=True)
sys.stdin.readline()                 # the upgrade happens here
import starter.spec.values
print(getattr(starter.spec.values, "CHANGED", None))
"""


def test_a_starter_upgraded_under_keeps_importing_the_version_it_started_with(tmp_path):
    """An upgrade (a new source and a new bundle, as the package's postinst
    or scripts/setup write them) while a starter runs: a module it imports
    only later comes from the bundle it started with, not the new source."""
    top = _bundled_copy(tmp_path)
    p = subprocess.Popen([PY, "-IS", "-c", UPGRADE_PROBE.format(top=top)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n", p.stderr.read()
        with open(os.path.join(top, "starter", "spec", "values.py"), "a") as f:
            f.write("\nCHANGED = 1\n")
        _bundle(top)
        out, err = p.communicate("\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (p.returncode, out) == (0, "None\n"), err
    # A process started after the upgrade gets the new version.
    assert _bundle_probe(top, ["-IS"])[-1] == "1"
