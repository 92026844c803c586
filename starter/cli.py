"""Command line: subcommands and their options, mapped to the modules that do
the work; errors mapped to exit codes.  No logic lives here.

The option parser is a small table-driven one, not argparse: argparse pulls
in `re` and costs ~8 ms per start on these machines, half the budget of a
whole `starter run -- /bin/true`.
"""

from starter import trace  # first: its clock starts with our first line

import errno
import os
import sys

from starter.errors import EXIT_STARTER_FAILED, StarterError

USAGE = """\
usage: starter COMMAND [options] ...

Launch one batch job isolated in its own PID, mount and network namespaces
and cgroup, and the tools to look after running jobs.

commands:
  run [options] -- CMD [ARGS]   run a job (see `starter run --help`)
  ns-exec [-pnmui] -- CMD       run CMD in fresh namespaces, as root, for debugging
  enter JOB [--user U] [-- CMD] run CMD inside a running job (its namespaces and cgroup)
  ps [--json]                   list the jobs on this node
  status JOB [--json] [--processes]
                                live usage of one job (and its processes)
  top JOB [--interval S] [--once]
                                the job's processes, refreshed (from its cgroup)
  metrics [--textfile DIR | --listen [ADDR:]PORT]
                                every job's usage in the Prometheus text format
  vacate|suspend|resume|kill JOB
                                control a running job (same as signalling its starter)
  gc                            reclaim what crashed starters left behind
  netd                          run the per-node network helper (for --net nat)
  config check|show [FILE]      validate / print the node policy (/etc/starter/starter.toml)
  spool [--spool DIR] add|ls|gc|link|release ...
                                shared executables, stored once per owner and hash

common options: --state-dir DIR (default /run/starter, or $STARTER_STATE_DIR),
--help on every command.  Relative paths are relative to the current directory.
exit codes of run: the job's code, 128+N for signal N, 125 starter failed,
126 not executable, 127 not found.
"""

# name -> (key, kind, help).  kind: flag | value | multi | mount
RUN_OPTIONS = {
    "--job": ("job", "value", "FILE  JSON job description; options given here override it"),
    "--id": ("id", "value", "ID  job id (default: random); [A-Za-z0-9_.-], at most 64"),
    "--user": ("user", "value", "USER  run as this user (name or uid; default: the starter-job account; root only if named)"),
    "--group": ("group", "value", "GROUP  primary group (default: the user's)"),
    "--userns-root": ("userns-root", "flag", "be uid 0 in a user namespace that maps 0 to the job's user (not host root)"),
    "--rlimit": ("rlimit", "multi", "NAME=SOFT[:HARD]  resource limit (repeatable), e.g. nofile=4096:65536, core=unlimited"),
    "--cwd": ("cwd", "value", "DIR  working directory inside the job (default: the scratch, else the caller's if the job can enter it, else home, else /)"),
    "--env": ("env", "multi", "K=V  set a variable (repeatable); the job gets only these plus HOME/USER/PATH"),
    "--net": ("net", "value", "MODE  none (default: own namespace, loopback only), host, nat"),
    "--hostname": ("hostname", "value", "NAME  host name inside the job (own UTS namespace)"),
    "--bind": ("bind", "mount", "SRC[:DST]  bind mount (repeatable)"),
    "--ro-bind": ("ro-bind", "mount", "SRC[:DST]  read-only bind mount (repeatable)"),
    "--tmpfs": ("tmpfs", "mount", "DST[:OPTS]  a tmpfs (size=,mode=,nr_inodes=)"),
    "--device": ("device", "multi", "PATH[:rwm]  pass a device node, bound at its path (repeatable; access read, write, mknod; default rw)"),
    "--gpus": ("gpus", "value", "LIST  NVIDIA GPUs by index or UUID (0,1 | GPU-... | all) and their control nodes; sets CUDA_VISIBLE_DEVICES"),
    "--init": ("init", "flag", "keep a tiny init as PID 1 (reaps orphans, forwards signals)"),
    "--seccomp": ("seccomp", "value", "default|off|FILE  syscall filter (default: the built-in profile)"),
    "--allow-userns": ("allow-userns", "flag", "let the job create user namespaces (unprivileged container runtimes)"),
    "--memory": ("memory", "value", "SIZE  memory limit, no swap beyond it (e.g. 512M)"),
    "--cpus": ("cpus", "value", "N  cpu quota in cores (e.g. 1.5)"),
    "--cpu-weight": ("cpu-weight", "value", "N  cpu weight 1..10000 (default 100)"),
    "--cpuset": ("cpuset", "value", "LIST  CPUs the job may run on, e.g. 0,2-3 (within its cgroup parent's)"),
    "--mems": ("mems", "value", "LIST  NUMA memory nodes the job may use, e.g. 0"),
    "--io-max": ("io-max", "multi", "DEV:KEY=V,..  block I/O limit (repeatable); KEY rbps, wbps (bytes/s, e.g. 10M), riops, wiops"),
    "--pids": ("pids", "value", "N  most processes/threads at once"),
    "--wall-time": ("wall-time", "value", "SECONDS  wall-clock limit; then the job is killed (reason timeout)"),
    "--delegate": ("delegate", "flag", "give the job its cgroup subtree to manage (pilots; cgroup v2 with nsdelegate only)"),
    "--oom-policy": ("oom-policy", "value", "kill|continue  kill: an OOM kill of any process ends the job (reason oom; default); continue: only that process dies"),
    "--grace": ("grace", "value", "SECONDS  vacate: time between SIGTERM and the kill (default 10)"),
    "--on-signal": ("on-signal", "multi", "SIG=ACTION  map a signal to vacate|suspend|resume|kill"),
    "--report": ("report", "value", "FILE|fd:N  write the JSON usage report here when the job ends"),
    "--report-format": ("report-format", "value", "FMT  json (default) or classad (HTCondor job attributes)"),
    "--events": ("events", "value", "FILE|fd:N  write JSON lines, one per state change"),
    "--state-dir": ("state-dir", "value", "DIR  per-job state (default /run/starter)"),
    "--cgroup-parent": ("cgroup-parent", "value", "PATH  job cgroups' parent: a NAME goes under the starter's own cgroup (default: starter), a /PATH (must exist) is used as is"),
    "--lan": ("lan", "multi", "CIDR  network counted as LAN (repeatable, IPv4 or IPv6); the rest is WAN"),
    "--pool": ("pool", "value", "CIDR  address pool for job networks (default 10.213.0.0/16)"),
    "--pool6": ("pool6", "value", "CIDR  IPv6 unique local pool for job networks (default fd70:7639:1864::/64)"),
    "--ipv6": ("ipv6", "value", "auto|on|off  IPv6 for NAT jobs: auto (default) where an uplink has IPv6; on: required"),
    "--uplink": ("uplink", "multi", "IFACE  interface jobs are NATed out of (repeatable: each destination leaves by the host's routing)"),
    "--allow-host-port": ("allow-host-port", "multi", "PROTO:PORT  let jobs reach this port on the host"),
    "--resolver": ("resolver", "value", "IP  name server (IPv4 or IPv6) written to the job's /etc/resolv.conf"),
    "--scratch": ("scratch", "value", "DIR  fresh private working directory, removed at the end"),
    "--execute-dir": ("execute-dir", "value", "DIR  make the scratch directory as DIR/job-ID"),
    "--keep-scratch": ("keep-scratch", "flag", "keep the scratch directory of a job that ran"),
    "--disk": ("disk", "value", "SIZE  the scratch is a file system of this size (e.g. 20G): writes past it fail (ENOSPC)"),
    "--disk-inodes": ("disk-inodes", "value", "N  with --disk: at least this many files and directories (default: one per 16 KiB)"),
    "--manifest": ("manifest", "value", "FILE  signature file listing the inputs (sha256sum format)"),
    "--manifest-digest": ("manifest-digest", "value", "SHA256  trusted digest of the signature file"),
    "--inputs": ("inputs", "value", "DIR  where the manifest's files are read from"),
}


class UsageError(StarterError):
    pass


class HelpRequested(Exception):
    """--help or -h among the options: main() prints `text` and exits 0."""

    def __init__(self, text):
        super().__init__("help")
        self.text = text


def parse(argv, table, positional=0, command_after=True, usage=None):
    """-> (values dict of given options, positionals, command list).
    --help / -h before any command: HelpRequested with `usage` and the table."""
    values, pos, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return values, pos, argv[i + 1:]
        if a in ("--help", "-h"):
            raise HelpRequested(help_text(f"usage: {usage or 'starter COMMAND [options]'}", table))
        if a.startswith("--"):
            name, eq, inline = a.partition("=")
            if name not in table:
                raise UsageError(f"unknown option {name} (see --help)")
            key, kind, _ = table[name]
            if kind == "flag":
                if eq:
                    raise UsageError(f"{name} takes no value")
                values[key] = True
            else:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise UsageError(f"{name} needs a value")
                    inline = argv[i]
                if kind == "multi":
                    values.setdefault(key, []).append(inline)
                elif kind == "mount":  # one list, in command-line order: later mounts stack on earlier ones
                    values.setdefault("mounts", []).append((key, inline))
                else:
                    values[key] = inline
        elif len(pos) < positional:
            pos.append(a)
        elif command_after:
            return values, pos, argv[i:]
        else:
            raise UsageError(f"unexpected argument {a!r}")
        i += 1
    return values, pos, []


def help_text(title, table):
    lines = [title, "", "options:"]
    for name, (_, kind, text) in table.items():
        arg, _, desc = text.partition("  ") if kind != "flag" else ("", "", text)
        lines.append(f"  {name} {arg}".ljust(30) + " " + desc)
    return "\n".join(lines) + "\n"


def need_root(what):
    if os.geteuid() != 0:
        if what == "starter run":
            raise StarterError(
                "starter run needs root: this `starter` command is not set-user-ID root",
                "users start jobs through the set-user-ID `starter` command that scripts/setup "
                "installs (.venv/bin/starter, mode 4755); `python -m starter` is for root only")
        raise StarterError(
            f"{what} must run as root",
            "it creates namespaces, cgroups and network devices and switches to the job's user; "
            "run it from the node daemon (startd, slurmd) or with sudo",
        )


# ------------------------------------------------------------ subcommands

def cmd_run(argv):
    if argv[:1] in (["--help"], ["-h"]):
        sys.stdout.write(help_text("usage: starter run [options] -- CMD [ARGS]", RUN_OPTIONS))
        return 0
    trace.mark("import")
    values, _, command = parse(argv, RUN_OPTIONS, usage="starter run [options] -- CMD [ARGS]")
    caller = None
    if os.geteuid() == 0:
        # First: the first cgroup migration's RCU wait then overlaps what follows.
        from starter.cgroups import warm_up

        warm_up()
        trace.mark("warm-up")
        if "STARTER_CALLER" in os.environ:    # the set-user-ID launcher's (starter/caller.py)
            from starter.caller import from_environ

            caller = from_environ()
    from starter import deadline, spec as S

    need_root("starter run")
    from starter import policy

    deadline.start()   # setup's deadline and signals, from here until the job runs
    if caller is not None and caller.fd is not None:
        from starter.caller import relay

        relay(caller.fd)    # the caller's signals, as signals to us, from now on (caller.py)
    try:
        # A root caller may name another policy file (tests, a trial); a caller
        # that is not root has an empty environment here (the launcher's doing).
        pol = policy.load(os.environ.get("STARTER_POLICY") or policy.PATH)
        if caller is None:
            job_file = S.load_job_file(values.pop("job")) if "job" in values else None
            if command:
                values["command"] = command
            js = S.build(values, job_file, pol)
        else:
            # Every path the caller names is looked at with its rights, not root's.
            with caller.rights():
                job_file = S.load_job_file(values.pop("job")) if "job" in values else None
                if command:
                    values["command"] = command
                js = S.build(values, job_file, pol, caller)
    except BaseException:
        deadline.claim()   # this failure is the one said (the watchdog stays out)
        raise
    trace.mark("spec")
    from starter.job import run

    return run(js, caller, pol)


def cmd_config(argv):
    """`starter config check [FILE]` / `starter config show [FILE]`: the node policy."""
    usage = "usage: starter config check|show [FILE]   (default FILE: /etc/starter/starter.toml)\n"
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("check", "show") or len(argv) > 2:
        sys.stdout.write(usage + "\ncheck: validate the node policy (exit 0: usable); show: print the "
                         "effective policy,\nits defaults and what callers that are not root may ask for.\n")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from starter import policy
    from starter import values as V

    path = V.host_path("config", argv[1]) if len(argv) > 1 else policy.PATH
    pol = policy.load(path, cached=False)
    if argv[0] == "check":
        sys.stdout.write(f"{path}: ok\n" if pol.path else f"{path}: no such file; the built-in policy applies\n")
    else:
        sys.stdout.write(pol.render())
    return 0


NS_FLAGS = {"p": "pid", "n": "net", "m": "mnt", "u": "uts", "i": "ipc"}


def cmd_ns_exec(argv):
    """ns_exec, the namespace tool of the per-job network recipe (docs/design.md,
    Background): `starter ns-exec -nm -- /bin/bash`."""
    flags = []
    for a in argv:
        if a == "--" or not a.startswith("-"):
            break
        flags.append(a)
    if not argv or "-h" in flags or "--help" in flags:
        sys.stdout.write(
            "usage: starter ns-exec [-p] [-n] [-m] [-u] [-i] [--] CMD [ARGS]\n\n"
            "Run CMD as root (capabilities kept) in fresh namespaces: -p pid, -n net,\n"
            "-m mount, -u uts, -i ipc; flags combine (-nm).  For an admin reproducing\n"
            "a job's view by hand.  With -p, /proc is remounted (needs -m, added).\n"
        )
        return 0 if argv else 2
    namespaces, i = set(), 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        for ch in argv[i][1:]:
            if ch not in NS_FLAGS:
                raise UsageError(f"unknown flag -{ch} (use -p -n -m -u -i)")
            namespaces.add(NS_FLAGS[ch])
        i += 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    command = argv[i:]
    if not command:
        raise UsageError("no command given")
    if not namespaces:
        raise UsageError("no namespace flag given (-p -n -m -u -i)")
    need_root("starter ns-exec")
    from starter.job import ns_exec

    return ns_exec(command, frozenset(namespaces))


def cmd_enter(argv):
    table = {
        "--user": ("user", "value", "USER  run as this user (default: the job's user)"),
        "--state-dir": ("state-dir", "value", "DIR  state directory"),
    }
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(help_text("usage: starter enter JOB [--user USER] [-- CMD [ARGS]]", table))
        return 0 if argv else 2
    values, pos, command = parse(argv, table, positional=1, usage="starter enter JOB [--user USER] [-- CMD [ARGS]]")
    if not pos:
        raise UsageError("which job? (starter ps lists them)")
    need_root("starter enter")
    from starter import admin

    return admin.enter(_state_dir(values), pos[0], command or ["/bin/sh"], values.get("user"))


def cmd_ps(argv):
    table = {"--json": ("json", "flag", "print JSON"), "--state-dir": ("state-dir", "value", "DIR  state directory")}
    values, _, _ = parse(argv, table, command_after=False, usage="starter ps [--json] [--state-dir DIR]")
    from starter import admin

    return admin.ps(_state_dir(values), values.get("json", False))


def cmd_status(argv):
    table = {"--json": ("json", "flag", "print JSON"), "--state-dir": ("state-dir", "value", "DIR  state directory"),
             "--processes": ("processes", "flag", "also list the job's processes (as `starter top --once`)")}
    values, pos, _ = parse(argv, table, positional=1, command_after=False,
                           usage="starter status JOB [--json] [--processes] [--state-dir DIR]")
    if not pos:
        raise UsageError("which job? (starter ps lists them)")
    need_root("starter status")       # the state directory is root-only
    from starter import admin

    return admin.status(_state_dir(values), pos[0], values.get("json", False), values.get("processes", False))


def cmd_top(argv):
    table = {
        "--interval": ("interval", "value", "S  seconds between refreshes, the cpu% window (default 2; 0.5 with --once)"),
        "--once": ("once", "flag", "print one table and exit (for scripts)"),
        "--json": ("json", "flag", "with --once: print JSON"),
        "--state-dir": ("state-dir", "value", "DIR  state directory"),
    }
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(help_text("usage: starter top JOB [--interval S] [--once [--json]]", table))
        return 0 if argv else 2
    values, pos, _ = parse(argv, table, positional=1, command_after=False)
    if not pos:
        raise UsageError("which job? (starter ps lists them)")
    interval = None
    if "interval" in values:
        try:
            interval = float(values["interval"])
        except ValueError:
            interval = -1
        if not 0.05 <= interval <= 3600:
            raise UsageError(f"--interval {values['interval']!r}: want seconds between 0.05 and 3600")
    if values.get("json") and not values.get("once"):
        raise UsageError("--json needs --once")
    from starter import admin

    try:
        return admin.top(_state_dir(values), pos[0], interval, values.get("once", False), values.get("json", False))
    except BrokenPipeError:         # `starter top JOB | head`: the reader is done
        quiet_stdout()
        return 0


def cmd_metrics(argv):
    table = {
        "--textfile": ("textfile", "value", "DIR  write DIR/starter.prom atomically (node_exporter textfile collector)"),
        "--listen": ("listen", "value", "[ADDR:]PORT  serve /metrics over HTTP; a bare port is 127.0.0.1"),
        "--state-dir": ("state-dir", "value", "DIR  state directory"),
    }
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(help_text("usage: starter metrics [--textfile DIR | --listen [ADDR:]PORT]", table))
        return 0
    values, _, _ = parse(argv, table, command_after=False)
    if "textfile" in values and "listen" in values:
        raise UsageError("give --textfile or --listen, not both")
    from starter import metrics

    state = _state_dir(values)
    if "listen" in values:
        return metrics.serve(state, values["listen"])
    if "textfile" in values:
        from starter import values as V

        metrics.write_textfile(state, V.path("textfile", values["textfile"], must_exist=True))
        return 0
    try:
        sys.stdout.write(metrics.text(state))
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
    return 0


def _control(action):
    def cmd(argv):
        table = {"--state-dir": ("state-dir", "value", "DIR  state directory")}
        values, pos, _ = parse(argv, table, positional=1, command_after=False,
                               usage=f"starter {action} JOB [--state-dir DIR]")
        if not pos:
            raise UsageError(f"usage: starter {action} JOB")
        need_root(f"starter {action}")
        from starter import admin

        return admin.control(_state_dir(values), pos[0], action)

    return cmd


def cmd_gc(argv):
    table = {"--state-dir": ("state-dir", "value", "DIR  state directory")}
    values, _, _ = parse(argv, table, command_after=False, usage="starter gc [--state-dir DIR]")
    need_root("starter gc")
    from starter import reclaim

    lines, ok = reclaim.gc(_state_dir(values))
    for line in lines:
        print(line)
    return 0 if ok else 1     # 1: something is still held (each line says what and why)


def cmd_netd(argv):
    """The per-node network helper: holds the nftables handle and the table
    between jobs, and tears down off the starter's path (docs/design.md, "netd")."""
    table = {"--state-dir": ("state-dir", "value", "DIR  state directory (socket: DIR/netd.sock)")}
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(help_text("usage: starter netd [--state-dir DIR]", table))
        return 0
    values, _, _ = parse(argv, table, command_after=False, usage="starter netd [--state-dir DIR]")
    need_root("starter netd")
    from starter import net

    state = _state_dir(values)
    net.serve(state, os.path.join(state, "netd.sock"))
    return 0


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
    from starter import spool

    argv = list(argv)
    spool_dir = os.environ.get("STARTER_SPOOL") or spool.DEFAULT_SPOOL
    if argv[:1] and argv[0].startswith("--spool"):
        name, eq, val = argv.pop(0).partition("=")
        if name != "--spool":
            raise UsageError(f"unknown option {name}")
        if not eq:
            if not argv:
                raise UsageError("--spool needs a value")
            val = argv.pop(0)
        spool_dir = val
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
    from starter import spool

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
        from starter import values as V

        min_age = V.duration("min-age", values.get("min-age", spool.DEFAULT_GC_MIN_AGE), 0, 10 * 366 * 86400)
        return s.gc(min_age=min_age)
    raise AssertionError(cmd)


def _state_dir(values):
    """--state-dir, else $STARTER_STATE_DIR, else the node policy's
    defaults.state_dir, else /run/starter."""
    from starter.spec import state_dir

    value = values.get("state-dir")
    if value is None and not os.environ.get("STARTER_STATE_DIR"):
        from starter import policy

        try:
            value = policy.load(os.environ.get("STARTER_POLICY") or policy.PATH).defaults.get("state-dir")
        except StarterError:
            value = None        # an admin command still works beside a broken policy
    return state_dir(value)


COMMANDS = {
    "run": cmd_run,
    "config": cmd_config,
    "ns-exec": cmd_ns_exec,
    "enter": cmd_enter,
    "ps": cmd_ps,
    "status": cmd_status,
    "vacate": _control("vacate"),
    "suspend": _control("suspend"),
    "resume": _control("resume"),
    "kill": _control("kill"),
    "gc": cmd_gc,
    "netd": cmd_netd,
    "spool": cmd_spool,
    "top": cmd_top,
    "metrics": cmd_metrics,
}


def launcher_code(repo, site):
    """What the `starter` command runs with `python -IS -c` (native/launcher.c,
    built by scripts/build-launcher; the bench and the tests run it too): the
    checkout and the venv's site-packages put back on sys.path (-S leaves
    them out), then entry()."""
    return f"import sys; sys.path[:0] = [{repo!r}, {site!r}]; from starter.cli import entry; entry()"


def entry():
    """The `starter` command (launcher, console script, python -m starter):
    main(), then leave without the interpreter's finalization (tearing down
    every module and a last GC: ~1.5 ms of each `starter run`, measured).  The
    starter registers no atexit handlers and runs no threads that must
    finish; stdout and stderr are flushed here."""
    code = main()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv=None):
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`starter ps | head -1`): nothing to report.
        quiet_stdout()
        return 128 + 13   # as if killed by SIGPIPE, like other tools


def quiet_stdout():
    """After EPIPE: point stdout at /dev/null so the interpreter's final
    flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _main(argv):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from starter import __version__

        print(f"starter {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        _error(f"starter: unknown command {argv[0]!r} (see starter --help)")
        return 2
    # Every way out is one line on stderr: what failed and what to do.
    try:
        return cmd(argv[1:])
    except HelpRequested as e:
        sys.stdout.write(e.text)
        return 0
    except UsageError as e:
        _error(f"starter {argv[0]}: {e}")
        return EXIT_STARTER_FAILED if argv[0] == "run" else 2
    except StarterError as e:
        _error(f"starter: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except RecursionError:
        _error(f"starter {argv[0]}: input nested too deeply")
        return EXIT_STARTER_FAILED
    except BrokenPipeError:
        raise
    except OSError as e:
        from starter.errors import from_oserror

        err = from_oserror(e)
        if e.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
            err.hint = f"starter {argv[0]} works on root-only state and cgroups: run it as root"
        _error(f"starter {argv[0]}: {err}")
        return EXIT_STARTER_FAILED
    except Exception as e:  # a bug: still one line (STARTER_DEBUG=1 shows the traceback)
        _debug_traceback()
        _error(f"starter {argv[0]}: internal error: {type(e).__name__}: {e} "
               "(please report it; STARTER_DEBUG=1 shows where)")
        return EXIT_STARTER_FAILED


def _error(msg):
    from starter.errors import one_line

    sys.stderr.write(one_line(msg) + "\n")


def _debug_traceback():
    if os.environ.get("STARTER_DEBUG"):
        import traceback

        traceback.print_exc()
