"""`train.init_from`: start a fresh run from existing weights, one tensor at a time.

The weights come from a moe_train export or checkpoint directory (any architecture), or a local
Hugging Face Qwen2-MoE directory (config.json with ``model_type``, safetensors, single or
sharded; read through the mapping of moe_train.models.hf_io). Their names and full shapes must
be exactly the model's: a mismatch is one CheckpointError line naming the tensors. Tensors are
read one at a time (safetensors headers give the shapes), so a ZeRO-3 model built partitioned
(`moe_train.parallel.zero3.partitioned_build`) is filled without any rank holding it whole:
only the main rank reads, and each value is scattered to the partitions. A step checkpoint
is the exception: its consolidated state is read whole on every rank (export it first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
from moe_train.errors import CheckpointError, MoeTrainError
from moe_train.parallel.zero3 import full_shape, load_partitioned
from moe_train.utils.safe_load import read_json_object
from moe_train.utils.tensor_source import Shape, TensorSource


def is_hf_model_dir(path: Path) -> bool:
    """Whether `path` looks like a Hugging Face model directory (config.json with a
    model_type), not a moe_train export (whose config.json has our sections)."""
    config = path / "config.json"
    return config.is_file() and "model_type" in read_json_object(config, "a config.json")


def open_init_weights(path: str | Path, cfg: ExperimentConfig,
                      manifest: dict[str, Any] | None = None) -> TensorSource:
    """The weights `train.init_from` names, under our tensor names, read lazily. Given the
    run's data `manifest`, the source must have seen the same tokenizer, domains and
    languages (`check_model_data`; a Hugging Face directory: its tokenizer.json)."""
    from moe_train.data.prepare import check_model_data
    from moe_train.models.hf_io import hf_source
    from moe_train.train.checkpoint import consolidated_state_dict
    from moe_train.train.export import export_source, read_parts

    path, prepared = Path(path), Path(cfg.data.prepared_dir)
    try:
        if path.is_dir() and is_hf_model_dir(path):
            if not cfg.decoder_only:
                raise CheckpointError(f"{path} is a Hugging Face model directory; expected "
                                      "model.arch hf_qwen2_moe to start from it (or a moe_train "
                                      "export / checkpoint)")
            if manifest is not None and (path / TOKENIZER_JSON).is_file():
                check_model_data(path, {"tokenizer": HFTokenizer.kind}, prepared, manifest)
            return hf_source(path, cfg)
        kind, where, _, source_manifest, _ = read_parts(path)
        if manifest is not None:
            check_model_data(where, source_manifest, prepared, manifest)
        if kind == "step":
            return TensorSource.from_dict(consolidated_state_dict(where), where)
        return export_source(where)
    except MoeTrainError as exc:
        raise CheckpointError(f"train.init_from: {exc}") from None


def model_shapes(model: nn.Module) -> dict[str, Shape]:
    """Full shapes of the model's state dict (partitioned ZeRO-3 parameters included)."""
    return {name: tuple(full_shape(t)) for name, t in model.state_dict(keep_vars=True).items()}


def check_shapes(own: dict[str, Shape], given: dict[str, Shape], source: str | Path,
                 model: str = "the model of its config") -> None:
    """Same names and shapes as `model`, else one line naming the first differences."""
    missing = [k for k in own if k not in given]
    unexpected = [k for k in given if k not in own]
    shapes = [f"{k} {given[k]} vs {own[k]}" for k in own if k in given and given[k] != own[k]]
    if missing or unexpected or shapes:
        raise CheckpointError(f"{source}: weights do not match {model} "
                              f"({len(missing)} missing {missing[:3]}, {len(unexpected)} "
                              f"unexpected {unexpected[:3]}, {len(shapes)} of other shape "
                              f"{shapes[:2]}); expected weights of the same architecture")


@torch.no_grad()
def load_init_weights(model: nn.Module, src: TensorSource, is_main: bool = True) -> int:
    """Copy every tensor of `src` into `model` (partitioned or not; collective when
    partitioned); returns the number of elements loaded (each tied tensor once)."""
    check_shapes(model_shapes(model), src.shapes, f"train.init_from: {src.where}",
                 "the model of this run's config")
    load_partitioned(model, src.get, is_main)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(int(torch.Size(full_shape(t)).numel()) for t in unique.values())


def build_start_model(cfg: ExperimentConfig, manifest: dict, ds_config: dict, is_main: bool,
                      load: bool = True) -> tuple[nn.Module, int]:
    """The model a run starts from and the elements `train.init_from` filled (0: none).

    A decoder-only model under ZeRO-3 whose weights come from `train.init_from` is built
    partitioned (`partitioned_build`), so no rank ever holds it whole; `load` False (resuming:
    the checkpoint's weights win) builds it the same way and reads nothing. The weights are
    opened before the model is built, so a bad path fails at once."""
    from moe_train.models.build import build_model
    from moe_train.parallel.zero3 import partitioned_build
    from moe_train.train.ds_config import deepspeed_config_errors

    init_from = cfg.train.init_from
    src = open_init_weights(init_from, cfg, manifest) if init_from and load else None
    partitioned = bool(init_from) and cfg.optim.zero_stage == 3 and cfg.decoder_only
    if partitioned:  # DeepSpeed reads the config here first: its refusals are one line too
        with deepspeed_config_errors(cfg.deepspeed), partitioned_build(ds_config):
            model = build_model(cfg, manifest)
    else:
        model = build_model(cfg, manifest)
    return model, 0 if src is None else load_init_weights(model, src, is_main)
