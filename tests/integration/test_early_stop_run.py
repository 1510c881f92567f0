"""A training run with early stopping stops on its dev plateau and still exports (CPU)."""

from moe_train.train.checkpoint import read_meta
from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def test_training_stops_after_patience_validations_without_a_gain(tiny_prepared, tmp_path):
    # min_delta is out of reach: the first validation sets the best, the next two do not
    # improve on it, so patience 2 stops the run at step 15 of 100
    overrides = debug_overrides(tiny_prepared, tmp_path, "train.max_steps=100",
                                "train.validate_every=5", "train.patience=2",
                                "train.early_stop_metric=loss", "train.min_delta=1e9",
                                "checkpoint.save_every=50", "train.bleu_sentences=4",
                                "data.max_tokens=400")
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert "| early stop at step 15: dev/loss best" in out and "at step 5," in out, out[-2000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000015"
    assert (tmp_path / "ckpt" / "export" / "model.safetensors").is_file()
    assert read_meta(tmp_path / "ckpt" / "step_00000015")["step"] == 15
    assert not (tmp_path / "ckpt" / "step_00000020").exists()
