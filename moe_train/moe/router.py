"""Routers: decide which experts each token goes to, with which combine weights.

A router maps the (layer-normed) token states and a `RoutingContext` to a `Routing`. Routers are
picked by name from the explicit `ROUTERS` registry through `build_router`:

- ``topk``: softmax over E, top-k, weights renormalised over the k (Eq. 4 of THOR-MoE).
- ``switch``: top-1 whose weight is the raw top-1 probability (Switch Transformer), so the gate
  gets a gradient from the main loss.
- ``gshard``: top-2, renormalised (GShard).
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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe import losses
from moe_train.moe.routing import Routing, RoutingContext, sentence_mean


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


class TopKRouter(Router):
    """Token-level top-k: softmax over E, the k largest, weights renormalised over the k."""

    name = "topk"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        self.k, self.renormalize = self._selection(cfg)
        user_k = type(self)._selection is TopKRouter._selection
        _check_k(self.k, num_experts, None if user_k else self.name)
        self.cfg = cfg
        self.gate = LinearGate(d_model, num_experts, cfg.noisy_gating, cfg.jitter_eps)

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        """(k, renormalize) of this router."""
        return cfg.k, True

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        pad_mask_T = None if rctx is None else rctx.pad_mask_T
        clean_TE, logits_TE = self.gate(x_TD)
        probs_TE = logits_TE.softmax(-1)
        expert_ids_TK, weights_TK = top_k_select(probs_TE, self.k, self.renormalize)
        return Routing(
            expert_ids_TK=expert_ids_TK, weights_TK=weights_TK.to(x_TD.dtype), probs_TE=probs_TE,
            num_experts=self.num_experts,
            aux_losses=_gate_losses(self.cfg, probs_TE, expert_ids_TK, clean_TE, pad_mask_T),
            stats=_token_stats(expert_ids_TK, self.num_experts, pad_mask_T, probs_TE))


class SwitchRouter(TopKRouter):
    """Switch Transformer: top-1, weight = the raw top-1 probability (not renormalised)."""

    name = "switch"

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        return 1, False


class GShardRouter(TopKRouter):
    """GShard: top-2, weights renormalised over the two."""

    name = "gshard"

    def _selection(self, cfg: RouterConfig) -> tuple[int, bool]:
        return 2, True


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
        if rctx.sentence_repr_BD is not None:
            repr_BD = rctx.sentence_repr_BD.to(x_TD.dtype)
        elif rctx.side == "decoder":
            raise ConfigError("moe.router: the sentence router on the decoder side needs the "
                              "encoder's sentence representation in ForwardContext.extras"
                              "['sentence_repr_BD'] (pooling decoder states sees future tokens)")
        else:
            repr_BD = sentence_mean(x_TD, rctx.sentence_ids_T, rctx.num_sentences,
                                    rctx.pad_mask_T)
        clean_BE, logits_BE = self.gate(repr_BD)
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
                       stats=stats)


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
            expert_ids_TK = self.assignment_NK[task_ids_B][sid_T]
            weights_TK = torch.full(expert_ids_TK.shape, 1.0 / self.k, dtype=x_TD.dtype,
                                    device=x_TD.device)
            return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_TK, probs_TE=None,
                           num_experts=self.num_experts,
                           stats=_token_stats(expert_ids_TK, self.num_experts,
                                              rctx.pad_mask_T, None))
        logits_BE = self.gate(self.embed(task_ids_B)).float()
        probs_BE = logits_BE.softmax(-1)
        ids_BK, weights_BK = top_k_select(probs_BE, self.k, renormalize=self.k > 1)
        expert_ids_TK, probs_TE = ids_BK[sid_T], probs_BE[sid_T]
        aux = _gate_losses(self.cfg, probs_TE, expert_ids_TK, logits_BE[sid_T], rctx.pad_mask_T)
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_BK[sid_T].to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=self.num_experts, aux_losses=aux,
                       stats=_token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T,
                                          probs_TE))


ROUTERS: dict[str, type[Router]] = {
    "gshard": GShardRouter,
    "sentence": SentenceRouter,
    "switch": SwitchRouter,
    "task": TaskRouter,
    "topk": TopKRouter,
    "topp": TopPRouter,
}
"""Router name (``moe.router``) -> class; every class takes (d_model, num_experts, cfg)."""


def build_router(name: str, d_model: int, num_experts: int, cfg: RouterConfig) -> Router:
    """The router registered as `name`; unknown names and impossible k are ConfigErrors."""
    if name not in ROUTERS:
        known = ", ".join(sorted(ROUTERS))
        raise ConfigError(f"moe.router: unknown router {name!r} (known: {known})")
    _expect(num_experts >= 1, "moe.num_experts", "a positive integer", num_experts)
    return ROUTERS[name](d_model, num_experts, cfg)
