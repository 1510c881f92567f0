"""Sentence- and task-level routers: every token of a sentence shares its sentence's experts.

- ``sentence``: one top-k decision per sentence from a sentence representation (Switch-SL /
  SGMoE-SL of the MoA paper).
- ``task``: one decision per task (language pair, target language, domain), learned from a task
  embedding or read from a fixed table (Kudugunta et al. 2021).

Shape legend: T tokens (flattened batch positions, padding included), B sentences, D model dim,
E experts, K expert slots per token, N tasks.
"""

from __future__ import annotations

import weakref

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
    linear_fp32,
    sentence_repr,
    top_k_select,
)
from moe_train.moe.routing import (Routing, RoutingContext, ids_on_host, tensor_version,
                                   unchanged)

RAW_TEXT_FLAGS = {"domain": "--domain", "tgt_lang": "--tgt-lang", "src_lang": "--src-lang",
                  "lang_pair": "--src-lang and --tgt-lang"}
"""The translate / evaluate flags that give raw text the ids a task source reads."""

class SentenceRouter(Router):
    """Sentence-level routing (Switch-SL / SGMoE-SL): one top-k decision per sentence.

    The gate reads ``rctx.sentence_repr_BD`` when given (e.g. the mean-pooled encoder output,
    so that every layer served decides from the same input), else the mean of the sentence's
    non-pad token states at this layer (Eq. 1 of the task-routing paper). Every token of a
    sentence, padding included, gets the sentence's experts and weights. Weights are the raw
    probability for k = 1 (Switch-SL) and renormalised for k > 1 (SGMoE-SL). Load-balance and
    z losses are computed over sentences that have a real token; ``balance_loss: cv2`` gives
    SGMoE's importance and load losses instead (noisy gating, Shazeer et al. 2017). On the
    decoder side a sentence representation must be given: pooling decoder states would let each
    position see future target tokens.
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
        clean_BE, logits_BE, std_BE = self.gate.scores(sentence_repr(x_TD, rctx, self.name))
        probs_BE = logits_BE.softmax(-1)
        ids_BK, weights_BK = top_k_select(probs_BE, self.k, renormalize=self.k > 1)
        empty_B = _sentence_pad_mask(rctx)
        cv2 = self.cfg.balance_loss == "cv2" and self.cfg.aux_loss_coef > 0
        aux = _gate_losses(self.cfg, probs_BE, ids_BK, clean_BE, empty_B, balance=not cv2)
        if cv2:  # G(x): the weights here, softmax over the kept top k of the noisy logits for
            # k > 1; for k = 1 the raw top-1 probability (Shazeer's G would be a constant 1,
            # leaving the importance loss no gradient)
            gates_BE = torch.zeros_like(probs_BE).scatter(1, ids_BK, weights_BK)
            importance, load = losses.importance_load_losses(gates_BE, clean_BE, logits_BE,
                                                             std_BE, self.k, empty_B)
            aux["importance"] = self.cfg.aux_loss_coef * importance
            aux["load"] = self.cfg.aux_loss_coef * load
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
    experts. Three ways to hold GATE:

    - learned: logits = W_g emb(task) with an N x D task embedding, top-k (raw probability for
      k = 1, renormalised for k > 1); load-balance and z losses over real tokens, the balance
      loss counting every slot (GShard's first-choice form, a reading of seed notes OD-T2,
      cost the demo 5.5 test BLEU: 79.22 against 84.77). The gate is
      evaluated for all N tasks at once and indexed by task (N is small), so a task's experts
      and weights are the same numbers whatever else is in the batch, and `table()` gives
      exactly what `forward` uses.
    - fixed: ``cfg.assignment[task]`` lists the k experts, weighted by
      ``cfg.assignment_weights`` (1/k each by default); a function of the config.
    - frozen table (``task_table`` rows): per-layer experts and weights kept in the state dict,
      written by `moe-train extract`; a row of -1 ids is a task this model does not serve.

    Fixed and frozen routers have no parameters and no losses (probs_TE None). Jitter and noisy
    gating do not apply (the gate input is not a token state).
    """

    name = "task"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig,
                 task_table: int = 0) -> None:
        super().__init__(num_experts)
        _check_k(cfg.k, num_experts)
        self.cfg = cfg
        self.k = cfg.k
        self.task_source = cfg.task_source
        self.embed: nn.Embedding | None = None
        self.gate: nn.Linear | None = None
        self.frozen = bool(task_table)
        """Whether the table comes from the checkpoint (and may leave tasks unserved)."""
        self._served_memo: tuple[weakref.ref, int | None, list[bool]] | None = None
        """(table_ids_NK, its version, which rows are served) of the last `_served` read."""
        if task_table:
            self.num_tasks = task_table
            # Learned state of an extracted model: saved with the checkpoint.
            self.register_buffer("table_ids_NK", torch.full((task_table, self.k), -1))
            self.register_buffer("table_weights_NK", torch.zeros(task_table, self.k))
        elif cfg.assignment:
            self.num_tasks = len(cfg.assignment)
            for i, row in enumerate(cfg.assignment):
                _expect(max(row) < num_experts, f"moe.assignment[{i}]",
                        f"expert ids below the side's number of experts ({num_experts})", row)
            weights = cfg.assignment_weights or [[1.0 / self.k] * self.k] * self.num_tasks
            # A function of the config, not learned state: not saved in checkpoints.
            self.register_buffer("table_ids_NK", torch.tensor(cfg.assignment, dtype=torch.long),
                                 persistent=False)
            self.register_buffer("table_weights_NK", torch.tensor(weights, dtype=torch.float32),
                                 persistent=False)
        else:
            _expect(cfg.num_tasks > 0, "moe.num_tasks",
                    "a positive number of tasks for the learned task router", cfg.num_tasks)
            self.num_tasks = cfg.num_tasks
            self.table_ids_NK = self.table_weights_NK = None
            self.embed = nn.Embedding(cfg.num_tasks, d_model)
            self.gate = nn.Linear(d_model, num_experts, bias=False)

    @property
    def learned(self) -> bool:
        return self.gate is not None

    def _gate_NE(self) -> tuple[Tensor, Tensor]:
        """(logits_NE, probs_NE) of the learned gate for every task."""
        logits_NE = linear_fp32(self.embed.weight, self.gate)
        return logits_NE, logits_NE.softmax(-1)

    @torch.no_grad()
    def table(self) -> tuple[Tensor, Tensor]:
        """(ids_NK, weights_NK): every task's experts and fp32 combine weights, in slot order,
        exactly as `forward` uses them (a learned gate frozen into a table)."""
        if not self.learned:
            return self.table_ids_NK.clone(), self.table_weights_NK.float().clone()
        ids_NK, weights_NK = top_k_select(self._gate_NE()[1], self.k, renormalize=self.k > 1)
        return ids_NK, weights_NK

    def _task_ids(self, rctx: RoutingContext) -> Tensor:
        task_ids_B = rctx.task_ids_B
        if task_ids_B is None:
            flags = RAW_TEXT_FLAGS.get(self.task_source)
            raise ConfigError(f"moe.task_source: task routing by {self.task_source} needs task "
                              "ids, but the data has no task ids for this batch" +
                              (f" (raw text: give {flags})" if flags else ""))
        if tuple(task_ids_B.shape) != (rctx.num_sentences,):
            raise ValueError(f"task_ids_B has shape {tuple(task_ids_B.shape)}, expected "
                             f"({rctx.num_sentences},)")
        if task_ids_B.numel():  # host values shared by all layers and steps (ids_on_host)
            ids = ids_on_host(task_ids_B)
            lo, hi = int(min(ids)), int(max(ids))
            _expect(lo >= 0 and hi < self.num_tasks, "moe.num_tasks",
                    f"more than the largest task id ({hi}) from {self.task_source}",
                    self.num_tasks)
        return task_ids_B.long()

    def _served(self, task_ids_B: Tensor) -> None:
        """A frozen table's unserved rows (-1) are an error naming the task id. Checked on
        host copies: the ids (`ids_on_host`) and which rows are served, read once per table
        (identity and version: a loaded checkpoint reads again)."""
        table_NK, memo = self.table_ids_NK, self._served_memo
        if memo is None or not unchanged(memo[0], memo[1], table_NK):
            memo = self._served_memo = (weakref.ref(table_NK), tensor_version(table_NK),
                                        (table_NK[:, 0] >= 0).tolist())
        served_N = memo[2]
        unserved = [t for t in ids_on_host(task_ids_B) if not served_N[t]]
        if unserved:
            served = [n for n, ok in enumerate(served_N) if ok]
            raise ConfigError(f"moe.extracted_task: this model serves {self.task_source} "
                              f"id(s) {served} only, got id {int(unserved[0])}")

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, "task")
        task_ids_B = self._task_ids(rctx).to(x_TD.device)
        sid_T = rctx.sentence_ids_T
        if not self.learned:
            if self.frozen:  # a fixed assignment serves every task: nothing to check
                self._served(rctx.task_ids_B)
            ids_BK = self.table_ids_NK[task_ids_B]
            expert_ids_TK = ids_BK[sid_T]
            weights_TK = self.table_weights_NK[task_ids_B][sid_T].to(x_TD.dtype)
            return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_TK, probs_TE=None,
                           num_experts=self.num_experts,
                           stats=_token_stats(expert_ids_TK, self.num_experts,
                                              rctx.pad_mask_T, None),
                           sentence_expert_ids_BK=ids_BK)
        logits_NE, probs_NE = self._gate_NE()
        ids_NK, weights_NK = top_k_select(probs_NE, self.k, renormalize=self.k > 1)
        ids_BK, weights_BK = ids_NK[task_ids_B], weights_NK[task_ids_B]
        expert_ids_TK = ids_BK[sid_T]
        probs_TE = probs_NE[task_ids_B][sid_T]
        aux = _gate_losses(self.cfg, probs_TE, expert_ids_TK, logits_NE[task_ids_B][sid_T],
                           rctx.pad_mask_T)
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_BK[sid_T].to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=self.num_experts, aux_losses=aux,
                       stats=_token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T,
                                          probs_TE),
                       sentence_expert_ids_BK=ids_BK)
