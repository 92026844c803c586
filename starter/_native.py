"""The cffi shim (native/shim_*.c, interface native/shim.h), and -errno returns turned into OSError.

Every shim call returns 0 (or a fd) on success and -errno on failure;
`check` raises OSError(errno, "<operation> failed") so the message names what
the starter was doing.
"""

import os

from starter._shim import ffi, lib

__all__ = ["ffi", "lib", "check", "cap_last_cap"]


def check(ret, what):
    """Return `ret`, or raise OSError naming `what` if it is -errno."""
    if ret < 0:
        raise OSError(-ret, f"{what} failed: {os.strerror(-ret)}")
    return ret


_cap_last_cap = None


def cap_last_cap():
    """Highest capability number the kernel knows (read once, before any
    clone: the child cannot read files safely)."""
    global _cap_last_cap
    if _cap_last_cap is None:
        try:
            with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
                _cap_last_cap = int(f.read())
        except OSError:
            _cap_last_cap = 63  # PR_CAPBSET_DROP of an unknown cap is EINVAL: harmless
    return _cap_last_cap
