"""Local token dispatch: group routed token copies by expert, and combine expert outputs back.

`LocalDispatcher` (expert parallelism 1) is the default and the reference the all-to-all
dispatcher (moe_train.parallel.expert_parallel) is tested against. `DenseDispatcher` serves
layers whose every token uses every expert: soft routers over all experts (Gated Adapters) and
task-routed layers that keep just the k experts of their task (an extracted sub-network).
Nothing to sort, the experts get all rows at once. Dropless by default; with a capacity
factor c, expert e keeps at most ceil(c * routed_slots / E) copies (every token's first choice
before any second, each in token order, as GShard) and the overflow is dropped and counted: a
dropped copy contributes nothing to its token's output (the residual carries the token on). The limit applies while
training only (`drop=True`, what MoELayer passes in train mode): evaluation and decoding are
dropless, so a token's output never depends on what else is in the batch and incremental
decoding equals full decoding.

Shape legend: T tokens, K slots per token, E experts, N kept (routed) rows, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_train.kernels.permute import permute, unpermute
from moe_train.moe.routing import Routing


@dataclass(frozen=True)
class DispatchMeta:
    """What `combine` needs to undo `dispatch`."""

    row_map_N: Tensor
    """Flat slot index t*K + k of each dispatched row (expert-sorted)."""
    weights_TK: Tensor
    """Combine weights, zero where a slot was dropped."""
    num_tokens: int
    dropped: Tensor
    """Number of routed slots dropped by the capacity limit (0-dim int64)."""


def capacity_of(routed_slots: Tensor, num_experts: int, capacity_factor: float) -> Tensor:
    """ceil(round(capacity_factor * routed_slots / E, 9)) as a 0-dim int64 tensor, computed on
    the device (no host sync), equal to that Python expression for every count.

    Rounded first: 1.1 * 100 / 2 is 55.000000000000007 in floating point, not 56 slots. The
    share x is the same float64 product and quotient as Python's; round(x, 9) is x to the
    nearest 9-decimal value, so ceil(round(x, 9)) is ceil(x) except where x lies less than
    5e-10 above an integer, which it rounds down to. x - floor(x) is exact, and no double lies
    between 5e-10 and the double nearest it (which is above it), so the test is exact too.
    """
    share = capacity_factor * routed_slots.double() / num_experts
    frac = share - share.floor()
    just_above = (frac > 0) & (frac < 5e-10)
    return torch.where(just_above, share.floor(), share.ceil()).long()


def apply_capacity(expert_ids_TK: Tensor, num_experts: int, capacity_factor: float
                   ) -> tuple[Tensor, Tensor]:
    """Drop slots beyond each expert's capacity: (expert_ids_TK, dropped).

    capacity = ceil(capacity_factor * routed_slots / E) (`capacity_of`); ids of dropped slots
    become -1. Slots are served slot-major, each in token order: every token's first choice
    before any second choice (GShard's Algorithm 1, DeepSpeed's top2gating), so an early
    token's second expert never takes the place of a later token's first. Nothing is read
    from the device: the capacity stays a tensor and the counts are a scatter-add.
    """
    ids_S = expert_ids_TK.t().reshape(-1)  # slot-major: (k, t) -> k * T + t
    routed = ids_S >= 0
    capacity = capacity_of(routed.sum(), num_experts, capacity_factor)
    keys_S = torch.where(routed, ids_S, torch.full_like(ids_S, num_experts))
    order_S = torch.sort(keys_S, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids_S.device)
    counts.scatter_add_(0, keys_S.long(), torch.ones_like(keys_S, dtype=torch.long))
    starts = torch.cumsum(counts, 0) - counts
    sorted_keys = keys_S[order_S]
    rank_sorted = torch.arange(ids_S.numel(), device=ids_S.device) - starts[sorted_keys]
    rank_S = torch.empty_like(rank_sorted)
    rank_S[order_S] = rank_sorted
    over = routed & (rank_S >= capacity)
    kept = torch.where(over, torch.full_like(ids_S, -1), ids_S)
    return kept.view(expert_ids_TK.size(1), -1).t().contiguous(), over.sum()


class LocalDispatcher:
    """All experts on this rank: permute rows by expert, unpermute with combine weights."""

    def __init__(self, num_experts: int, capacity_factor: float = 0.0) -> None:
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def capped(self, drop: bool) -> bool:
        """Whether this call applies a capacity limit."""
        return drop and self.capacity_factor > 0

    def route_slots(self, routing: Routing, drop: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """(expert_ids_TK, weights_TK, dropped) after the capacity limit, if any."""
        ids_TK, weights_TK = routing.expert_ids_TK, routing.weights_TK
        if self.capped(drop):
            ids_TK, dropped = apply_capacity(ids_TK, self.num_experts, self.capacity_factor)
            weights_TK = torch.where(ids_TK >= 0, weights_TK, torch.zeros_like(weights_TK))
        else:
            dropped = torch.zeros((), dtype=torch.long, device=ids_TK.device)
        return ids_TK, weights_TK, dropped

    def dispatch(self, x_TD: Tensor, routing: Routing, drop: bool = True
                 ) -> tuple[Tensor, Tensor, DispatchMeta]:
        """(x_ND rows grouped by expert, counts_E, meta).

        Sentence-level routing without a capacity limit takes the sentence fast path: rows are
        ordered by sorting the B*K sentence slots (`routing.sentence_expert_ids_BK`), not the
        T*K token slots; same rows, same order. A capacity limit drops slots token by token,
        so it always takes the token path.
        """
        ids_TK, weights_TK, dropped = self.route_slots(routing, drop)
        ids_BK = None if self.capped(drop) else routing.sentence_expert_ids_BK
        x_ND, row_map_N, counts_E = permute(x_TD, ids_TK, self.num_experts,
                                            expert_ids_BK=ids_BK)
        return x_ND, counts_E, DispatchMeta(row_map_N, weights_TK, x_TD.size(0), dropped)

    def combine(self, y_ND: Tensor, meta: DispatchMeta) -> Tensor:
        """y_TD[t] = sum_k weights_TK[t, k] * y_ND[row(t, k)]."""
        return unpermute(y_ND, meta.row_map_N, meta.weights_TK, meta.num_tokens)


@dataclass(frozen=True)
class DenseMeta:
    """What `DenseDispatcher.combine` needs."""

    weights_NE: Tensor
    """Each dispatched row's weight for each expert (0 at padding)."""
    dropped: Tensor
    """Always 0: dense routing drops nothing."""
    rows_N: Tensor | None = None
    """The tokens the rows are (padding left out), None when the rows are all T tokens."""
    num_tokens: int = 0


class DenseDispatcher:
    """Every token to every expert: no sort and, on an accelerator, no host sync. For routings
    whose K slots name each of the E experts once per token, in any order (-1: padding).

    `dispatch` hands the experts the token rows themselves with ``counts_E`` None, which asks a
    `StackedExperts` module for all experts on all rows at once, (E, N, D) (see
    `Experts.all_experts`); `combine` sums them with the weights in expert order, the sum
    `LocalDispatcher` computes. On CPU, where reading a count costs nothing, padding rows are
    left out, so the GEMMs see exactly the rows `LocalDispatcher` gives them and the numbers
    match it bit for bit where every token uses every expert (an extracted sub-network against
    its full model); on an accelerator padding rows are computed with weight 0 instead.
    Local only: expert parallelism swaps in the all-to-all dispatcher with `capacity_factor`.
    """

    def __init__(self, num_experts: int, capacity_factor: float = 0.0) -> None:
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        """Never applied here (every expert takes every token); kept for expert parallelism."""

    def dispatch(self, x_TD: Tensor, routing: Routing, drop: bool = True
                 ) -> tuple[Tensor, None, DenseMeta]:
        ids_TK = routing.expert_ids_TK
        if routing.top_k != self.num_experts:
            raise ValueError(f"DenseDispatcher: routing has {routing.top_k} slots per token, "
                             f"expected one per expert ({self.num_experts})")
        weights_TK = torch.where(ids_TK >= 0, routing.weights_TK, 0.0)  # padding: -1
        weights_TE = torch.zeros_like(weights_TK).scatter_add_(1, ids_TK.clamp(min=0),
                                                               weights_TK)
        dropped = torch.zeros((), dtype=torch.long, device=x_TD.device)
        T = x_TD.size(0)
        if not x_TD.is_cuda:
            rows_N = ids_TK.ge(0).any(1).nonzero().squeeze(1)
            if rows_N.numel() < T:
                return x_TD.index_select(0, rows_N), None, DenseMeta(
                    weights_TE.index_select(0, rows_N), dropped, rows_N, T)
        return x_TD, None, DenseMeta(weights_TE, dropped, None, T)

    def combine(self, y_END: Tensor, meta: DenseMeta) -> Tensor:
        """y_TD[t] = sum_e weights[t, e] * y_END[e, row of t], summed in expert order (0 at
        padding)."""
        w_NE = meta.weights_NE.to(y_END.dtype)
        y_ND = y_END.new_zeros(y_END.shape[1:])  # from +0, as the scatter-add starts
        for e in range(y_END.size(0)):
            y_ND = y_ND + y_END[e] * w_NE[:, e:e + 1]
        if meta.rows_N is None:
            return y_ND
        return y_ND.new_zeros(meta.num_tokens, y_ND.size(1)).index_copy(0, meta.rows_N, y_ND)
