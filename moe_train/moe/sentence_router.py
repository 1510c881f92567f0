"""Sentence- and task-level routers: every token of a sentence shares its sentence's experts.

- ``sentence``: one top-k decision per sentence from a sentence representation (Switch-SL /
  SGMoE-SL of the MoA paper).
- ``task``: one decision per task (language pair, target language, domain), learned from a task
  embedding or read from a fixed table (Kudugunta et al. 2021).

Shape legend: T tokens (flattened batch positions, padding included), B sentences, D model dim,
E experts, K expert slots per token, N tasks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe import losses
from moe_train.moe.gating import (
    LinearGate,
    Router,
    _check_k,
    _expect,
    _gate_losses,
    _require_sentences,
    _sentence_pad_mask,
    _token_stats,
    sentence_repr,
    top_k_select,
)
from moe_train.moe.routing import Routing, RoutingContext


class SentenceRouter(Router):
    """Sentence-level routing (Switch-SL / SGMoE-SL): one top-k decision per sentence.

    The gate reads ``rctx.sentence_repr_BD`` when given (e.g. the mean-pooled encoder output,
    so that every layer served decides from the same input), else the mean of the sentence's
    non-pad token states at this layer (Eq. 1 of the task-routing paper). Every token of a
    sentence, padding included, gets the sentence's experts and weights. Weights are the raw
    probability for k = 1 (Switch-SL) and renormalised for k > 1 (SGMoE-SL). Load-balance and
    z losses are computed over sentences that have a real token. On the decoder side a
    sentence representation must be given: pooling decoder states would let each position see
    future target tokens.
    """

    name = "sentence"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        _check_k(cfg.k, num_experts)
        self.cfg = cfg
        self.k = cfg.k
        self.gate = LinearGate(d_model, num_experts, cfg.noisy_gating, cfg.jitter_eps)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, "sentence")
        clean_BE, logits_BE = self.gate(sentence_repr(x_TD, rctx, self.name))
        probs_BE = logits_BE.softmax(-1)
        ids_BK, weights_BK = top_k_select(probs_BE, self.k, renormalize=self.k > 1)
        empty_B = _sentence_pad_mask(rctx)
        aux = _gate_losses(self.cfg, probs_BE, ids_BK, clean_BE, empty_B)
        sid_T = rctx.sentence_ids_T
        expert_ids_TK = ids_BK[sid_T]
        stats = _token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T, None)
        stats["routing_entropy"] = losses.routing_entropy(probs_BE, empty_B)
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_BK[sid_T].to(x_TD.dtype),
                       probs_TE=probs_BE[sid_T], num_experts=self.num_experts, aux_losses=aux,
                       stats=stats, sentence_expert_ids_BK=ids_BK)


class TaskRouter(Router):
    """Static task-level routing (Kudugunta et al. 2021): GATE(task_id), Eq. 2.

    The task of a sentence comes from ``rctx.task_ids_B`` (``cfg.task_source``: language pair,
    target language, domain or given task ids), so every token of a task goes to the same
    experts. Learned: logits = W_g emb(task_id) with an N x D task embedding, top-k (raw
    probability for k = 1, renormalised for k > 1); load-balance and z losses are taken over
    real tokens, the units the experts actually process. Fixed: ``cfg.assignment[task]`` lists
    the k experts (weight 1/k each), no parameters, no losses, probs_TE None. Jitter and noisy
    gating do not apply (the gate input is not a token state).
    """

    name = "task"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        _check_k(cfg.k, num_experts)
        self.cfg = cfg
        self.k = cfg.k
        self.task_source = cfg.task_source
        self.embed: nn.Embedding | None = None
        self.gate: nn.Linear | None = None
        if cfg.assignment:
            self.num_tasks = len(cfg.assignment)
            for i, row in enumerate(cfg.assignment):
                _expect(max(row) < num_experts, f"moe.assignment[{i}]",
                        f"expert ids below moe.num_experts ({num_experts})", row)
            # A function of the config, not learned state: not saved in checkpoints.
            self.register_buffer("assignment_NK", torch.tensor(cfg.assignment, dtype=torch.long),
                                 persistent=False)
        else:
            _expect(cfg.num_tasks > 0, "moe.num_tasks",
                    "a positive number of tasks for the learned task router", cfg.num_tasks)
            self.num_tasks = cfg.num_tasks
            self.assignment_NK = None
            self.embed = nn.Embedding(cfg.num_tasks, d_model)
            self.gate = nn.Linear(d_model, num_experts, bias=False)

    def _task_ids(self, rctx: RoutingContext) -> Tensor:
        task_ids_B = rctx.task_ids_B
        if task_ids_B is None:
            raise ConfigError(f"moe.task_source: task routing by {self.task_source} needs task "
                              "ids, but the data has no task ids for this batch")
        if tuple(task_ids_B.shape) != (rctx.num_sentences,):
            raise ValueError(f"task_ids_B has shape {tuple(task_ids_B.shape)}, expected "
                             f"({rctx.num_sentences},)")
        if task_ids_B.numel():
            lo, hi = int(task_ids_B.min()), int(task_ids_B.max())  # device sync, once per call
            _expect(lo >= 0 and hi < self.num_tasks, "moe.num_tasks",
                    f"more than the largest task id ({hi}) from {self.task_source}",
                    self.num_tasks)
        return task_ids_B.long()

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, "task")
        task_ids_B = self._task_ids(rctx).to(x_TD.device)
        sid_T = rctx.sentence_ids_T
        if self.assignment_NK is not None:
            ids_BK = self.assignment_NK[task_ids_B]
            expert_ids_TK = ids_BK[sid_T]
            weights_TK = torch.full(expert_ids_TK.shape, 1.0 / self.k, dtype=x_TD.dtype,
                                    device=x_TD.device)
            return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_TK, probs_TE=None,
                           num_experts=self.num_experts,
                           stats=_token_stats(expert_ids_TK, self.num_experts,
                                              rctx.pad_mask_T, None),
                           sentence_expert_ids_BK=ids_BK)
        logits_BE = self.gate(self.embed(task_ids_B)).float()
        probs_BE = logits_BE.softmax(-1)
        ids_BK, weights_BK = top_k_select(probs_BE, self.k, renormalize=self.k > 1)
        expert_ids_TK, probs_TE = ids_BK[sid_T], probs_BE[sid_T]
        aux = _gate_losses(self.cfg, probs_TE, expert_ids_TK, logits_BE[sid_T], rctx.pad_mask_T)
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_BK[sid_T].to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=self.num_experts, aux_losses=aux,
                       stats=_token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T,
                                          probs_TE),
                       sentence_expert_ids_BK=ids_BK)
