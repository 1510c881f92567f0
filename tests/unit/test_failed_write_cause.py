"""A replaced output directory is never missing, and a library's failed write that carries no
errno (torch.save, numpy) is reported with the cause the machine gives: a full disk, a full
quota or a file-size limit, not a bare "Input/output error"."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_train.utils import atomic
from moe_train.utils.atomic import atomic_dir, atomic_path


def _write_dir(out: Path, text: str, **kwargs) -> None:
    with atomic_dir(out, **kwargs) as tmp:
        (tmp / "model.txt").write_text(text)


def _swaps_here(tmp_path: Path) -> bool:
    a, b = tmp_path / "swap-a", tmp_path / "swap-b"
    a.mkdir(), b.mkdir()
    try:
        return atomic._exchange(a, b)
    finally:
        a.rmdir(), b.rmdir()


def test_overwriting_a_directory_never_leaves_it_missing(tmp_path, monkeypatch) -> None:
    """The previous directory and the new one are swapped in one step (no rename at all, so
    no moment at which a reader finds no directory), and nothing is left beside it."""
    if not _swaps_here(tmp_path):
        pytest.skip("this file system has no RENAME_EXCHANGE")
    out = tmp_path / "export"
    _write_dir(out, "old")
    renames, swaps = [], []
    real_exchange = atomic._exchange
    monkeypatch.setattr(atomic.os, "replace", lambda *a: renames.append(a))
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: swaps.append(real_exchange(a, b))
                        or swaps[-1])
    _write_dir(out, "new", overwrite=True)
    assert (out / "model.txt").read_text() == "new"
    assert swaps == [True] and renames == []
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_without_an_atomic_swap_the_old_directory_is_moved_aside(tmp_path, monkeypatch) -> None:
    """A C library or file system without RENAME_EXCHANGE: two renames, the same result; a
    file in the directory's place is replaced as well."""
    monkeypatch.setattr(atomic, "_renameat2", lambda: None)
    out = tmp_path / "export"
    _write_dir(out, "old")
    _write_dir(out, "new", overwrite=True)
    assert (out / "model.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]

    monkeypatch.undo()
    for swap in (True, False):
        monkeypatch.setattr(atomic, "_renameat2", atomic._renameat2 if swap else lambda: None)
        out.with_name("plain").write_text("a file")
        _write_dir(out.with_name("plain"), "dir", overwrite=True)
        assert (tmp_path / "plain" / "model.txt").read_text() == "dir"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "plain"]
        atomic._remove(tmp_path / "plain")


def test_a_refused_swap_names_the_output(tmp_path, monkeypatch) -> None:
    """An errno other than "not supported" is the machine refusing: raised naming the output,
    the new content removed, the old kept."""
    out = tmp_path / "export"
    _write_dir(out, "old")

    def busy(*args):
        atomic.ctypes.set_errno(errno.EBUSY)
        return -1

    monkeypatch.setattr(atomic, "_renameat2", lambda: busy)
    with pytest.raises(OSError) as err:
        _write_dir(out, "new", overwrite=True)
    assert (err.value.errno, err.value.filename) == (errno.EBUSY, str(out))
    assert (out / "model.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_torch_and_numpy_writes_past_a_file_size_limit_say_file_too_large(tmp_path) -> None:
    """torch.save's zip writer fails with "unexpected pos" and numpy with a short write, both
    without an errno; under a file-size limit the error says EFBIG, naming the output."""
    script = f"""
import errno, resource, numpy, torch
from moe_train.utils.atomic import atomic_path
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
for name, write in (("t.pt", lambda p: torch.save(torch.zeros(1 << 20), p)),
                    ("n.bin", lambda p: numpy.zeros(1 << 20).tofile(p))):
    try:
        with atomic_path({str(tmp_path)!r} + "/" + name) as tmp:
            write(tmp)
    except OSError as exc:
        print(name, errno.errorcode[exc.errno], exc.filename)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"t.pt EFBIG {tmp_path}/t.pt",
                                        f"n.bin EFBIG {tmp_path}/n.bin"]
    assert list(tmp_path.iterdir()) == []


def test_a_full_quota_is_found_by_a_probe_write(tmp_path, monkeypatch) -> None:
    """A full quota leaves the disk's free space alone: a small write where the output was
    being written finds EDQUOT; the probe file does not stay."""
    def quota_full(fd, data):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    with monkeypatch.context() as patch, pytest.raises(OSError) as err:
        patch.setattr(atomic.os, "write", quota_full)  # os.write: only for this block
        with atomic_path(tmp_path / "ckpt.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    assert (err.value.errno, err.value.filename) == (errno.EDQUOT, str(tmp_path / "ckpt.pt"))
    assert list(tmp_path.iterdir()) == []


def test_the_probe_is_made_where_the_output_is_written(tmp_path, monkeypatch) -> None:
    """A symlinked output is written (and probed) beside the file it leads to; a directory
    in its temporary directory; a device written in place is not probed."""
    probed = []
    monkeypatch.setattr(atomic, "_probe_write", lambda d: probed.append(d))
    torch_failure = RuntimeError("PytorchStreamWriter failed writing file data/0")
    (tmp_path / "real").mkdir()
    (tmp_path / "link.pt").symlink_to(tmp_path / "real" / "out.pt")
    held = []
    for out, opener in ((tmp_path / "link.pt", atomic_path), (tmp_path / "d", atomic_dir),
                        (Path("/dev/null"), atomic_path)):
        with pytest.raises(OSError) as err:
            with opener(out) as tmp:
                held.append(tmp)
                raise torch_failure
        assert (err.value.errno, err.value.filename) == (errno.EIO, str(out))
    assert held[0].parent == tmp_path / "real" and held[1].parent == tmp_path
    assert probed == [tmp_path / "real", held[1]]  # the file's directory; the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pt", "real"]


def test_efbig_only_for_a_file_at_the_size_limit(tmp_path, monkeypatch) -> None:
    """Under a finite file-size limit, a failed write is EFBIG only when what was written
    reached it; a smaller file's failure stays EIO (a network file system's error)."""
    import resource

    written = tmp_path / ".out.pt.abcdefgh.tmp"
    written.write_bytes(bytes(1000))
    for limit, code in ((resource.RLIM_INFINITY, errno.EIO), (4096, errno.EIO),
                        (1000, errno.EFBIG)):
        monkeypatch.setattr(resource, "getrlimit", lambda which, limit=limit: (limit, limit))
        assert atomic._probed_errno(tmp_path / "out.pt", written) == code, limit


def test_a_nearly_full_disk_says_no_space(tmp_path, monkeypatch) -> None:
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(atomic.os, "statvfs", lambda path: Full)
    assert atomic._probed_errno(tmp_path / "x.pt", None) == errno.ENOSPC
