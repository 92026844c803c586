"""`starter spool`: its usage, options (SPOOL_OPTIONS, SPOOL_NEEDS: what each
spool command needs) and the commands' output; the store itself is
spool/store.py.  Imported only when `starter spool` runs.
"""

import os
import sys

from starter.cli.parse import UsageError, leading_option, parse


SPOOL_USAGE = """\
usage: starter spool [--spool DIR] COMMAND [options] ...

Shared executables, stored once per owner and content hash in DIR (default
$STARTER_SPOOL or /var/lib/starter/spool) and hard-linked into each job.

commands:
  add --owner O [--hash ATTRS] FILE [--dest PATH]
                      hash FILE, store it unless O has it; prints ANSWER CMDHASH PATH
                      (ANSWER: have = nothing copied, send = stored now)
  lookup --owner O --cmdhash H      print the hash path and exit 0 ("have it"), else exit 1 ("send it")
  store --owner O --cmdhash H FILE  store FILE under H (its hash is checked); prints ANSWER PATH
  link --owner O --cmdhash H [--src FILE] DEST
                      give a job its copy at DEST (hard link; a private copy if links fail
                      or H is 'invalid', which needs --src)
  release --owner O --cmdhash H JOBCOPY
                      drop a job's copy; the spool entry goes with its last user
  ls [--json]         entries: users, size, owner, CmdHash
  gc [--min-age SECONDS] [--json]
                      remove entries no job links to, unchanged for SECONDS (default 600)

ATTRS: comma-separated hash attributes, in order (default CmdHashSHA256; also
CmdHashMD5, CmdHashSHA1, CmdHashSHA512; 'none' means CmdHash 'invalid').

No symlink is followed in FILE, DEST or JOBCOPY; FILE must be a regular file that
O could read (a local account's rights; otherwise it must be world-readable).
"""

SPOOL_OPTIONS = {
    "--owner": ("owner", "value", "OWNER  the job owner (user name); FILE is read with its rights"),
    "--cmdhash": ("cmdhash", "value", "CMDHASH  as printed by add, or 'invalid'"),
    "--hash": ("hash", "value", "ATTRS  comma-separated hash attributes"),
    "--src": ("src", "value", "FILE  source for a private copy or to restore a lost entry"),
    "--dest": ("dest", "value", "PATH  also give a job its copy here"),
    "--min-age": ("min-age", "value", "SECONDS  gc: keep unused entries younger than this"),
    "--json": ("json", "flag", "machine-readable output"),
}

# spool command -> (options it needs, how many positionals)
SPOOL_NEEDS = {
    "add": (("owner",), 1),
    "lookup": (("owner", "cmdhash"), 0),
    "store": (("owner", "cmdhash"), 1),
    "link": (("owner", "cmdhash"), 1),
    "release": (("owner", "cmdhash"), 1),
    "ls": ((), 0),
    "gc": ((), 0),
}


def cmd_spool(argv):
    from starter.spool import store as spool

    argv = list(argv)
    spool_dir = leading_option(argv, "--spool", os.environ.get("STARTER_SPOOL") or spool.DEFAULT_SPOOL)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(SPOOL_USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in SPOOL_NEEDS:
        raise UsageError(f"unknown spool command {cmd!r} (add, lookup, store, link, release, ls, gc)")
    synopsis = next((ln.strip().split("  ")[0] for ln in SPOOL_USAGE.splitlines()
                     if ln.startswith(f"  {cmd} ")), cmd)
    values, pos, _ = parse(rest, SPOOL_OPTIONS, positional=SPOOL_NEEDS[cmd][1], command_after=False,
                           usage=f"starter spool [--spool DIR] {synopsis}")
    for key in SPOOL_NEEDS[cmd][0]:
        if key not in values:
            raise UsageError(f"{cmd} needs --{key}")
    if len(pos) < SPOOL_NEEDS[cmd][1]:
        raise UsageError(f"{cmd} needs a file argument (see starter spool --help)")
    out = _spool_command(spool.Spool(spool_dir), cmd, values, pos)
    if out is None:
        return 1
    if values.get("json"):
        import json

        print(json.dumps(out, indent=None if isinstance(out, dict) else 1))
    elif isinstance(out, list):
        for e in out:
            print(f"{e['users']:>5} {e['size']:>12} {e['mode']} {e['owner']} {e['cmdhash']}"
                  if isinstance(e, dict) else e)
    else:
        print(out["text"])
    return 0


def _spool_command(s, cmd, values, pos):
    from starter.spool import store as spool

    owner, cmdhash = values.get("owner"), values.get("cmdhash")
    if cmd == "add":
        h = values.get("hash", "CmdHashSHA256")
        attrs = () if h == "none" else tuple(a for a in h.split(",") if a)
        answer, path = s.add(owner, pos[0], attrs, dest=values.get("dest"))
        ch = spool.INVALID if path == spool.INVALID else spool.parse_name(os.path.basename(path))[1]
        return {"answer": answer, "cmdhash": ch, "path": path, "text": f"{answer} {ch} {path}"}
    if cmd == "lookup":
        path = s.lookup(owner, cmdhash)
        return {"answer": "have", "path": path, "text": path} if path else None
    if cmd == "store":
        answer, path = s.store(owner, cmdhash, pos[0])
        path = path or spool.INVALID
        return {"answer": answer, "path": path, "text": f"{answer} {path}"}
    if cmd == "link":
        dest = s.link_into(owner, cmdhash, pos[0], src=values.get("src"))
        st = spool.stat_dest(dest)
        return {"dest": dest, "shared": st.st_nlink > 1, "text": f"{'linked' if st.st_nlink > 1 else 'copied'} {dest}"}
    if cmd == "release":
        removed = s.release(pos[0], owner, cmdhash)
        return {"released": pos[0], "entry_removed": removed,
                "text": f"released {pos[0]}" + (" (last user: entry removed)" if removed else "")}
    if cmd == "ls":
        return s.ls()
    if cmd == "gc":
        from starter.spec import values as V

        min_age = V.duration("min-age", values.get("min-age", spool.DEFAULT_GC_MIN_AGE), 0, 10 * 366 * 86400)
        return s.gc(min_age=min_age)
    raise AssertionError(cmd)
