"""Bad arguments to any benchmark script: one line starting ``error:`` that names the option,
exit status 2, nothing on stdout, before anything runs, is written or is deleted (`--fresh`
included). Each script's `main(argv)` runs in this process with its ROOT pointed at a scratch
tree; the argparse types are checked on their own too."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from moe_train.utils.cli_args import (comma_list, command_line, existing_dir, int_at_least,
                                      non_negative_float, positive_float)
from tests.conftest import ROOT, load_benchmark

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                 if "\ndef main(" in p.read_text())
MISSING = "/nonexistent/test-dir"
EMPTY = "<an existing directory without test files>"
"""Replaced by such a directory in each case that names it."""

BAD: dict[str, list[list[str]]] = {
    "average_checkpoints": [["--steps", "0"], ["--average", "1"],
                            ["--fresh", "--steps", "3", "--save-every", "2", "--average", "2"]],
    "decode_throughput": [["--experts", "3"], ["--batches", "8,x"], ["--batches", "0"]],
    "gad": [["--steps", "0"], ["--minutes", "-1"], ["--test-dir", MISSING],
            ["--fresh", "--test-dir", EMPTY], ["--set", "optim.warmup_stepz=5"]],
    "kernels": [["--reps", "0"], ["--experts", "1"], ["--slots", "64", "100"]],
    "moa_real_data": [["--runs", "rs,nope"], ["--adapter-steps", "0"], ["--minutes", "nan"],
                      ["--test-dir", MISSING], ["--fresh", "--test-dir", EMPTY],
                      ["--anchors", "0"]],
    "moa_synthetic": [["--anchors", "0"], ["--fresh", "--seeds", "1,1"],
                      ["--fresh", "--runs", "top1"], ["--synth", "nope=1"],
                      ["--set", "optim.warmup_steps=-1"]],
    "moe_layer": [["--ks", "0"], ["--threads", "0"], ["--experts", "2", "--ks", "3"],
                  ["--experts", "1"], ["--ks", "1", "--experts", "8", "3"]],
    "multilingual": [["--variants", "dense,nope"], ["--minutes", "0"], ["--beam", "0"],
                     ["--test-dir", MISSING], ["--fresh", "--test-dir", EMPTY],
                     ["--fresh", "--variants", "token-target", "--extract", "xx-en"],
                     ["--variants", "token-target,token-lp", "--extract", "de"]],
    "qwen_block": [["--reps", "0"], ["--warmup", "-1"]],
    "real_data": [["--beam", "0"], ["--minutes", "inf"], ["--test-dir", MISSING],
                  ["--fresh", "--test-dir", EMPTY]],
    "swiglu_experts": [["--reps", "0"]],
    "thor": [["--variants", ","], ["--steps", "-1"], ["--test-dir", MISSING],
             ["--fresh", "--test-dir", EMPTY], ["--set", "thor.alphaa=1"],
             ["--data", "opus", "--set", "train.patience=3"]],  # with the benchmark's own
}
WORK_DIRS = ("average-de-en", "moa-opus-de-en", "moa-synthetic-bench", "multilingual", "opus-de-en",
             "thor-synthetic", "gad-synthetic")
"""The default work directories (under ROOT/work) that `--fresh` would empty."""
OUT_IS_A_DIR = [(name, ["--out", EMPTY]) for name in SCRIPTS] + \
    [(name, ["--fresh", "--out", EMPTY]) for name in ("multilingual", "thor", "moa_synthetic")]
"""Every script checks where its results go before it measures (or empties its work)."""
CASES = [(name, ["--no-such-option"]) for name in SCRIPTS] + \
    [(name, argv) for name, cases in BAD.items() for argv in cases] + OUT_IS_A_DIR


def test_the_cases_name_real_scripts() -> None:
    assert set(BAD) <= set(SCRIPTS) and len(SCRIPTS) >= 13


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_mtime_ns for p in sorted(root.rglob("*"))
            if "configs" not in p.relative_to(root).parts[1:2]}


@pytest.mark.parametrize("name,argv", CASES, ids=[f"{n}:{' '.join(a)}" for n, a in CASES])
def test_bad_argument_is_one_line_and_status_2(name: str, argv: list[str], capsys,
                                               tmp_path: Path, monkeypatch) -> None:
    scratch = tmp_path / "root"  # the scripts' ROOT: their work directories and results/
    for keep in [f"work/{d}/keep" for d in WORK_DIRS] + ["benchmarks/results/keep"]:
        (scratch / keep).parent.mkdir(parents=True)
        (scratch / keep).write_text("x")
    (scratch / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "empty").mkdir()
    before = _tree(tmp_path)
    argv = [str(tmp_path / "empty") if a == EMPTY else a for a in argv]
    monkeypatch.chdir(tmp_path)
    script = load_benchmark(name)
    for module in (script, sys.modules.get("real_data"), sys.modules.get("moa_real_data")):
        if hasattr(module, "ROOT"):
            monkeypatch.setattr(module, "ROOT", scratch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2, err
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert [a for a in argv if a.startswith("--") and a != "--fresh"][-1] in err
    assert "Traceback" not in err
    assert _tree(tmp_path) == before  # nothing written or deleted


def test_byte_size_reads_sizes_as_transformers_does() -> None:
    """max_shard_size's units: powers of 1000 and 1024, a lowercase b after K/M/G/T counting
    bits; a fraction of a byte, nothing or a 400-digit number in one line, not a traceback."""
    from moe_train.utils.cli_args import byte_size

    for text, size in [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("5Gb", 625 * 10**6),
                       ("1.5GB", 15 * 10**8), ("1000", 1000), ("7 MiB", 7 * 2**20)]:
        assert byte_size(text) == size, text
    assert byte_size("1" + "0" * 400) == 10**400
    for text in ("1.9", "0", "0.5KiB1", "5XB", "", "1e9", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number of bytes"):
            byte_size(text)


def test_argument_types() -> None:
    assert int_at_least(0)("0") == 0 and int_at_least(1)("7") == 7
    assert positive_float("0.5") == 0.5 and non_negative_float("0") == 0.0
    assert comma_list(("a", "b", "c"))("c, a,c") == ["c", "a"]
    assert existing_dir(str(ROOT)) == str(ROOT)
    assert command_line("/x/benchmarks/b.py", ["--quick"]) == ["benchmarks/b.py", "--quick"]
    for parse, text, says in [(int_at_least(1), "0", "a positive integer, got '0'"),
                              (int_at_least(2), "2.5", "an integer >= 2"),
                              (positive_float, "nan", "a positive number"),
                              (positive_float, "0", "a positive number"),
                              (non_negative_float, "-1", "a number >= 0"),
                              (non_negative_float, "inf", "a number >= 0"),
                              (comma_list(("a", "b")), "a,z", "(unknown: z)"),
                              (comma_list(("a", "b")), " , ", "some of a, b"),
                              (existing_dir, MISSING, "expected a directory")]:
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            parse(text)
        assert says in str(exc.value)


def test_fresh_deletes_only_a_benchmark_work_directory(tmp_path: Path, capsys) -> None:
    """`--fresh --work ~/notes` must not delete the user's directory: only one a benchmark
    marked (or an empty one) is emptied; a symlink is kept and its directory emptied."""
    real_data = load_benchmark("real_data")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    with pytest.raises(SystemExit) as exc:
        real_data.fresh_work(mine, fresh=True)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and f"--work {mine}" in err
    assert (mine / "thesis.tex").read_text() == "x"
    # used without --fresh it is written into but not marked: a later --fresh still refuses
    assert real_data.fresh_work(mine, fresh=False) == mine
    assert not (mine / real_data.WORK_MARK).exists()
    with pytest.raises(SystemExit):
        real_data.fresh_work(mine, fresh=True)
    assert (mine / "thesis.tex").read_text() == "x"
    ours = tmp_path / "ours"
    real_data.fresh_work(ours, fresh=False)  # made here: marked, so --fresh may empty it
    (ours / "stage").mkdir()
    link = tmp_path / "latest"
    link.symlink_to(ours)
    assert real_data.fresh_work(link, fresh=True) == ours
    assert link.is_symlink() and sorted(p.name for p in ours.iterdir()) == [real_data.WORK_MARK]
    empty, new = tmp_path / "empty", tmp_path / "a" / "new"
    empty.mkdir()
    for work in (empty, new):
        real_data.fresh_work(work, fresh=True)
        assert (work / real_data.WORK_MARK).is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        real_data.fresh_work(tmp_path / "file", fresh=True)
    assert (tmp_path / "file").read_text() == "x"
