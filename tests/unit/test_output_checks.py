"""Where commands write, and what they read of foreign files, is checked before the work: an
output path that cannot be written, an output directory that holds someone else's files or the
command's own input and a DeepSpeed config that DeepSpeed rejects are each one line naming the
place, never a traceback or lost files."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import sys
import threading
from pathlib import Path

import pytest

from moe_train.errors import ConfigError, DataError
from moe_train.utils.atomic import (atomic_dir, atomic_path, check_dir_setting,
                                    check_out_dir, check_out_file, write_json, write_target,
                                    write_text)


def test_out_dir_is_never_the_working_directory_or_above_it(tmp_path, monkeypatch) -> None:
    """`--out .` (or `..`) passed the checks, then failed after all the work (a ValueError
    traceback: '.' has no name; EBUSY for '..')."""
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    for out in (".", "..", str(work)):
        with pytest.raises(DataError, match=rf"^--out {re.escape(out)}: is the working "
                                            "directory or one above it"):
            check_out_dir(out, "--out", "average.json", "average")
    assert check_out_dir("sub", "--out", "average.json", "average") == Path("sub")


def test_out_dir_new_empty_or_own_earlier_output(tmp_path) -> None:
    """Accepted (returned, nothing raised): a new path, an empty directory, and an earlier
    output of the same command, known by the file only that command writes."""
    new, empty, old = tmp_path / "new" / "out", tmp_path / "empty", tmp_path / "old"
    empty.mkdir()
    old.mkdir()
    (old / "extract.json").write_text("{}")
    (old / "manifest.json").write_text("{}")
    for out in (new, empty, old):
        assert check_out_dir(out, "--out", "extract.json", "extract") == out
    assert not new.parent.exists()
    # An export or prepared data also holds a manifest.json, but no extract.json: refused.
    (old / "extract.json").unlink()
    with pytest.raises(DataError, match="holds no extract.json of an earlier extract"):
        check_out_dir(old, "--out", "extract.json", "extract")


def test_out_dir_refuses_foreign_files_a_file_and_its_input(tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep\n")
    with pytest.raises(DataError, match="holds no manifest.json of an earlier export"):
        check_out_dir(mine, "--out", "manifest.json", "export")
    mine.chmod(0)  # unreadable (as root, readable anyway): one line either way, no traceback
    try:
        check_out_dir(mine, "--out", "manifest.json", "export")
    except DataError as exc:
        assert "\n" not in str(exc)
    finally:
        mine.chmod(0o755)
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match="exists and is not a directory"):
        check_out_dir(tmp_path / "f", "--out", "manifest.json", "export")
    src = tmp_path / "run" / "ckpt"
    src.mkdir(parents=True)
    (src / "manifest.json").write_text("{}")  # even an earlier export: it is the input
    for out in (src, src.parent, tmp_path / "run" / "ckpt" / ".." / "ckpt"):
        with pytest.raises(DataError, match="is or contains the input"):
            check_out_dir(out, "--out", "manifest.json", "export", sources=[src])
    assert check_out_dir(src / "sub", "--out", "manifest.json", "export", sources=[src])
    with pytest.raises(DataError, match="f is not a directory"):
        check_out_dir(tmp_path / "f" / "out", "--out", "manifest.json", "export")
    assert (mine / "notes.txt").read_text() == "keep\n"


def test_out_file_checks(tmp_path) -> None:
    assert check_out_file(tmp_path / "a" / "b.txt", "--output") == tmp_path / "a" / "b.txt"
    with pytest.raises(DataError, match="--output: expected a file path"):
        check_out_file("", "--output")
    with pytest.raises(DataError, match="is a directory"):
        check_out_file(tmp_path, "--output")
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match=r"--output .*f/o.txt: .*f is not a directory"):
        check_out_file(tmp_path / "f" / "o.txt", "--output")
    assert not (tmp_path / "a").exists()  # checking creates nothing


def test_out_file_never_replaces_a_file_of_an_input_directory(tmp_path) -> None:
    """evaluate --json prepared/manifest.json replaced the data's manifest with metrics."""
    prepared = tmp_path / "prepared"
    (prepared / "shards").mkdir(parents=True)
    (prepared / "manifest.json").write_text("{}")
    inputs = {"--prepared": str(prepared), "--src": None}
    (tmp_path / "alias").symlink_to(prepared)
    for victim in (prepared / "manifest.json", tmp_path / "alias" / "manifest.json"):
        with pytest.raises(DataError, match=r"would replace a file of the --prepared input"):
            check_out_file(victim, "--json", inputs)
    assert check_out_file(prepared / "new.json", "--json", inputs)  # a new file is fine
    assert check_out_file(tmp_path / "m.json", "--json", inputs)




def test_atomic_dir_recovers_what_a_killed_write_left(tmp_path) -> None:
    """Killed while writing: a half-written temporary directory; killed between the renames:
    no `export`, the previous one aside. The next write puts the previous one back first and
    removes the temporaries (each the size of a model export)."""
    final = tmp_path / "export"
    (tmp_path / ".export.old").mkdir()
    (tmp_path / ".export.old" / "weights").write_text("previous")
    for name in (".export.a1b2c3d4.tmp", ".export.c3d4_e5f.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text("half")
    (tmp_path / ".exports.x.tmp").mkdir()  # another output's: not ours to remove
    (tmp_path / ".export.bf16.k2m4p6q8.tmp").mkdir()  # nor is output export.bf16's
    live = tmp_path / ".export.zz99yy88.tmp"  # nor one a live run is writing (it holds it)
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with atomic_dir(final, overwrite=True) as tmp:
            assert (final / "weights").read_text() == "previous"  # put back before the work
            (tmp / "weights").write_text("new")
    finally:
        os.close(fd)
    assert (final / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".export.bf16.k2m4p6q8.tmp", ".export.zz99yy88.tmp", ".exports.x.tmp", "export"]


def test_atomic_dir_keeps_a_symlink_and_replaces_its_target(tmp_path) -> None:
    runs, link = tmp_path / "runs" / "7", tmp_path / "latest"
    runs.mkdir(parents=True)
    (runs / "old.txt").write_text("old")
    link.symlink_to(runs)
    with atomic_dir(link, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert link.is_symlink() and os.readlink(link) == str(runs)
    assert sorted(p.name for p in runs.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "runs"]
    assert sorted(p.name for p in runs.parent.iterdir()) == ["7"]


def test_atomic_dir_replaces_a_file_without_leftovers(tmp_path) -> None:
    out = tmp_path / "out"
    out.write_text("old file")
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_pipe_is_written_in_place_never_replaced(tmp_path) -> None:
    """`--output /dev/null` once replaced /dev/null itself (as root) with a regular file: a
    device, pipe or socket is written through, not renamed onto. A pipe stands in for the
    device here, so a regression cannot break the machine's /dev/null."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_json(fifo, {"a": 1})
    reader.join(timeout=30)
    assert got == [b'{\n  "a": 1\n}\n']
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no temporary left
    with pytest.raises(FileExistsError, match="neither a directory nor a file"):
        with atomic_dir(fifo, overwrite=True):
            pytest.fail("atomic_dir let the work start on a pipe it would then replace")
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_out_file_that_is_written_in_place_needs_only_itself_writable(tmp_path,
                                                                      monkeypatch) -> None:
    """A user who may not write into /dev may still write to /dev/null."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) in (fifo, Path("/dev/null")))
    assert check_out_file("/dev/null", "--output") == Path("/dev/null")
    assert check_out_file(fifo, "--output") == fifo
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != fifo and real(p, mode))
    with pytest.raises(DataError, match="--output .*fifo: cannot write to it"):
        check_out_file(fifo, "--output")


@pytest.mark.parametrize("path, in_place", [
    ("/dev/null", True), ("/dev/stdout", True), ("/dev/fd/1", True), ("/proc/self/fd/1", True),
    ("/dev/shm/moe-train-out.json", False), ("/dev/../tmp/out.json", False),
    ("out.json", False)])
def test_file_descriptor_names_are_written_in_place(path, in_place) -> None:
    assert write_target(path) == (Path(path), True) if in_place else not write_target(path)[1]


def test_a_link_to_stdout_is_written_in_place_even_when_stdout_is_a_file(tmp_path) -> None:
    """`out -> /dev/stdout` with stdout redirected to log.txt: /dev/stdout resolves to
    log.txt, but renaming onto log.txt would cut off everything printed after."""
    link = tmp_path / "out"
    link.symlink_to("/dev/stdout")
    assert write_target(link) == (link, True)


def test_a_symlink_to_a_file_is_kept_and_its_target_replaced(tmp_path) -> None:
    target, link = tmp_path / "results" / "run1.json", tmp_path / "latest.json"
    target.parent.mkdir()
    target.write_text("old")
    link.symlink_to(target)
    write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["run1.json"]


def test_a_dangling_link_needs_its_target_directory(tmp_path, monkeypatch) -> None:
    """As for `open`: a link to a missing file in an existing directory makes the file; a link
    into a missing directory is refused, its directories not made."""
    made, nowhere = tmp_path / "made.json", tmp_path / "nodir" / "sub" / "x.json"
    (tmp_path / "a").symlink_to(made)
    write_text(tmp_path / "a", "new")
    assert (tmp_path / "a").is_symlink() and made.read_text() == "new"
    (tmp_path / "b").symlink_to(nowhere)
    with pytest.raises(DataError, match="--output .*b: links to .*x.json, whose directory"):
        check_out_file(tmp_path / "b", "--output")
    with pytest.raises(FileNotFoundError):
        write_text(tmp_path / "b", "new")
    assert not (tmp_path / "nodir").exists()
    # The directory written into is the target's, not the link's.
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "c").symlink_to(shared / "run.txt")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != shared and real(p, mode))
    with pytest.raises(DataError, match="--output .*run.txt: cannot write into .*shared"):
        check_out_file(tmp_path / "c", "--output")


def test_deepspeed_validation_is_one_config_line() -> None:
    import deepspeed
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from moe_train.train.ds_config import deepspeed_config_errors

    with pytest.raises(ConfigError) as err, deepspeed_config_errors():
        DeepSpeedZeroConfig(**{"stage": 7})
    text = str(err.value)
    assert text.startswith("deepspeed config (DeepSpeedZeroConfig): stage: ") and "\n" not in text
    # DeepSpeed's refusals at start-up: one line naming the raw entries, when there are any
    raw = {"prescale_gradients": True, "zero_optimization": {"reduce_scatter": True}}
    in_deepspeed = os.path.join(os.path.dirname(deepspeed.__file__), "runtime", "engine.py")
    refusal = compile("raise AssertionError('pre-scale gradients is not yet supported\\n"
                      "with ZeRO-2')", in_deepspeed, "exec")  # raised in a DeepSpeed frame
    with pytest.raises(ConfigError) as err, deepspeed_config_errors(raw):
        exec(refusal)
    assert str(err.value) == ("deepspeed config: DeepSpeed refused the run with the raw entries "
                              "prescale_gradients, zero_optimization.reduce_scatter "
                              "(AssertionError: pre-scale gradients is not yet supported with "
                              "ZeRO-2)")
    with pytest.raises(AssertionError), deepspeed_config_errors({}):  # none: a bug, as is
        raise AssertionError("ours")
    with pytest.raises(KeyError), deepspeed_config_errors(raw):  # not a refusal: as is
        raise KeyError("x")
    with pytest.raises(AssertionError), deepspeed_config_errors(raw):  # ours, under its calls
        raise AssertionError("ours")
    # raised in the standard library under DeepSpeed (its DtypeEnum refusing a name in enum.py):
    # DeepSpeed's; the same under a frame of ours that DeepSpeed called: ours
    import enum

    import moe_train

    ns: dict = {}
    exec(compile("def refuse(): raise ValueError(\"'bfloat' is not a valid DtypeEnum\")",
                 enum.__file__, "exec"), ns)
    exec(compile("def ours(): refuse()", moe_train.__file__, "exec"), ns)
    exec(compile("def deepspeeds(call): call()", in_deepspeed, "exec"), ns)
    with pytest.raises(ConfigError, match="'bfloat' is not a valid DtypeEnum"), \
            deepspeed_config_errors(raw):
        ns["deepspeeds"](ns["refuse"])
    with pytest.raises(ValueError), deepspeed_config_errors(raw):
        ns["deepspeeds"](ns["ours"])


def test_a_write_that_fails_names_the_output_and_leaves_nothing(tmp_path) -> None:
    """A full disk fails at flush with an OSError that names no file: it is made to name the
    output, and no temporary file or partial output is left."""
    out = tmp_path / "hyps.txt"
    for named in (None, "tmp"):  # no file named, or the temporary one (torch.save(tmp))
        with pytest.raises(OSError) as err:
            with atomic_path(out) as tmp:
                tmp.write_text("half")
                raise OSError(errno.ENOSPC, "No space left on device",
                              str(tmp) if named else None)
        assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(out))
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError) as err:  # another file's error is left as it is
        with atomic_path(out):
            raise OSError(errno.ENOENT, "No such file or directory", "/some/input")
    assert err.value.filename == "/some/input"
    with pytest.raises(IsADirectoryError) as err:  # not the machine, and no file: a bug
        with atomic_path(out):
            raise OSError(errno.EISDIR, "Is a directory")
    assert err.value.filename is None
    out.mkdir()  # the rename fails: the error names the output, not the temporary file
    with pytest.raises(OSError) as err:
        write_text(out, "x")
    assert err.value.filename == str(out)
    assert [p.name for p in tmp_path.iterdir()] == ["hyps.txt"]
    if Path("/dev/full").exists():  # the same, for real, on a device written in place
        with pytest.raises(OSError) as err:
            write_text("/dev/full", "x" * 100_000)
        assert (err.value.errno, err.value.filename) == (errno.ENOSPC, "/dev/full")


def test_a_full_disk_inside_a_directory_being_written_names_the_output(tmp_path,
                                                                       monkeypatch) -> None:
    """In `atomic_dir` an error about a file of the temporary directory names that file under
    the output; a copy's names its destination, not its source; one that names no file (a
    plain write's flush, numpy's short write) names the output. Nothing is left behind."""
    from moe_train.utils import atomic

    out, src = tmp_path / "export", tmp_path / "spm.model"
    src.write_text("model")
    monkeypatch.setattr(atomic, "_probed_errno", lambda final, tmp: errno.ENOSPC)
    cases = {
        "copy": lambda d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device",
                                                        str(src), None, str(d / "spm.model"))),
        "file": lambda d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device",
                                                        str(d / "a" / "x.json"))),
        "flush": lambda d: (_ for _ in ()).throw(OSError(errno.ENOSPC,
                                                         "No space left on device")),
        "numpy": lambda d: (_ for _ in ()).throw(OSError("3548 requested and 1024 written")),
    }
    expect = {"copy": out / "spm.model", "file": out / "a" / "x.json", "flush": out,
              "numpy": out}
    for case, fail in cases.items():
        with pytest.raises(OSError) as err:
            with atomic_dir(out) as d:
                fail(d)
        assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(expect[case])), case
        assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model"], case
    with pytest.raises(OSError) as err:  # numpy's short write in a file being written
        with atomic_path(tmp_path / "f.npy"):
            raise OSError("1600 requested and 992 written")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "f.npy"))
    with pytest.raises(OSError, match="^some other failure$"):  # no errno, not a write: as is
        with atomic_path(tmp_path / "f.npy"):
            raise OSError("some other failure")
    with pytest.raises(OSError) as err:  # an input's error inside the block: left as it is
        with atomic_dir(out):
            raise OSError(errno.EIO, "Input/output error", str(src))
    assert err.value.filename == str(src)


def test_the_cli_reports_a_failed_write_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Not bad input (status 2) but the machine (status 1): one line naming the file."""
    from moe_train import commands
    from moe_train.cli import main

    def full_disk(args):
        write_text(tmp_path / "c" / "x.txt", "x")

    monkeypatch.setattr("moe_train.utils.atomic.tempfile.mkstemp", _raise_enospc)
    monkeypatch.setattr(commands, "cmd_synth", full_disk)
    assert main(["synth", "--out", str(tmp_path / "c")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {tmp_path / 'c' / 'x.txt'}: No space left on device\n"

    for bug in (OSError(errno.EIO, "no file named"),  # a bug's OSError keeps its traceback
                FileNotFoundError(errno.ENOENT, "No such file or directory", "/wrong/path")):
        monkeypatch.setattr(commands, "cmd_synth", _raising(bug))
        with pytest.raises(OSError) as err:
            main(["synth", "--out", str(tmp_path / "c")])
        assert err.value is bug


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_standard_output_on_a_full_device_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    """`moe-train params ... > /dev/full`: the write fails without a file name, which the rule
    above leaves a traceback; standard output names itself, so it is the machine's one line (also
    when the output sat in the buffer until the command ended, and through `.buffer`)."""
    import io

    from moe_train import commands
    from moe_train.cli import main

    for write in (lambda: print("table"), lambda: sys.stdout.buffer.write(b"x" * (1 << 20))):
        monkeypatch.setattr(commands, "cmd_synth", lambda args, write=write: write() and 0)
        full = io.TextIOWrapper(open("/dev/full", "wb"))
        monkeypatch.setattr(sys, "stdout", full)
        assert main(["synth", "--out", str(tmp_path / "c")]) == 1
        assert sys.stdout is full  # put back
        monkeypatch.undo()
        assert capsys.readouterr().err == "error: <stdout>: No space left on device\n"


def test_closed_standard_streams_are_one_line(monkeypatch, capsys) -> None:
    """`translate <&-` and `translate >&-`: Python's sys.stdin / sys.stdout are None."""
    from moe_train.cli import main

    monkeypatch.setattr(sys, "stdin", None)
    assert main(["translate", "--checkpoint", "ck"]) == 2
    assert capsys.readouterr().err.startswith("error: <stdin>: standard input is closed")
    monkeypatch.setattr(sys, "stdin", io_with("a sentence\n"))
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["translate", "--checkpoint", "ck"]) == 2
    assert capsys.readouterr().err == ("error: --output -: standard output is closed "
                                       "(give --output FILE)\n")


def io_with(text: str):
    import io
    return io.TextIOWrapper(io.BytesIO(text.encode()))


def _raise_enospc(*args, dir=None, prefix="", suffix="", **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", f"{dir}/{prefix}{suffix}")


def _raising(exc: BaseException):
    def command(args):
        raise exc

    return command


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_directory_that_refuses_new_files_is_found_before_the_work() -> None:
    """/proc passes the permission bits for root yet refuses new files: the check creates
    (and removes) a probe file, so the command fails at once in one line."""
    for check in (lambda: check_out_dir("/proc/moe-out", "--out", "done.json", "run"),
                  lambda: check_out_file("/proc/moe-out/result.json", "--json"),
                  lambda: check_dir_setting("/proc/moe-out", "train.out_dir")):
        with pytest.raises(DataError, match="cannot (create files in|write into) /proc"):
            check()


def test_the_probe_leaves_nothing_behind(tmp_path) -> None:
    check_out_file(tmp_path / "sub" / "out.json", "--json")
    assert list(tmp_path.iterdir()) == []


def test_lines_text_keeps_one_line_per_item() -> None:
    """A hypothesis holding a line break (byte-level BPE can decode one) stays one line."""
    from moe_train.utils.atomic import lines_text

    text = lines_text(["hello\nworld", "", "a\r\nb c"])
    assert text == "hello world\n\na b c\n" and len(text.splitlines()) == 3


def test_a_killed_writers_temporaries_are_removed_and_nothing_else(tmp_path) -> None:
    """What a SIGKILL inside `atomic_path` / `atomic_dir` leaves (hidden, the size of what was
    being written) goes when a stage takes its directory again; other hidden files stay."""
    import tempfile

    from moe_train.utils.atomic import remove_stale_temporaries

    (tmp_path / "sub").mkdir()
    _, f = tempfile.mkstemp(prefix=".features.npy.", suffix=".tmp", dir=tmp_path)
    d = tempfile.mkdtemp(prefix=".export.", suffix=".tmp", dir=tmp_path / "sub")
    (Path(d) / "model.safetensors").write_text("half")
    _, latest = tempfile.mkstemp(prefix=".latest.", suffix=".tmp", dir=tmp_path / "sub")
    keep = [tmp_path / ".lock", tmp_path / "sub" / ".tmp-step_00000002" / "x",
            tmp_path / ".notes.tmp", tmp_path / "features.npy"]
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(map(str, removed)) == sorted([f, d, latest])
    assert all(p.exists() for p in keep) and not any(Path(p).exists() for p in (f, d, latest))


def test_deeply_nested_json_or_yaml_and_damaged_npz_are_one_line_errors(tmp_path) -> None:
    """A RecursionError from a deeply nested file, and zipfile / zlib errors from a damaged
    .npz, used to escape the readers as tracebacks."""
    import numpy as np

    from moe_train.config.loader import read_yaml
    from moe_train.errors import CheckpointError, ConfigError
    from moe_train.utils.safe_load import load_array, load_arrays, read_json

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"deep.json: nested too deeply to read"):
        read_json(deep)
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.yaml: nested too deeply to read"):
        read_yaml(deep_yaml)
    good = tmp_path / "meta.npz"
    np.savez(good, split=np.arange(40), index=np.arange(40))
    data = good.read_bytes()
    broken = tmp_path / "broken.npz"
    for damaged in (data[:len(data) // 2], data[:60] + bytes(40) + data[100:]):
        broken.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="broken.npz"):
            load_arrays(broken, "the features' metadata", ["split", "index"], 40)
        with pytest.raises(CheckpointError, match="broken.npz"):
            load_array(broken, "labels", "i", 1)


def test_overlong_names_and_links_to_nothing_are_refused_before_the_work(tmp_path) -> None:
    """A 300-byte name passed the checks (or raised ENAMETOOLONG from the first stat), and an
    ancestor that links to nothing passed too: both failed after the work, as tracebacks."""
    from moe_train.utils.atomic import check_dir_setting, check_out_file

    long = "x" * 300
    with pytest.raises(DataError, match="a name of 300 bytes; expected at most"):
        check_out_file(tmp_path / "sub" / long / "out.txt", "--output")
    with pytest.raises(DataError, match="a name of 300 bytes"):
        check_out_file(tmp_path / long, "--output")
    with pytest.raises(DataError, match="a name of 300 bytes"):
        check_out_dir(tmp_path / long, "--out", "x.json", "x")
    with pytest.raises(DataError, match="a name of 300 bytes"):
        check_dir_setting(tmp_path / long, "checkpoint.dir")
    (tmp_path / "data").symlink_to(tmp_path / "nowhere")
    for check in (lambda p: check_out_dir(p, "--out", "x.json", "x"),
                  lambda p: check_out_file(p / "f.txt", "--out"),
                  lambda p: check_dir_setting(p, "--out")):
        with pytest.raises(DataError, match=r"data links to .*nowhere, which does not exist"):
            check(tmp_path / "data" / "corpus")


def test_a_mount_point_is_refused_as_an_output(tmp_path, monkeypatch) -> None:
    """A volume or a bind-mounted file passed the checks; the final rename onto it then failed
    with EBUSY, after all the work."""
    import moe_train.utils.atomic as atomic
    from moe_train.utils.atomic import check_out_file

    volume, bound = tmp_path / "volume", tmp_path / "bound.json"
    volume.mkdir()
    bound.write_text("{}")
    monkeypatch.setattr(atomic, "mount_points", lambda: {str(volume), str(bound), "/"})
    with pytest.raises(DataError, match=r"--out .*volume: is a mount point"):
        check_out_dir(volume, "--out", "x.json", "x")
    with pytest.raises(DataError, match=r"--json .*bound.json: is a mount point"):
        check_out_file(bound, "--json")
    assert check_out_dir(volume / "run", "--out", "x.json", "x") == volume / "run"
    assert check_out_file(tmp_path / "other.json", "--json") == tmp_path / "other.json"


def test_mount_points_unescape_their_names(tmp_path, monkeypatch) -> None:
    import moe_train.utils.atomic as atomic

    info = tmp_path / "mountinfo"
    info.write_text("36 35 98:0 / /mnt/my\\040disk rw,noatime master:1 - ext3 /dev/root rw\n")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: real(
        info if str(self) == "/proc/self/mountinfo" else self, *a, **k))
    assert atomic.mount_points() == {"/mnt/my disk"}


def test_a_directory_that_cannot_be_started_names_the_output(tmp_path, monkeypatch) -> None:
    """A full disk when `atomic_dir` makes its temporary directory: the error names the output
    the user asked for, not the hidden temporary that never existed."""
    monkeypatch.setattr("moe_train.utils.atomic.tempfile.mkdtemp", _raise_enospc)
    with pytest.raises(OSError) as err:
        with atomic_dir(tmp_path / "out"):
            pass
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "out")
