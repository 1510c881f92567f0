"""Permute tokens into expert-contiguous rows, and unpermute rows back with combine weights.

`permute` sorts the T*K routed slots by expert (stably: token order within an expert), drops
slots whose id is -1 and gathers the token rows: N = number of kept slots. `row_map_N` maps each
sorted row n to its slot as the flat index t*K + k (token t = row_map // K, slot k = row_map % K).
`unpermute` is the combine: y_TD[t] = sum over kept slots k of weights_TK[t, k] * y_ND[row(t, k)];
its gradient flows to the rows and to the combine weights (the router learns through it).

Both run as a torch reference (index_select / index_add, no Python loops; the CPU path) or as
Triton kernels on CUDA (a row gather, a gather-based combine without atomics).

Shape legend: T tokens, K expert slots per token, E experts, N kept (routed) rows, D model dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from moe_train.kernels.backend import use_triton
from moe_train.kernels.histogram import check_expert_ids, expert_histogram


class Permuted(NamedTuple):
    """What `permute` returns."""

    x_ND: Tensor
    """Token rows grouped by expert (expert 0's rows first), stable within an expert."""
    row_map_N: Tensor
    """int64 flat slot index t*K + k of each row."""
    counts_E: Tensor
    """int64 rows per expert; sums to N."""


def sort_slots(expert_ids_TK: Tensor, num_experts: int, *, backend: str = "auto"
               ) -> tuple[Tensor, Tensor]:
    """(row_map_N, counts_E): kept slots ordered by expert, stably. One host sync (for N)."""
    check_expert_ids(expert_ids_TK)
    counts_E = expert_histogram(expert_ids_TK, num_experts, backend=backend)
    ids = expert_ids_TK.reshape(-1)
    keys = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    order = torch.sort(keys, stable=True).indices
    num_rows = int(counts_E.sum())
    return order[:num_rows], counts_E


def inverse_row_map(row_map_N: Tensor, num_slots: int) -> Tensor:
    """pos_S: the row of each flat slot (S = T*K), -1 for dropped slots."""
    pos = torch.full((num_slots,), -1, dtype=torch.long, device=row_map_N.device)
    pos[row_map_N] = torch.arange(row_map_N.numel(), device=row_map_N.device)
    return pos


# --- torch reference (also the CPU path) --------------------------------------------------------

def permute_rows_torch(x_TD: Tensor, token_N: Tensor) -> Tensor:
    """x_ND[n] = x_TD[token_N[n]]."""
    return x_TD.index_select(0, token_N)


def scatter_rows_torch(x_ND: Tensor, token_N: Tensor, num_tokens: int) -> Tensor:
    """Sum of the rows of each token: the transpose of `permute_rows_torch`."""
    out = x_ND.new_zeros(num_tokens, x_ND.size(1))
    return out.index_add_(0, token_N, x_ND)


def unpermute_torch(y_ND: Tensor, row_map_N: Tensor, weights_TK: Tensor) -> Tensor:
    """Reference combine: y_TD[t] = sum_k weights_TK[t, k] * y_ND[row(t, k)]."""
    T, K = weights_TK.shape
    w_N = weights_TK.reshape(-1).index_select(0, row_map_N).to(y_ND.dtype)
    return scatter_rows_torch(y_ND * w_N[:, None], row_map_N // K, T)


def unpermute_backward_torch(grad_TD: Tensor, y_ND: Tensor | None, row_map_N: Tensor,
                             weights_TK: Tensor) -> tuple[Tensor, Tensor | None]:
    """Gradients of `unpermute_torch` wrt y_ND and (when `y_ND` is given) weights_TK."""
    T, K = weights_TK.shape
    g_ND = grad_TD.index_select(0, row_map_N // K)
    w_N = weights_TK.reshape(-1).index_select(0, row_map_N).to(g_ND.dtype)
    grad_w_TK = None
    if y_ND is not None:
        dots_N = (g_ND * y_ND).sum(-1, dtype=torch.float32)
        grad_w_TK = torch.zeros(T * K, dtype=torch.float32, device=g_ND.device)
        grad_w_TK.index_copy_(0, row_map_N, dots_N)
        grad_w_TK = grad_w_TK.view(T, K).to(weights_TK.dtype)
    return g_ND * w_N[:, None], grad_w_TK


# --- autograd wrappers -----------------------------------------------------------------------

class _PermuteFn(torch.autograd.Function):
    """x_ND = rows of x_TD in routed order; backward sums each token's row gradients."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, row_map_N: Tensor, K: int, triton: bool) -> Tensor:
        token_N = row_map_N // K
        ctx.save_for_backward(row_map_N)
        ctx.shape, ctx.triton = (x_TD.size(0), K), triton
        if triton:
            from moe_train.kernels.triton_ops import gather_rows_triton
            return gather_rows_triton(x_TD, token_N)
        return permute_rows_torch(x_TD, token_N)

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        (row_map_N,) = ctx.saved_tensors
        T, K = ctx.shape
        if ctx.triton:
            from moe_train.kernels.triton_ops import combine_rows_triton
            pos_TK = inverse_row_map(row_map_N, T * K).view(T, K)
            grad_TD = combine_rows_triton(grad_ND.contiguous(), pos_TK, None)
        else:
            grad_TD = scatter_rows_torch(grad_ND, row_map_N // K, T)
        return grad_TD, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    """Weighted combine of expert rows into tokens; gradients to the rows and the weights."""

    @staticmethod
    def forward(ctx, y_ND: Tensor, row_map_N: Tensor, weights_TK: Tensor, triton: bool
                ) -> Tensor:
        need_w_grad = ctx.needs_input_grad[2]
        ctx.save_for_backward(y_ND if need_w_grad else None, row_map_N, weights_TK)
        ctx.triton = triton
        if triton:
            from moe_train.kernels.triton_ops import combine_rows_triton
            T, K = weights_TK.shape
            pos_TK = inverse_row_map(row_map_N, T * K).view(T, K)
            return combine_rows_triton(y_ND.contiguous(), pos_TK, weights_TK.contiguous())
        return unpermute_torch(y_ND, row_map_N, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        y_ND, row_map_N, weights_TK = ctx.saved_tensors
        if ctx.triton:
            from moe_train.kernels.triton_ops import unpermute_backward_triton
            grad_y, grad_w = unpermute_backward_triton(grad_TD.contiguous(), y_ND, row_map_N,
                                                       weights_TK.contiguous())
        else:
            grad_y, grad_w = unpermute_backward_torch(grad_TD, y_ND, row_map_N, weights_TK)
        return grad_y, None, grad_w, None


# --- public ops ------------------------------------------------------------------------------

def permute(x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, *, backend: str = "auto"
            ) -> Permuted:
    """Group the rows of x_TD by expert: (x_ND, row_map_N, counts_E). Ids of -1 are dropped."""
    if x_TD.dim() != 2 or x_TD.size(0) != expert_ids_TK.size(0):
        raise ValueError(f"permute: x_TD {tuple(x_TD.shape)} does not match expert_ids_TK "
                         f"{tuple(expert_ids_TK.shape)}")
    row_map_N, counts_E = sort_slots(expert_ids_TK, num_experts, backend=backend)
    triton = use_triton(x_TD, backend)
    x_ND = _PermuteFn.apply(x_TD, row_map_N, expert_ids_TK.size(1), triton)
    return Permuted(x_ND, row_map_N, counts_E)


def unpermute(y_ND: Tensor, row_map_N: Tensor, weights_TK: Tensor, num_tokens: int, *,
              backend: str = "auto") -> Tensor:
    """Combine rows back into tokens: y_TD[t] = sum_k weights_TK[t, k] * y_ND[row(t, k)].

    Dropped slots contribute nothing and get a zero weight gradient. Output dtype: y_ND's.
    """
    if weights_TK.dim() != 2 or weights_TK.size(0) != num_tokens \
            or y_ND.size(0) != row_map_N.numel():
        raise ValueError(f"unpermute: y_ND {tuple(y_ND.shape)}, row_map_N "
                         f"{tuple(row_map_N.shape)}, weights_TK {tuple(weights_TK.shape)} and "
                         f"num_tokens={num_tokens} do not match")
    return _UnpermuteFn.apply(y_ND, row_map_N, weights_TK, use_triton(y_ND, backend))
