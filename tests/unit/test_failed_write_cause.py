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


def test_overwriting_a_directory_never_leaves_it_missing(tmp_path, monkeypatch) -> None:
    """The previous directory and the new one are swapped in one step: no moment (no rename)
    at which a reader finds no directory, and nothing is left beside it."""
    out = tmp_path / "export"
    _write_dir(out, "old")
    seen = []
    real_replace = os.replace

    def watched_replace(src, dst):
        real_replace(src, dst)
        seen.append(out.is_dir())

    monkeypatch.setattr(atomic.os, "replace", watched_replace)
    _write_dir(out, "new", overwrite=True)
    assert (out / "model.txt").read_text() == "new"
    assert all(seen), seen
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
    """A full quota leaves the disk's free space alone: a small write beside the output finds
    EDQUOT; the probe file does not stay. A write that succeeds leaves EIO."""
    real_write = os.write

    def quota_full(fd, data):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(atomic.os, "write", quota_full)
    with pytest.raises(OSError) as err:
        with atomic_path(tmp_path / "ckpt.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    assert (err.value.errno, err.value.filename) == (errno.EDQUOT, str(tmp_path / "ckpt.pt"))
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(atomic.os, "write", real_write)
    assert atomic._probed_errno(tmp_path / "sub" / "x.pt") == errno.EIO
    assert list(tmp_path.iterdir()) == []


def test_a_nearly_full_disk_says_no_space(tmp_path, monkeypatch) -> None:
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(atomic.os, "statvfs", lambda path: Full)
    assert atomic._probed_errno(tmp_path / "x.pt") == errno.ENOSPC
