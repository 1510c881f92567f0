"""Skipping a non-finite optimizer step on a DeepSpeed engine, and ZeRO 1/2's pre-step norm.

The trainer decides before `engine.step()` whether the step may be applied (loss and global
gradient norm finite on every rank, `collectives.step_is_finite`). A skipped step must leave
parameters, optimizer moments and the lr scheduler untouched on every ZeRO stage, and drop the
gradients. `skipped_update` does that by sending `engine.step()` down DeepSpeed's own overflow
path (as for an fp16 overflow): the engine then zeroes gradients, counts `skipped_steps`, does
not step the lr scheduler, and still counts `global_steps`, at every stage alike.

Under ZeRO 1/2 the reduced gradients live in the optimizer's partitions (`averaged_gradients`:
dense groups partitioned over the data-parallel group, expert groups over the expert-data-parallel
group, and the expert-parallel ranks hold disjoint experts), so one SUM all-reduce of the local
squares over the data-parallel group is the exact global norm, every element counted once.
Checked against deepspeed 0.19.8; missing internals are a ConfigError naming optim.zero_stage.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist

from moe_train.errors import ConfigError
from moe_train.parallel.zero3 import is_zero3, skipped_zero3_step

_ZERO_INTERNALS = ("averaged_gradients", "bit16_groups", "dp_process_group", "loss_scale",
                   "device", "check_grad_overflow", "check_overflow", "overflow")
"""DeepSpeedZeroOptimizer (stage 1/2) attributes read here."""


def check_zero_optimizer(optimizer: Any) -> None:
    """Fail at start-up, not at the first skipped step, when DeepSpeed's internals moved."""
    missing = [name for name in _ZERO_INTERNALS if not hasattr(optimizer, name)]
    if missing:
        raise ConfigError(f"optim.zero_stage: the non-finite step guard needs DeepSpeed's ZeRO "
                          f"1/2 optimizer (checked against deepspeed 0.19.8); "
                          f"{type(optimizer).__name__} lacks {', '.join(missing)}")
    if getattr(optimizer, "cpu_offload", False):
        raise ConfigError("deepspeed.zero_optimization.offload_optimizer: the non-finite step "
                          "guard reads gradient partitions on the device; offload is unsupported")


def local_squared_norms(optimizer: Any) -> torch.Tensor:
    """This rank's [dense, expert] sums of squared (loss-scaled) gradient partitions (float64)."""
    sq_S = torch.zeros(2, dtype=torch.float64, device=optimizer.device)
    is_moe_G = getattr(optimizer, "is_moe_param_group", None) or [False] * len(
        optimizer.bit16_groups)
    for i in range(len(optimizer.bit16_groups)):
        for g in optimizer.averaged_gradients.get(i) or []:
            if not getattr(g, "_zero_padding", False):
                sq_S[int(bool(is_moe_G[i]))] += g.detach().double().pow(2).sum()
    return sq_S


def zero_grad_norm(optimizer: Any) -> float:
    """The exact unscaled global L2 gradient norm under ZeRO 1/2, read after the accumulation
    boundary's backward and before `engine.step()` (one all-reduce of two numbers)."""
    sq_S = local_squared_norms(optimizer)
    if dist.is_initialized():
        dist.all_reduce(sq_S, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    return math.sqrt(float(sq_S.sum())) / float(optimizer.loss_scale)


@contextlib.contextmanager
def _force_zero_overflow(opt: Any) -> Iterator[None]:
    """ZeRO 1/2: step() checks overflow first; report one and it drops the gradient partitions,
    updates the loss scaler (a back-off under dynamic fp16 scaling) and returns."""
    saved = opt.check_grad_overflow
    opt.check_grad_overflow = True  # fp32 / bf16 runs skip the check otherwise
    opt.check_overflow = lambda partition_gradients=True: setattr(opt, "overflow", True)
    try:
        yield
    finally:
        del opt.check_overflow  # the class's method again
        opt.check_grad_overflow = saved


@contextlib.contextmanager
def _replace_step(opt: Any, skip: Any, overflow_attr: bool) -> Iterator[None]:
    """ZeRO 0: the engine calls `optimizer.step()` and then reads `optimizer.overflow`."""
    opt.step = skip
    had_overflow = "overflow" in vars(opt)
    if overflow_attr:
        opt.overflow = True
    try:
        yield
    finally:
        del opt.step
        if overflow_attr and not had_overflow:
            del opt.overflow


def _skip_bf16(opt: Any) -> None:
    """BF16_Optimizer's own invalid-norm branch."""
    opt.overflow = True
    opt._global_grad_norm = float("inf")
    opt.clear_hp_grads()
    opt.clear_lp_grads()


@contextlib.contextmanager
def skipped_update(engine: Any) -> Iterator[None]:
    """`engine.step()` at the accumulation boundary inside this block applies no update."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer):
        guard = _force_zero_overflow(opt)
    elif is_zero3(opt):
        guard = skipped_zero3_step(opt)
    elif hasattr(type(opt), "_skip_invalid_grad_norm"):  # FP16_Optimizer, FP16_UnfusedOptimizer
        guard = _replace_step(opt, lambda closure=None: opt._skip_invalid_grad_norm(), False)
    elif hasattr(type(opt), "clear_hp_grads"):  # BF16_Optimizer
        guard = _replace_step(opt, lambda closure=None: _skip_bf16(opt), False)
    elif isinstance(opt, torch.optim.Optimizer):  # fp32 ZeRO 0: the client optimizer itself
        guard = _replace_step(opt, lambda closure=None: None, True)
    else:
        raise ConfigError(f"optim.zero_stage: cannot skip a non-finite step with DeepSpeed "
                          f"optimizer {type(opt).__name__}")
    with guard:
        yield


def loss_scale(engine: Any) -> float:
    """The optimizer's current fp16 loss scale (1.0 without loss scaling), which the gradients
    carry between `engine.backward()` and `engine.step()`."""
    opt = engine.optimizer
    config = getattr(opt, "loss_scale_config", None)
    scale = config.cur_scale if config is not None else getattr(opt, "cur_scale", None)
    return float(scale) if scale else 1.0
