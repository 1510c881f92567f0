"""The encoder-decoder Transformer under ZeRO-3 (one rank, every parameter partitioned): its
final validation decodes dev BLEU with search calling `decode` itself, outside any module
forward, so the output projection (tied to the embedding table, or its own) must be gathered
there; the run used to crash at that validation, leaving no checkpoint or export."""

import json

import pytest

from tests.conftest import ROOT, debug_overrides, run_cli


@pytest.mark.parametrize("tied", [True, False])
def test_zero3_encoder_decoder_validates_bleu_and_exports(tiny_prepared, tmp_path, tied):
    proc = run_cli(["train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
                    *debug_overrides(tiny_prepared, tmp_path, "optim.zero_stage=3",
                                     "train.max_steps=2", "train.validate_every=0",
                                     "train.bleu_sentences=4", "data.max_tokens=300",
                                     f"model.tie_embeddings={str(tied).lower()}",
                                     # partition every parameter, however small
                                     "deepspeed.zero_optimization.stage3_param_persistence_"
                                     "threshold=0")], cwd=ROOT)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["step"] == 2 and summary["dev/chrf"] > 0
    assert (tmp_path / "ckpt" / "export" / "model.index.json").is_file()
