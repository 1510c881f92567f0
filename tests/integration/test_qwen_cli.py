"""The decoder-only Qwen2-MoE through the CLI as a user runs it: prepare with a local Hugging Face
tokenizer (instruction prompts), train, translate and evaluate raw text, evaluate a prepared
split, count parameters; bad tokenizer directories are one-line errors with exit status 2."""

from __future__ import annotations

import json

from tests.conftest import ROOT, run_cli

CONFIG = str(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml")


def test_prepare_train_translate_evaluate(qwen_prepared, tmp_path):
    prepared, tok = qwen_prepared
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["tokenizer"] == "hf" and manifest["pad_id"] != manifest["eos_id"]
    overrides = [f"data.prepared_dir={prepared}", f"data.tokenizer={tok}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}",
                 "train.max_steps=30", "train.validate_every=15", "train.bleu_sentences=4",
                 "data.max_tokens=800", "optim.lr=5e-3", "optim.warmup_steps=5"]
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=tmp_path, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    losses = [float(line.split("| loss ")[1].split()[0]) for line in proc.stdout.splitlines()
              if line.startswith("| step")]
    assert losses[-1] < losses[0] - 1.0, losses
    export = tmp_path / "ckpt" / "export"
    assert summary["export"] == str(export) and (export / "tokenizer.json").is_file()

    src = tmp_path / "in.txt"
    src.write_text("the patient needs a new dose\nthe court rejected the appeal\n")
    for beam in ("1", "3"):
        out = tmp_path / f"out{beam}.txt"
        run_cli(["translate", "--checkpoint", str(export), "--input", str(src), "--output",
                 str(out), "--beam", beam], cwd=tmp_path)
        assert len(out.read_text().splitlines()) == 2
    # whitespace as prepare reads it, and a blank line stays blank
    messy = tmp_path / "messy.txt"
    messy.write_text("the patient  needs a\tnew dose \n\n  the court rejected the appeal\n")
    run_cli(["translate", "--checkpoint", str(export), "--input", str(messy), "--output",
             str(tmp_path / "messy.out"), "--beam", "1"], cwd=tmp_path)
    first, blank, second = (tmp_path / "messy.out").read_text().split("\n")[:3]
    assert [first, blank, second] == [*(tmp_path / "out1.txt").read_text().split("\n")[:1],
                                      "", *(tmp_path / "out1.txt").read_text().split("\n")[1:2]]
    long = tmp_path / "long.txt"
    long.write_text("the patient " * 400 + "\n")
    proc = run_cli(["translate", "--checkpoint", str(export), "--input", str(long), "--output",
                    str(tmp_path / "long.out")], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "more than the model's qwen.max_position_embeddings=" in proc.stderr  # its field
    # raw text scored: the same prompts as translate, so the same hypotheses
    ref = tmp_path / "ref.txt"
    ref.write_text("der Patient braucht eine neue Dosis\ndas Gericht wies die Berufung ab\n")
    proc = run_cli(["evaluate", "--checkpoint", str(export), "--beam", "1", "--src", str(src),
                    "--ref", str(ref), "--hyps", str(tmp_path / "hyps.txt")], cwd=tmp_path)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["all"]["sentences"] == 2
    assert (tmp_path / "hyps.txt").read_text() == (tmp_path / "out1.txt").read_text()
    proc = run_cli(["evaluate", "--checkpoint", str(export), "--beam", "1",
                    "--max-sentences", "16"], cwd=tmp_path)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["all"]["sentences"] == manifest["splits"]["test"]["sentences"]
    params = json.loads(run_cli(["params", "--checkpoint", str(export)], cwd=tmp_path)
                        .stdout.strip().splitlines()[-1])
    assert params["decoder_num_experts"] == 8 and params["encoder_moe_layers"] == 0


def test_bad_tokenizer_directories_are_one_line_errors(tiny_corpus, tmp_path):
    for name, files in (("missing", {}), ("garbage", {"tokenizer.json": "{not json",
                                                      "tokenizer_config.json": "{}"})):
        tok = tmp_path / name
        tok.mkdir()
        for file, text in files.items():
            (tok / file).write_text(text)
        proc = run_cli(["prepare", "--config", CONFIG, "--data", str(tiny_corpus), "--out",
                        str(tmp_path / f"p-{name}"), f"data.tokenizer={tok}"], cwd=tmp_path,
                       check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "tokenizer.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp_path / f"p-{name}").exists()


def test_training_refuses_data_longer_than_the_positions(qwen_prepared, tmp_path):
    prepared, tok = qwen_prepared
    proc = run_cli(["train", "--config", CONFIG, f"data.prepared_dir={prepared}",
                    f"data.tokenizer={tok}", "qwen.max_position_embeddings=16",
                    f"checkpoint.dir={tmp_path / 'ckpt'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "qwen.max_position_embeddings: expected at least" in proc.stderr
    assert "prompt + target" in proc.stderr
    # prompts prepared with one template, a model trained with another: refused
    proc = run_cli(["train", "--config", CONFIG, f"data.prepared_dir={prepared}",
                    f"data.tokenizer={tok}", "data.prompt_template=Q: {source} A:",
                    f"checkpoint.dir={tmp_path / 'ckpt'}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.prompt_template: " in proc.stderr and "prepared with" in proc.stderr
