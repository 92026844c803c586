"""STARTER_TRACE=1: milliseconds per phase of a `starter run`, on stderr.

    STARTER_TRACE=1 starter run --net none -- /bin/true
    starter: trace   interpreter  7.91 ms  (CPU before the first line of starter ran)
    starter: trace        import  1.20 ms
    ...
    starter: trace         total 14.02 ms  (from the first line of starter)

Each mark("name") closes the phase that ran since the previous mark.  Unset,
mark() is one compare; the clock is read only when tracing.  Kept in the
code (not a profiler run) so a regression on the start path shows up as one
phase growing: scripts/bench prints the same phases.
"""

import os
import time

ON = bool(os.environ.get("STARTER_TRACE"))
_marks = []            # (phase, seconds since the previous mark)
_t0 = _last = time.perf_counter() if ON else 0.0
# CPU the interpreter spent before the first line of ours: its start-up.
_before = time.process_time() if ON else 0.0


def mark(phase):
    """End `phase` now (it began at the previous mark)."""
    global _last
    if ON:
        t = time.perf_counter()
        _marks.append((phase, t - _last))
        _last = t


def report(out=None):
    """Write the phases (once; later calls add only new marks)."""
    if not ON or not _marks:
        return
    import sys

    out = out or sys.stderr
    lines = []
    if _before is not None:
        lines.append(f"starter: trace {'interpreter':>13} {_before * 1000:6.2f} ms  "
                     "(CPU before the first line of starter ran)")
    for phase, dt in _marks:
        lines.append(f"starter: trace {phase:>13} {dt * 1000:6.2f} ms")
    lines.append(f"starter: trace {'total':>13} {(_last - _t0) * 1000:6.2f} ms  (from the first line of starter)")
    out.write("\n".join(lines) + "\n")
    out.flush()
    _marks.clear()
    globals()["_before"] = None
