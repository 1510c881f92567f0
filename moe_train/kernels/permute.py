"""Permute tokens into expert-contiguous rows, and unpermute rows back with combine weights.

`permute` sorts the T*K routed slots by expert (stably: token order within an expert), drops
slots whose id is -1 and gathers the token rows: N = number of kept slots. `row_map_N` maps each
sorted row n to its slot as the flat index t*K + k (token t = row_map // K, slot k = row_map % K).
For sentence-level routing (every token of a sentence has the sentence's experts) the same
order comes from sorting the B*K sentence slots instead (`sort_sentence_slots`).
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


def sort_slots(expert_ids_TK: Tensor, num_experts: int, *, backend: str = "auto",
               num_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """(row_map_N, counts_E): kept slots ordered by expert, stably. One host sync (for N),
    none when the caller already read `num_rows` (N, the number of slots whose id is not -1)."""
    check_expert_ids(expert_ids_TK)
    counts_E = expert_histogram(expert_ids_TK, num_experts, backend=backend)
    ids = expert_ids_TK.reshape(-1)
    keys = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    order = torch.sort(keys, stable=True).indices
    if num_rows is None:
        num_rows = int(counts_E.sum())
    return order[:num_rows], counts_E


def sort_sentence_slots(expert_ids_TK: Tensor, expert_ids_BK: Tensor, num_experts: int,
                        *, backend: str = "auto") -> tuple[Tensor, Tensor] | None:
    """`sort_slots` for sentence-level routing, sorting the B*K sentence slots, not the T*K.

    When token t of the T = B*L flattened positions has the experts of its sentence t // L
    (`expert_ids_BK[t // L]`, a slot may be -1: padding), the rows of expert e are the
    sentences that chose e, in order, each a run of its L tokens: so the sentence slots are
    sorted (stably) by expert and expanded into their tokens' flat slots t*K + k, leaving out
    the -1 slots. This is exactly `sort_slots`'s result (expert, then token, then slot order).
    Returns None, for the caller to take the token path, when the ids are not of that form
    (checked on the expanded slots), the sizes do not fit, or a sentence names one expert
    twice (its rows would interleave by token).
    """
    T, K = expert_ids_TK.shape
    B = expert_ids_BK.size(0)
    if B == 0 or T == 0 or T % B or expert_ids_BK.shape != (B, K) or \
            expert_ids_BK.is_floating_point():
        return None
    L = T // B
    ids_S = expert_ids_BK.reshape(-1).long()
    keys_S = torch.where(ids_S < 0, num_experts, ids_S)
    keys_sorted_S, order_S = torch.sort(keys_S, stable=True)
    # flat token slot (t*K + k) of each sentence slot's L positions, in expert order
    slot_SL = torch.arange(0, L * K, K, device=ids_S.device) \
        + (order_S // K * (L * K) + order_S % K)[:, None]
    ids_SL = expert_ids_TK.reshape(-1).take(slot_SL)
    keep_SL = ids_SL >= 0
    kept_S = keep_SL.sum(1)
    # of the form iff every kept slot names its sentence's expert: count the others
    bad = kept_S.sum() - (ids_SL == keys_sorted_S[:, None]).sum()
    if K > 1:  # a sentence naming one expert twice
        by_row_BK = keys_S.view(B, K).sort(-1).values
        bad = bad + ((by_row_BK[:, 1:] == by_row_BK[:, :-1])
                     & (by_row_BK[:, 1:] < num_experts)).sum()
    num_bad, num_rows = torch.stack([bad, kept_S.sum()]).tolist()  # the one host sync
    if num_bad:
        return None
    counts_E = torch.zeros(num_experts + 1, dtype=torch.long, device=ids_S.device)
    counts_E.scatter_add_(0, keys_sorted_S, kept_S)
    # the kept slots in row-major order, as masked_select gives them; N read above, so the
    # output size is known and selecting them waits for nothing
    kept_N = torch.nonzero_static(keep_SL.reshape(-1), size=num_rows).squeeze(1)
    return slot_SL.reshape(-1).index_select(0, kept_N), counts_E[:num_experts]


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


def one_row_per_token(row_map_N: Tensor, num_tokens: int, K: int) -> bool:
    """True when every token has exactly one row (top-1, nothing dropped): then the rows are a
    permutation of the tokens, and summing a token's rows is gathering its row."""
    return K == 1 and row_map_N.numel() == num_tokens


def token_rows_torch(x_ND: Tensor, row_map_N: Tensor, num_tokens: int, K: int) -> Tensor:
    """`scatter_rows_torch` by slot: the sum of each token's rows. With one row per token a
    gather through the inverse map (no zero fill, no scatter-add; the same values)."""
    if one_row_per_token(row_map_N, num_tokens, K):
        return x_ND.index_select(0, inverse_row_map(row_map_N, num_tokens))
    return scatter_rows_torch(x_ND, row_map_N // K, num_tokens)


def unpermute_torch(y_ND: Tensor, row_map_N: Tensor, weights_TK: Tensor) -> Tensor:
    """Reference combine: y_TD[t] = sum_k weights_TK[t, k] * y_ND[row(t, k)]."""
    T, K = weights_TK.shape
    if one_row_per_token(row_map_N, T, K):  # gather each token's row, then weight it in place
        y_TD = y_ND.index_select(0, inverse_row_map(row_map_N, T))
        return y_TD.mul_(weights_TK.to(y_ND.dtype))
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
        acc = torch.promote_types(g_ND.dtype, torch.float32)  # widen bf16, keep float64
        dots_N = (g_ND * y_ND).sum(-1, dtype=acc)
        grad_w_TK = torch.zeros(T * K, dtype=acc, device=g_ND.device)
        grad_w_TK.index_copy_(0, row_map_N, dots_N)
        grad_w_TK = grad_w_TK.view(T, K).to(weights_TK.dtype)
    return g_ND.mul_(w_N[:, None]), grad_w_TK  # g_ND is this function's own gather


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
            grad_TD = token_rows_torch(grad_ND, row_map_N, T, K)
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

def permute(x_TD: Tensor, expert_ids_TK: Tensor, num_experts: int, *, backend: str = "auto",
            expert_ids_BK: Tensor | None = None, num_rows: int | None = None) -> Permuted:
    """Group the rows of x_TD by expert: (x_ND, row_map_N, counts_E). Ids of -1 are dropped.

    `expert_ids_BK` (sentence-level routing: token t of sentence t // (T / B) has its
    sentence's experts) lets the slots be ordered by sorting B*K sentence slots
    (`sort_sentence_slots`); the result is the same, and ids of another form fall back to the
    token sort. `num_rows`: N, when the caller has read it already (the token sort then reads
    nothing from the device).
    """
    if x_TD.dim() != 2 or x_TD.size(0) != expert_ids_TK.size(0):
        raise ValueError(f"permute: x_TD {tuple(x_TD.shape)} does not match expert_ids_TK "
                         f"{tuple(expert_ids_TK.shape)}")
    check_expert_ids(expert_ids_TK)
    sorted_slots = None if expert_ids_BK is None else sort_sentence_slots(
        expert_ids_TK, expert_ids_BK, num_experts, backend=backend)
    row_map_N, counts_E = sorted_slots or sort_slots(expert_ids_TK, num_experts,
                                                     backend=backend, num_rows=num_rows)
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
