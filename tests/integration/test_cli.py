"""The `moe-train` command end to end: errors in one line, prepare -> train -> evaluate -> translate."""

import json

import pytest

from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert err.count("\n") == 0, err
    assert err.startswith("error: ")
    for needle in needles:
        assert needle in err, err


def test_help_for_every_command(tmp_path):
    for cmd in ("prepare", "train", "translate", "evaluate", "demo"):
        proc = run_cli([cmd, "--help"], cwd=tmp_path)
        assert "usage: moe-train" in proc.stdout


@pytest.mark.parametrize("case", ["mismatch", "utf8", "empty", "missing"])
def test_prepare_data_errors_are_one_line_and_leave_nothing(tmp_path, case):
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("a b\nc d\ne f\n")
    tgt.write_text("x y\nz w\nv u\n")
    expect = {}
    if case == "mismatch":
        tgt.write_text("x y\nz w\n")
        expect = (str(src), "3 lines", str(tgt))
    elif case == "utf8":
        src.write_bytes(b"a b\nc \xff d\ne f\n")
        expect = (f"{src}:2", "UTF-8")
    elif case == "empty":
        tgt.write_text("x y\n\nv u\n")
        expect = (f"{tgt}:2", "empty")
    else:
        tgt.unlink()
        expect = (str(tgt),)
    out = tmp_path / "out"
    proc = run_cli(["prepare", "--src", str(src), "--tgt", str(tgt), "--out", str(out)],
                   cwd=tmp_path, check=False)
    _one_line_error(proc, *expect)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_config_errors_are_one_line(tmp_path):
    _one_line_error(run_cli(["train", "--config", CONFIG, "model.n_heads=5"], cwd=tmp_path,
                            check=False), "model.d_model", "multiple of model.n_heads")
    _one_line_error(run_cli(["train", "--config", str(tmp_path / "nope.yaml")], cwd=tmp_path,
                            check=False), "nope.yaml", "not found")
    _one_line_error(run_cli(["train", "--config", CONFIG, f"data.prepared_dir={tmp_path}/none"],
                            cwd=tmp_path, check=False), "none", "moe-train prepare")


def test_prepare_train_evaluate_translate(tiny_corpus, tmp_path):
    prepared = tmp_path / "prepared"
    proc = run_cli(["prepare", "--data", str(tiny_corpus), "--out", str(prepared), "--config",
                    CONFIG, "data.vocab_size=300", "data.pairs=[en-de]"], cwd=tmp_path)
    assert "train" in proc.stdout and (prepared / "manifest.json").is_file()
    work = tmp_path / "w"
    run_cli(["train", "--config", CONFIG,
             *debug_overrides(prepared, work, "train.max_steps=30", "train.validate_every=15",
                              "train.bleu_every=15", "train.bleu_sentences=10")], cwd=tmp_path)
    assert list((work / "tb").glob("events.out.tfevents.*"))

    ev = run_cli(["evaluate", "--checkpoint", str(work / "ckpt"), "--split", "test", "--beam", "2",
                  "--hyps", str(tmp_path / "hyps.txt"), "--json", str(tmp_path / "m.json")],
                 cwd=tmp_path)
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    domains = json.loads((tiny_corpus / "domains.json").read_text())
    assert len(result["domains"]) == 5
    assert result["all"]["sentences"] == 5 * 8
    assert result["all"]["bleu_signature"].startswith("nrefs:1|")
    assert len((tmp_path / "hyps.txt").read_text().splitlines()) == 40
    assert json.loads((tmp_path / "m.json").read_text())["all"] == result["all"]
    assert domains  # the generator recorded its domains

    src_file = next(tiny_corpus.glob("*/*.test.en"))
    out_file = tmp_path / "out.txt"
    run_cli(["translate", "--checkpoint", str(work / "ckpt" / "export"), "--input",
             str(src_file), "--output", str(out_file), "--beam", "3"], cwd=tmp_path)
    assert len(out_file.read_text().splitlines()) == len(src_file.read_text().splitlines())
