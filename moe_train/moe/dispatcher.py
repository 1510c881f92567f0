"""Local token dispatch: group routed token copies by expert, and combine expert outputs back.

`LocalDispatcher` (expert parallelism 1) is the default and the reference the all-to-all
dispatcher (moe_train.parallel.expert_parallel) is tested against. `DenseDispatcher` serves
soft routers that weigh every expert for every token (Gated Adapters): nothing to sort, the
experts get all rows at once. Dropless by default; with a
capacity factor c, expert e keeps at most ceil(c * routed_slots / E) copies (first come, first
served in token order) and the overflow is dropped and counted: a dropped copy contributes
nothing to its token's output (the residual carries the token on). The limit applies while
training only (`drop=True`, what MoELayer passes in train mode): evaluation and decoding are
dropless, so a token's output never depends on what else is in the batch and incremental
decoding equals full decoding.

Shape legend: T tokens, K slots per token, E experts, N kept (routed) rows, D model dim.
"""

from __future__ import annotations

import math
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


def apply_capacity(expert_ids_TK: Tensor, num_experts: int, capacity_factor: float
                   ) -> tuple[Tensor, Tensor]:
    """Drop slots beyond each expert's capacity (in token order): (expert_ids_TK, dropped).

    capacity = ceil(capacity_factor * routed_slots / E); ids of dropped slots become -1.
    """
    ids_S = expert_ids_TK.reshape(-1)
    routed = ids_S >= 0
    capacity = math.ceil(capacity_factor * int(routed.sum()) / num_experts)
    keys_S = torch.where(routed, ids_S, torch.full_like(ids_S, num_experts))
    order_S = torch.sort(keys_S, stable=True).indices
    counts = torch.bincount(keys_S, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    sorted_keys = keys_S[order_S]
    rank_sorted = torch.arange(ids_S.numel(), device=ids_S.device) - starts[sorted_keys]
    rank_S = torch.empty_like(rank_sorted)
    rank_S[order_S] = rank_sorted
    over = routed & (rank_S >= capacity)
    kept = torch.where(over, torch.full_like(ids_S, -1), ids_S)
    return kept.view_as(expert_ids_TK), over.sum()


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

    weights_TE: Tensor
    """Each token's weight for each expert (0 at padding)."""
    dropped: Tensor
    """Always 0: dense routing drops nothing."""


class DenseDispatcher:
    """Every token to every expert in order, e.g. a soft gate over all adapters: no sort, no
    copy. `dispatch` hands the experts the T rows themselves with ``counts_E`` None, which
    asks a `StackedExperts` module for all experts on all rows at once, (E, T, D) (see
    `AdapterExperts.forward`); `combine` sums them with the weights. Local only (ep_size 1)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x_TD: Tensor, routing: Routing, drop: bool = True
                 ) -> tuple[Tensor, None, DenseMeta]:
        ids_TE = routing.expert_ids_TK
        if routing.top_k != self.num_experts:
            raise ValueError(f"DenseDispatcher: routing has {routing.top_k} slots per token, "
                             f"expected one per expert ({self.num_experts}), in expert order")
        weights_TE = torch.where(ids_TE >= 0, routing.weights_TK, 0.0)  # padding: -1
        return x_TD, None, DenseMeta(weights_TE, torch.zeros((), dtype=torch.long,
                                                             device=x_TD.device))

    def combine(self, y_ETD: Tensor, meta: DenseMeta) -> Tensor:
        """y_TD[t] = sum_e weights_TE[t, e] * y_ETD[e, t]."""
        return torch.einsum("etd,te->td", y_ETD, meta.weights_TE.to(y_ETD.dtype))
