"""Collective helpers that stages, training and evaluation call instead of torch.distributed.

Each helper is a no-op (identity) on a runtime that is not distributed, so callers need no
branches for the single-process debug mode.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_train.parallel.runtime import ParallelRuntime


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
