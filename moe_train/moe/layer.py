"""The MoE layer: router -> dispatcher -> experts -> combine, in the Transformer's FFN slot.

Composed by injection: any router of the registry, a dispatcher (local, or the all-to-all one
that moe_train.parallel wires in for expert parallelism), and a stacked experts module.
Padding tokens are never routed. The layer returns its output and its (already weighted) aux
losses; per-expert token counts, dropped slots and routing entropy of the last forward are kept
in non-persistent buffers for logging, and every scalar of `Routing.stats` in `scalar_stats`.

Shape legend: B sentences, T positions, D model dim, E experts, K slots per token, N rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.kernels.histogram import expert_histogram
from moe_train.models.context import ForwardContext
from moe_train.moe.routing import Routing, RoutingContext


class MoELayer(nn.Module):
    """FFN-slot MoE layer: `forward(x_BTD, ctx) -> (y_BTD, aux_losses)`."""

    def __init__(self, router: nn.Module, dispatcher: Any, experts: nn.Module,
                 dropout: float = 0.0, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.router = router
        self.dispatcher = dispatcher
        self.experts = experts
        self.shared_expert = shared_expert
        self.dropout = dropout
        num_experts = router.num_experts
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        self.register_buffer("dropped_slots", torch.zeros((), dtype=torch.long),
                             persistent=False)
        self.scalar_stats: dict[str, Tensor] = {}
        """The router's scalar statistics of the last forward (detached), logged per layer."""

    @property
    def num_experts(self) -> int:
        """Global number of experts (the router's choice space)."""
        return self.router.num_experts

    def forward(self, x_BTD: Tensor, ctx: ForwardContext) -> tuple[Tensor, dict[str, Tensor]]:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        rctx = RoutingContext.from_forward(ctx, B, T, task_source=self.router.task_source,
                                           device=x_BTD.device)
        routing: Routing = self.router.route(x_TD, rctx)
        if rctx.pad_mask_T is not None:  # padding takes no expert capacity and no compute
            ids_TK = routing.expert_ids_TK.masked_fill(rctx.pad_mask_T[:, None], -1)
            routing = dataclasses.replace(routing, expert_ids_TK=ids_TK)
        x_ND, counts_E, meta = self.dispatcher.dispatch(x_TD, routing, drop=self.training)
        y_ND = self.experts(x_ND, counts_E)
        y_TD = self.dispatcher.combine(y_ND, meta)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        self._record(routing, meta)
        y_BTD = F.dropout(y_TD.view(B, T, D), self.dropout, self.training)
        return y_BTD, dict(routing.aux_losses)

    @torch.no_grad()
    def _record(self, routing: Routing, meta: Any) -> None:
        """Logging buffers: routed slots per expert (the router's count of real tokens when it
        has one, else a histogram of the ids, padding already -1), dropped slots, and the
        router's scalar statistics (entropy only from a router with probabilities)."""
        counts = routing.stats.get("tokens_per_expert")
        if counts is None or counts.shape != self.tokens_per_expert_E.shape:
            counts = expert_histogram(routing.expert_ids_TK, routing.num_experts)
        self.tokens_per_expert_E.copy_(counts)
        self.dropped_slots.copy_(meta.dropped)
        self.scalar_stats = {key: value.detach() for key, value in routing.stats.items()
                             if isinstance(value, Tensor) and value.dim() == 0}
