"""Parsers of cgroup files' text (pure; unit-tested on fixture text in
tests/fixtures/cgroup/): keyed files, I/O and pressure totals."""


def parse_flat_keyed(text):
    """`key value` lines (cpu.stat, memory.stat, memory.events, cgroup.events,
    memory.oom_control, v1 cpu.stat) -> {key: int}.  Non-integer values are
    skipped rather than guessed."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out


def parse_nested_keyed(text):
    """`name k=v k=v` lines (io.stat, pressure files) -> {name: {k: value}}.

    Values are int where they parse as int, else float (avg10=0.12)."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if not parts:
            continue
        entry = {}
        for kv in parts[1:]:
            k, sep, v = kv.partition("=")
            if not sep:
                continue
            try:
                entry[k] = int(v)
            except ValueError:
                try:
                    entry[k] = float(v)
                except ValueError:
                    continue
        out[parts[0]] = entry
    return out


def io_stat_totals(text):
    """v2 io.stat -> (read_bytes, write_bytes) summed over devices."""
    r = w = 0
    for entry in parse_nested_keyed(text).values():
        r += entry.get("rbytes", 0)
        w += entry.get("wbytes", 0)
    return r, w


def blkio_totals(text):
    """v1 blkio.*io_service_bytes -> (read_bytes, write_bytes).

    Lines are `MAJ:MIN Read N` per device and operation, then one `Total N`
    line that sums everything: sum the per-device Read and Write lines and
    ignore the grand total."""
    r = w = 0
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        _, op, n = parts
        if op == "Read":
            r += int(n)
        elif op == "Write":
            w += int(n)
    return r, w


def pressure_totals(text):
    """A PSI file (cpu.pressure ...) -> {"some": total_us, "full": total_us}.

    `total=` is cumulative stall time in microseconds.  Older kernels have no
    "full" line in cpu.pressure; it is then absent from the dict."""
    if text is None:
        return None
    out = {}
    for name, entry in parse_nested_keyed(text).items():
        if "total" in entry:
            out[name] = int(entry["total"])
    return out or None
