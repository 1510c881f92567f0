"""Standalone inference checkpoints: weights, config, sentencepiece model; no DeepSpeed needed.

`load_for_inference` accepts an export directory, a training checkpoint directory (follows
`latest`) or one step directory of it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_train.config.loader import config_from_dict
from moe_train.config.schema import ExperimentConfig
from moe_train.data.vocab import Vocab
from moe_train.errors import CheckpointError
from moe_train.models.build import build_model
from moe_train.train.checkpoint import consolidated_state_dict, latest_tag, read_meta
from moe_train.utils.atomic import atomic_dir

EXPORT_WEIGHTS = "model.pt"


@dataclass
class InferenceModel:
    """Everything translation needs."""

    model: torch.nn.Module
    vocab: Vocab
    cfg: ExperimentConfig
    manifest: dict[str, Any]
    source: Path


def export_inference(out_dir: str | Path, state_dict: dict[str, torch.Tensor],
                     cfg: ExperimentConfig, manifest: dict[str, Any], spm_model: Path) -> Path:
    """Write model.pt (fp32 weights), config.json, manifest.json, spm.model atomically."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        weights = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                   for k, v in state_dict.items()}
        torch.save(weights, tmp / EXPORT_WEIGHTS)
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.copyfile(spm_model, tmp / "spm.model")
    return out_dir


def _resolve(path: Path) -> tuple[str, Path]:
    if (path / EXPORT_WEIGHTS).is_file():
        return "export", path
    if (path / "meta.json").is_file():
        return "step", path
    if path.is_dir():
        tag = latest_tag(path)
        if tag is not None:
            return "step", path / tag
    raise CheckpointError(f"{path}: not an export directory (model.pt), a checkpoint directory "
                          "(latest) or a step directory (meta.json)")


def load_for_inference(path: str | Path, device: torch.device | str = "cpu") -> InferenceModel:
    """Load a model for translation, in eval mode, on `device`."""
    kind, where = _resolve(Path(path))
    if kind == "export":
        cfg_dict = json.loads((where / "config.json").read_text())
        manifest = json.loads((where / "manifest.json").read_text())
        state = torch.load(where / EXPORT_WEIGHTS, map_location="cpu", weights_only=True)
    else:
        meta = read_meta(where)
        cfg_dict, manifest = meta["config"], json.loads((where / "manifest.json").read_text())
        state = consolidated_state_dict(where)
    cfg = config_from_dict(cfg_dict)
    model = build_model(cfg, manifest)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{where}: weights do not match the config (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    model.to(device).eval()
    return InferenceModel(model=model, vocab=Vocab(where / "spm.model"), cfg=cfg,
                          manifest=manifest, source=where)
