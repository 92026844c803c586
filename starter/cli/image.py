"""`starter image`: the node's image cache (image/cache.py), root's.
Imported only when `starter image` runs."""

import os
import sys

from starter.cli.parse import UsageError, leading_option, parse

IMAGE_USAGE = """\
usage: starter image [--cache DIR] COMMAND [options] ...

The node's image cache, root's: each image once, by the sha256 of its
squashfs, in DIR (default $STARTER_IMAGE_CACHE, the node policy's
[defaults] image_cache, or /var/lib/starter/images).

commands:
  import FILE [--digest sha256:HEX] [--limit SIZE]
                      store a squashfs file, a SIF file's squashfs partition, or an OCI
                      image (a layout directory or a docker-archive, made a squashfs)
                      unless the cache has it; prints DIGEST SIZE FORMAT ANSWER (stored | have).
                      --digest: refuse it unless it has that digest; --limit: the
                      cache's size, all images together (default 64G)
  ls [--json]         the images: DIGEST SIZE FORMAT SOURCE
  rm DIGEST ...       remove images
  gc [--json]         remove what an import that died left
"""

IMAGE_OPTIONS = {
    "--digest": ("digest", "value", "sha256:HEX  the digest the image must have"),
    "--limit": ("limit", "value", "SIZE  the cache's size, all images together (default 64G)"),
    "--json": ("json", "flag", "machine-readable output"),
}

IMAGE_NEEDS = {"import": 1, "ls": 0, "rm": 1, "gc": 0}


def cmd_image(argv):
    from starter.image import cache as C

    argv = list(argv)
    path = leading_option(argv, "--cache", None) or os.environ.get("STARTER_IMAGE_CACHE") or _policy_cache() \
        or C.DEFAULT_CACHE
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(IMAGE_USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in IMAGE_NEEDS:
        raise UsageError(f"unknown image command {cmd!r} (import, ls, rm, gc)")
    values, pos, _ = parse(rest, IMAGE_OPTIONS, positional=IMAGE_NEEDS[cmd] and 64, command_after=False,
                           usage=f"starter image [--cache DIR] {cmd} ...")
    if len(pos) < IMAGE_NEEDS[cmd]:
        raise UsageError(f"image {cmd} needs {'a file' if cmd == 'import' else 'a digest'}")
    if cmd == "import" and len(pos) > 1:
        raise UsageError("image import takes one file")
    if os.geteuid() != 0:
        from starter.errors import StarterError

        raise StarterError("starter image is root's: the image cache is the node's",
                           "ask the node's admin to import the image")
    if not path.startswith("/"):
        raise UsageError(f"--cache {path!r} must be an absolute path")
    limit = C.DEFAULT_LIMIT
    if "limit" in values:
        from starter.spec import values as V

        limit = V.size("limit", values["limit"])
    cache = C.Cache(path, limit)
    if cmd == "import":
        return _import(cache, pos[0], values)
    if cmd == "ls":
        rows = []
        for hexd, size in cache.entries():
            rec = cache.record(hexd)
            rows.append({"digest": "sha256:" + hexd, "size": size, "format": rec.get("format"),
                         "source": rec.get("source"), "imported_at": rec.get("imported_at")})
        _out(values, rows, lambda r: f"{r['digest']} {r['size']} {r['format']} {r['source']}")
        return 0
    if cmd == "rm":
        missing = [d for d in pos if not cache.remove(d)]
        for d in missing:
            print(f"starter: image {d} is not in the cache", file=sys.stderr)
        return 1 if missing else 0
    removed = cache.gc()
    _out(values, removed, str)
    return 0


def _policy_cache():
    """The node policy's [defaults] image_cache, if it sets one."""
    from starter.callers import policy

    try:
        return policy.load(os.environ.get("STARTER_POLICY") or policy.PATH).defaults.get("image-cache")
    except Exception:        # (an unusable policy is said where it matters: starter run)
        return None


def _import(cache, path, values):
    from starter.image import cache as C

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise C.CacheError(f"{path}: {e.strerror}") from None
    try:
        hexd, size, fmt, stored = cache.import_(fd, os.path.abspath(path), values.get("digest"))
    finally:
        os.close(fd)
    row = {"digest": "sha256:" + hexd, "size": size, "format": fmt, "answer": "stored" if stored else "have",
           "path": os.path.join(cache.path, C.PREFIX + hexd + C.SUFFIX)}
    _out(values, row, lambda r: f"{r['digest']} {r['size']} {r['format']} {r['answer']}")
    return 0


def _out(values, data, line):
    if values.get("json"):
        import json

        print(json.dumps(data))
    elif isinstance(data, list):
        for r in data:
            print(line(r))
    else:
        print(line(data))
