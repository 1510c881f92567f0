"""Build the model a config describes (the one place that maps config -> modules)."""

from __future__ import annotations

from typing import Any

from moe_train.config.schema import ExperimentConfig
from moe_train.models.transformer import Seq2SeqTransformer


def build_model(cfg: ExperimentConfig, manifest: dict[str, Any]) -> Seq2SeqTransformer:
    """A single-device Seq2SeqTransformer sized to the prepared data's vocabulary."""
    return Seq2SeqTransformer(cfg.model, vocab_size=manifest["vocab_size"],
                              pad_id=manifest["pad_id"])
