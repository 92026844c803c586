"""The shim's pure parts under AddressSanitizer and UndefinedBehaviorSanitizer
(native/shim_harness.c): compiled here with the shim's own files, run, and
every group of checks must pass with no sanitizer report.  Needs a C compiler
(skipped without one) and no privileges: part of the fast tier.

What it covers is listed at the top of native/shim_harness.c: the string
helpers and the error report, the tmpfs option split, the mount plan's pure
questions and the destination walk on a tree of its own, the PATH search and
exec's exit codes, the rlimit table, the fd keep list and close_range's
fallback.
"""

import glob
import os
import shutil
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

NATIVE = os.path.join(REPO, "native")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
GROUPS = 10   # "ok ..." lines the harness prints, one per group of checks


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler (cc, gcc, clang) on PATH: the sanitizer harness is not built")
    out = str(tmp_path_factory.mktemp("harness") / "shim_harness")
    sources = sorted(glob.glob(os.path.join(NATIVE, "shim_*.c")))
    assert os.path.join(NATIVE, "shim_harness.c") in sources
    cmd = [cc, *SANITIZE, "-g", "-O1", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-Werror",
           "-I", NATIVE, *sources, "-o", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"the harness does not build:\n{' '.join(cmd)}\n{p.stderr}"
    return out


def test_the_shims_pure_parts_pass_under_asan_and_ubsan(harness):
    env = dict(os.environ, ASAN_OPTIONS="abort_on_error=0:detect_leaks=1:halt_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    p = subprocess.run([harness], capture_output=True, text=True, timeout=120, env=env)
    report = p.stdout + p.stderr
    assert p.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
    lines = p.stdout.splitlines()
    assert len([l for l in lines if l.startswith("ok ")]) == GROUPS, report
    assert lines[-1].startswith("harness: ") and lines[-1].endswith(" checks, 0 failed"), report


def test_the_harness_sees_an_overrun(tmp_path, harness):
    """The sanitizers are live in this build: a one-byte overrun of a malloc'd
    buffer through the shim's own s_cat is reported and fails the run."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    src = tmp_path / "overrun.c"
    src.write_text('#include "shim_internal.h"\n#include <stdlib.h>\n'
                   "int main(void) { char *b = malloc(4); s_cat(b, 0, 5, \"abcd\"); free(b); return 0; }\n")
    others = [s for s in sorted(glob.glob(os.path.join(NATIVE, "shim_*.c"))) if not s.endswith("shim_harness.c")]
    exe = str(tmp_path / "overrun")
    p = subprocess.run([cc, *SANITIZE, "-g", "-O1", "-I", NATIVE, str(src), *others, "-o", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "heap-buffer-overflow" in p.stderr, (p.returncode, p.stderr[-2000:])
