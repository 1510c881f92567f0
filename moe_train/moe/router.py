"""Routers: decide which experts each token goes to, with which combine weights.

A router maps the (layer-normed) token states and a `RoutingContext` to a `Routing`. Routers are
picked by name from the explicit registry in moe_train.moe.registry (`build_router`). This file
holds the token-level ones; moe_train.moe.sentence_router the sentence- and task-level ones:

- ``topk``: softmax over E, top-k, weights renormalised over the k (Eq. 4 of THOR-MoE), or the
  raw probabilities with ``moe.renormalize: false`` (Qwen's norm_topk_prob false).
- ``switch``: top-1 whose weight is the raw top-1 probability (Switch Transformer), so the gate
  gets a gradient from the main loss.
- ``gshard``: top-2, renormalised; the balance loss counts first choices only (GShard).
- ``topp``: per token, the fewest experts whose probability mass reaches p (Eqs. 5-7), raw
  probabilities as weights, plus the entropy loss of Eq. 13.
- ``sentence``: one decision per sentence from its mean-pooled states (Switch-SL / SGMoE-SL).
- ``task``: one decision per task (language pair, target language, domain), learned from a task
  embedding or read from a fixed table.

All token-gate routers support input jitter and Shazeer's noisy gating, in training mode only.
Router logits and probabilities are float32 whatever the parameter dtype; combine weights come
back in the input's dtype.

Shape legend: T tokens (flattened batch positions, padding included), B sentences, D model dim,
E experts, K expert slots per token, N tasks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from moe_train.config.moe import RouterConfig
from moe_train.moe import losses
from moe_train.moe.gating import LinearGate, Router, _check_k, _gate_losses, _token_stats
from moe_train.moe.gating import top_k_gate, top_p_select
from moe_train.moe.routing import Routing, RoutingContext


class TopKRouter(Router):
    """Token-level top-k: softmax over E, the k largest, weights renormalised over the k."""

    name = "topk"
    first_choice_balance = False
    """Whether the balance loss's f_e counts each token's first expert only."""

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        self.k, self.renormalize = self._selection(cfg)
        user_k = type(self)._selection is TopKRouter._selection
        _check_k(self.k, num_experts, None if user_k else self.name)
        self.cfg = cfg
        self.gate = LinearGate(d_model, num_experts, cfg.noisy_gating, cfg.jitter_eps)

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        """(k, renormalize) of this router."""
        return cfg.k, cfg.renormalize

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        """Gate, then softmax, top-k, weights and losses in one autograd node (`top_k_gate`:
        one expert histogram, no host sync); the entropy statistic reuses the z-loss's
        logsumexp when the logits carry no noise."""
        pad_mask_T = None if rctx is None else rctx.pad_mask_T
        clean_TE, logits_TE = self.gate(x_TD)
        probs_TE, expert_ids_TK, weights_TK, aux, counts_E, lse_T = top_k_gate(
            logits_TE, clean_TE, self.k, self.renormalize, self.cfg, pad_mask_T,
            self.first_choice_balance)
        same = logits_TE is clean_TE and lse_T is not None  # no noise: one set of logits
        return Routing(
            expert_ids_TK=expert_ids_TK, weights_TK=weights_TK.to(x_TD.dtype), probs_TE=probs_TE,
            num_experts=self.num_experts, aux_losses=aux,
            stats=_token_stats(expert_ids_TK, self.num_experts, pad_mask_T, probs_TE,
                               counts_E=counts_E, logits_TE=logits_TE if same else None,
                               lse_T=lse_T if same else None))


class SwitchRouter(TopKRouter):
    """Switch Transformer: top-1, weight = the raw top-1 probability (not renormalised)."""

    name = "switch"

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        return 1, False


class GShardRouter(TopKRouter):
    """GShard: top-2, weights renormalised over the two; the balance loss is
    E * sum_e (c_e / S) m_e with c_e the tokens whose first choice is e (GShard Algorithm 1,
    DeepSpeed's top2gating). In training, random routing (`second_expert_sampling`): the
    second expert is kept with probability min(1, 2 g2), else its slot is -1 with weight 0,
    before the dispatcher's capacity sees it; the first weight stays g1 / (g1 + g2)."""

    name = "gshard"
    first_choice_balance = True

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        return 2, True

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        routing = super().forward(x_TD, rctx)
        if not (self.training and self.cfg.second_expert_sampling):
            return routing
        ids_TK, weights_TK = routing.expert_ids_TK, routing.weights_TK
        with torch.no_grad():
            second_T = weights_TK[:, 1].float()
            keep_T = torch.rand_like(second_T) < 2.0 * second_T
        keep_TK = torch.stack([torch.ones_like(keep_T), keep_T], dim=1)
        ids_TK = torch.where(keep_TK, ids_TK, torch.full_like(ids_TK, -1))
        pad_mask_T = None if rctx is None else rctx.pad_mask_T
        counts_E = losses.tokens_per_expert(ids_TK, self.num_experts, pad_mask_T)
        return dataclasses.replace(
            routing, expert_ids_TK=ids_TK, weights_TK=weights_TK * keep_TK.to(weights_TK.dtype),
            stats={**routing.stats, "tokens_per_expert": counts_E})


class TopPRouter(Router):
    """Dynamic top-p routing (Huang et al. 2024; THOR-MoE Sec. 2.2.2) with the entropy loss.

    Each token takes the fewest experts whose probability mass reaches ``cfg.top_p``, weighted by
    their raw probabilities; K is the largest set in the batch and the other slots are -1 / 0.
    Losses: load balance (over all used slots), z-loss, and ``entropy_coef`` times Eq. 13.
    """

    name = "topp"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        _check_k(1, num_experts)
        self.cfg = cfg
        self.gate = LinearGate(d_model, num_experts, cfg.noisy_gating, cfg.jitter_eps)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        pad_mask_T = None if rctx is None else rctx.pad_mask_T
        clean_TE, logits_TE = self.gate(x_TD)
        probs_TE = logits_TE.softmax(-1)
        expert_ids_TK, weights_TK = top_p_select(probs_TE, self.cfg.top_p)
        aux = _gate_losses(self.cfg, probs_TE, expert_ids_TK, clean_TE, pad_mask_T)
        if self.cfg.entropy_coef > 0:
            aux["entropy"] = self.cfg.entropy_coef * losses.entropy_loss(probs_TE, pad_mask_T)
        stats = _token_stats(expert_ids_TK, self.num_experts, pad_mask_T, probs_TE)
        with torch.no_grad():
            used_T = (expert_ids_TK >= 0).sum(-1).float()
            keep_T = torch.ones_like(used_T) if pad_mask_T is None else (~pad_mask_T).float()
            stats["experts_per_token"] = (used_T * keep_T).sum() / keep_T.sum().clamp_min(1.0)
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_TK.to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=self.num_experts, aux_losses=aux,
                       stats=stats)
