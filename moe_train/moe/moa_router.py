"""MoA routing: the distilled sentence gate (Eq. 2), Gumbel-Max routing (Eq. 8-10, Algorithm 1),
the trivial router of a single pre-injected adapter, and `SharedRouter`, which makes one
sentence-level decision serve every layer of a stack.

Shape legend: T tokens (flattened batch positions, padding included), B sentences, D model dim,
E experts (adapters), K candidates.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe import losses
from moe_train.moe.gating import (Router, _check_k, _require_sentences, _token_stats, linear_fp32,
                                   sentence_repr)
from moe_train.moe.routing import Routing, RoutingContext


class MoAGate(nn.Module):
    """s = tanh(h W1 + b1) W2 + b2 (MoA Eq. 2): adapter scores from a sentence representation.

    W1 is D x D, W2 is D x K. Trained by distillation on cluster labels (Eq. 6-7), then frozen.
    """

    def __init__(self, d_model: int, num_experts: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, num_experts)

    def forward(self, h_BD: Tensor) -> Tensor:
        """Scores (B, K), float32."""
        return linear_fp32(torch.tanh(linear_fp32(h_BD, self.hidden)), self.out)


def gumbel_max_select(scores_BE: Tensor, k: int, tau: float,
                      generator: torch.Generator | None = None) -> Tensor:
    """One expert per row: a Gumbel-Max sample among the k best scores (MoA Algorithm 1).

    p = softmax(top-k(s) / tau) (Eq. 8); e = argmax(log p + g), g ~ Gumbel(0, 1) (Eq. 9-10), so
    candidate j of the top-k is chosen with probability p_j and nothing outside the top-k is ever
    chosen. k <= 1 or tau == 0 is plain argmax. Returns expert ids (B,), int64.
    """
    if k <= 1 or tau == 0:
        return scores_BE.argmax(-1)
    k = min(k, scores_BE.size(-1))
    top_BK, idx_BK = scores_BE.float().topk(k, dim=-1)
    log_p_BK = torch.log_softmax(top_BK / tau, dim=-1)
    u_BK = torch.rand(log_p_BK.shape, generator=generator, device=log_p_BK.device)
    gumbel_BK = -torch.log(-torch.log(u_BK.clamp(1e-20, 1.0 - 1e-7)))
    pick_B1 = (log_p_BK + gumbel_BK).argmax(-1, keepdim=True)
    return idx_BK.gather(1, pick_B1).squeeze(1)


class GumbelMaxRouter(Router):
    """MoA's sentence-level adapter routing over a (frozen, distilled) `MoAGate`.

    Training: one adapter per sentence sampled by Gumbel-Max among the ``cfg.k`` best scores at
    temperature ``cfg.tau``. Inference (eval mode): the top-1 adapter. Weight 1, no aux loss:
    the gate is trained by distillation, not by the translation loss.
    """

    name = "gumbel"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        _check_k(cfg.k, num_experts)
        self.k, self.tau = cfg.k, cfg.tau
        self.gate = MoAGate(d_model, num_experts)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, self.name)
        scores_BE = self.gate(sentence_repr(x_TD, rctx, self.name))
        if self.training:
            ids_B = gumbel_max_select(scores_BE.detach(), self.k, self.tau)
        else:
            ids_B = scores_BE.argmax(-1)
        sid_T = rctx.sentence_ids_T
        expert_ids_TK = ids_B[sid_T][:, None]
        probs_TE = scores_BE.softmax(-1)[sid_T]
        return Routing(expert_ids_TK=expert_ids_TK,
                       weights_TK=torch.ones(expert_ids_TK.shape, dtype=x_TD.dtype,
                                             device=x_TD.device),
                       probs_TE=probs_TE, num_experts=self.num_experts,
                       stats=_token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T,
                                          probs_TE.detach()),
                       sentence_expert_ids_BK=ids_B[:, None])


class RandomSentenceRouter(Router):
    """A fixed pseudo-random expert per sentence, blind to what the sentence is about: the
    "does routing matter" control (RND routing). The choice is a hash of the sentence
    representation (quantised to 0.01), so every layer and every decoding step of a sentence
    agree, and two runs agree. No parameters, no aux loss.

    With `weights_of` (a trained router), only the experts are random: each token keeps that
    router's k slots and combine weights (a Switch-SL gate's probability, SGMoE-SL's two
    renormalised weights), its experts become the sentence's hash and the k - 1 experts after
    it, so the control changes which experts run and nothing else."""

    name = "random"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig,
                 weights_of: Router | None = None) -> None:
        super().__init__(num_experts)
        self.weights_of = weights_of
        self.k = 1 if weights_of is None else int(getattr(weights_of, "k", 1))
        gen = torch.Generator().manual_seed(7919)
        self.register_buffer("salt_D", torch.randint(1, 2**31 - 1, (d_model,), generator=gen),
                             persistent=False)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, self.name)
        q_BD = torch.round(sentence_repr(x_TD, rctx, self.name).float() * 100).long()
        hash_B = (q_BD * self.salt_D.to(q_BD.device)).sum(-1)
        kept = None if self.weights_of is None else self.weights_of.route(x_TD, rctx)
        K = 1 if kept is None else kept.expert_ids_TK.size(1)
        ids_BK = torch.remainder(hash_B[:, None] + torch.arange(K, device=hash_B.device),
                                 self.num_experts)
        expert_ids_TK = ids_BK[rctx.sentence_ids_T]
        if kept is None:
            weights_TK = torch.ones(expert_ids_TK.shape, dtype=x_TD.dtype, device=x_TD.device)
        else:  # the trained router's unused slots stay unused
            expert_ids_TK = torch.where(kept.expert_ids_TK < 0, -1, expert_ids_TK)
            weights_TK = kept.weights_TK
        return Routing(expert_ids_TK=expert_ids_TK, weights_TK=weights_TK,
                       probs_TE=None, num_experts=self.num_experts,
                       stats=_token_stats(expert_ids_TK, self.num_experts, rctx.pad_mask_T, None),
                       sentence_expert_ids_BK=ids_BK)


class SingleRouter(Router):
    """Every token to expert 0 with weight 1: one adapter per layer (MoA's pre-injected one)."""

    name = "single"

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig) -> None:
        super().__init__(num_experts)
        if num_experts != 1:
            raise ConfigError(f"moe.num_experts: expected 1 for the single router, "
                              f"got {num_experts}")
        self.k = 1

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        ids_TK = torch.zeros(x_TD.size(0), 1, dtype=torch.long, device=x_TD.device)
        pad_mask_T = None if rctx is None else rctx.pad_mask_T
        return Routing(expert_ids_TK=ids_TK, weights_TK=torch.ones_like(ids_TK, dtype=x_TD.dtype),
                       probs_TE=None, num_experts=1,
                       stats={"tokens_per_expert": losses.tokens_per_expert(ids_TK, 1, pad_mask_T)})


def _as_is(t: Tensor) -> Tensor:
    return t


class SharedRouter(nn.Module):
    """One sentence-level router serving several layers with ONE decision per forward pass.

    Layers of a stack share this module. The first layer to route a batch computes the decision
    from the stack's sentence representation (``rctx.sentence_repr_BD``, the same tensor for all
    layers of one forward); later layers of the same pass reuse it (same experts, same sampled
    Gumbel choice, aux losses counted once), which is "route data in all layers with these scores"
    of the sentence-level baselines. Only for routers whose decision depends on the sentence,
    never on the layer's token states.
    """

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner
        self._memo: tuple[Any, int, bool, Routing] | None = None

    @property
    def num_experts(self) -> int:
        return self.inner.num_experts

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def task_source(self) -> str | None:
        return self.inner.task_source

    @property
    def k(self) -> int:
        return int(getattr(self.inner, "k", self.inner.num_experts))

    def route(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        return self(x_TD, rctx)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        key = None if rctx is None else rctx.sentence_repr_BD
        if key is not None and self._memo is not None:
            ref, T, training, routing, drawn = self._memo
            if ref() is key and T == x_TD.size(0) and training == self.training:
                if drawn is not None and _same_states(_rng_states(x_TD), drawn[0]):
                    # A checkpointed layer that made this decision is recomputed in backward
                    # from the random state it started with: move the generators on as the
                    # decision's draws (noise, jitter, Gumbel) did, so the dropout after it
                    # draws what it drew in the forward.
                    _set_rng_states(x_TD, drawn[1])
                return dataclasses.replace(routing, aux_losses={})
        # Later layers reuse this decision, so its tensors are saved outside any activation
        # checkpoint: a checkpointed layer that made it is recomputed in backward, finds the
        # memo, and must save what its first run saved (none of these).
        before = _rng_states(x_TD) if self.training else None
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            routing = self.inner.route(x_TD, rctx)
        drawn = None
        if before is not None:
            after = _rng_states(x_TD)
            drawn = None if _same_states(before, after) else (before, after)
        self._memo = None if key is None else (weakref.ref(key), x_TD.size(0), self.training,
                                                routing, drawn)
        return routing


def _rng_states(x: Tensor) -> list[Tensor]:
    """The states of the generators a draw for `x` may use: the CPU's, and x's GPU's."""
    states = [torch.get_rng_state()]
    if x.is_cuda:
        states.append(torch.cuda.get_rng_state(x.device))
    return states


def _set_rng_states(x: Tensor, states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if x.is_cuda:
        torch.cuda.set_rng_state(states[1], x.device)


def _same_states(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))
