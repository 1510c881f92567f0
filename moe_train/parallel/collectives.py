"""Collective helpers that stages, training and evaluation call instead of torch.distributed.

Each helper is a no-op (identity) on a runtime that is not distributed, so callers need no
branches for the single-process debug mode.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe_train.errors import PeerFailed
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.zero3 import local_values


def all_reduce_sum(rt: ParallelRuntime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the data-parallel group, in place; returns it."""
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=rt.dp_group)
    return tensor


def all_reduce_floats(rt: ParallelRuntime, *values: float) -> list[float]:
    """Sum a few Python floats over ranks (one collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    return all_reduce_sum(rt, t).tolist()


def all_gather_object(rt: ParallelRuntime, obj: Any) -> list[Any]:
    """Gather one picklable object per rank, in rank order."""
    if not (rt.distributed and rt.world_size > 1):
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.dp_group)
    return out


def broadcast_object(rt: ParallelRuntime, obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    if not (rt.distributed and rt.world_size > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=rt.dp_group)
    return box[0]


def barrier(rt: ParallelRuntime) -> None:
    if rt.distributed and rt.world_size > 1:
        dist.barrier()


def max_int(rt: ParallelRuntime, value: int) -> int:
    """The largest `value` over ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=rt.device)
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.dp_group)
    return int(t.item())


def all_ranks_true(rt: ParallelRuntime, flag: bool) -> bool:
    """True when `flag` is true on every rank (a MIN all-reduce); keeps ranks in lockstep."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=rt.device)
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=rt.dp_group)
    return bool(t.item())


def raise_if_any_rank_failed(rt: ParallelRuntime, failed: BaseException | None,
                             peer_message: str,
                             cleanup: Callable[[], None] | None = None) -> None:
    """Collective: every rank learns whether any rank `failed` (a write only rank 0 makes, a
    full disk on one rank); if one did, `cleanup` runs and every rank raises, the failed ones
    their own error and the others PeerFailed(`peer_message`), instead of one rank going on
    alone or all waiting for each other."""
    if all_ranks_true(rt, failed is None):
        return
    if cleanup is not None:
        cleanup()
    if failed is not None:
        raise failed
    raise PeerFailed(peer_message)


def step_is_finite(rt: ParallelRuntime, loss: float, grad_norm: float | None) -> bool:
    """The one decision, agreed by every rank, whether this optimizer step may be applied.

    False when this step's loss or global gradient norm is NaN or infinite on any rank (one
    MIN all-reduce of a flag), so either every rank updates or none does.
    """
    finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    return all_ranks_true(rt, finite)


def parameters_are_finite(rt: ParallelRuntime, model: torch.nn.Module) -> bool:
    """True when no rank holds a NaN or infinite parameter (experts differ between ranks; under
    ZeRO-3 each rank checks its own partitions)."""
    finite = all(bool(torch.isfinite(local_values(p)).all()) for p in model.parameters())
    return all_ranks_true(rt, finite)


def grad_norm_and_clip(model: torch.nn.Module, expert_param_ids: set[int], rt: ParallelRuntime,
                       max_norm: float, loss_scale: float = 1.0) -> float:
    """Global L2 norm of the (already reduced) gradients, counting every expert once; clips.

    Dense gradients are identical on all ranks after the data-parallel reduction; each rank of
    an expert-parallel group holds the gradients of different experts, so their squared norms
    are summed over that group. The gradients may carry a loss scale (fp16): the norm is that
    of the unscaled gradients, `||g|| / loss_scale`, and with max_norm > 0 all gradients are
    multiplied by min(1, max_norm / (norm + 1e-6)), which commutes with the later unscaling.
    Returns the unscaled norm before clipping (NaN or inf when a gradient is not finite; then
    nothing is clipped, the step is to be skipped).
    """
    dense_sq = torch.zeros((), dtype=torch.float64, device=rt.device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=rt.device)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        sq = p.grad.detach().double().pow(2).sum()
        if id(p) in expert_param_ids:
            expert_sq += sq
        else:
            dense_sq += sq
    if rt.ep_size > 1:
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=rt.ep_group)
    norm = float((dense_sq + expert_sq).sqrt()) / loss_scale
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm
