"""The docs stay true to the code (pure: nothing is run but the CLI's --help,
in-process).

  - every long option of every command (as its --help prints it, the spool's
    subcommands included), every job-file key and every STARTER_* variable the
    starter reads is in docs/reference.md;
  - the admin guide's example node policy is a valid one (starter/callers/policy.py);
  - every relative link in README.md and docs/*.md names a file that exists,
    and a #fragment names a heading of that file;
  - every file in starter/, native/ and scripts/ is named in the README's
    Layout, and every file the Layout names exists; every tests/*.py and
    tests/unit/*.py is named in docs/testing.md.
"""

import os
import re

import pytest

from conftest import REPO
from starter.cli import main as cli
from starter.spec import jobfile

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

DOCS = os.path.join(REPO, "docs")
REFERENCE = os.path.join(DOCS, "reference.md")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def mentions(text, word):
    """`word` in text as a whole token (so --pool is not found in --pool6)."""
    return re.search(r"(?<![\w.-])" + re.escape(word) + r"(?![\w-])", text) is not None


# ---------------------------------------------------------------- reference

def help_texts(capsys):
    """Every --help the CLI prints: the top level, each command, each spool command."""
    argvs = [["--help"]] + [[c, "--help"] for c in cli.COMMANDS]
    argvs += [["spool", c, "--help"] for c in cli.SPOOL_NEEDS]
    out = {}
    for argv in argvs:
        code = cli.main(argv)
        text = capsys.readouterr().out
        assert code == 0 and text.startswith("usage:"), (argv, code, text)
        out[" ".join(argv)] = text
    return out


def test_every_option_of_every_command_is_in_the_reference(capsys):
    reference = read(REFERENCE)
    options = {}
    for argv, text in help_texts(capsys).items():
        for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
            options.setdefault(opt, argv)
    assert "--memory" in options and "--owner" in options and "--textfile" in options, options
    missing = {opt: where for opt, where in options.items() if not mentions(reference, opt)}
    assert not missing, f"options missing from docs/reference.md (option: the --help that shows it): {missing}"


def test_every_run_option_has_a_row_in_the_reference():
    reference = read(REFERENCE)
    rows = [line for line in reference.splitlines() if line.startswith("| `--")]
    missing = [opt for opt in cli.RUN_OPTIONS if not any(mentions(r.split("|")[1], opt) for r in rows)]
    assert not missing, f"`starter run` options without a table row in docs/reference.md: {missing}"


def test_every_job_file_key_is_in_the_reference():
    reference = read(REFERENCE)
    keys = set(jobfile.FILE_KEYS) | set(jobfile.LIMIT_KEYS) | set(jobfile.NET_KEYS)
    missing = sorted(k for k in keys if f"`{k}`" not in reference)
    assert not missing, f"job-file keys missing from docs/reference.md: {missing}"


def test_every_environment_variable_is_in_the_reference():
    reference = read(REFERENCE)
    found = set()
    for root, dirs, files in os.walk(os.path.join(REPO, "starter")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                found |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"'](STARTER_[A-Z0-9_]+)",
                                        read(os.path.join(root, name))))
    assert "STARTER_STATE_DIR" in found, found
    missing = sorted(v for v in found if f"`{v}`" not in reference)
    assert not missing, f"environment variables missing from docs/reference.md: {missing}"


def test_every_trace_phase_is_in_the_reference():
    reference = read(REFERENCE)
    row = next(line for line in reference.splitlines() if line.startswith("| `STARTER_TRACE`"))
    phases = set()
    for root, dirs, files in os.walk(os.path.join(REPO, "starter")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                phases |= set(re.findall(r"trace\.mark\(\s*[\"']([\w-]+)", read(os.path.join(root, name))))
    assert "clone" in phases, phases
    missing = sorted(p for p in phases if f"`{p}`" not in row)
    assert not missing, f"STARTER_TRACE phases missing from its row in docs/reference.md: {missing}"


def test_the_admin_guides_node_policy_parses():
    from starter.callers import policy

    guide = read(os.path.join(DOCS, "admin-guide.md"))
    blocks = re.findall(r"^```toml\n(.*?)^```", guide, re.S | re.M)
    examples = [b for b in blocks if b.startswith("# /etc/starter/starter.toml")]
    assert len(examples) == 1, blocks
    pol = policy.parse(examples[0].encode(), "admin-guide.md")
    assert pol.defaults["state-dir"] == "/run/starter" and pol.callers["max_jobs"] == 16, pol.render()


# ---------------------------------------------------------------- links

FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(text):
    """Markdown without code blocks (indented or fenced) and inline code."""
    text = FENCE.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text):
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-',
    repeats numbered."""
    seen, out = {}, set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def doc_files():
    return [os.path.join(REPO, "README.md")] + sorted(
        os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(doc):
    text = read(doc)
    bad = []
    links = re.findall(r"\]\(([^)\s]+)\)", prose(text))
    for link in links:
        if re.match(r"[a-z]+:", link):          # http:, https:, mailto:
            continue
        path, _, frag = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(target):
            bad.append(f"{link}: no such file")
        elif frag and target.endswith(".md") and frag not in anchors(read(target)):
            bad.append(f"{link}: no heading #{frag} in {os.path.relpath(target, REPO)}")
    assert not bad, f"{os.path.relpath(doc, REPO)}: broken links: {bad}"


def test_the_link_checker_sees_links():
    assert "reference.md" in " ".join(re.findall(r"\]\(([^)\s]+)\)", prose(read(os.path.join(REPO, "README.md")))))
    assert anchors("# A\n## `--init` and PID 1: x\n## A\n") == {"a", "--init-and-pid-1-x", "a-1"}


# ---------------------------------------------------------------- layout

def layout():
    text = read(os.path.join(REPO, "README.md"))
    assert "\n## Layout\n" in text, "README.md has no Layout section"
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def tree(top):
    """Files under top that are sources (build products and caches left out)."""
    out = []
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(root, n) for n in files
                if not n.endswith((".so", ".pyc", ".o")) and not (top == "native" and n.startswith("_"))]
    return out


@pytest.mark.parametrize("top", ["starter", "native", "scripts"])
def test_every_file_is_in_the_layout(top):
    text = layout()
    files = tree(top)
    assert files
    missing = []
    for path in files:
        name = os.path.basename(path)
        stem = os.path.splitext(name)[0]
        # starter/ and native/: the file name; scripts/bench.d and vm/ list stems
        if not (mentions(text, name) or (top == "scripts" and mentions(text, stem))):
            missing.append(os.path.relpath(path, REPO))
    assert not missing, f"files not described in README.md's Layout: {missing}"


def test_every_file_the_layout_names_exists():
    names = set(re.findall(r"[\w.-]+\.(?:py|c|h|json|txt|md|toml)\b", layout()))
    have = {n for top in ("starter", "native", "scripts", "tests", "docs") for n in map(os.path.basename, tree(top))}
    have |= set(os.listdir(REPO))
    stale = sorted(n for n in names if n not in have)
    assert not stale, f"README.md's Layout names files that do not exist: {stale}"


def test_every_test_file_is_in_testing_md():
    testing = read(os.path.join(DOCS, "testing.md"))
    files = [n for d in ("tests", "tests/unit") for n in os.listdir(os.path.join(REPO, d)) if n.endswith(".py")]
    missing = sorted(n for n in files if not mentions(testing, n))
    assert not missing, f"test files not described in docs/testing.md: {missing}"


def test_the_readmes_table_is_the_newest_benchmark_runs():
    """The README quotes one table: every row of it is a row of the dated
    section of docs/benchmarks.md it names, and that is the newest run of
    `core` on the hybrid host (one run, not numbers of its own)."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(DOCS, "benchmarks.md")) as f:
        bench = f.read()
    speed = readme.split("\n## Speed\n")[1].split("\n## ")[0]
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", speed).group(0)
    sections = bench.split("\n## ")[1:]
    named = [sec for sec in sections if sec.startswith(stamp + ":")]
    assert named, f"the README names the run of {stamp}, which docs/benchmarks.md does not have"
    # (the table's rows are the `core` section's: a run of other sections alone does not replace it)
    newest_hybrid = next(sec for sec in sections
                         if "hybrid host" in sec.splitlines()[0] and re.search(r"\bcore\b", sec.splitlines()[0]))
    assert newest_hybrid is named[0], f"the README's run ({stamp}) is not the newest `core` run on the hybrid host"
    rows = [line for line in speed.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 3, speed
    missing = [row for row in rows if row not in named[0].splitlines()]
    assert not missing, f"README rows not in the run of {stamp} in docs/benchmarks.md: {missing}"


def test_every_script_answers_help():
    """Every command in scripts/ answers --help with its usage (its header
    comment) and exit 0, doing nothing else."""
    import subprocess

    top = os.path.join(REPO, "scripts")
    for name in sorted(os.listdir(top)):
        path = os.path.join(top, name)
        if not os.path.isfile(path) or not os.access(path, os.X_OK) or name.endswith(".py"):
            continue
        p = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
        assert p.returncode == 0 and p.stdout.strip(), (name, p.returncode, p.stdout[:200], p.stderr[:200])
        assert "usage" in p.stdout.lower() or len(p.stdout.splitlines()) >= 2, (name, p.stdout)
