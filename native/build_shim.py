"""cffi (API mode) build of the native shim: starter._shim.

The cdef is the block of native/shim.h between the cffi markers, so the
header stays the one description of the interface.
"""
import os

import cffi

_here = os.path.dirname(os.path.abspath(__file__))


def _cdef():
    with open(os.path.join(_here, "shim.h")) as f:
        text = f.read()
    start = text.index("/* cffi-begin */") + len("/* cffi-begin */")
    return text[start : text.index("/* cffi-end */")]


# The shim by concern (shim_internal.h lists what each file owns), then the
# parent-side helpers.
SOURCES = (
    "shim_clone.c", "shim_report.c", "shim_mount.c", "shim_mountfd.c", "shim_creds.c",
    "shim_reset.c", "shim_fds.c", "shim_exec.c", "shim_init.c", "shim_enter.c",
    "seccomp.c", "uidkill.c", "devices.c", "threadcreds.c", "shim_image.c",
)

ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "starter._shim",
    '#include "shim.h"',
    sources=[os.path.relpath(os.path.join(_here, f)) for f in SOURCES],
    include_dirs=[os.path.relpath(_here)],
    libraries=["seccomp"],  # libseccomp-dev: native/seccomp.c, run in the parent only
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
