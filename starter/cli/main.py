"""Command line: the front.  The usage, `starter run` and its options
(RUN_OPTIONS), the table of subcommands (COMMANDS), and errors mapped to
exit codes.  No logic lives here.

The option parser is cli/parse.py (table-driven, not argparse); the other
subcommands live in cli/admin.py (the node's and its jobs' tools) and
cli/spool.py (`starter spool`), imported only when one of them runs: a
`starter run` loads neither.
"""

from starter.job import trace  # first: its clock starts with our first line

import errno
import gc
import os
import sys

# parse, help_text, need_root, quiet_stdout, UsageError, HelpRequested: also as cli.X
from starter.spec import registry
from starter.cli.parse import HelpRequested, UsageError, help_text, need_root, parse, quiet_stdout  # noqa: F401
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
  checkpoint JOB --to DIR [--leave-running]
                                dump the job with CRIU; `run --restore DIR` brings it back
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

# "--name" -> (name, kind, help): the option registry's (spec/registry.py)
RUN_OPTIONS = registry.cli_table()


# ------------------------------------------------------------ subcommands

def cmd_run(argv):
    if argv[:1] in (["--help"], ["-h"]):
        sys.stdout.write(help_text("usage: starter run [options] -- CMD [ARGS]", RUN_OPTIONS))
        return 0
    trace.mark("import")
    values, _, command = parse(argv, RUN_OPTIONS, usage="starter run [options] -- CMD [ARGS]")
    caller = pilot = None
    if os.geteuid() != 0 and os.getuid() != 0:
        # No root anywhere (a pilot's own jobs): the starter's own user
        # namespace first, while this process has no threads (rootless/).
        from starter.rootless import pilot as rootless

        pilot = rootless.begin(values.get("state-dir"))
        rootless.check_values(values)
        from starter.cgroups import warm_up

        warm_up()       # (a thread: after the user namespace, which wants none)
        trace.mark("warm-up")
    elif os.geteuid() == 0:
        # First: the first cgroup migration's RCU wait then overlaps what follows.
        from starter.cgroups import warm_up

        warm_up()
        trace.mark("warm-up")
        if "STARTER_CALLER" in os.environ:    # the set-user-ID launcher's (starter/callers/caller.py)
            from starter.callers.caller import from_environ

            caller = from_environ()
    from starter.job import watchdog
    from starter.spec import jobspec

    need_root("starter run")
    from starter.callers import policy

    watchdog.start()   # setup's deadline and signals, from here until the job runs
    if caller is not None and caller.fd is not None:
        from starter.callers.caller import relay

        relay(caller.fd)    # the caller's signals, as signals to us, from now on (caller.py)
    try:
        # A root caller may name another policy file (tests, a trial); a caller
        # that is not root has an empty environment here (the launcher's doing).
        image = None
        pol = policy.load(os.environ.get("STARTER_POLICY") or policy.PATH) if pilot is None else \
            rootless.policy(pilot)
        if "restore" in values:
            from starter.checkpoint import criu as checkpoint, directory as checkpoint_dir

            if command:
                raise UsageError("--restore takes no command: the job goes on with its own")
            image = checkpoint_dir.load(values["restore"], caller,
                                        jobspec.state_dir(values.get("state-dir") or pol.defaults.get("state-dir")))
            values = checkpoint.restore_values(image, values)
            command = values.pop("command", None)
        if caller is None:
            job_file = jobspec.load_job_file(values.pop("job")) if "job" in values else None
            if command:
                values["command"] = command
            js = jobspec.build(values, job_file, pol)
        else:
            # Every path the caller names is looked at with its rights, not root's.
            with caller.rights():
                job_file = jobspec.load_job_file(values.pop("job")) if "job" in values else None
                if command:
                    values["command"] = command
                js = jobspec.build(values, job_file, pol, caller)
    except BaseException:
        watchdog.claim()   # this failure is the one said (the watchdog stays out)
        if image is not None:
            image.close()
        raise
    if image is not None:
        js = js.replace(restore=image)
    if pilot is not None:
        js = rootless.check_spec(js)
    trace.mark("spec")
    from starter.job.run import run

    return run(js, caller, pol)


def _admin(name, *args):
    """A subcommand of cli/admin.py, imported when it runs."""
    def cmd(argv):
        from starter.cli import admin as cliadmin

        return getattr(cliadmin, name)(*args, argv)

    return cmd


def cmd_spool(argv):
    from starter.cli import spool as clispool

    return clispool.cmd_spool(argv)


def cmd_image(argv):
    from starter.cli import image as cliimage

    return cliimage.cmd_image(argv)


COMMANDS = {
    "run": cmd_run,
    "config": _admin("cmd_config"),
    "ns-exec": _admin("cmd_ns_exec"),
    "enter": _admin("cmd_enter"),
    "ps": _admin("cmd_ps"),
    "status": _admin("cmd_status"),
    "vacate": _admin("cmd_control", "vacate"),
    "checkpoint": _admin("cmd_checkpoint"),
    "suspend": _admin("cmd_control", "suspend"),
    "resume": _admin("cmd_control", "resume"),
    "kill": _admin("cmd_control", "kill"),
    "gc": _admin("cmd_gc"),
    "netd": _admin("cmd_netd"),
    "spool": cmd_spool,
    "image": cmd_image,
    "top": _admin("cmd_top"),
    "metrics": _admin("cmd_metrics"),
}


def __getattr__(name):
    """cli.SPOOL_NEEDS (the spool commands and what each needs): from
    cli/spool.py, loaded only when asked for."""
    if name == "SPOOL_NEEDS":
        from starter.cli.spool import SPOOL_NEEDS

        return SPOOL_NEEDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def launcher_code(repo, site):
    """What the `starter` command runs with `python -IS -c` (native/launcher.c,
    built by scripts/build-launcher; the bench and the tests run it too): the
    checkout and the venv's site-packages put back on sys.path (-S leaves
    them out), then entry()."""
    return f"import sys; sys.path[:0] = [{repo!r}, {site!r}]; from starter.cli.main import entry; entry()"


def entry():
    """The `starter` command (launcher, console script, python -m starter):
    main(), then leave without the interpreter's finalization (tearing down
    every module and a last GC: ~1.5 ms of each `starter run`, measured).  The
    starter registers no atexit handlers and runs no threads that must
    finish; stdout and stderr are flushed here.

    No cyclic garbage collection while `starter run` starts its job: the
    five young and one older collection that fell into every start's
    imports and parsing cost 0.4-0.9 ms (interleaved, 50 rounds).  job/run.py
    turns it back on once the job runs, over a frozen start-up heap.  Every
    other command (netd, metrics, top: some live long) keeps it."""
    if sys.argv[1:2] == ["run"]:
        gc.disable()
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
