"""Router building blocks: the `Router` base class, gates, selection rules and shared losses.

Routers (moe_train.moe.router for token-level, moe_train.moe.sentence_router for sentence- and
task-level) are composed from these pieces. Router logits and probabilities are float32
whatever the parameter dtype.

Shape legend: T tokens (flattened batch positions, padding included), B sentences, D model dim,
E experts, K expert slots per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe import losses
from moe_train.moe.routing import Routing, RoutingContext


def _expect(cond: bool, path: str, expected: str, got: object) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


def _check_k(k: int, num_experts: int, fixed_by: str | None = None) -> None:
    """k must not exceed E; `fixed_by` names a router whose k is not the user's moe.k."""
    _expect(num_experts >= 1, "moe.num_experts", "a positive integer", num_experts)
    if k > num_experts:
        if fixed_by is not None:
            raise ConfigError(f"moe.num_experts: expected at least {k} for the {fixed_by} "
                              f"router (top-{k}), got {num_experts}")
        raise ConfigError(f"moe.k: expected at most moe.num_experts ({num_experts}), got {k}")


# ----------------------------------------------------------------------------------------------
# Selection rules (pure functions)


def top_k_select(probs_TE: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The k most probable experts per row and their weights (renormalised to sum 1, or raw)."""
    weights_TK, expert_ids_TK = probs_TE.topk(k, dim=-1)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return expert_ids_TK, weights_TK


def top_p_select(probs_TE: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """Per row, the fewest experts (by decreasing probability) whose mass reaches p (>= p).

    Expert j of the sorted order is kept iff the mass before it is < p, so the first is always
    kept and at most E are. Ties in probability are broken by the lower expert id (stable sort);
    the size of the set does not depend on how ties are broken. Returns (ids, weights) with
    K = the largest set in the batch; a row's unused slots have id -1 and weight 0. Weights are
    the raw probabilities (THOR-MoE Eq. 6), not renormalised. Reading K syncs with the device.
    """
    sorted_TE, order_TE = probs_TE.sort(dim=-1, descending=True, stable=True)
    mass_before_TE = F.pad(sorted_TE.cumsum(-1)[:, :-1], (1, 0))
    keep_TE = mass_before_TE < p
    K = max(int(keep_TE.sum(-1).max()), 1) if probs_TE.size(0) else 1
    expert_ids_TK = torch.where(keep_TE, order_TE, -1)[:, :K]
    weights_TK = torch.where(keep_TE, sorted_TE, 0.0)[:, :K]
    return expert_ids_TK, weights_TK


# ----------------------------------------------------------------------------------------------
# Building blocks


class LinearGate(nn.Module):
    """Router logits x W_g (float32), with optional input jitter and noisy gating in training.

    Returns ``(clean_logits_TE, routed_logits_TE)``: the z-loss uses the clean logits, the
    selection and the probabilities the routed (possibly noisy) ones. Outside training both are
    the same tensor.
    """

    def __init__(self, d_model: int, num_experts: int, noisy: bool = False,
                 jitter_eps: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Linear(d_model, num_experts, bias=False)
        # Shazeer et al. (2017): noise std softplus(x W_noise), W_noise starts at zero.
        self.noise = nn.Linear(d_model, num_experts, bias=False) if noisy else None
        if self.noise is not None:
            nn.init.zeros_(self.noise.weight)
        self.jitter_eps = jitter_eps

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        if self.training and self.jitter_eps > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter_eps,
                                                          1.0 + self.jitter_eps)
        clean_TE = self.weight(x_TD).float()
        if not (self.training and self.noise is not None):
            return clean_TE, clean_TE
        std_TE = F.softplus(self.noise(x_TD).float())
        return clean_TE, clean_TE + torch.randn_like(clean_TE) * std_TE


def _gate_losses(cfg: RouterConfig, probs_TE: Tensor, expert_ids_TK: Tensor,
                 logits_TE: Tensor, pad_mask_T: Tensor | None) -> dict[str, Tensor]:
    """Load-balance and z losses (weighted), skipping those whose coefficient is 0."""
    aux: dict[str, Tensor] = {}
    if cfg.aux_loss_coef > 0:
        aux["load_balance"] = cfg.aux_loss_coef * losses.load_balance_loss(
            probs_TE, expert_ids_TK, pad_mask_T)
    if cfg.z_loss_coef > 0:
        aux["z_loss"] = cfg.z_loss_coef * losses.z_loss(logits_TE, pad_mask_T)
    return aux


def _token_stats(expert_ids_TK: Tensor, num_experts: int, pad_mask_T: Tensor | None,
                 probs_TE: Tensor | None) -> dict[str, Tensor]:
    stats = {"tokens_per_expert": losses.tokens_per_expert(
        expert_ids_TK.detach(), num_experts, pad_mask_T)}
    if probs_TE is not None:
        stats["routing_entropy"] = losses.routing_entropy(probs_TE, pad_mask_T)
    return stats


def _require_sentences(rctx: RoutingContext | None, router: str) -> RoutingContext:
    if rctx is None or rctx.sentence_ids_T is None:
        raise ValueError(f"the {router} router needs RoutingContext.sentence_ids_T "
                         "(build it with RoutingContext.from_forward / from_batch)")
    return rctx


def _sentence_pad_mask(rctx: RoutingContext) -> Tensor:
    """True for sentences without any real token (left out of the router losses)."""
    keep_T = (torch.ones_like(rctx.sentence_ids_T, dtype=torch.float32) if rctx.pad_mask_T is None
              else (~rctx.pad_mask_T).float())
    counts_B = keep_T.new_zeros(rctx.num_sentences).index_add(0, rctx.sentence_ids_T, keep_T)
    return counts_B == 0


# ----------------------------------------------------------------------------------------------
# Routers


class Router(nn.Module):
    """Base class: ``route(x_TD, rctx) -> Routing``; subclasses implement `forward`.

    `route` goes through ``nn.Module.__call__`` so module hooks (e.g. ZeRO-3 parameter
    gathering) run. `task_source` tells the caller which task ids `RoutingContext.from_forward`
    must provide (None: the router needs none).
    """

    name = "router"
    """Registry name, for messages."""
    task_source: str | None = None

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def route(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        """Route the T tokens of `x_TD` (T, D)."""
        return self(x_TD, rctx)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        raise NotImplementedError
