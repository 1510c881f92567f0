"""Exact global gradient norm for DeepSpeed's ZeRO 1/2 optimizer under expert parallelism.

What DeepSpeed 0.19.8 does (runtime/zero/stage_1_and_2.py): `scaled_global_norm` takes one norm
per optimizer param group from `get_grad_norm_direct` (squares of this rank's gradient partition,
summed over the whole data-parallel group), then, with MoE layers, `_average_expert_grad_norms`
averages each expert group's norm over its `real_dp_process_group` (the expert-data-parallel
group), and combines the groups by L2. `step` clips with that norm and keeps it in
`_global_grad_norm` (read back by `engine.get_global_grad_norm()`).

Whether that is the norm of the full gradient hinges on which group the squares are summed over:
with the whole data-parallel group (0.19.8) the averaging is over equal values and the result is
exact; older releases averaged over the expert-parallel group, and summing over the expert-data
group alone would count only this rank's experts. `exact_ep_grad_norm` replaces
`scaled_global_norm` on one optimizer instance by a computation that does not depend on that
choice: ZeRO partitions dense groups over the data-parallel group and expert groups over the
expert-data-parallel group, and the P expert-parallel ranks hold disjoint experts, so every
element of the full gradient lives in exactly one rank's partition. One SUM all-reduce of the
local squares over the data-parallel group is therefore the exact squared norm: dense parameters
counted once, every expert counted once across the expert-parallel group.

Shape legend: G optimizer param groups, P expert-parallel size, W data-parallel world size
(= P * expert-data-parallel size), S = 2 (dense, expert) squared-norm slots.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from moe_train.errors import ConfigError
from moe_train.parallel.runtime import ParallelRuntime

_REQUIRED = ("scaled_global_norm", "averaged_gradients", "bit16_groups", "dp_process_group",
             "real_dp_process_group", "has_moe_layers", "cpu_offload", "loss_scale", "device",
             "param_groups", "_global_grad_norm")
"""DeepSpeedZeroOptimizer (stage 1/2) internals the exact norm reads."""

_PATCHED_FLAG = "_moe_train_exact_ep_norm"


def _missing_internals(optimizer: Any, ep_size: int) -> list[str]:
    names = list(_REQUIRED) + (["is_moe_param_group", "ep_process_group"] if ep_size > 1 else [])
    return [name for name in names if not hasattr(optimizer, name)]


def _check_layout(optimizer: Any, rt: ParallelRuntime) -> None:
    """The ranks' partitions tile the full gradient: W = P * (expert-data-parallel size)."""
    if rt.ep_size == 1:
        return
    if not optimizer.has_moe_layers:
        raise RuntimeError("DeepSpeed's ZeRO optimizer has no MoE parameter groups: create the "
                           "engine inside parallel.expert_parallel.deepspeed_sees_moe_layers()")
    if getattr(optimizer, "model_parallel_world_size", 1) != 1:
        raise ConfigError("optim.zero_stage: the exact expert-parallel gradient norm does not "
                          "support tensor (model) parallelism")
    world = dist.get_world_size(group=optimizer.dp_process_group)
    for i, is_moe in enumerate(optimizer.is_moe_param_group):
        if not is_moe:
            continue
        name = optimizer.param_groups[i].get("name")
        ep_world = dist.get_world_size(group=optimizer.ep_process_group[name])
        edp_world = dist.get_world_size(group=optimizer.real_dp_process_group[i])
        if ep_world != rt.ep_size or ep_world * edp_world != world:
            raise ConfigError(f"moe.ep_size: expected expert-parallel groups of {rt.ep_size} "
                              f"ranks times expert-data-parallel groups to tile the "
                              f"{world} data-parallel ranks; param group {i} ({name}) has "
                              f"{ep_world} x {edp_world}")


def local_squared_norms(optimizer: Any) -> torch.Tensor:
    """This rank's [dense, expert] sums of squared gradient partitions (float64, shape S)."""
    sq_S = torch.zeros(2, dtype=torch.float64, device=optimizer.device)
    is_moe_G = getattr(optimizer, "is_moe_param_group", None) or [False] * len(
        optimizer.bit16_groups)
    lacks_scale = getattr(optimizer, "_muon_update_lacks_loss_scale", None)
    for i in range(len(optimizer.bit16_groups)):
        grads = optimizer.averaged_gradients[i] or []
        group_sq = sum((g.detach().double().pow(2).sum() for g in grads
                        if not getattr(g, "_zero_padding", False)),
                       torch.zeros((), dtype=torch.float64, device=optimizer.device))
        if lacks_scale is not None and lacks_scale(i):  # Muon updates carry no loss scale
            group_sq = group_sq * float(optimizer.loss_scale) ** 2
        sq_S[int(bool(is_moe_G[i]))] += group_sq
    return sq_S


def _exact_scaled_global_norm(self: Any, norm_type: int = 2) -> torch.Tensor:
    """Replacement for DeepSpeedZeroOptimizer.scaled_global_norm (bound per instance).

    Returns the loss-scaled L2 norm of the full gradient as a float32 scalar tensor, +inf when
    it is not finite (DeepSpeed's step then treats the step as an overflow).
    """
    if norm_type != 2:
        raise ValueError(f"only the L2 norm is supported, got norm_type={norm_type}")
    sq_S = local_squared_norms(self)
    dist.all_reduce(sq_S, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    norm = sq_S.sum().sqrt().float()
    return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, float("inf")))


def exact_ep_grad_norm(optimizer: Any, rt: ParallelRuntime) -> None:
    """Make this ZeRO 1/2 optimizer clip with (and report) the exact global gradient norm.

    Patches `scaled_global_norm` on the instance only (the class is untouched). DeepSpeed's
    `step` clips with the returned norm and stores norm / loss_scale in `_global_grad_norm`,
    which `engine.get_global_grad_norm()` returns for logging. Call right after
    `deepspeed.initialize` with `engine.optimizer`. Raises ConfigError (naming
    optim.zero_stage) when the DeepSpeed internals it relies on are missing.
    """
    if getattr(optimizer, _PATCHED_FLAG, False):
        return
    missing = _missing_internals(optimizer, rt.ep_size)
    if missing:
        raise ConfigError(
            f"optim.zero_stage: the exact expert-parallel gradient norm needs DeepSpeed's ZeRO "
            f"1/2 optimizer (checked against deepspeed 0.19.8); {type(optimizer).__name__} "
            f"lacks {', '.join(missing)}")
    if optimizer.cpu_offload:
        raise ConfigError("deepspeed.zero_optimization.offload_optimizer: the exact "
                          "expert-parallel gradient norm does not support optimizer offload")
    _check_layout(optimizer, rt)
    optimizer.scaled_global_norm = types.MethodType(_exact_scaled_global_norm, optimizer)
    setattr(optimizer, _PATCHED_FLAG, True)
