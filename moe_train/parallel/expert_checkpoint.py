"""Expert parameters in checkpoints, under their global expert index (EP-size independent).

DeepSpeed writes the model states of rank 0 only, which under expert parallelism hold just that
rank's slice of every stacked expert tensor. So expert tensors are taken out of the module state
dict (a state-dict hook) and written by the first rank of every expert-data-parallel group to
the tensor store ``experts_ep{r}of{P}`` (utils/tensor_store.py: safetensors shards and an
index): its local slice [r*L, (r+1)*L) of each stacked parameter (fp32 master) and the Adam
moments of those slices, gathered one parameter at a time under ZeRO 0-3
(parallel/optim_state.py; collective under ZeRO 1-3, so every rank takes part), so no rank
holds all experts at once. Concatenated in rank order they give every tensor under its global
expert index. Loading cuts the slice the loading rank owns, whatever its ep size; inference
assembles the full experts. Checkpoints written before the stores hold
``experts_ep{r}of{P}.pt`` (read with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from moe_train.errors import CheckpointError
from moe_train.moe.experts import StackedExperts
from moe_train.parallel.zero3 import full_shape
from moe_train.parallel.optim_state import (MOMENTS, adam_step, legacy_state_source,
                                             save_param_state, set_moments, set_param,
                                             state_keys)
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.utils.safe_load import load_torch
from moe_train.utils.tensor_source import TensorSource
from moe_train.utils.tensor_store import MAX_SHARD_BYTES, TensorStoreWriter, open_store

_FILE_RE = re.compile(r"^experts_ep(\d+)of(\d+)\.(?:pt|index\.json)$")


def expert_modules(model: nn.Module) -> Iterator[tuple[str, StackedExperts]]:
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts):
            yield name, module


def _drop_from_state_dict(module: nn.Module, state: dict, prefix: str, meta: Any) -> None:
    for name, _ in module.named_parameters(recurse=False):
        state.pop(prefix + name, None)


def detach_experts_from_state_dict(model: nn.Module) -> None:
    """Leave expert tensors out of `model.state_dict()` (they live in the expert files)."""
    for _, experts in expert_modules(model):
        experts.register_state_dict_post_hook(_drop_from_state_dict)


def _local_tensors(model: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{mod_name}.{p_name}": p for mod_name, mod in expert_modules(model)
            for p_name, p in mod.named_parameters(recurse=False)}


def save_expert_shards(model: nn.Module, optimizer: Any, rt: ParallelRuntime,
                       tag_dir: Path, max_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write this rank's expert slices (first rank of each expert-data group; collective),
    one parameter at a time (`save_param_state`)."""
    params = _local_tensors(model)
    if not params:
        return
    # ranks 0..P-1 form the first expert-parallel group (DeepSpeed's layout): they write
    writer = TensorStoreWriter(tag_dir, f"experts_ep{rt.ep_rank}of{rt.ep_size}",
                               active=rt.rank < rt.ep_size, max_bytes=max_bytes)
    save_param_state(params, optimizer, writer)
    writer.close({"ep_size": rt.ep_size, "ep_rank": rt.ep_rank,
                  "adam_step": adam_step(optimizer)})


def _open_shards(tag_dir: Path) -> tuple[list[TensorSource], float]:
    """(one lazy source per expert-parallel rank, in rank order; Adam's step) of a checkpoint's
    expert files: tensor stores, or the single .pt files of older checkpoints."""
    names = {m.group(1, 2): p for p in Path(tag_dir).iterdir()
             if (m := _FILE_RE.match(p.name)) is not None}
    if not names:
        return [], 0.0
    sizes = {int(size) for _, size in names}
    ranks = sorted(int(rank) for rank, _ in names)
    if len(sizes) != 1 or ranks != list(range(sizes.pop())):
        raise CheckpointError(f"{tag_dir}: incomplete expert files "
                              f"({', '.join(sorted(p.name for p in names.values()))})")
    sources, step = [], 0.0
    for rank in ranks:
        path = next(p for (r, _), p in names.items() if int(r) == rank)
        if path.name.endswith(".index.json"):
            src, meta = open_store(tag_dir, path.name[:-len(".index.json")])
            step = float(meta.get("adam_step", 0.0))
        else:
            shard = load_torch(path, "expert shard")
            src = legacy_state_source(shard, str(path))
            step = shard.get("adam_step")
            if step is None:  # files written before adam_step was recorded: per moment
                step = next((float(m["step"]) for m in shard["moments"].values()
                             if "step" in m), 0.0)
        sources.append(src)
    return sources, float(step)


def _expert_names(sources: list[TensorSource]) -> list[str]:
    return [k[len("param/"):] for k in sources[0].names() if k.startswith("param/")]


def _global(sources: list[TensorSource], key: str) -> Tensor:
    """A stacked expert tensor under its global expert index: the ranks' slices, in order."""
    return torch.cat([src.get(key) for src in sources], 0)


def expert_tensors(tag_dir: Path) -> Iterator[tuple[str, Tensor]]:
    """(name, global stacked tensor [E, ...]) of every expert parameter, assembled from the
    expert files one at a time."""
    sources, _ = _open_shards(tag_dir)
    for name in _expert_names(sources) if sources else []:
        yield name, _global(sources, state_keys(name)["value"])


def full_expert_state(tag_dir: Path) -> dict[str, Tensor]:
    """Global stacked expert tensors {name: [E, ...]} assembled from the expert files."""
    return dict(expert_tensors(tag_dir))


def read_expert_moments(tag_dir: Path) -> dict[str, dict[str, Tensor]]:
    """{name: {moment: global tensor}} of the expert files ({} before Adam's first step)."""
    sources, _ = _open_shards(tag_dir)
    out = {}
    for name in _expert_names(sources) if sources else []:
        keys = state_keys(name)
        if all(keys[k] in sources[0].shapes for k in MOMENTS):
            out[name] = {k: _global(sources, keys[k]) for k in MOMENTS}
    return out


def load_expert_shards(model: nn.Module, optimizer: Any, rt: ParallelRuntime,
                       tag_dir: Path) -> None:
    """Copy this rank's slice of every expert tensor (and Adam moments if saved) into place,
    one parameter at a time."""
    params = _local_tensors(model)
    if not params:
        return
    sources, step = _open_shards(tag_dir)
    if not sources:
        raise CheckpointError(f"{tag_dir}: the model has MoE experts but the checkpoint has "
                              "no experts_ep* files")
    for name, p in params.items():
        keys = state_keys(name)
        if keys["value"] not in sources[0].shapes:
            raise CheckpointError(f"{tag_dir}: no expert tensor {name!r} in the checkpoint")
        shape = full_shape(p)
        L = shape[0]
        lo = rt.ep_rank * L
        full = _global(sources, keys["value"])
        if full.shape[1:] != shape[1:] or lo + L > full.size(0):
            raise CheckpointError(f"{tag_dir}: expert tensor {name!r} has shape "
                                  f"{tuple(full.shape)}, the model needs slice {lo}:{lo + L} of "
                                  f"shape {tuple(shape)}")
        set_param(optimizer, p, full[lo:lo + L])
        del full
        if all(keys[k] in src.shapes for src in sources for k in MOMENTS):
            moments = {k: _global(sources, keys[k])[lo:lo + L] for k in MOMENTS}
            set_moments(optimizer, p, moments, step)
