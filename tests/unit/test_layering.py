"""The starter's modules import each other without a cycle.

Pure logic: the sources are parsed (ast), nothing is imported.  Every import
of a starter module counts, at module level or inside a function: a
function-local import only puts off loading the module, the dependency is the
same.  Not counted: a module importing its own package (`from starter.net
import NetConfig` in starter/net/netd.py).  Python loads a package before any
module in it, so that edge is there for every module of a package whatever the
code says; a package's __init__ that reaches into its modules (the net facade
calling netd) stays above them.
"""

import ast
import os

import pytest

import starter

pytestmark = pytest.mark.fast    # the fast tier: pure, as any user (docs/testing.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(starter.__file__)))


def _modules():
    out = {}
    for d, _, names in os.walk(os.path.join(ROOT, "starter")):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(d, n)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


def _imports(mod, path, mods):
    is_pkg = path.endswith("__init__.py")
    here = mod if is_pkg else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:   # `from starter import values`: the module, if it is one
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return {m for m in found if m in mods and m != mod and not mod.startswith(m + ".")}


def graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def cycles(g):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_is_read():
    g = graph()
    assert "starter.spec.values" in g["starter.spec.jobspec"]          # module level
    assert "starter.spool.store" in g["starter.cli.spool"]        # inside a function
    assert "starter.cgroups.files" in g["starter.cgroups.base"]   # relative
    assert "starter.net" not in g["starter.net.netd"]     # its own package


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles among starter modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_package_is_installed():
    """Every directory of starter/ with modules is a package (an
    __init__.py) that pyproject.toml's packages list names: a wheel or a
    Debian package without it would fail at its first import (starter.image
    was missing from both)."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for d, dirs, files in os.walk(os.path.join(root, "starter")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        if any(f.endswith(".py") for f in files):
            rel = os.path.relpath(d, root).replace(os.sep, ".")
            assert "__init__.py" in files, f"{rel} has modules and no __init__.py"
            found.add(rel)
    assert found == listed, (sorted(found - listed), sorted(listed - found))
