"""A delegated job's sub-cgroups, whose names and shapes the job controls:
walked below the job's cgroup without following a link, each one's figures
read for the report, its path shown escaped."""

import os

from .parsers import parse_flat_keyed

NAME_MAX_SHOWN = 256  # characters of an escaped cgroup path in the report
_WALK_MAX_DEPTH = 32  # beyond the starter's cgroup.max.depth, in case


def show_name(raw):
    """A cgroup path the job chose (bytes) -> printable ASCII: bytes outside
    0x21..0x7e and the backslash become \\xNN; longer than NAME_MAX_SHOWN,
    cut and ended with "..."."""
    out = "".join(chr(b) if 0x21 <= b <= 0x7E and b != 0x5C else f"\\x{b:02x}" for b in raw)
    return out if len(out) <= NAME_MAX_SHOWN else out[: NAME_MAX_SHOWN - 3] + "..."


def _read_at(dir_fd, name):
    """A cgroup file's text below dir_fd (never through a link), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def cgroup_figures(dir_fd):
    """One cgroup's own usage (hierarchical: it and everything below it):
    cpu_s (cpu.stat usage_usec), memory_peak_bytes (memory.peak, left out
    where the kernel has none), memory_max_bytes (None: max), oom, oom_kill,
    oom_group_kill (memory.events), oom_local and oom_kill_local
    (memory.events.local: this cgroup's own limit was reached / processes
    of this very cgroup the OOM killer took)."""
    out = {}
    cpu = parse_flat_keyed(_read_at(dir_fd, "cpu.stat"))
    if "usage_usec" in cpu:
        out["cpu_s"] = round(cpu["usage_usec"] / 1e6, 6)
    peak = _read_at(dir_fd, "memory.peak")
    if peak is not None and peak.strip().isdigit():
        out["memory_peak_bytes"] = int(peak)
    mx = _read_at(dir_fd, "memory.max")
    if mx is not None:
        mx = mx.strip()
        out["memory_max_bytes"] = int(mx) if mx.isdigit() else None
    ev = _read_at(dir_fd, "memory.events")
    if ev is not None:
        ev = parse_flat_keyed(ev)
        for k in ("oom", "oom_kill", "oom_group_kill"):
            out[k] = ev.get(k, 0)
        local = _read_at(dir_fd, "memory.events.local")
        if local is not None:
            local = parse_flat_keyed(local)
            out["oom_local"] = local.get("oom", 0)
            out["oom_kill_local"] = local.get("oom_kill", 0)
    return out


def ran_out_of_memory(fig):
    """cgroup_figures() -> did this cgroup reach its own memory limit and
    the OOM killer kill in it?  (Not: a process in it was a victim of an
    OOM of an ancestor, such as the whole job's.)"""
    return fig.get("oom_local", fig.get("oom", 0)) > 0 and fig.get("oom_kill", 0) > 0


def subtree_figures(top, limit):
    """cgroup_figures() of every cgroup below `top`, depth first in name
    order, each with "name" (its path below `top`, show_name()), at most
    `limit` of them -> (list, number of cgroups left out).  Directories are
    opened relative to their parent's fd with O_NOFOLLOW: a job renaming or
    linking things meanwhile cannot send the walk outside `top`."""
    out, left_out = [], 0
    try:
        top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return out, 0

    def walk(fd, prefix, depth):
        nonlocal left_out
        try:
            with os.scandir(fd) as it:
                names = sorted(os.fsencode(e.name) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for name in names:
            try:
                cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            try:
                path = prefix + b"/" + name if prefix else name
                if len(out) < limit:
                    rec = {"name": show_name(path)}
                    rec.update(cgroup_figures(cfd))
                    out.append(rec)
                else:
                    left_out += 1
                if depth < _WALK_MAX_DEPTH:
                    walk(cfd, path, depth + 1)
            finally:
                os.close(cfd)

    try:
        walk(top_fd, b"", 1)
    finally:
        os.close(top_fd)
    return out, left_out
