"""The command line's shared parts: the small table-driven option parser
(parse, help_text: a table of name -> (key, kind, help)), UsageError and
HelpRequested, and what every subcommand module uses (need_root,
quiet_stdout).  On the run path: cli/main.py's `starter run` parses with it.

Not argparse: argparse pulls in `re` and costs ~8 ms per start on these
machines, half the budget of a whole `starter run -- /bin/true`.
"""

import os
import sys

from starter.errors import StarterError


class UsageError(StarterError):
    pass


def leading_option(argv, name, default):
    """A subcommand's own option before its command (`starter spool --spool
    DIR ...`, `starter image --cache DIR ...`): its value, or `default`;
    taken off argv (a list)."""
    if not (argv[:1] and argv[0].startswith(name)):
        return default
    given, eq, value = argv.pop(0).partition("=")
    if given != name:
        raise UsageError(f"unknown option {given}")
    if not eq:
        if not argv:
            raise UsageError(f"{name} needs a value")
        value = argv.pop(0)
    return value


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


def quiet_stdout():
    """After EPIPE: point stdout at /dev/null so the interpreter's final
    flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
