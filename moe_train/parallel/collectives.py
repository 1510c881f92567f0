"""Collective helpers that stages, training and evaluation call instead of torch.distributed.

Each helper is a no-op (identity) on a runtime that is not distributed, so callers need no
branches for the single-process debug mode.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from moe_train.errors import PeerFailed
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.zero3 import local_values


def all_reduce_sum(rt: ParallelRuntime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the data-parallel group, in place; returns it."""
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=rt.dp_group)
    return tensor


def _float64_vector(rt: ParallelRuntime, values: Sequence[float | Tensor]) -> Tensor:
    """Python floats and 0-dim tensors as one float64 vector on the device; tensors stay there
    (nothing is read), floats become fills (no host-to-device copy)."""
    if not any(isinstance(v, Tensor) for v in values):
        return torch.tensor(values, dtype=torch.float64, device=rt.device)
    return torch.stack([v.detach().to(rt.device, torch.float64).reshape(())
                        if isinstance(v, Tensor)
                        else torch.full((), v, dtype=torch.float64, device=rt.device)
                        for v in values])


def read_values(rt: ParallelRuntime, summed: Sequence[float | Tensor],
                local: Sequence[float | Tensor] = ()) -> tuple[list[float], list[float]]:
    """(`summed` summed over ranks, `local` as this rank has them), read from the device
    together: one collective and one host sync. Values are Python floats or 0-dim tensors
    still on the device (window sums of losses, metric counts)."""
    t = all_reduce_sum(rt, _float64_vector(rt, summed))
    if local:
        t = torch.cat([t, _float64_vector(rt, local)])
    values = t.tolist()
    return values[:len(summed)], values[len(summed):]


def all_reduce_floats(rt: ParallelRuntime, *values: float | Tensor) -> list[float]:
    """Sum a few values (Python floats or 0-dim device tensors) over ranks: one collective,
    one read."""
    return read_values(rt, values)[0]


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


@contextlib.contextmanager
def agreed_exit(rt: ParallelRuntime, peer_message: str) -> Iterator[None]:
    """A block some ranks may fail in (rank 0's fit or write): every rank leaves it together,
    the block's end a barrier. If any rank failed, it raises its own error there and the
    others PeerFailed(`peer_message`), instead of waiting at the next collective for a rank
    that is gone."""
    failed: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (raised below, once every rank knows)
        failed = exc
    raise_if_any_rank_failed(rt, failed, peer_message)


def step_is_finite(rt: ParallelRuntime, loss: float | Tensor,
                   grad_norm: float | Tensor | None) -> bool:
    """The one decision, agreed by every rank, whether this optimizer step may be applied.

    False when this step's loss or global gradient norm is NaN or infinite on any rank (one
    MIN all-reduce of a flag), so either every rank updates or none does.
    """
    return step_decision(rt, loss, grad_norm)[0]


def step_decision(rt: ParallelRuntime, loss: float | Tensor, grad_norm: float | Tensor | None
                  ) -> tuple[bool, float | None]:
    """(`step_is_finite`, the gradient norm as a float) with one host sync: the loss and the
    norm may still be on the device (0-dim tensors); they are tested there, the flag is
    all-reduced there, and the flag and the norm are read together."""
    on_host = [v for v in (loss, grad_norm) if v is not None and not isinstance(v, Tensor)]
    flag = torch.full((1,), int(all(math.isfinite(v) for v in on_host)), dtype=torch.int64,
                      device=rt.device)
    for v in (loss, grad_norm):
        if isinstance(v, Tensor):
            flag = flag * torch.isfinite(v.detach()).reshape(1).to(flag.device)
    if rt.distributed and rt.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=rt.dp_group)
    if not isinstance(grad_norm, Tensor):
        return bool(flag.item()), grad_norm
    finite, norm = torch.cat([flag.double(), grad_norm.detach().double().reshape(1)]).tolist()
    return bool(finite), norm


def parameters_are_finite(rt: ParallelRuntime, model: torch.nn.Module) -> bool:
    """True when no rank holds a NaN or infinite parameter (experts differ between ranks; under
    ZeRO-3 each rank checks its own partitions)."""
    finite = all(bool(torch.isfinite(local_values(p)).all()) for p in model.parameters())
    return all_ranks_true(rt, finite)


def global_grad_norm(model: torch.nn.Module, expert_param_ids: set[int], rt: ParallelRuntime,
                     loss_scale: float = 1.0) -> Tensor:
    """Global L2 norm of the (already reduced) gradients, counting every expert once, as a
    0-dim float64 tensor on the device (nothing is read: see `grad_norm_and_clip`).

    Dense gradients are identical on all ranks after the data-parallel reduction; each rank of
    an expert-parallel group holds the gradients of different experts, so their squared norms
    are summed over that group. The gradients may carry a loss scale (fp16): the norm is that
    of the unscaled gradients, `||g|| / loss_scale`. One `_foreach_norm` per group (float64
    per-tensor norms, summed as squares), not one fp64 copy per parameter.
    """
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is not None:
            (experts if id(p) in expert_param_ids else dense).append(p.grad)
    dense_sq = _squared_norm(dense, rt.device)
    expert_sq = _squared_norm(experts, rt.device)
    if rt.ep_size > 1:
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=rt.ep_group)
    return (dense_sq + expert_sq).sqrt() / loss_scale


def _squared_norm(grads: list[Tensor], device: torch.device | str) -> Tensor:
    """Sum of the squares of every element of `grads`, float64 (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def clip_gradients(model: torch.nn.Module, norm: float, max_norm: float) -> None:
    """With max_norm > 0 and a finite `norm` above it, multiply every gradient by
    max_norm / (norm + 1e-6) (which commutes with a later unscaling by the loss scale)."""
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))


def grad_norm_and_clip(model: torch.nn.Module, expert_param_ids: set[int], rt: ParallelRuntime,
                       max_norm: float, loss_scale: float = 1.0) -> float:
    """`global_grad_norm` read as a float, then `clip_gradients`: returns the unscaled norm
    before clipping (NaN or inf when a gradient is not finite; then nothing is clipped, the
    step is to be skipped). The trainer reads the norm with its finite check instead (one
    sync for both)."""
    norm = float(global_grad_norm(model, expert_param_ids, rt, loss_scale))
    clip_gradients(model, norm, max_norm)
    return norm
