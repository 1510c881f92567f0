"""`moe-train demo`, the README's first command, end to end in a shortened form.

The real command (synthetic corpus, sentencepiece preparation, DeepSpeed training, export, beam
search over the whole test set) with overrides that shrink the model and the training to a few
steps. It must end with the per-domain BLEU table and the paths it wrote, and those files must be
there; a second run reuses every finished artifact and resumes the checkpoint.
"""

from __future__ import annotations

import json
import re

from tests.conftest import ROOT, run_cli

SHRINK = ["model.d_model=32", "model.n_heads=2", "model.ffn_dim=64", "model.encoder_layers=1",
          "model.decoder_layers=1", "data.vocab_size=300", "data.max_tokens=600",
          "train.max_steps=6", "train.log_every=2", "train.validate_every=0", "train.bleu_every=0",
          "checkpoint.save_every=6", "eval.beam=2"]
DOMAINS = ["it", "law", "medical", "religion", "subtitles"]
ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\d+\.\d\d)\s+(\d+\.\d\d)$")


def _table(out: str) -> dict[str, tuple[int, float, float]]:
    """The per-domain table the demo prints: name -> (sentences, BLEU, chrF)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["domain", "sents", "BLEU", "chrF"])
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
    assert all(rows[d][0] == 100 for d in DOMAINS) and rows["ALL"][0] == 500  # the whole test set
    metrics = json.loads((work / "test_metrics.json").read_text())
    for name in DOMAINS:
        m = metrics["domains"][name]
        assert (m["sentences"], m["bleu"], m["chrf"]) == rows[name]
    assert rows["ALL"][2] > 0  # something was translated
    # It ends by naming what it wrote, and those are there.
    tail = out.strip().splitlines()[-4:]
    assert tail[0] == f"[demo] work directory: {work}", tail
    ckpt = work / "checkpoints"
    assert tail[1] == f"[demo]   checkpoint:  {ckpt} (export: {ckpt / 'export'})", tail
    assert re.search(r"\[demo\] done in [\d.]+ min \| 6 steps \|", out)
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert (ckpt / "step_00000006").is_dir()
    inf = load_for_inference(ckpt / "export")  # the export the table came from loads back
    assert inf.cfg.model.d_model == 32 and inf.manifest["vocab_size"] == 300
    assert any((work / "tensorboard").iterdir())

    # Run again: corpus, preparation and checkpoint are reused (no new step is trained).
    again = run_cli(args, cwd=tmp_path, timeout=600).stdout
    assert "[demo] generating" not in again and "[demo] preparing" not in again
    assert "resume from step 6" in again, again[-3000:]
    assert _table(again) == rows  # same export, same deterministic beam search
    assert (ckpt / "latest").read_text().strip() == "step_00000006"


def test_demo_bad_override_is_one_line_error(tmp_path):
    proc = run_cli(["demo", "--workdir", str(tmp_path / "w"), "model.no_such_field=1"],
                   cwd=ROOT, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no_such_field" in lines[0]
    assert not (tmp_path / "w" / "data").exists()  # nothing generated before the config is valid
