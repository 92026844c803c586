"""`starter top JOB` and `starter status JOB --processes`: the job's
processes, read from its cgroup (every hierarchy, every sub-cgroup the job
made), not from a walk of the process tree, so a double-forked daemon is
listed too.

Per process: pid on the host, pid inside the job (the last NSpid of
/proc/PID/status), user, state, cpu% over the refresh window, rss and the
command line.  psutil does the /proc parsing; it is imported here only, off
the run path.

Everything shown comes from the job: the command line and even the process
name are the job's to choose, so control characters are replaced before
they reach a terminal (no escape-sequence injection into the admin's tty).
"""

import sys
import time

from starter.errors import StarterError

DEFAULT_INTERVAL = 2.0
DEFAULT_ONCE_WINDOW = 0.5
COLUMNS = (("pid", "PID"), ("nspid", "JOBPID"), ("user", "USER"), ("state", "S"),
           ("cpu_percent", "CPU%"), ("rss_bytes", "RSS"), ("command", "COMMAND"))


def printable(text):
    """What the job named (its commands) as the terminal may show it: control
    characters (C0, DEL, C1), format characters (the bidi overrides and
    isolates that reorder a line, zero-width ones), separators other than
    the space and unassigned code points -> '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def ns_pid(pid):
    """The pid in the innermost PID namespace (the job's), from NSpid."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def in_job(pid, job_id):
    """Is pid (still) in the job's cgroup or below it?  Guards against a pid
    that exited and was reused between reading cgroup.procs and /proc."""
    want = "job-" + job_id
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(want in line.rstrip("\n").split(":", 2)[-1].split("/") for line in f)
    except OSError:
        return False


class Sampler:
    """Keeps psutil.Process objects between refreshes so cpu% covers the
    time since the previous one."""

    def __init__(self, cg, job_id):
        self.job_id = job_id
        self.cg = cg
        self.procs = {}

    def prime(self):
        self._refresh()

    def _refresh(self):
        import psutil

        pids = set(self.cg.pids())
        for pid in list(self.procs):
            if pid not in pids:
                del self.procs[pid]
        for pid in pids:
            if pid in self.procs:
                continue
            try:
                p = psutil.Process(pid)
                p.cpu_percent(None)       # starts the window for this process
            except psutil.Error:
                continue
            self.procs[pid] = p

    def rows(self):
        import psutil

        self._refresh()
        out = []
        for pid, p in sorted(self.procs.items()):
            try:
                with p.oneshot():
                    cpu = p.cpu_percent(None)
                    rss = p.memory_info().rss
                    status = p.status()
                    try:
                        user = p.username()
                    except (KeyError, psutil.Error):
                        user = str(p.uids().real)
                    cmd = p.cmdline()
                    command = " ".join(cmd) if cmd else f"[{p.name()}]"
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            except psutil.AccessDenied:
                continue
            if not in_job(pid, self.job_id):
                continue
            out.append({"pid": pid, "nspid": ns_pid(pid), "user": user, "state": status,
                        "cpu_percent": round(cpu, 1), "rss_bytes": rss, "command": command})
        return out


def sample(cg, job_id, window=DEFAULT_ONCE_WINDOW):
    """The processes in the job's cgroup `cg` now, cpu% measured over `window` seconds."""
    s = Sampler(cg, job_id)
    s.prime()
    time.sleep(window)
    return s.rows()


def _size(n):
    for unit in ("", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def table(rows):
    """Rows -> aligned text; the command column last and unpadded."""
    lines = [[h for _, h in COLUMNS]]
    for r in rows:
        cells = []
        for key, _ in COLUMNS:
            v = r.get(key)
            if v is None:
                v = "-"
            elif key == "rss_bytes":
                v = _size(v)
            cells.append(printable(str(v)))
        lines.append(cells)
    widths = [max(len(l[i]) for l in lines) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(c.rjust(w) if i in (0, 1, 4, 5) else c.ljust(w)
                               for i, (c, w) in enumerate(zip(l, widths))) + "  " + l[-1] for l in lines)


def main(st, cg, job_id, interval=None, once=False, as_json=False):
    """`starter top`: `st` is the job's state entry, `cg` its cgroup (admin.top
    finds both)."""
    from starter.state import store as S

    if once:
        rows = sample(cg, job_id, DEFAULT_ONCE_WINDOW if interval is None else interval)
        if as_json:
            print(S.dumps(rows))
        else:
            print(table(rows))
        return 0
    interval = DEFAULT_INTERVAL if interval is None else interval
    sampler = Sampler(cg, job_id)
    sampler.prime()
    tty = sys.stdout.isatty()
    while True:
        time.sleep(interval)
        if not S.starter_alive(st):
            print(f"job {job_id} has ended")
            return 0
        try:
            rows = sampler.rows()
        except StarterError:
            print(f"job {job_id} has ended")
            return 0
        cpu = sum(r["cpu_percent"] for r in rows)
        rss = sum(r["rss_bytes"] for r in rows)
        head = (f"job {printable(job_id)}  {time.strftime('%H:%M:%S')}  {len(rows)} processes  "
                f"cpu {cpu:.1f}%  rss {_size(rss)}  (every {interval:g} s, ^C to quit)")
        if tty:
            sys.stdout.write("\033[H\033[2J")
        sys.stdout.write(head + "\n" + table(rows) + "\n" + ("" if tty else "\n"))
        sys.stdout.flush()
