"""Per-parameter Adam state under ZeRO 0-3, independent of how it is partitioned.

Under ZeRO 0 the optimizer keeps a state dict per parameter. Under ZeRO 1/2 DeepSpeed keeps one
flat fp32 partition per parameter group and rank, and maps each parameter to its fragment
(``param._hp_mapping``, the basis of its tensor-fragment API `safe_get_full_optimizer_state` /
`safe_set_full_optimizer_state`). We read and write through that mapping directly: DeepSpeed's
getters fail when its optimizer-state links are stale (they are made once, after the first
step), ours read the partition's current Adam state. Getting is COLLECTIVE (an all-reduce over the
parameter's data-parallel group: the expert-data group for experts), so every rank calls it for
the same parameters in the same order; setting is local (each rank writes the fragment it owns).

With these, checkpoints store moments per parameter (experts under their global index), so a run
resumes at another world size or ep size with its optimizer state (DeepSpeed 0.19.8 itself refuses
to load ZeRO optimizer partitions at another data-parallel world size).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_train.errors import CheckpointError
from moe_train.parallel.zero3 import copy_partition, full_shape, is_zero3, z3_get, z3_set
from moe_train.utils.tensor_source import TensorSource
from moe_train.utils.tensor_store import TensorStoreWriter

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero12(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeed's ZeRO stage 1/2 optimizer (flat fp32 partitions)."""
    return hasattr(optimizer, "single_partition_of_fp32_groups")


def is_zero_partitioned(optimizer: Any) -> bool:
    """Whether `optimizer` is a DeepSpeed ZeRO optimizer (stage 1, 2 or 3: partitioned fp32
    master weights and Adam state; see parallel/zero3.py for stage 3)."""
    return _zero12(optimizer) or is_zero3(optimizer)


def _base(optimizer: Any) -> Any:
    return optimizer.optimizer if is_zero_partitioned(optimizer) else optimizer


def adam_step(optimizer: Any) -> float:
    """Adam's update count (0.0 before the first step)."""
    for slot in _base(optimizer).state.values():
        if "step" in slot:
            return float(slot["step"])
    return 0.0


def _fragment(optimizer: Any, p: nn.Parameter) -> tuple[Tensor, Any, Any] | None:
    """(flat fp32 partition, its fragment address, the parameter's address) or None when this
    rank's partition holds no part of `p`."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    return flat, mapping.hp_fragment_address, mapping.lp_fragment_address


def _zero_get(optimizer: Any, p: nn.Parameter, key: str | None) -> Tensor:
    """The full fp32 value (key None) or Adam state `key` of `p`: every rank contributes its
    fragment and the data-parallel group all-reduces (DeepSpeed's `get_full_hp_param`, reading
    the partition itself, so it also works before DeepSpeed links its optimizer fragments)."""
    buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    frag = _fragment(optimizer, p)
    if frag is not None:
        flat, hp, lp = frag
        src = flat if key is None else optimizer.optimizer.state.get(flat, {}).get(key)
        if src is not None:
            buf.narrow(0, lp.start, lp.numel).copy_(src.narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, group=p._dp_group)
    return buf.view(p.shape).cpu()


def _zero_set(optimizer: Any, p: nn.Parameter, key: str | None, value: Tensor,
              step: float = 0.0) -> None:
    """Write this rank's fragment of `value` (full tensor) into the partition (local)."""
    frag = _fragment(optimizer, p)
    if frag is None:
        return
    flat, hp, lp = frag
    if key is None:
        dst = flat.data
    else:
        slot = optimizer.optimizer.state[flat]
        if not all(k in slot for k in MOMENTS):  # Adam's state is created lazily
            slot.update({k: torch.zeros_like(flat) for k in MOMENTS})
            slot["step"] = torch.tensor(step, dtype=torch.float32)
        dst = slot[key]
    src = value.reshape(-1).to(dst.device, dst.dtype)
    dst.narrow(0, hp.start, hp.numel).copy_(src.narrow(0, lp.start, lp.numel))


def _frozen_value(p: nn.Parameter) -> Tensor:
    """The value of a parameter the optimizer does not hold (frozen: requires_grad False, the
    same on every rank), gathered whole under ZeRO-3 (collective there)."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            return p.detach().float().cpu().clone()
    return p.detach().float().cpu().clone()


def has_unfused_masters(optimizer: Any) -> bool:
    """DeepSpeed keeps fp32 masters beside a 16-bit module at ZeRO 0 (FP16_UnfusedOptimizer)."""
    return (isinstance(getattr(optimizer, "fp16_groups", None), list)
            and isinstance(getattr(optimizer, "fp32_groups", None), list))


def _unfused_master(optimizer: Any, p: nn.Parameter) -> Tensor | None:
    """The fp32 copy DeepSpeed keeps of `p` in 16-bit training at ZeRO 0 (its
    FP16_UnfusedOptimizer: `fp16_groups` and `fp32_groups`, parameter for parameter; Adam's
    state is keyed by the copy); None otherwise (fp32: `p` is its own master)."""
    if not has_unfused_masters(optimizer):
        return None
    for group_low, group_high in zip(optimizer.fp16_groups, optimizer.fp32_groups):
        for a, b in zip(group_low, group_high):
            if a is p:
                return b
    return None


def fp32_param(optimizer: Any, p: nn.Parameter) -> Tensor:
    """The fp32 master value of `p` (collective under ZeRO 1-3); a frozen parameter's own.
    In 16-bit training the module holds the master's rounding: exports and checkpoints take
    the master, what the optimizer updates."""
    if not p.requires_grad:  # not in the optimizer: no master copy, no partition
        return _frozen_value(p)
    if is_zero3(optimizer):
        return z3_get(optimizer, p, None)
    if _zero12(optimizer):
        return _zero_get(optimizer, p, None)
    return _state_key(optimizer, p).detach().float().cpu().clone()


def master_tensors(model: nn.Module, optimizer: Any, keep: bool = True
                   ) -> Iterator[tuple[str, Tensor | None]]:
    """(name, fp32 CPU copy) of every state-dict entry of `model`, each trainable parameter as
    its fp32 master (`fp32_param`), buffers and frozen parameters as they are (gathered under
    ZeRO-3). Collective under ZeRO 1-3: every rank iterates to the end; ranks that do not
    `keep` get None."""
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter):
            value = fp32_param(optimizer, t)
        elif hasattr(t, "ds_id"):
            value = _frozen_value(t)
        else:
            value = t.detach().float().cpu().clone() if t.is_floating_point() else \
                t.detach().cpu().clone()
        yield name, value if keep else None


def _state_key(optimizer: Any, p: nn.Parameter) -> Tensor:
    """`p`'s fp32 master at ZeRO 0 when it has one (what the optimizer keys its Adam state
    by), else `p` itself."""
    master = _unfused_master(optimizer, p)
    return p if master is None else master


def get_moments(optimizer: Any, p: nn.Parameter) -> dict[str, Tensor] | None:
    """Full Adam moments of `p` on CPU, or None before the first step or for a frozen
    parameter (collective, ZeRO 1/2)."""
    if not p.requires_grad:
        return None
    if is_zero_partitioned(optimizer):
        if adam_step(optimizer) == 0.0:  # same answer on every rank
            return None
        get = z3_get if is_zero3(optimizer) else _zero_get
        return {k: get(optimizer, p, k) for k in MOMENTS}
    slot = optimizer.state.get(_state_key(optimizer, p), {})
    if not all(k in slot for k in MOMENTS):
        return None
    return {k: slot[k].detach().cpu().clone() for k in MOMENTS}


def set_param(optimizer: Any, p: nn.Parameter, value: Tensor) -> None:
    """Set `p` and its fp32 master copy (local: each rank writes what it owns); a frozen
    parameter has no master copy, only its own values (under ZeRO-3 its partition). At ZeRO
    0 in 16-bit only `p`: DeepSpeed's own checkpoint restores the masters there (expert
    files written before they held masters hold `p`'s rounding)."""
    if not p.requires_grad and hasattr(p, "ds_tensor"):
        copy_partition(p.ds_tensor, value, dist.get_rank(group=p.ds_process_group))
        return
    if is_zero3(optimizer):
        z3_set(optimizer, p, None, value)
        return
    with torch.no_grad():
        p.copy_(value.to(p.device, p.dtype))
    if is_zero_partitioned(optimizer):
        _zero_set(optimizer, p, None, value)


def set_moments(optimizer: Any, p: nn.Parameter, moments: dict[str, Tensor], step: float) -> None:
    """Set the Adam moments of `p` from full tensors (local; none for a frozen parameter)."""
    if not p.requires_grad:
        return
    if is_zero_partitioned(optimizer):
        put = z3_set if is_zero3(optimizer) else _zero_set
        for k in MOMENTS:
            put(optimizer, p, k, moments[k], step)
        return
    key = _state_key(optimizer, p)
    slot = optimizer.state.setdefault(key, {})
    for k in MOMENTS:
        slot[k] = moments[k].to(key.device, key.dtype).clone()
    slot["step"] = torch.tensor(step, dtype=torch.float32)


def state_keys(name: str) -> dict[str, str]:
    """Store keys of a parameter's fp32 value and Adam moments (parallel checkpoints)."""
    return {"value": f"param/{name}", **{k: f"{k}/{name}" for k in MOMENTS}}


def save_param_state(params: dict[str, nn.Parameter], optimizer: Any,
                     writer: TensorStoreWriter, moments: bool = True) -> None:
    """fp32 value and (with `moments`) Adam moments, once there are any, of each of `params`,
    gathered one parameter at a time into `writer` (collective under ZeRO: every rank runs
    the same gathers; only an active writer keeps them)."""
    for name, p in params.items():
        keys = state_keys(name)
        writer.add(keys["value"], fp32_param(optimizer, p))
        if not moments:
            continue
        moments_p = get_moments(optimizer, p)
        for k, value in (moments_p or {}).items():
            writer.add(keys[k], value)


def dense_params(model: nn.Module, skip: set[int], frozen: bool = False
                 ) -> dict[str, nn.Parameter]:
    """The trainable parameters of `model` not in `skip` (the experts), by name; with
    `frozen`, the frozen ones too (under ZeRO-3 their values exist only as partitions: DeepSpeed's
    model states hold empty placeholders for them)."""
    return {name: p for name, p in model.named_parameters()
            if (p.requires_grad or frozen) and id(p) not in skip}


def param_aliases(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, str]:
    """{other name: name in `params`} of each of `params` that `model` also holds under another
    name (tied embeddings: `named_parameters` lists a shared tensor once), so a reader of the
    stored values can fill every name the model's state dict has."""
    stored = {id(p): name for name, p in params.items()}
    return {name: stored[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in stored and stored[id(p)] != name}


def legacy_state_source(state: dict[str, Any], where: str) -> TensorSource:
    """The store keys of a pre-store state dict {"params": {n: t}, "moments": {n: {k: t}}}."""
    flat = {state_keys(n)["value"]: t for n, t in state["params"].items()}
    flat.update({state_keys(n)[k]: t for n, m in state["moments"].items() for k, t in m.items()})
    return TensorSource.from_dict(flat, where)


def load_dense_state(model: nn.Module, optimizer: Any, src: TensorSource, step: float,
                     skip: set[int], frozen: bool = False) -> None:
    """Set every trainable parameter not in `skip` and its moments from `src` (local: each
    rank writes its partition; tensors read one at a time); with `frozen`, the frozen ones
    too, which must then be there (ZeRO-3 saves them)."""
    for name, p in dense_params(model, skip, frozen).items():
        keys = state_keys(name)
        if keys["value"] not in src.shapes:
            what = "value" if not p.requires_grad else "optimizer state"
            raise CheckpointError(f"{src.where}: no {what} for parameter {name!r}")
        if src.shapes[keys["value"]] != tuple(full_shape(p)):
            raise CheckpointError(f"{src.where}: parameter {name!r} has shape "
                                  f"{src.shapes[keys['value']]}, the model needs "
                                  f"{tuple(full_shape(p))}")
        set_param(optimizer, p, src.get(keys["value"]))
        if all(keys[k] in src.shapes for k in MOMENTS):
            set_moments(optimizer, p, {k: src.get(keys[k]) for k in MOMENTS}, step)
