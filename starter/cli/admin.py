"""The subcommands that look after a node and its jobs: config, ns-exec,
enter, ps, status, top, metrics, vacate/suspend/resume/kill, gc, netd.
Each parses its options (cliparse) and hands the work to admin, metrics,
reclaim, net or policy; cli/main.py imports this module only when one of them
runs, never for a `starter run`.
"""

import os
import sys

from starter.cli.parse import UsageError, help_text, need_root, parse, quiet_stdout
from starter.errors import StarterError


def cmd_config(argv):
    """`starter config check [FILE]` / `starter config show [FILE]`: the node policy."""
    usage = "usage: starter config check|show [FILE]   (default FILE: /etc/starter/starter.toml)\n"
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("check", "show") or len(argv) > 2:
        sys.stdout.write(usage + "\ncheck: validate the node policy (exit 0: usable); show: print the "
                         "effective policy,\nits defaults and what callers that are not root may ask for.\n")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from starter.callers import policy
    from starter.spec import values as V

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
    from starter.admin.jobs import ns_exec

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
    _root_or_pilot("starter enter", values, pos[0])
    from starter.admin import jobs as admin

    return admin.enter(_state_dir(values), pos[0], command or ["/bin/sh"], values.get("user"))


def cmd_ps(argv):
    table = {"--json": ("json", "flag", "print JSON"), "--state-dir": ("state-dir", "value", "DIR  state directory")}
    values, _, _ = parse(argv, table, command_after=False, usage="starter ps [--json] [--state-dir DIR]")
    from starter.admin import jobs as admin

    return admin.ps(_state_dir(values), values.get("json", False))


def cmd_status(argv):
    table = {"--json": ("json", "flag", "print JSON"), "--state-dir": ("state-dir", "value", "DIR  state directory"),
             "--processes": ("processes", "flag", "also list the job's processes (as `starter top --once`)")}
    values, pos, _ = parse(argv, table, positional=1, command_after=False,
                           usage="starter status JOB [--json] [--processes] [--state-dir DIR]")
    if not pos:
        raise UsageError("which job? (starter ps lists them)")
    _root_or_pilot("starter status", values, pos[0])       # the state directory is root-only
    from starter.admin import jobs as admin

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
    from starter.admin import jobs as admin

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
    from starter.observe import metrics

    state = _state_dir(values)
    if "listen" in values:
        return metrics.serve(state, values["listen"])
    if "textfile" in values:
        from starter.spec import values as V

        metrics.write_textfile(state, V.path("textfile", values["textfile"], must_exist=True))
        return 0
    try:
        sys.stdout.write(metrics.text(state))
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
    return 0


def cmd_control(action, argv):
    """vacate, suspend, resume, kill JOB."""
    table = {"--state-dir": ("state-dir", "value", "DIR  state directory")}
    values, pos, _ = parse(argv, table, positional=1, command_after=False,
                           usage=f"starter {action} JOB [--state-dir DIR]")
    if not pos:
        raise UsageError(f"usage: starter {action} JOB")
    _root_or_pilot(f"starter {action}", values, pos[0])
    from starter.admin import jobs as admin

    return admin.control(_state_dir(values), pos[0], action)


def cmd_checkpoint(argv):
    """checkpoint JOB --to DIR [--leave-running] (starter/checkpoint/criu.py)."""
    table = {"--state-dir": ("state-dir", "value", "DIR  state directory"),
             "--to": ("to", "value", "DIR  a new directory for the images and the starter's record"),
             "--leave-running": ("leave-running", "flag", "the job goes on after the dump (default: it ends, "
                                 "reason checkpointed)")}
    usage = "starter checkpoint JOB --to DIR [--leave-running] [--state-dir DIR]"
    values, pos, _ = parse(argv, table, positional=1, command_after=False, usage=usage)
    if not pos or not values.get("to"):
        raise UsageError(f"usage: {usage}")
    need_root("starter checkpoint")
    from starter.checkpoint import criu as checkpoint

    return checkpoint.checkpoint(_state_dir(values), pos[0], os.path.abspath(values["to"]),
                                 bool(values.get("leave-running")))


def cmd_gc(argv):
    table = {"--state-dir": ("state-dir", "value", "DIR  state directory")}
    values, _, _ = parse(argv, table, command_after=False, usage="starter gc [--state-dir DIR]")
    _root_or_pilot("starter gc", values, None)
    from starter.admin.gc import gc

    lines, ok = gc(_state_dir(values))
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


def _root_or_pilot(what, values, job):
    """Root, or a pilot (not root, starter/rootless) on its own jobs: for one
    job, inside the user namespace its starter made (whose root the pilot
    is), where its namespaces and processes are ours; for gc, in a new one
    mapped as its starters' are (what a dead one left is of those ids)."""
    if os.geteuid() == 0:
        return
    from starter.rootless import pilot

    os.environ["STARTER_STATE_DIR"] = _state_dir(values)   # (root's default, once 0 in the namespace)
    if job is None:
        pilot.begin()
    else:
        pilot.join_job(os.environ["STARTER_STATE_DIR"], job)


def _state_dir(values):
    """--state-dir, else $STARTER_STATE_DIR, else the node policy's
    defaults.state_dir, else /run/starter."""
    from starter.spec.jobspec import state_dir

    value = values.get("state-dir")
    if value is None and not os.environ.get("STARTER_STATE_DIR") and os.geteuid() != 0:
        from starter.rootless import pilot       # a pilot's own jobs

        return state_dir(pilot.default_state_dir())
    if value is None and not os.environ.get("STARTER_STATE_DIR"):
        from starter.callers import policy

        try:
            value = policy.load(os.environ.get("STARTER_POLICY") or policy.PATH).defaults.get("state-dir")
        except StarterError:
            value = None        # an admin command still works beside a broken policy
    return state_dir(value)
