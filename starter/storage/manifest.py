"""Verified inputs: files checked against a signature file whose own digest is trusted.

The glidein scheme: the trusted argument (the job's command line, which the
submitter cannot change) carries the SHA-256 of a signature file; the
signature file lists the SHA-256 of every input.  So:

  1. read the signature file once into memory, compare its SHA-256 with the
     trusted digest in constant time, and parse only those bytes;
  2. for each listed file: open it once (O_NOFOLLOW) from the source dir, hash
     it while copying it into the job's scratch (temp name, fsync), and only
     if the digest matches give it its name there, owned by the job user;
  3. the caller runs the verified copies: nothing is read again from a path
     that could have changed after the check.

Any mismatch removes whatever was staged and raises StagingError naming the
file.  Signature file format is sha256sum's output:

    <64 hex>  <name>        text mode
    <64 hex> *<name>        binary mode (same thing here)
    <64 hex> x<name>        our extension: stage it executable (0755)

Names are plain file names (no '/', not '.' or '..', no NUL, no leading '-').
Blank lines and lines starting with '#' are ignored.  A staged file is 0755 if
the line says 'x' or the source had an exec bit, else 0644.
"""

import errno
import hashlib
import hmac
import os
import stat

from starter.job import watchdog
from starter.spec import values
from starter.errors import SpecError, StagingError
from starter.fileio import NoRoom, TooLarge, copy_hashing, read_limited, sized_to_fit, unlink_best_effort, unlink_quiet

MAX_SIGFILE = 4 << 20


def check_name(name, where="manifest"):
    """A plain file name (values.filename) that does not look like an option."""
    try:
        values.filename(where, name)
        bad = name.startswith("-")
    except SpecError:
        bad = True
    if bad:
        raise StagingError(
            f"{where}: {name!r} is not a plain file name",
            hint="list plain names relative to the source directory: no '/', '.', '..', NUL or leading '-'",
        )
    return name


def parse(data, source="manifest"):
    """Signature file bytes -> [(name, hexdigest, executable)] in file order."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StagingError(f"{source}: not UTF-8 text (byte {e.start})") from None
    out, seen = [], set()
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}: line {lineno}"
        if line.startswith("\\"):
            raise StagingError(f"{where}: escaped file names are not supported", hint="rename the file")
        digest, mode, name = line[:64].lower(), line[65:66], line[66:]
        if len(line) < 67 or not set(digest) <= values.HEX_DIGITS or len(digest) != 64 or line[64] != " " or mode not in " *x":
            raise StagingError(
                f"{where}: expected '<sha256 hex>  <name>' (or ' *<name>', ' x<name>'), got {line[:80]!r}",
                hint="generate it with `sha256sum FILE...`",
            )
        check_name(name, where)
        if name in seen:
            raise StagingError(f"{where}: {name} is listed twice")
        seen.add(name)
        out.append((name, digest, mode == "x"))
    return out


def read_sigfile(sigfile, trusted_digest):
    """Read the signature file once and check it against the trusted digest -> its bytes."""
    from starter.storage import paths

    want = values.sha256_digest("manifest-digest", trusted_digest)

    try:  # no link followed, a FIFO or device refused without blocking
        fd = paths.open_file(sigfile, "manifest: signature file")
    except paths.LinkError as e:
        raise StagingError(e.args[0], e.hint) from None
    try:
        data = read_limited(fd, MAX_SIGFILE)
    except TooLarge:
        raise StagingError(f"manifest: signature file {sigfile} is over {MAX_SIGFILE} bytes") from None
    finally:
        os.close(fd)
    got = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(got, want):
        raise StagingError(
            f"manifest: signature file {sigfile}: sha256 mismatch with the trusted digest (expected {want}, got {got})",
            hint="the signature file changed, or --manifest-digest is stale",
        )
    return data


def verify_and_stage(sigfile, trusted_digest, src_dir, dest_dir, uid, gid):
    """Check the signature file, then copy+verify every file it lists into `dest_dir`.

    `dest_dir` is a path or an open directory fd (e.g. Scratch.fd).  Returns
    {name: staged path}.  On any failure nothing listed is left in `dest_dir`.
    """
    entries = parse(read_sigfile(sigfile, trusted_digest), source=f"manifest {sigfile}")
    from starter.storage import paths

    try:
        sfd = paths.open_dir(src_dir, "manifest: source directory", readable=True)
    except paths.LinkError as e:
        raise StagingError(e.args[0], e.hint) from None
    own_dfd = not isinstance(dest_dir, int)
    try:
        dfd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC) if own_dfd else dest_dir
    except OSError as e:
        os.close(sfd)
        raise StagingError(f"manifest: cannot open destination {dest_dir}: {e.strerror}") from None
    dest_path = dest_dir if own_dfd else os.readlink(f"/proc/self/fd/{dfd}")
    staged = {}
    try:
        for name, digest, executable in entries:
            _stage_one(sfd, dfd, name, digest, executable, uid, gid, src_dir)
            staged[name] = os.path.join(dest_path, name)
        os.fsync(dfd)
    except BaseException:
        for name in staged:
            unlink_best_effort(name, dfd)
        raise
    finally:
        os.close(sfd)
        if own_dfd:
            os.close(dfd)
    return staged


def _stage_one(sfd, dfd, name, digest, executable, uid, gid, src_dir):
    try:
        with watchdog.region(f"manifest: input {name} in {src_dir}"):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
    except OSError as e:
        why = "is a symlink (not followed)" if e.errno == errno.ELOOP else e.strerror
        raise StagingError(f"manifest: {name}: {why} in {src_dir}") from None
    tmp = f".stage-{os.urandom(6).hex()}"
    out = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StagingError(f"manifest: {name}: not a regular file in {src_dir}")
        try:  # the input is not verified yet: root copies it only within bounds
            size = sized_to_fit(fd, dfd)
        except NoRoom as e:
            raise StagingError(f"manifest: {name}: {e.strerror} where the job's scratch is",
                               hint="free space there, or check the input") from None
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with watchdog.region(f"manifest: input {name} in {src_dir}"):
                got = copy_hashing(fd, out, ("sha256",), limit=size)["sha256"]
        except OSError as e:
            raise StagingError(f"manifest: {name}: {e.strerror} (in {src_dir})") from None
        if not hmac.compare_digest(got, digest):
            raise StagingError(
                f"manifest: {name}: sha256 mismatch (expected {digest}, got {got})",
                hint=f"the file in {src_dir} is not the one the signature file lists",
            )
        os.fchmod(out, 0o755 if executable or st.st_mode & 0o111 else 0o644)
        os.fchown(out, uid, gid)
        os.fsync(out)
        os.close(out)
        out = None
        try:  # link, not rename: never replace a name that is already there
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            raise StagingError(f"manifest: {name}: already exists in the destination") from None
    finally:
        os.close(fd)
        if out is not None:
            os.close(out)
        unlink_quiet(tmp, dfd)

