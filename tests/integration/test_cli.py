"""The `moe-train` command end to end: errors in one line, prepare -> train -> evaluate -> translate."""

import json
import os

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
    for cmd in ("synth", "prepare", "train", "translate", "evaluate", "demo", "average"):
        proc = run_cli([cmd, "--help"], cwd=tmp_path)
        assert "usage: moe-train" in proc.stdout


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_synth_writes_the_generator_corpus_that_prepare_reads(tmp_path):
    """`synth` writes exactly what generate_synthetic writes for the same options (the same
    seed, the same bytes), refuses to replace it without --overwrite, and prepare reads it."""
    from moe_train.data.synthetic import generate_synthetic

    out = tmp_path / "corpus"
    args = ["synth", "--out", str(out), "--domains", "2", "--langs", "de,fr", "--train", "30",
            "--dev", "3", "--test", "4", "--seed", "11"]
    proc = run_cli(args, cwd=tmp_path)
    assert f"wrote {out}" in proc.stdout and "de-en, en-fr" in proc.stdout
    generate_synthetic(tmp_path / "ref", num_domains=2, target_langs=["de", "fr"],
                       train_per_domain=30, dev_per_domain=3, test_per_domain=4, seed=11,
                       report=True)  # synth adds the difficulty report
    files = _files(out)
    assert "difficulty: bag-of-words domain accuracy" in proc.stdout
    assert files == _files(tmp_path / "ref")
    assert len(files) == 1 + 2 * 2 * 3 * 2  # domains.json + domains x pairs x splits x sides
    assert (out / "medical" / "medical.en-fr.test.fr").read_text().count("\n") == 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    _one_line_error(run_cli(args, cwd=tmp_path, check=False), str(out), "--overwrite")
    run_cli([*args[:-1], "12", "--overwrite"], cwd=tmp_path)
    assert _files(out) != files  # another seed, replaced whole
    proc = run_cli(["prepare", "--data", str(out), "--out", str(tmp_path / "prepared"),
                    "data.vocab_size=4000"], cwd=tmp_path)
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert sorted(manifest["domains"]) == ["law", "medical"]
    # a corpus this small cannot fill 4000 pieces: the summary says what was asked
    assert manifest["vocab_size"] < 4000
    assert (f"| vocabulary {manifest['vocab_size']} (data.vocab_size asked 4000; the training "
            "text filled no more) |") in proc.stdout


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
                              "train.bleu_every=15", "train.bleu_sentences=10",
                              "checkpoint.save_every=15")], cwd=tmp_path)
    assert list((work / "tb").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_train.train.schedule import inverse_sqrt_factor
    acc = EventAccumulator(str(work / "tb"))
    acc.Reload()
    lrs = {e.step: e.value for e in acc.Scalars("train/lr")}
    assert lrs and all(abs(v - 1e-3 * inverse_sqrt_factor(s, 50)) < 1e-9 for s, v in lrs.items())

    ev = run_cli(["evaluate", "--checkpoint", str(work / "ckpt"), "--split", "test", "--beam", "2",
                  "--hyps", str(tmp_path / "hyps.txt"), "--json", str(tmp_path / "m.json")],
                 cwd=tmp_path)
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    domains = json.loads((tiny_corpus / "domains.json").read_text())
    assert len(result["domains"]) == 5
    assert result["all"]["sentences"] == 5 * 8
    assert result["all"]["bleu_signature"].startswith("nrefs:1|")
    assert len((tmp_path / "hyps.txt").read_text().splitlines()) == 40
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["all"] == result["all"]
    assert "evaluate" in record["provenance"]["command"] and record["provenance"]["git"]["commit"]
    # timed from the command's start (loading and decoding 40 sentences), not from the write
    assert record["provenance"]["wall_seconds"] >= 1, record["provenance"]
    assert result["data"]["split"] == "test" and result["data"]["prepared"]  # what was scored
    assert result["decoding"]["beam"] == 2 and "lenpen" in result["decoding"]
    assert domains  # the generator recorded its domains

    # the last two checkpoints (steps 15 and 30) averaged into an export that evaluates
    avg = run_cli(["average", str(work / "ckpt"), "--last", "2", "--out", str(tmp_path / "avg")],
                  cwd=tmp_path)
    assert [i["step"] for i in json.loads(avg.stdout.strip().splitlines()[-1])["inputs"]] == [
        15, 30]
    averaged = json.loads((tmp_path / "avg" / "average.json").read_text())
    assert [i["path"] for i in averaged["inputs"]] == [
        str((work / "ckpt" / f"step_{s:08d}").resolve()) for s in (15, 30)]
    assert "average" in averaged["provenance"]["command"] and averaged["provenance"]["machine"]
    ev = run_cli(["evaluate", "--checkpoint", str(tmp_path / "avg"), "--split", "test",
                  "--beam", "1"], cwd=tmp_path)
    assert json.loads(ev.stdout.strip().splitlines()[-1])["all"]["sentences"] == 40

    src_file = next(tiny_corpus.glob("*/*.test.en"))
    ref_file = src_file.with_suffix(".de")
    quiet = run_cli(["evaluate", "--checkpoint", str(work / "ckpt"), "--beam", "1",
                     "--src", str(src_file), "--ref", str(ref_file),
                     "--hyps", os.devnull, "--json", os.devnull], cwd=tmp_path)  # both discarded
    quiet_result = json.loads(quiet.stdout.strip().splitlines()[-1])
    assert quiet_result["all"]["sentences"] == 8
    assert quiet_result["data"] == {"src": str(src_file), "ref": str(ref_file)}
    out_file = tmp_path / "out.txt"
    run_cli(["translate", "--checkpoint", str(work / "ckpt" / "export"), "--input",
             str(src_file), "--output", str(out_file), "--beam", "3"], cwd=tmp_path)
    assert len(out_file.read_text().splitlines()) == len(src_file.read_text().splitlines())
    # standard output: UTF-8 whatever the locale says, and a reader that has left (`| head`)
    # ends the command quietly (128 + SIGPIPE), not in a traceback
    import subprocess
    import sys

    from tests.conftest import cli_env

    export = str(work / "ckpt" / "export")
    env = {**cli_env(), "PYTHONIOENCODING": "ascii"}
    to_stdout = subprocess.run([sys.executable, "-m", "moe_train", "translate", "--checkpoint",
                                export, "--input", str(src_file), "--beam", "3"], cwd=tmp_path,
                               env=env, capture_output=True, timeout=300)
    assert to_stdout.returncode == 0, to_stdout.stderr[-2000:]
    assert to_stdout.stdout.decode("utf-8") == out_file.read_text(encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "moe_train", "translate", "--checkpoint",
                             export, "--input", str(src_file), "--beam", "1"], cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before anything is written
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and b"Traceback" not in err, err[-2000:]
