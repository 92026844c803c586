"""The job file: read strictly (JSON or TOML, a regular file of at most
1 MiB, no duplicate keys) and flattened into the command line's option names
(FILE_KEYS, LIMIT_KEYS, NET_KEYS: the file's key -> the option), which
spec.build merges with the flags.  Imported only for a job given a file.
"""

import os

from starter.isolate import mounts as M
from starter.spec import registry as R, values as V
from starter.errors import SpecError

# The file's key -> the option, from the option registry; limits, network,
# mounts and rlimits are read below, command is not an option.
FILE_KEYS = {"command": "command", "limits": None, "network": None, "mounts": None, "rlimits": None}
FILE_KEYS.update({k: v for k, v in R.file_keys().items() if k not in FILE_KEYS})
LIMIT_KEYS = R.file_keys("limits")
NET_KEYS = R.file_keys("network")


def flatten(doc):
    """A parsed job file -> (option name, value) pairs."""
    if not isinstance(doc, dict):
        raise SpecError("job", "the job file must hold a JSON object")
    for key, val in doc.items():
        if key not in FILE_KEYS:
            raise SpecError(key, f"unknown key (known: {', '.join(sorted(FILE_KEYS))})")
        if key == "env":
            if not isinstance(val, dict):
                raise SpecError("env", "must be an object of NAME: value")
            yield "env", [(k, v) for k, v in val.items()]
        elif key == "limits":
            yield from _sub(val, "limits", LIMIT_KEYS)
        elif key == "network":
            if isinstance(val, str):
                yield "net", val
            else:
                yield from _sub(val, "network", NET_KEYS)
        elif key == "mounts":
            if not isinstance(val, list):
                raise SpecError("mounts", "must be a list")
            mounts = []
            for i, m in enumerate(val):
                f = f"mounts[{i}]"
                if not isinstance(m, dict) or set(m) - {"type", "src", "dst", "options"} or "type" not in m:
                    raise SpecError(f, "must be {type, src, dst[, options]}")
                kind = m["type"]
                if kind not in M.KINDS:
                    raise SpecError(f + ".type", f"{V.show(kind)} is not one of {', '.join(M.KINDS)}")
                if kind == "tmpfs":
                    mounts.append((kind, V.string(f, m.get("dst", "")) + (":" + V.string(f, m["options"]) if m.get("options") else "")))
                else:
                    mounts.append((kind, V.string(f, m.get("src", "")) + ":" + V.string(f, m.get("dst", m.get("src", "")))))
            yield "mounts", mounts
        elif key == "rlimits":
            if not isinstance(val, dict):
                raise SpecError("rlimits", 'must be an object of NAME: "SOFT[:HARD]" (or a number)')
            items = []
            for k, v in val.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    v = str(v)
                items.append(f"{V.string('rlimits', k)}={V.string('rlimits.' + k, v)}")
            yield "rlimit", items
        elif key == "command":
            if not isinstance(val, list) or not all(isinstance(a, str) for a in val):
                raise SpecError("command", "must be a list of strings")
            yield "command", val
        else:
            yield FILE_KEYS[key], val


def _sub(val, name, keys):
    if not isinstance(val, dict):
        raise SpecError(name, "must be an object")
    for k, v in val.items():
        if k not in keys:
            raise SpecError(f"{name}.{k}", f"unknown key (known: {', '.join(sorted(keys))})")
        yield keys[k], v


def load_job_file(path):
    """Parse a job file strictly: JSON (duplicate keys are an error), or TOML
    when the name ends in .toml (TOML itself forbids duplicate keys)."""
    import json

    def no_dups(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise SpecError(k, "duplicate key in job file")
            seen[k] = v
        return seen

    path = V.string("job", path)          # relative: to the caller's cwd, as open() does
    import stat

    try:
        # A regular file only, looked at before it is opened (non-blocking):
        # a FIFO or a device there must not hang the start or arm anything.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SpecError("job", f"{V.show(path)} is not a regular file")
        with open(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SpecError("job", f"{V.show(path)} is not a regular file")
            data = f.read((1 << 20) + 1)
    except OSError as e:
        raise SpecError("job", f"cannot read {V.show(path)}: {e.strerror}") from None
    if len(data) > 1 << 20:
        raise SpecError("job", "job file larger than 1 MiB")
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:
            raise SpecError("job", "TOML job files need Python 3.11 or later; use JSON") from None
        try:
            return tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise SpecError("job", "job file is not UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise SpecError("job", f"not valid TOML: {e}") from None
        except ValueError as e:         # e.g. an integer of more than 4300 digits
            raise SpecError("job", f"not usable TOML: {e}") from None
        except RecursionError:
            raise SpecError("job", "job file nested too deeply") from None
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_dups)
    except UnicodeDecodeError:
        raise SpecError("job", "job file is not UTF-8") from None
    except ValueError as e:
        raise SpecError("job", f"not valid JSON: {e}") from None
    except RecursionError:
        raise SpecError("job", "job file nested too deeply") from None
