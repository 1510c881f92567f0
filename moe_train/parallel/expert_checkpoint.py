"""Expert parameters in checkpoints, under their global expert index (EP-size independent).

DeepSpeed writes the model states of rank 0 only, which under expert parallelism hold just that
rank's slice of every stacked expert tensor. So expert tensors are taken out of the module state
dict (a state-dict hook) and written by the first rank of every expert-data-parallel group to
``experts_ep{r}of{P}.pt``: its local slice [r*L, (r+1)*L) of each stacked parameter (fp32 master)
and the Adam moments of those slices, read per parameter under ZeRO 0, 1 and 2
(parallel/optim_state.py; collective under ZeRO 1/2, so every rank takes part). Concatenated in
file order they give every tensor under its global expert index. Loading cuts the slice the
loading rank owns, whatever its ep size; inference assembles the full experts. The files hold
tensors only and load with ``torch.load(weights_only=True)``.
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
from moe_train.parallel.optim_state import (adam_step, fp32_param, get_moments, set_moments,
                                             set_param)
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import load_torch

_FILE_RE = re.compile(r"^experts_ep(\d+)of(\d+)\.pt$")


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
                       tag_dir: Path) -> None:
    """Write this rank's expert slices (first rank of each expert-data group; collective)."""
    params = _local_tensors(model)
    if not params:
        return
    values = {n: fp32_param(optimizer, p) for n, p in params.items()}  # every rank: collective
    moments = {}
    for name, p in params.items():
        m = get_moments(optimizer, p)
        if m is not None:
            moments[name] = m
    if rt.rank >= rt.ep_size:
        return  # ranks 0..P-1 form the first expert-parallel group (DeepSpeed's layout)
    payload = {"ep_size": rt.ep_size, "ep_rank": rt.ep_rank, "adam_step": adam_step(optimizer),
               "params": values, "moments": moments}
    with atomic_path(tag_dir / f"experts_ep{rt.ep_rank}of{rt.ep_size}.pt") as tmp:
        torch.save(payload, tmp)


def _read_shards(tag_dir: Path) -> list[dict[str, Any]]:
    files = sorted((p for p in Path(tag_dir).iterdir() if _FILE_RE.match(p.name)),
                   key=lambda p: int(_FILE_RE.match(p.name).group(1)))
    if not files:
        return []
    sizes = {int(_FILE_RE.match(p.name).group(2)) for p in files}
    if len(sizes) != 1 or len(files) != sizes.pop():
        raise CheckpointError(f"{tag_dir}: incomplete expert files "
                              f"({', '.join(p.name for p in files)})")
    return [load_torch(p, "expert shard") for p in files]


def full_expert_state(tag_dir: Path) -> dict[str, Tensor]:
    """Global stacked expert tensors {name: [E, ...]} assembled from the expert files."""
    shards = _read_shards(tag_dir)
    if not shards:
        return {}
    return {name: torch.cat([s["params"][name] for s in shards], 0)
            for name in shards[0]["params"]}


def load_expert_shards(model: nn.Module, optimizer: Any, rt: ParallelRuntime,
                       tag_dir: Path) -> None:
    """Copy this rank's slice of every expert tensor (and Adam moments if saved) into place."""
    params = _local_tensors(model)
    if not params:
        return
    shards = _read_shards(tag_dir)
    if not shards:
        raise CheckpointError(f"{tag_dir}: the model has MoE experts but the checkpoint has "
                              "no experts_ep*.pt files")
    step = shards[0].get("adam_step")
    if step is None:  # files written before adam_step was recorded keep it per moment
        step = next((float(m["step"]) for m in shards[0]["moments"].values() if "step" in m), 0.0)
    for name, p in params.items():
        if name not in shards[0]["params"]:
            raise CheckpointError(f"{tag_dir}: no expert tensor {name!r} in the checkpoint")
        shape = full_shape(p)
        L = shape[0]
        lo = rt.ep_rank * L
        full = torch.cat([s["params"][name] for s in shards], 0)
        if full.shape[1:] != shape[1:] or lo + L > full.size(0):
            raise CheckpointError(f"{tag_dir}: expert tensor {name!r} has shape "
                                  f"{tuple(full.shape)}, the model needs slice {lo}:{lo + L} of "
                                  f"shape {tuple(shape)}")
        set_param(optimizer, p, full[lo:lo + L])
        if all(name in s["moments"] for s in shards):
            moments = {k: torch.cat([s["moments"][name][k] for s in shards], 0)[lo:lo + L]
                       for k in ("exp_avg", "exp_avg_sq")}
            set_moments(optimizer, p, moments, step)
