"""Atomic file and directory writes: write to a temporary name in the same directory, then rename.

A reader (or a crashed run) never sees a half-written file or directory under the final name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import glob
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from moe_train.errors import MACHINE_ERRNOS, DataError

try:  # POSIX only
    import resource
except ImportError:  # pragma: no cover
    resource = None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _not_a_file(path: Path) -> bool:
    """`path` is there and is neither a regular file nor a directory: a device, a pipe, a
    socket (`/dev/null`, a shell's `>(...)`), followed through symlinks."""
    try:
        mode = path.stat().st_mode
    except OSError:  # not there (or a dangling link): a new file
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _fd_name(path: str) -> bool:
    """`path` (absolute) names a file descriptor or a device: under /proc, or under /dev but
    for /dev/shm (an ordinary tmpfs)."""
    parts = Path(path).parts
    return parts[1:2] == ("proc",) or (parts[1:2] == ("dev",) and parts[2:3] != ("shm",))


def write_target(path: str | os.PathLike) -> tuple[Path, bool]:
    """Where a write to `path` lands and whether it must be written in place.

    In place (`path`, True): a device, pipe or socket (`/dev/null`, a shell's `>(...)`), or a
    file descriptor's name (`/dev/stdout`, `/proc/self/fd/1`), also at the end of a symlink
    chain. Renaming onto one would destroy it (as root, /dev/null itself) instead of writing
    to it. Otherwise (file, False): the path itself, or for a symlink the file it leads to,
    so that the link is kept and its target replaced."""
    path = Path(path)
    hop = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a symlink chain
        if _fd_name(hop):
            return path, True
        if not os.path.islink(hop):
            break
        hop = os.path.join(os.path.realpath(os.path.dirname(hop)), os.readlink(hop))
        hop = os.path.normpath(hop)
    if _not_a_file(path):
        return path, True
    return (Path(os.path.realpath(path)) if path.is_symlink() else path), False


_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")
_SHORT_WRITE_RE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile / np.save
_TORCH_WRITER = ("PytorchStreamWriter", "inline_container.cc")


def _probed_errno(final: str | os.PathLike, tmp: Path | None) -> int:
    """The errno behind a library's failed write that carries none (torch.save, numpy), found
    while what failed (`tmp`, a file or a directory; None for a device written in place) still
    holds its space: ENOSPC when its file system has under 1 MiB left; else the errno of a
    small probe write where it was written (EDQUOT for a full quota, which leaves the disk's
    free space alone); else EFBIG when a file written reached the process's file-size limit;
    else EIO."""
    place = tmp if tmp is not None and tmp.exists() else Path(os.path.realpath(final))
    try:
        while not place.exists() and place != place.parent:
            place = place.parent
        vfs = os.statvfs(place)
        if vfs.f_bavail * vfs.f_frsize < 1 << 20:
            return errno.ENOSPC
    except OSError:
        return errno.EIO
    if tmp is None or not tmp.exists():
        return errno.EIO
    code = _probe_write(tmp if tmp.is_dir() else tmp.parent)
    if code is not None:
        return code
    if resource is not None:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and _largest_file(tmp) >= limit:
            return errno.EFBIG
    return errno.EIO


def _largest_file(path: Path) -> int:
    """Size of `path`, or of the largest file under it (0 for none)."""
    if not path.is_dir():
        return path.stat().st_size if path.is_file() else 0
    return max((p.stat().st_size for p in path.rglob("*") if p.is_file()), default=0)


def _probe_write(directory: Path) -> int | None:
    """The errno of writing and syncing 64 KiB to a temporary file in `directory` (removed
    again), or None when that succeeds."""
    try:
        fd, name = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=directory)
    except OSError as exc:
        return exc.errno
    code = None
    try:
        data = memoryview(bytes(1 << 16))
        while data:  # a write near a limit may be short before it fails
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError as exc:
        code = exc.errno
    try:
        os.close(fd)  # a network file system may report the failure only here
    except OSError as exc:
        code = code or exc.errno
    with contextlib.suppress(OSError):
        os.unlink(name)
    return code


def _library_write_error(exc: Exception, final: str | os.PathLike,
                         tmp: Path | None) -> int | None:
    """The errno behind a library's failed write that carries none, or None for any other
    error: safetensors says "(os error N)"; torch.save's zip writer raises a RuntimeError and
    numpy's short write an OSError, both without an errno (`_probed_errno`)."""
    text = str(exc)
    if type(exc).__name__ == "SafetensorError":
        match = _OS_ERROR_RE.search(text)
        return int(match.group(1)) if match else None
    if isinstance(exc, OSError) and exc.errno is None and _SHORT_WRITE_RE.search(text):
        return _probed_errno(final, tmp)
    if isinstance(exc, RuntimeError) and any(m in text for m in _TORCH_WRITER):
        return _probed_errno(final, tmp)
    return None


def _under(final: Path, tmp: Path | None, name: Any) -> str | None:
    """An error's file `name` as the path it will have under `final`, when it is `tmp` or lies
    below it (a directory being written); None otherwise."""
    if tmp is None or name is None or isinstance(name, int):
        return None
    try:
        rel = Path(os.fsdecode(name)).relative_to(tmp)
    except (TypeError, ValueError):
        return None
    return str(final / rel) if rel.parts else str(final)


@contextlib.contextmanager
def write_errors_naming(final: str | os.PathLike, tmp: Path | None = None) -> Iterator[None]:
    """Make an error raised while writing `final` (a file, or a directory written as `tmp`) an
    OSError that names what the user asked for: one about the temporary file or a file in the
    temporary directory (hidden names, gone by the time anyone reads the error; for a copy,
    its destination, not the source it names first), one that names no file and says the
    machine refused the write (a full disk: ENOSPC at flush), or a library's failed write
    (torch.save, safetensors, numpy) that carries no errno or name. The block should only
    write; any other error is left as it is."""
    final = Path(final)
    try:
        yield
    except Exception as exc:
        code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else \
            _library_write_error(exc, final, tmp)
        if code is None:
            raise
        names = (exc.filename2, exc.filename) if isinstance(exc, OSError) else ()
        named = next((n for n in (_under(final, tmp, name) for name in names) if n), None)
        if named is None:
            if any(name is not None for name in names) or code not in MACHINE_ERRNOS:
                raise  # about another file (an input), or not the machine: left as it is
            named = str(final)
        raise OSError(code, os.strerror(code), named) from exc


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path beside `final`; rename it onto `final` on success.

    What `write_target` says to write in place (`--output /dev/null`, `--json /dev/stdout`) is
    yielded as it is: it has no content to protect and must not be replaced. A symlink is kept
    and the file it leads to replaced; that file's directory must exist (as for `open`)."""
    target, in_place = write_target(final)
    if in_place:
        with write_errors_naming(final):
            yield target
        return
    if not Path(final).is_symlink():
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:  # a full disk or a read-only directory: name the output
        raise OSError(exc.errno, exc.strerror, str(final)) from exc
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with write_errors_naming(final, tmp_path):
            yield tmp_path
            # mkstemp makes 0600, and so may a writer that makes its own file there
            # (safetensors): give the usual permissions once the content is written
            os.chmod(tmp_path, 0o666 & ~_umask())
            os.replace(tmp_path, target)  # EBUSY on a bind-mounted file, EPERM under sticky bit
        _fsync_dir(target.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it onto `final` on success.

    With `overwrite`, an existing `final` is replaced only after the new directory is complete,
    in one atomic swap where the file system has one (else moved aside, then removed). A
    symlink is kept and the directory it leads to replaced (`--out latest -> runs/7`), as
    `atomic_path` does for a file.
    """
    final = Path(os.path.abspath(final))  # `.` has no name to put a temporary beside
    if final.is_symlink():
        final = Path(os.path.realpath(final))
    if _not_a_file(final):
        raise FileExistsError(f"{final}: is neither a directory nor a file; not replacing it")
    final.parent.mkdir(parents=True, exist_ok=True)
    _recover(final)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    except OSError as exc:  # a full disk or a read-only directory: name the output
        raise OSError(exc.errno, exc.strerror, str(final)) from exc
    _, held = _hold(tmp)  # another run's _recover leaves a directory being written alone
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; other ranks/users may read it
    try:
        with write_errors_naming(final, tmp):
            yield tmp
        if final.exists() and not overwrite:
            raise FileExistsError(f"{final}: already exists")
        replace_dir(tmp, final)
        _fsync_dir(final.parent)
    finally:
        _remove(tmp)  # after a swap, the previous content
        if held is not None:
            os.close(held)


def replace_dir(new: Path, final: Path) -> None:
    """Put the directory `new` at `final`, removing what was there: in one atomic swap where
    the file system has one (a reader of `final` sees the old or the new content, never
    neither), else moved aside first (`_recover` puts it back if killed in between)."""
    if not final.exists():
        os.replace(new, final)
    elif _exchange(new, final):
        _remove(new)  # after the swap: the previous content
    else:
        old = final.with_name(f".{final.name}.old")
        _remove(old)
        os.replace(final, old)
        os.replace(new, final)
        _remove(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    """The C library's renameat2 (glibc >= 2.28), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux RENAME_EXCHANGE), so that a reader of `b`
    sees the old or the new content, never neither. False where the C library, the kernel or
    the file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # EPERM: a seccomp filter; a real refusal recurs in the fallback
    raise OSError(code, os.strerror(code), str(b))


def _recover(final: Path) -> None:
    """Undo what a killed `atomic_dir` left beside `final`: its previous content moved aside
    (killed between the two renames, so `final` is missing) goes back, and half-written
    temporary directories (each the size of what was being written) are removed."""
    old = final.with_name(f".{final.name}.old")
    if old.is_dir() and not final.exists():
        os.replace(old, final)
    elif old.exists():
        _remove(old)
    own = re.compile(rf"\.{re.escape(final.name)}\.[a-z0-9_]{{8}}\.tmp")  # not `NAME.x`'s
    for stale in final.parent.glob(f".{glob.escape(final.name)}.*.tmp"):
        if not (own.fullmatch(stale.name) and stale.is_dir() and not stale.is_symlink()):
            continue
        busy, held = _hold(stale)
        if busy:
            continue  # a live run is writing it
        try:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            if held is not None:
                os.close(held)


def _hold(directory: Path) -> tuple[bool, int | None]:
    """(busy, fd): an exclusive lock on `directory`, held by the open descriptor `fd` (close
    it when done; None where locks are not available); busy when another process holds it."""
    import fcntl

    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return True, None
    except OSError:  # no flock on this file system
        os.close(fd)
        return False, None
    return False, fd


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Remove what a killed `atomic_path` / `atomic_dir` left anywhere under `root` (hidden
    `.NAME.XXXXXXXX.tmp` files and directories, the size of what was being written); returns
    them. Only for a directory this process holds (a stage's, under its lock)."""
    stale = []
    for top, dirs, files in os.walk(root):
        for name in [*files, *dirs]:
            if _TEMPORARY_RE.fullmatch(name):
                stale.append(Path(top) / name)
        dirs[:] = [d for d in dirs if not _TEMPORARY_RE.fullmatch(d)]
    for path in stale:
        _remove(path)
    return stale


_TEMPORARY_RE = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
"""The names tempfile.mkstemp / mkdtemp give with our prefix `.NAME.` and suffix `.tmp`."""


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def lines_text(lines: Iterable[str]) -> str:
    """One line per item, each ended by "\\n": line breaks inside an item (a byte-level
    tokenizer can decode one) become spaces, so line i of the file stays item i."""
    return "".join(" ".join(line.splitlines()) + "\n" for line in lines)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _remove(path: Path) -> None:
    """Delete a file or a directory tree if it is there (best effort)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _check_names(path: Path, flag: str) -> None:
    """Each component of `path` short enough for its file system (a longer one is ENAMETOOLONG
    from the first stat, or from the write after all the work)."""
    full = Path(os.path.abspath(path))
    if len(os.fsencode(full)) >= 4096:
        raise DataError(f"{flag} {str(path)[:60]}...: the path is too long (PATH_MAX 4096 bytes)")
    try:
        limit = os.pathconf("/", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in full.parts[1:]:
        if len(os.fsencode(part)) > limit:
            raise DataError(f"{flag} {str(path)[:60]}...: a name of {len(os.fsencode(part))} "
                            f"bytes; expected at most {limit} per file or directory name")


def mount_points() -> set[str]:
    """The mount points of this process (/proc/self/mountinfo; empty where there is none)."""
    try:
        text = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    # field 5 is the mount point, with spaces and such escaped as octal (\040)
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4])
            for line in text.splitlines() if len(line.split()) > 4}


def _check_not_a_mount(path: Path, flag: str) -> None:
    """An output replaced by a rename cannot be a mount point (a volume, a bind-mounted file):
    the rename fails with EBUSY, after all the work."""
    if path.exists() and str(path.resolve()) in mount_points():
        raise DataError(f"{flag} {path}: is a mount point, which an output cannot replace; "
                        "choose a path inside it")


def check_parent_writable(path: Path, flag: str) -> None:
    """The nearest existing ancestor of `path` is a directory this process may write into."""
    _check_names(path, flag)
    parent = path.absolute().parent
    try:
        while not parent.exists():
            if parent.is_symlink():  # a link to nothing: mkdir would fail there after the work
                raise DataError(f"{flag} {path}: {parent} links to {os.readlink(parent)}, "
                                "which does not exist")
            parent = parent.parent
    except OSError as exc:
        raise DataError(f"{flag} {path}: cannot check {parent} ({exc.strerror})") from None
    if not parent.is_dir():
        raise DataError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"{flag} {path}: cannot write into {parent}")
    try:  # permission bits do not tell: /proc, /sys and some mounts refuse new files anyway
        fd, probe = tempfile.mkstemp(prefix=".moe-train-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DataError(f"{flag} {path}: cannot create files in {parent} "
                        f"({exc.strerror})") from None


def check_out_file(path: str | os.PathLike, flag: str,
                   inputs: dict[str, str | os.PathLike | None] | None = None) -> Path:
    """`path` if a command may write its output file there (checked before the work starts,
    so a bad path fails at once, not after hours of decoding): not empty, not a directory,
    not one of the command's `inputs` ({flag: path}) nor an existing file inside an input
    directory (a checkpoint, prepared data), under a directory that exists or can be made."""
    if str(path) == "":
        raise DataError(f"{flag}: expected a file path, got an empty string")
    path = Path(path)
    _check_names(path, flag)
    if path.is_dir():
        raise DataError(f"{flag} {path}: is a directory; expected a file path")
    for in_flag, source in (inputs or {}).items():
        if not source or str(source) == "-" or not path.is_file():
            continue
        if Path(source).is_file() and os.path.samefile(path, source):
            raise DataError(f"{flag} {path}: is the {in_flag} input; expected another file")
        if Path(source).is_dir() and Path(source).resolve() in path.resolve().parents:
            raise DataError(f"{flag} {path}: would replace a file of the {in_flag} input "
                            f"{source}; expected another file")
    target, in_place = write_target(path)
    if in_place and path.exists():  # /dev/null: written to, no file made beside it
        if not os.access(path, os.W_OK):
            raise DataError(f"{flag} {path}: cannot write to it")
        return path
    if path.is_symlink() and not target.parent.is_dir():
        raise DataError(f"{flag} {path}: links to {target}, whose directory does not exist")
    _check_not_a_mount(target, flag)
    check_parent_writable(target, flag)
    return path


def check_out_dir(out_dir: str | os.PathLike, flag: str, marker: str, what: str,
                  sources: Iterable[str | os.PathLike] = ()) -> Path:
    """`out_dir` if a command may replace it with its output directory: new, empty, or an
    earlier output of the same command (it holds `marker`, a file only that command writes),
    and neither one of the command's `sources` nor a directory above one. Anything else is
    refused, never deleted."""
    out_dir = Path(out_dir)
    _check_names(out_dir, flag)
    _check_not_a_mount(out_dir, flag)
    resolved = out_dir.resolve()
    for source in sources:
        src = Path(source).resolve()
        if resolved == src or resolved in src.parents:
            raise DataError(f"{flag} {out_dir}: is or contains the input {source}; "
                            "choose a new directory")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:  # replaced whole, under the command's feet
        raise DataError(f"{flag} {out_dir}: is the working directory or one above it; choose "
                        "a new directory")
    try:
        if out_dir.exists():
            if not out_dir.is_dir():
                raise DataError(f"{flag} {out_dir}: exists and is not a directory")
            if not (out_dir / marker).is_file() and any(out_dir.iterdir()):
                raise DataError(f"{flag} {out_dir}: exists and holds no {marker} of an "
                                f"earlier {what}; refusing to replace it (choose a new "
                                "directory)")
    except OSError as exc:
        raise DataError(f"{flag} {out_dir}: cannot read it ({exc.strerror})") from None
    check_parent_writable(out_dir, flag)
    return out_dir


def check_dir_setting(path: str | os.PathLike, field: str) -> None:
    """A config field naming a directory a run will create or fill: not an existing file, and
    under a directory (checked before training, not at its first save)."""
    if str(path) == "":
        return
    path = Path(path)
    _check_names(path, field)
    if path.is_dir():  # written into: it must be writable itself, whatever its parent is
        if not os.access(path, os.W_OK | os.X_OK):
            raise DataError(f"{field}: cannot write into {path}")
        return
    if path.exists():
        raise DataError(f"{field}: {path} exists and is not a directory")
    check_parent_writable(path, field)
