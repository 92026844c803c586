"""Write starter/__pycache__/bundle.<tag>: every module of the package (but
this one and __init__), compiled, with its source's mtime and size, for
starter/__init__.py to serve to the launcher's interpreter.  Run by
scripts/setup after compileall: `python -I starter/bundle.py`."""

import marshal
import os
import sys


def build(top):
    table = {}
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for n in sorted(files):
            if not n.endswith(".py"):
                continue
            path = os.path.join(d, n)
            rel = os.path.relpath(path, top)
            if rel in ("__init__.py", "bundle.py"):
                continue
            parts = ["starter"] + rel[:-3].split(os.sep)
            pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if pkg else parts)
            with open(path, "rb") as f:
                src = f.read()
            st = os.stat(path)
            code = compile(src, path, "exec", dont_inherit=True)
            table[name] = (path[len(top):], st.st_mtime_ns, st.st_size, marshal.dumps(code), pkg)
    return table


def pack(table):
    """8 bytes: the index's length; the index {name: (source, mtime_ns, size,
    offset, length, is_package)}, offsets from the end of the index; then
    each module's marshalled code."""
    blobs, index, at = [], {}, 0
    for name, (src, mtime, size, code, pkg) in table.items():
        index[name] = (src, mtime, size, at, len(code), pkg)
        blobs.append(code)
        at += len(code)
    head = marshal.dumps(index)
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def main():
    top = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(top, "__pycache__", "bundle." + sys.implementation.cache_tag)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(pack(build(top)))
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
