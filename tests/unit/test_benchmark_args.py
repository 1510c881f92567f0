"""Bad arguments to any benchmark script: one ``error: benchmarks/X.py: ...`` line naming the
option, exit status 2, nothing on stdout, before anything runs or is written. Each script's
`main(argv)` runs in this process; the argparse types are checked on their own too."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moe_train.utils.cli_args import comma_list, existing_dir, int_at_least, positive_float
from tests.conftest import ROOT, load_benchmark

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                 if "\ndef main(" in p.read_text())
MISSING = "/nonexistent/test-dir"

BAD = {
    "decode_throughput": [["--experts", "3"], ["--batches", "8,x"], ["--batches", "0"]],
    "gad": [["--steps", "0"], ["--minutes", "-1"], ["--test-dir", MISSING]],
    "kernels": [["--reps", "0"], ["--experts", "x"], ["--slots", "8", "-3"]],
    "moa_real_data": [["--runs", "rs,nope"], ["--adapter-steps", "0"], ["--minutes", "nan"],
                      ["--test-dir", MISSING], ["--anchors", "0"]],
    "moa_synthetic": [["--anchors", "0"], ["--seeds", "1,1"], ["--runs", "top1"],
                      ["--synth", "nope=1"]],
    "moe_layer": [["--ks", "0"], ["--threads", "0"], ["--experts", "2", "--ks", "3"]],
    "multilingual": [["--variants", "dense,nope"], ["--minutes", "0"], ["--beam", "0"],
                     ["--test-dir", MISSING]],
    "qwen_block": [["--reps", "0"], ["--warmup", "-1"]],
    "real_data": [["--beam", "0"], ["--minutes", "inf"], ["--test-dir", MISSING]],
    "swiglu_experts": [["--reps", "0"]],
    "thor": [["--variants", ","], ["--steps", "-1"], ["--test-dir", MISSING]],
}
CASES = [(name, ["--no-such-option"]) for name in SCRIPTS] + \
    [(name, argv) for name, cases in BAD.items() for argv in cases]


def test_every_script_with_a_main_is_covered() -> None:
    assert set(BAD) <= set(SCRIPTS) and len(SCRIPTS) >= 13


@pytest.mark.parametrize("name,argv", CASES, ids=[f"{n}:{' '.join(a)}" for n, a in CASES])
def test_bad_argument_is_one_line_and_status_2(name: str, argv: list[str], capsys,
                                               tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    script = load_benchmark(name)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2, err
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    option = [a for a in argv if a.startswith("--")][-1]
    assert option in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_argument_types() -> None:
    assert int_at_least(0)("0") == 0 and int_at_least(1)("7") == 7
    assert positive_float("0.5") == 0.5
    assert comma_list(("a", "b", "c"))("c, a,c") == ["c", "a"]
    assert existing_dir(str(ROOT)) == str(ROOT)
    for parse, text, says in [(int_at_least(1), "0", "a positive integer, got '0'"),
                              (int_at_least(2), "2.5", "an integer >= 2"),
                              (positive_float, "nan", "a positive number"),
                              (positive_float, "-1", "a positive number"),
                              (comma_list(("a", "b")), "a,z", "(unknown: z)"),
                              (comma_list(("a", "b")), " , ", "some of a, b"),
                              (existing_dir, MISSING, "expected a directory")]:
        with pytest.raises(argparse.ArgumentTypeError, match=".*" + says.replace("(", r"\(")
                           .replace(")", r"\)")):
            parse(text)
