"""Expert parameters in checkpoints, under their global expert index (EP-size independent).

DeepSpeed writes the model states of rank 0 only, which under expert parallelism hold just that
rank's slice of every stacked expert tensor. So expert tensors are taken out of the module state
dict (a state-dict hook) and written by the first rank of every expert-data-parallel group to
``experts_ep{r}of{P}.pt``: its local slice [r*L, (r+1)*L) of each stacked parameter, with the
Adam moments of those slices when the optimizer keeps them per parameter (ZeRO stage 0). Loading
assembles the global tensors from all files and cuts the slice the loading rank owns, whatever
its ep size; inference assembles the full experts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from moe_train.errors import CheckpointError
from moe_train.moe.experts import StackedExperts
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.utils.atomic import atomic_path

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
    """Write this rank's expert slices (first rank of each expert-data group only)."""
    params = _local_tensors(model)
    if not params or rt.rank >= rt.ep_size:
        return  # ranks 0..P-1 form the first expert-parallel group (DeepSpeed's layout)
    moments: dict[str, dict[str, Tensor]] = {}
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for name, p in params.items():
            if p in state and "exp_avg" in state[p]:
                moments[name] = {k: v.detach().cpu().clone() for k, v in state[p].items()
                                 if torch.is_tensor(v)}
    payload = {"ep_size": rt.ep_size, "ep_rank": rt.ep_rank,
               "params": {n: p.detach().cpu().clone() for n, p in params.items()},
               "moments": moments}
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
    return [torch.load(p, map_location="cpu", weights_only=False) for p in files]


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
    state = getattr(optimizer, "state", None)
    for name, p in params.items():
        if name not in shards[0]["params"]:
            raise CheckpointError(f"{tag_dir}: no expert tensor {name!r} in the checkpoint")
        L = p.size(0)
        lo = rt.ep_rank * L
        full = torch.cat([s["params"][name] for s in shards], 0)
        if full.shape[1:] != p.shape[1:] or lo + L > full.size(0):
            raise CheckpointError(f"{tag_dir}: expert tensor {name!r} has shape "
                                  f"{tuple(full.shape)}, the model needs slice {lo}:{lo + L} of "
                                  f"shape {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(full[lo:lo + L])
        if isinstance(state, dict) and all(name in s["moments"] for s in shards):
            moments = {k: torch.cat([s["moments"][name][k] for s in shards], 0)
                       for k in ("exp_avg", "exp_avg_sq")}
            slot = state.setdefault(p, {})
            for k, v in moments.items():
                slot[k] = v[lo:lo + L].to(p.device, p.dtype).clone()
            slot.setdefault("step", shards[0]["moments"][name].get("step", torch.tensor(0.0)))
