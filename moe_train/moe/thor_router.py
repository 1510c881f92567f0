"""THOR-MoE (seed 003): hierarchical task-guided and context-responsive routing.

`TaskPredictor` is a context provider (models/transformer.py): it max-pools the encoder states
([CLS] included) at a configured layer, predicts the task (P^t, Eq. 8), trains on the gold task
(L_tp, Eq. 10) and builds the task representation E_p (Eq. 9) once per sentence for every MoE
layer of both stacks. `ThorRouter` ("thor"), one per MoE layer:
  1. task level: a task router on E_p picks the candidate set S^t, fixed for the sentence; its
     weights g^t are softmax(task logits) renormalised over S^t (OD-4);
  2. context: the token router reads g*x + (1-g)*H_ctx, g = sigmoid([x; H_ctx] W^g + b^g)
     (vector or scalar gate), H_ctx the masked source mean (encoder) or the inclusive causal
     prefix mean (decoder; kept in the decoder cache while decoding); experts still get x;
  3. token level: top-k (Eq. 4) or top-p (Eqs. 5-7) over the candidate-restricted softmax;
     combine weight g^t_e * g_e (optionally renormalised).
Losses, each the mean over THOR layers: L_bd (Eq. 11, beta), L_bt (Eq. 12, gamma; replaces the
Switch balance loss), L_topp (Eq. 13, delta, top-p only), plus moe.z_loss_coef.

Shape legend: B sentences, S source positions, T tokens (flattened B x length), D model dim,
E experts, K task classes (predictor) or slots per token (routing), C candidates per sentence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.config.moe import RouterConfig
from moe_train.config.thor import ThorConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext
from moe_train.moe import losses
from moe_train.moe.gating import (LinearGate, Router, _token_stats, linear_fp32, top_k_ids,
                                   top_k_select)
from moe_train.moe.gating import top_p_select
from moe_train.moe.routing import (Routing, RoutingContext, context_rows, expand_rows,
                                   ids_on_host, task_ids_from_context)

TASK_PROBS_KEY = "task_probs_BK"
"""Extras key of the predicted task distribution P^t (float32)."""
TASK_REPR_KEY = "task_repr_BD"
"""Extras key of the task representation E_p every THOR layer reads."""
TASK_EMB_KEY = "task_embeddings_KD"
"""Extras key of the task embedding table EMB1 (for the task-level balance loss)."""
GOLD_TASK_KEY = "gold_task_B"
"""Extras key of the gold task ids, when the batch has them."""


class TaskPredictor(nn.Module):
    """[CLS] + max-pool -> W^p -> P^t over K tasks -> E_p; a context provider."""

    def __init__(self, d_model: int, num_tasks: int, cfg: ThorConfig,
                 pivot_lang_id: int | None = None) -> None:
        """`pivot_lang_id`: the id of `cfg.pivot_lang` (task_source other_lang only)."""
        super().__init__()
        self.cfg = cfg
        self.num_tasks = num_tasks
        if cfg.task_source == "other_lang" and pivot_lang_id is None:
            raise ValueError("TaskPredictor: task_source other_lang needs pivot_lang_id")
        self.pivot_lang_id = pivot_lang_id
        self.proj = nn.Linear(d_model, num_tasks, bias=False)  # W^p
        self.task_embed_KD = nn.Parameter(torch.empty(num_tasks, d_model))  # EMB1
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.normal_(self.task_embed_KD, std=d_model ** -0.5)

    def forward(self, x_BSD: Tensor, ctx: ForwardContext
                ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        pad_BS = ctx.src_pad_mask_BS
        h_BSD = x_BSD if pad_BS is None else x_BSD.masked_fill(pad_BS[..., None], float("-inf"))
        logits_BK = linear_fp32(h_BSD.amax(1), self.proj)  # Eq. 8 ([CLS] is never padding)
        probs_BK = logits_BK.softmax(-1)
        gold_B = self.gold_tasks(ctx)
        aux: dict[str, Tensor] = {}
        if gold_B is not None:  # checked on the host copy the task routers share
            bad = [t for t in map(int, ids_on_host(gold_B)) if not 0 <= t < self.num_tasks]
            if bad:
                raise ConfigError(f"thor.num_tasks: task id {bad[0]} by "
                                 f"{self.cfg.task_source} outside 0 .. {self.num_tasks - 1}")
            gold_B = gold_B.long()
            if self.cfg.alpha > 0:  # Eq. 10
                aux["thor_task"] = self.cfg.alpha * F.cross_entropy(logits_BK, gold_B)
        table_KD = self.task_embed_KD
        mode = self.cfg.task_repr
        if mode == "gold":
            if gold_B is None:
                raise ConfigError(f"thor.task_repr: gold needs the gold task "
                                  f"({self.cfg.task_source}) of every sentence, which this input "
                                  "lacks (raw text: pass --domain / --src-lang / --tgt-lang)")
            repr_BD = table_KD.index_select(0, gold_B)
        elif mode == "argmax":
            repr_BD = table_KD.index_select(0, probs_BK.argmax(-1))
        else:  # mixed, infuse: Eq. 9
            repr_BD = probs_BK.to(table_KD.dtype) @ table_KD
        extras = {TASK_PROBS_KEY: probs_BK, TASK_REPR_KEY: repr_BD.to(x_BSD.dtype),
                  TASK_EMB_KEY: table_KD}
        if gold_B is not None:
            extras[GOLD_TASK_KEY] = gold_B
        return extras, aux

    def gold_tasks(self, ctx: ForwardContext) -> Tensor | None:
        """The gold task of each sentence by `cfg.task_source`, None when the batch lacks it."""
        if self.cfg.task_source != "other_lang":
            return task_ids_from_context(ctx, self.cfg.task_source)
        if ctx.src_lang_B is None or ctx.tgt_lang_B is None:
            return None
        return torch.where(ctx.src_lang_B == self.pivot_lang_id, ctx.tgt_lang_B, ctx.src_lang_B)


class ThorRouter(Router):
    """Task-guided candidate sets + context-fused token routing (see the module docstring)."""

    name = "thor"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig,
                 thor: ThorConfig | None = None, loss_scale: float = 1.0) -> None:
        super().__init__(num_experts)
        self.cfg, self.thor = cfg, thor or ThorConfig()
        self.loss_scale = loss_scale
        self.candidates = self.thor.candidate_sets
        self.set_size = min(self.thor.num_candidates, num_experts) if self.candidates \
            else num_experts
        self.task_gate = nn.Linear(d_model, num_experts, bias=False) if self.candidates else None
        self.gate = LinearGate(d_model, num_experts, cfg.noisy_gating, cfg.jitter_eps)
        self.context_gate = None
        if self.thor.context:  # U3: W^g (2D x D, or 2D x 1) and b^g
            width = d_model if self.thor.context_gate == "vector" else 1
            self.context_gate = nn.Linear(2 * d_model, width)
            if self.thor.context_gate_init == "xavier":
                nn.init.xavier_uniform_(self.context_gate.weight)
            else:  # "open": W^g = 0, so every token's gate starts at sigmoid(b^g)
                nn.init.zeros_(self.context_gate.weight)
            nn.init.constant_(self.context_gate.bias, self.thor.context_gate_bias)

    def candidate_sets(self, repr_BD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(task probabilities over all E (float32), candidates_BC, g^t_BE: the probabilities
        renormalised over each sentence's candidates, 0 elsewhere)."""
        probs_BE = linear_fp32(repr_BD, self.task_gate).softmax(-1)
        cand_BC = top_k_ids(probs_BE, self.set_size)
        in_set_BE = torch.zeros_like(probs_BE, dtype=torch.bool).scatter_(1, cand_BC, True)
        g_BE = probs_BE * in_set_BE
        return probs_BE, cand_BC, g_BE / g_BE.sum(-1, keepdim=True)

    def router_input(self, x_TD: Tensor, rctx: RoutingContext) -> tuple[Tensor, Tensor | None]:
        """What the token gate reads: the context-fused state (U3), + E_p for "infuse"; and
        the context gate g (None without context)."""
        h_TD, g_TX = x_TD, None
        if self.context_gate is not None:  # [x; H] W^g as x W_x + H W_h: no (T, 2D) copy
            D = x_TD.size(1)
            w_x, w_h = self.context_gate.weight[:, :D], self.context_gate.weight[:, D:]
            ctx_ND, row_T = context_rows(x_TD, rctx)  # encoder: H per sentence, B rows
            ctx_TD = expand_rows(ctx_ND, row_T)
            gate_h_TX = expand_rows(F.linear(ctx_ND, w_h), row_T)
            g_TX = torch.sigmoid(F.linear(x_TD, w_x, self.context_gate.bias) + gate_h_TX)
            h_TD = torch.lerp(ctx_TD, x_TD, g_TX)  # g * x + (1 - g) * H_ctx
        if self.thor.task_repr == "infuse":
            repr_BD = rctx.require(TASK_REPR_KEY, self.name)
            h_TD = h_TD + repr_BD.to(h_TD.dtype).index_select(0, rctx.sentence_ids_T)
        return h_TD, g_TX

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        if rctx is None or rctx.sentence_ids_T is None:
            raise ValueError("the thor router needs a RoutingContext with sentence ids "
                             "(RoutingContext.from_forward)")
        pad_T, sid_T, E = rctx.pad_mask_T, rctx.sentence_ids_T, self.num_experts
        h_TD, g_TX = self.router_input(x_TD, rctx)
        clean_TE, logits_TE = self.gate(h_TD)
        aux: dict[str, Tensor] = {}
        g_task_TE = in_set_TE = cand_BC = None
        if self.candidates:
            repr_BD = rctx.require(TASK_REPR_KEY, self.name)
            _, cand_BC, g_BE = self.candidate_sets(repr_BD)
            g_task_TE = g_BE.index_select(0, sid_T)
            in_set_TE = g_task_TE > 0
            logits_TE = logits_TE.masked_fill(~in_set_TE, float("-inf"))
            if self.thor.beta > 0 and self.training:  # Eq. 11 over the K task embeddings
                table_KD = rctx.require(TASK_EMB_KEY, self.name)
                task_probs_KE, cand_KC, _ = self.candidate_sets(table_KD.to(repr_BD.dtype))
                aux["thor_task_balance"] = self.loss_scale * self.thor.beta * \
                    losses.task_balance_loss(task_probs_KE, cand_KC)
        probs_TE = logits_TE.softmax(-1)  # zero outside S^t: top-p keeps its meaning
        if self.thor.token_routing == "topk":
            ids_TK, weights_TK = top_k_select(probs_TE, self.cfg.k, renormalize=True)
        else:
            ids_TK, weights_TK = top_p_select(probs_TE, self.cfg.top_p)
        if in_set_TE is not None:  # never outside S^t, even for slots of zero probability
            safe_TK = ids_TK.clamp_min(0)
            keep_TK = (ids_TK >= 0) & in_set_TE.gather(1, safe_TK)
            ids_TK = torch.where(keep_TK, ids_TK, -1)
            weights_TK = torch.where(keep_TK, weights_TK * g_task_TE.gather(1, safe_TK), 0.0)
        if self.thor.renormalize:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(1e-12)
        counts_E = losses.tokens_per_expert(ids_TK, E, pad_T)
        if self.thor.gamma > 0:  # Eq. 12
            aux["thor_token_balance"] = self.loss_scale * self.thor.gamma * \
                losses.token_balance_loss(probs_TE, counts_E, pad_T, float(self.set_size))
        if self.thor.token_routing == "topp" and self.thor.delta > 0:  # Eq. 13
            aux["thor_topp_entropy"] = self.loss_scale * self.thor.delta * \
                losses.entropy_loss(probs_TE, pad_T)
        if self.cfg.z_loss_coef > 0:
            aux["z_loss"] = self.loss_scale * self.cfg.z_loss_coef * losses.z_loss(clean_TE, pad_T)
        return Routing(expert_ids_TK=ids_TK, weights_TK=weights_TK.to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=E, aux_losses=aux,
                       stats=self._stats(ids_TK, probs_TE, counts_E, cand_BC, g_TX, rctx))

    @torch.no_grad()
    def _stats(self, ids_TK: Tensor, probs_TE: Tensor, counts_E: Tensor, cand_BC: Tensor | None,
               g_TX: Tensor | None, rctx: RoutingContext) -> dict[str, Tensor]:
        """Tokens per expert, entropy, experts per real token (003 Table 7), the mean context
        gate (the share of x in the router input) and, with candidate sets, how many real
        sentences hold each expert as a candidate and the share of (sentence, candidate) pairs
        that received a token (candidate usage). Real sentences are weighted in, not
        selected (an output of data-dependent size): no host sync, the same values."""
        pad_T, sid_T = rctx.pad_mask_T, rctx.sentence_ids_T
        stats = _token_stats(ids_TK, self.num_experts, pad_T, probs_TE, counts_E=counts_E)
        keep_T = torch.ones_like(sid_T, dtype=torch.float32) if pad_T is None else (~pad_T).float()
        used_T = (ids_TK >= 0).sum(-1).float()
        stats["experts_per_token"] = (used_T * keep_T).sum() / keep_T.sum().clamp_min(1.0)
        if g_TX is not None:
            stats["context_gate_mean"] = (g_TX.float().mean(-1) * keep_T).sum() \
                / keep_T.sum().clamp_min(1.0)
        if cand_BC is not None:
            B, E = rctx.num_sentences, self.num_experts
            real_B = keep_T.new_zeros(B).index_add_(0, sid_T, keep_T) > 0
            real_BC = real_B[:, None].expand_as(cand_BC)
            stats["candidates_per_expert"] = cand_BC.new_zeros(E).scatter_add_(
                0, cand_BC.reshape(-1), real_BC.reshape(-1).long())
            hit_BE = torch.zeros(B, E + 1, device=ids_TK.device)
            rows_TK = sid_T[:, None].expand_as(ids_TK)
            cols_TK = torch.where(ids_TK >= 0, ids_TK, E)
            hit_BE.index_put_((rows_TK.reshape(-1), cols_TK.reshape(-1)),
                              keep_T[:, None].expand_as(ids_TK).reshape(-1), accumulate=True)
            used_BC = ((hit_BE[:, :E].gather(1, cand_BC) > 0) & real_BC).float()
            stats["candidate_usage"] = used_BC.sum() / real_BC.sum().clamp_min(1)
        return stats

