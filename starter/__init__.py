"""starter: launch one batch job in its own namespaces, cgroup and network.

Started as the `starter` command runs it (python -I -S: the launcher), the
package serves its modules from one file, starter/__pycache__/bundle.<tag>
(made by scripts/setup: starter/bundle.py), instead of finding, opening and
reading a .pyc per module: about 2 ms of every `starter run`.  A module
whose source changed since (its mtime or size) is imported the usual way,
unless a new bundle has replaced the one this process read (an upgrade
under a running starter): its modules then all come from the version it
started with."""
__version__ = "0.1.0"


def _serve_bundle():
    import marshal
    import os
    import sys

    here = __path__[0]
    path = os.path.join(here, "__pycache__", "bundle." + sys.implementation.cache_tag)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        table = marshal.loads(os.pread(fd, n, 8))
    except (OSError, ValueError, EOFError, TypeError):
        os.close(fd)
        return
    base = 8 + n
    spec_class = type(sys.__spec__)

    class Loader:
        @staticmethod
        def create_module(spec):
            return None

        @staticmethod
        def exec_module(module):
            e = table[module.__name__]
            src = module.__file__ = module.__spec__.origin
            try:
                code = marshal.loads(os.pread(fd, e[4], base + e[3]))
            except (OSError, ValueError, EOFError, TypeError):     # a damaged bundle: the source
                with open(src, "rb") as f:
                    code = compile(f.read(), src, "exec", dont_inherit=True)
            exec(code, module.__dict__)

    def replaced():
        """Is the bundle we read no longer the one at its path?  An upgrade
        (the package's, or scripts/setup's) wrote a new one: then a module
        this process has yet to import still comes from ours, so that it
        runs the code it started with, not half of each version."""
        try:
            now = os.stat(path)
        except OSError:
            return True
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            e = table.get(name)
            if e is None:
                return None
            src = here + e[0]
            try:
                st = os.stat(src)
            except OSError:
                st = None
            if (st is None or st.st_mtime_ns != e[1] or st.st_size != e[2]) and not replaced():
                return None
            spec = spec_class(name, Loader, origin=src, is_package=e[5])
            spec.has_location = True
            if e[5]:
                spec.submodule_search_locations = [os.path.dirname(src)]
            return spec

    sys.meta_path.insert(0, Finder)


import sys as _sys

if _sys.flags.isolated and _sys.flags.no_site:     # the launcher's -I -S
    _serve_bundle()
