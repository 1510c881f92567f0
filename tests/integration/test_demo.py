"""`moe-train demo`, the README's first command, end to end in a shortened form.

The real command (synthetic multilingual corpus, sentencepiece preparation, DeepSpeed training of
the hybrid MoE, export, beam search over the whole test set, routing tables, extraction of one
direction's sub-network) with overrides that shrink the model and the training to a few steps.
It must print BLEU per direction and per domain, the decoder's expert x target-language table,
pass its extraction check and end with the paths it wrote, and those files must be there; a
second run reuses every finished artifact and resumes the checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import ROOT, run_cli

SHRINK = ["model.d_model=32", "model.n_heads=2", "model.ffn_dim=64", "model.encoder_layers=1",
          "model.decoder_layers=1", "data.vocab_size=300", "data.max_tokens=600",
          "train.max_steps=6", "train.log_every=2", "train.validate_every=0", "train.bleu_every=0",
          "checkpoint.save_every=6", "eval.beam=2"]
DOMAINS = ["it", "law", "medical"]
DIRECTIONS = ["de-en", "en-de", "en-fr", "fr-en"]
ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\d+\.\d\d)\s+(\d+\.\d\d)$")


def _table(out: str, head: str = "domain") -> dict[str, tuple[int, float, float]]:
    """A BLEU table the demo prints (per domain or per direction): name -> (sentences, BLEU,
    chrF)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == [head, "sents", "BLEU", "chrF"])
    rows = {}
    for line in lines[start + 1:]:
        match = ROW.match(line)
        if not match:
            break
        rows[match[1]] = (int(match[2]), float(match[3]), float(match[4]))
    return rows


def test_demo_command_end_to_end(tmp_path):
    from moe_train.train.export import load_for_inference

    work = tmp_path / "demo-work"
    args = ["demo", "--workdir", str(work), "--minutes", "2", *SHRINK]
    out = run_cli(args, cwd=tmp_path, timeout=600).stdout

    rows = _table(out)
    assert list(rows) == [*DOMAINS, "ALL"], out[-3000:]
    assert all(rows[d][0] == 100 for d in DOMAINS) and rows["ALL"][0] == 300  # the whole test set
    pairs = _table(out, "direction")
    assert list(pairs) == [*DIRECTIONS, "ALL"] and pairs["ALL"] == rows["ALL"]
    assert all(pairs[d][0] == 75 for d in DIRECTIONS)
    metrics = json.loads((work / "test_metrics.json").read_text())
    for group, names, table in (("domains", DOMAINS, rows), ("pairs", DIRECTIONS, pairs)):
        for name in names:
            m = metrics[group][name]
            assert (m["sentences"], m["bleu"], m["chrf"]) == table[name]
    assert rows["ALL"][2] > 0  # something was translated
    # The decoder routes by target language: its expert x language table and heatmap.
    assert re.search(r"^expert\s+de\s+en\s+fr$", out, re.M), out[-3000:]
    assert re.search(r"decoder_layers\.\d+\.ffn \(task routing by target language, k=2\): "
                     r"share of each target language's token slots per expert", out), out[-3000:]
    assert "provenance" in metrics and "demo" in metrics["provenance"]["command"]
    heatmap = re.search(r"routing heatmap: (\S+)", out)
    assert heatmap and heatmap[1].endswith(".expert_tgt_lang.png"), out[-3000:]
    assert Path(heatmap[1]).is_file() and Path(heatmap[1]).parent == work / "routing"
    # The en-de sub-network: smaller, and it translates its test sentences identically.
    assert "extraction check: 75/75 en-de test sentences translated identically" in out
    ext = metrics["extraction"]
    assert ext["passed"] and ext["identical"] == 75
    assert ext["extracted"]["total"] < ext["full"]["total"]
    assert load_for_inference(ext["out"]).cfg.moe.decoder_num_experts == 2
    # It ends by naming what it wrote, and those are there.
    tail = out.strip().splitlines()[-5:]
    assert tail[0] == f"[demo] work directory: {work}", tail
    ckpt = work / "checkpoints"
    assert tail[1] == f"[demo]   checkpoint:  {ckpt} (export: {ckpt / 'export'})", tail
    assert "NOTE" not in out  # the step budget ended training, not the time guard
    assert re.search(r"\[demo\] done in [\d.]+ min \| 6 steps \| \d+ target tokens/s$", out,
                     re.M), out[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert (ckpt / "step_00000006").is_dir()
    inf = load_for_inference(ckpt / "export")  # the export the table came from loads back
    assert inf.cfg.model.d_model == 32 and inf.manifest["vocab_size"] == 300
    assert any((work / "tensorboard").iterdir())

    # Run again: corpus, preparation and checkpoint are reused (no new step is trained).
    again = run_cli(args, cwd=tmp_path, timeout=600).stdout
    assert "[demo] generating" not in again and "[demo] preparing" not in again
    assert "resume from step 6" in again, again[-3000:]
    assert re.search(r"\[demo\] done in [\d.]+ min \| 6 steps \| \d+ target tokens/s \(trained "
                     r"by an earlier run; this one only evaluated\)", again), again[-3000:]
    assert _table(again) == rows  # same export, same deterministic beam search
    assert "extraction check: 75/75" in again
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    # Other data settings would silently reuse the corpus prepared with the old ones: refused.
    other = run_cli([*args, "data.vocab_size=250"], cwd=tmp_path, check=False, timeout=120)
    assert other.returncode == 2, other.stderr[-2000:]
    assert other.stderr.strip().splitlines() == [
        f"error: demo --workdir {work}: its corpus was made with data.vocab_size 300, not 250; "
        "use another --workdir (or remove this one)"]


def test_demo_bad_override_is_one_line_error(tmp_path):
    proc = run_cli(["demo", "--workdir", str(tmp_path / "w"), "model.no_such_field=1"],
                   cwd=ROOT, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no_such_field" in lines[0]
    assert not (tmp_path / "w" / "data").exists()  # nothing generated before the config is valid


def test_demo_names_what_ended_training(tmp_path, monkeypatch, capsys):
    """Early stopping is not the time guard; --minutes 0 is no guard at all."""
    import pytest

    import moe_train.commands as commands
    import moe_train.demo as demo
    import moe_train.train.export as export

    class Evaluating(Exception):
        pass

    def stop(*args, **kwargs):
        raise Evaluating

    monkeypatch.setattr(demo, "_data", lambda workdir, cfg: tmp_path)
    monkeypatch.setattr(commands, "run_training", lambda cfg, resume: {
        "step": 4, "stopped_early": True, "exported_step": 2})
    monkeypatch.setattr(export, "load_for_inference", stop)
    with pytest.raises(Evaluating):
        demo.run_demo(tmp_path / "w", minutes=0)
    out = capsys.readouterr().out
    assert "600 steps (no time guard)" in out
    assert "NOTE: early stopping ended training at step 4 of 600 (the export is step 2)" in out
    assert "guard stopped" not in out


def test_a_run_that_failed_while_preparing_does_not_block_the_next(tmp_path, monkeypatch):
    """The data settings are written once the corpus is prepared: a first run that failed in
    `prepare` (after making the corpus) left settings that refused the corrected run ("its
    corpus was made with data.vocab_size 20"). Corpus and prepare are fakes here."""
    import pytest

    import moe_train.data.prepare as prepare_module
    import moe_train.data.synthetic_dir as synthetic_dir
    import moe_train.demo as demo
    from moe_train.errors import DataError

    def make_corpus(out, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "domains.json").write_text("{}")

    def prepare(corpora, out, data_cfg, seed=1, overwrite=False):
        if data_cfg.vocab_size < 100:
            raise DataError(f"data.vocab_size: {data_cfg.vocab_size} is too small")
        out.mkdir(parents=True, exist_ok=True)
        (out / "manifest.json").write_text("{}")
        return {"vocab_size": data_cfg.vocab_size,
                "splits": {s: {"sentences": 5} for s in ("train", "dev", "test")}}

    monkeypatch.setattr(synthetic_dir, "write_synthetic", make_corpus)
    monkeypatch.setattr(prepare_module, "prepare", prepare)
    monkeypatch.setattr("moe_train.data.corpus.discover", lambda *a, **k: [])
    work = tmp_path / "w"
    with pytest.raises(DataError, match="20 is too small"):
        demo._data(work, demo.demo_config(work, None, ["data.vocab_size=20"]))
    assert (work / "data" / "domains.json").is_file()
    assert not (work / "data-settings.json").exists()
    demo._data(work, demo.demo_config(work, None, ["data.vocab_size=300"]))
    assert json.loads((work / "data-settings.json").read_text())["data.vocab_size"] == 300
