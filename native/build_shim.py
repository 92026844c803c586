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


ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "starter._shim",
    '#include "shim.h"',
    sources=[os.path.relpath(os.path.join(_here, f)) for f in ("shim.c", "seccomp.c", "uidkill.c", "devices.c")],
    include_dirs=[os.path.relpath(_here)],
    libraries=["seccomp"],  # libseccomp-dev: native/seccomp.c, run in the parent only
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
