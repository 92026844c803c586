"""The mount plan handed to the shim: what the job sees besides the host's /.

Applied in the child in this order, after / was made a slave mount (so
nothing propagates back to the host): fresh /proc (pid ns), fresh /sys (net
ns), a private /tmp, then these mounts in the order given.  A mount point must
exist, except inside a tmpfs this plan mounted (the private /tmp or an earlier
tmpfs entry), where the shim creates it.

A plain class rather than a dataclass: `import dataclasses` costs every job
~13 ms of start-up.
"""

import os

from starter.errors import SpecError
from starter.values import host_path as _host_path, path as _check_path, show as _show

KINDS = ("bind", "ro-bind", "tmpfs")
_KIND_CODE = {"bind": 1, "ro-bind": 2, "tmpfs": 3}  # SHIM_MOUNT_* in shim.h


class Mount:
    """One mount.  kind: "bind" | "ro-bind" | "tmpfs"; dst: absolute path in the
    job's view; src: the source of a bind (absolute, in the starter's view);
    options: tmpfs options such as "size=64m,mode=1777"."""

    __slots__ = ("kind", "dst", "src", "options")

    def __init__(self, kind, dst, src=None, options=""):
        for name, value in (("kind", kind), ("dst", dst), ("src", src), ("options", options)):
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self):
        if self.kind not in KINDS:
            raise SpecError("mount.kind", f"{_show(self.kind)} is not one of {', '.join(KINDS)}")
        _check_path("mount.dst", self.dst)
        if self.kind == "tmpfs":
            if self.src is not None:
                raise SpecError("mount.src", f"a tmpfs on {_show(self.dst)} takes no source")
            if not isinstance(self.options, str) or "\0" in self.options:
                raise SpecError("mount.options", f"bad tmpfs options for {_show(self.dst)}")
        else:
            if self.src is None:
                raise SpecError("mount.src", f"a {self.kind} on {_show(self.dst)} needs a source")
            _check_path("mount.src", self.src)
            if self.options:
                raise SpecError("mount.options", f"{self.kind} takes no options (got {_show(self.options)})")

    @classmethod
    def parse(cls, kind, text):
        """From the command line: "SRC:DST" (or "PATH" for SRC=DST) for binds,
        "DST[:OPTIONS]" for tmpfs.  A relative SRC is resolved against the
        caller's working directory (and is then also the DST if none is given)."""
        if kind == "tmpfs":
            dst, _, opts = text.partition(":")
            return cls("tmpfs", dst, None, opts)
        src, sep, dst = text.partition(":")
        src = _host_path("mount.src", src) if src and kind in KINDS else src
        return cls(kind, dst if sep else src, src)

    def __setattr__(self, name, value):
        raise AttributeError("Mount is frozen")

    def __eq__(self, other):
        return type(other) is Mount and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return (self.kind, self.dst, self.src, self.options)

    def __repr__(self):
        return f"Mount(kind={self.kind!r}, dst={self.dst!r}, src={self.src!r}, options={self.options!r})"


def to_c(ffi, mounts, keep, fds=None):
    """A `struct shim_mount[]` for the shim.  Every buffer it points to is
    appended to `keep`, which must outlive the clone.  With `fds` (a list),
    each bind source is opened (O_PATH) here, resolved without following
    links (paths.open_path; a link is refused), and the fd, which the caller
    closes after the clone, goes to the shim as src_fd."""
    arr = ffi.new("struct shim_mount[]", max(len(mounts), 1))
    for i, m in enumerate(mounts):
        if not isinstance(m, Mount):
            raise SpecError("mounts", f"{m!r} is not a Mount")
        c = arr[i]
        c.kind = _KIND_CODE[m.kind]
        c.src_fd = -1
        dst = ffi.new("char[]", os.fsencode(os.path.normpath(m.dst)))
        keep.append(dst)
        c.dst = dst
        if m.src is not None:
            src = ffi.new("char[]", os.fsencode(m.src))
            keep.append(src)
            c.src = src
            if fds is not None:
                from starter.paths import open_path

                fd, _st = open_path(m.src, "bind source")
                fds.append(fd)
                c.src_fd = fd
        if m.options:
            data = ffi.new("char[]", m.options.encode())
            keep.append(data)
            c.data = data
    keep.append(arr)
    return arr
