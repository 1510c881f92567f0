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


def top_k_ids(probs_TE: Tensor, k: int) -> Tensor:
    """Ids of the k largest entries per row, in decreasing order; ties go to the lower id.

    k rounds of argmax, masking each pick: on CPU several times faster than `topk` for the
    small k of routing (whose order among equal values is unspecified), no gradient.
    """
    with torch.no_grad():
        scores_TE = probs_TE.detach()
        picks = [scores_TE.argmax(-1, keepdim=True)]
        for _ in range(k - 1):
            if len(picks) == 1:
                scores_TE = scores_TE.scatter(-1, picks[-1], float("-inf"))
            else:
                scores_TE.scatter_(-1, picks[-1], float("-inf"))
            picks.append(scores_TE.argmax(-1, keepdim=True))
        return picks[0] if k == 1 else torch.cat(picks, -1)


def top_k_select(probs_TE: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The k most probable experts per row (ties to the lower id) and their weights
    (renormalised to sum 1, or raw); the weights are differentiable in probs_TE."""
    expert_ids_TK = top_k_ids(probs_TE, k)
    weights_TK = probs_TE.gather(-1, expert_ids_TK)
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


def linear_fp32(x: Tensor, layer: nn.Linear) -> Tensor:
    """`layer(x)` computed in float32 whatever the parameter dtype: a router's logits rounded to
    bf16 tie or swap near-equal experts (and an fp32 export would then choose others)."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias)


class LinearGate(nn.Module):
    """Router logits x W_g, with optional input jitter and noisy gating in training.

    The product itself is float32 whatever the model's dtype (ST-MoE's selective precision, as
    DeepSpeed's gate does): in bf16 the rounding of the logits alone changes a token's top-2 set
    in about 0.5% of tokens (D 512, E 32), and the softmax, the z-loss and the balance
    statistics all start from them. The weight stays in the model's dtype. Returns
    ``(clean_logits_TE, routed_logits_TE)``: the z-loss uses the clean logits, the selection and
    the probabilities the routed (possibly noisy) ones. Outside training both are the same
    tensor.
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
        clean_TE, routed_TE, _ = self.scores(x_TD)
        return clean_TE, routed_TE

    def scores(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """`forward`'s two logits and the noise's scale softplus(x W_noise) (None without noisy
        gating); the scale also outside training, where no noise is drawn (SGMoE's Load)."""
        x_TD = x_TD.float()  # first: bf16 spaces values near 1 by 2^-8 (eps 0.002: no jitter)
        if self.training and self.jitter_eps > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter_eps,
                                                          1.0 + self.jitter_eps)
        clean_TE = F.linear(x_TD, self.weight.weight.float())
        if self.noise is None:
            return clean_TE, clean_TE, None
        std_TE = F.softplus(F.linear(x_TD, self.noise.weight.float()))
        if not self.training:
            return clean_TE, clean_TE, std_TE
        return clean_TE, clean_TE + torch.randn_like(clean_TE) * std_TE, std_TE


def _gate_losses(cfg: RouterConfig, probs_TE: Tensor, expert_ids_TK: Tensor,
                 logits_TE: Tensor, pad_mask_T: Tensor | None, *,
                 counts_E: Tensor | None = None, lse_T: Tensor | None = None,
                 balance: bool = True) -> dict[str, Tensor]:
    """Load-balance and z losses (weighted), skipping those whose coefficient is 0 (`balance`
    False: the caller computes its own balance loss); `counts_E` and `lse_T` are reused when
    the caller has them."""
    aux: dict[str, Tensor] = {}
    if balance and cfg.aux_loss_coef > 0:
        aux["load_balance"] = cfg.aux_loss_coef * losses.load_balance_loss(
            probs_TE, expert_ids_TK, pad_mask_T, counts_E)
    if cfg.z_loss_coef > 0:
        aux["z_loss"] = cfg.z_loss_coef * losses.z_loss(logits_TE, pad_mask_T, lse_T)
    return aux


class _TopKGateFn(torch.autograd.Function):
    """The token top-k gate after the logits, as one autograd node: softmax, top-k, combine
    weights, load-balance and z losses.

    The forward runs the same ops as `top_k_select` + `_gate_losses` (same values). The
    backward is written out, so that the gradients of the weights, of both losses and of
    probs_TE reach the logits in about five passes over T x E instead of the ~15 of the
    composed ops (topk/gather scatter, broadcast, adds, softmax and logsumexp backwards):
        dprobs = scatter(d raw weights) + g_lb * coef * E * f_E * keep_t / n   (+ g_probs)
        dlogits = probs * (dprobs - <probs, dprobs>_t) + g_z * zcoef * 2 lse_t keep_t / n
                  * softmax(clean)          (softmax(clean) = probs without noise)
    Outputs: probs_TE, weights_TK, load-balance loss, z loss (0 when their coefficient is 0),
    and, without gradient, expert_ids_TK, counts_E (routed real slots per expert) and lse_T
    (logsumexp of the clean logits; empty without a z loss).
    """

    @staticmethod
    def forward(ctx, routed_TE: Tensor, clean_TE: Tensor, k: int, renormalize: bool,
                aux_coef: float, z_coef: float, pad_mask_T: Tensor | None,
                first_choice_balance: bool = False):
        T, E = routed_TE.shape
        probs_TE = routed_TE.softmax(-1)
        ids_TK = top_k_ids(probs_TE, k)
        raw_TK = probs_TE.gather(-1, ids_TK)
        sum_T1 = raw_TK.sum(-1, keepdim=True)
        weights_TK = raw_TK / sum_T1 if renormalize else raw_TK
        counts_E = losses.tokens_per_expert(ids_TK, E, pad_mask_T)
        keep_T = None if pad_mask_T is None else (~pad_mask_T).to(torch.float32)
        n_real = max(T, 1) if keep_T is None else keep_T.sum().clamp_min(1.0)
        lb, z = probs_TE.new_zeros(()), probs_TE.new_zeros(())
        f_E = losses.assignment_fractions(
            losses.tokens_per_expert(ids_TK[:, :1], E, pad_mask_T) if first_choice_balance
            else counts_E)
        if aux_coef > 0:
            lb = aux_coef * (E * (f_E * losses.mean_probs(probs_TE, pad_mask_T)).sum())
        lse_T = probs_TE.new_empty(0)
        if z_coef > 0:
            lse_T = torch.logsumexp(clean_TE, dim=-1)
            z = z_coef * losses.z_loss(clean_TE, pad_mask_T, lse_T)
        same = routed_TE is clean_TE
        ctx.save_for_backward(probs_TE, ids_TK, raw_TK, sum_T1, weights_TK, f_E, lse_T,
                              keep_T, None if same else clean_TE)
        ctx.consts = (renormalize, aux_coef, z_coef, n_real, same)
        ctx.mark_non_differentiable(ids_TK, counts_E, lse_T)
        return probs_TE, weights_TK, lb, z, ids_TK, counts_E, lse_T

    @staticmethod
    def backward(ctx, g_probs, g_w, g_lb, g_z, *_):
        probs_TE, ids_TK, raw_TK, sum_T1, weights_TK, f_E, lse_T, keep_T, clean_TE = \
            ctx.saved_tensors
        renormalize, aux_coef, z_coef, n_real, same = ctx.consts
        T, E = probs_TE.shape
        col_T = probs_TE.new_zeros(T)  # per-token terms of dlogits / probs
        row_E = None  # the load-balance gradient on probs, per expert (times keep_t)
        if g_lb is not None and aux_coef > 0:
            row_E = (g_lb * (aux_coef * E) / n_real) * f_E
            dot_T = probs_TE @ row_E
            col_T -= dot_T if keep_T is None else dot_T * keep_T
        d_raw_TK = None
        if g_w is not None:
            d_raw_TK = g_w
            if renormalize:
                d_raw_TK = (g_w - (g_w * weights_TK).sum(-1, keepdim=True)) / sum_T1
            col_T -= (raw_TK * d_raw_TK).sum(-1)
        if g_probs is not None:
            col_T -= (probs_TE * g_probs).sum(-1)
        z_T = None
        if g_z is not None and z_coef > 0:
            z_T = (g_z * (2.0 * z_coef) / n_real) * lse_T
            if keep_T is not None:
                z_T = z_T * keep_T
            if same:  # d lse / d logits = probs: fold into the per-token term
                col_T += z_T
        if row_E is None:
            base_TE = col_T[:, None].expand(T, E).clone()
        elif keep_T is None:
            base_TE = row_E[None, :] + col_T[:, None]
        else:
            base_TE = torch.addcmul(col_T[:, None], keep_T[:, None], row_E[None, :])
        if g_probs is not None:
            base_TE += g_probs
        d_routed_TE = base_TE.mul_(probs_TE)
        if d_raw_TK is not None:
            d_routed_TE.scatter_add_(-1, ids_TK, raw_TK * d_raw_TK)
        d_clean_TE = None
        if z_T is not None and not same:
            d_clean_TE = clean_TE.softmax(-1).mul_(z_T[:, None])
        return d_routed_TE, d_clean_TE, None, None, None, None, None, None


def top_k_gate(routed_TE: Tensor, clean_TE: Tensor, k: int, renormalize: bool,
               cfg: RouterConfig, pad_mask_T: Tensor | None, first_choice_balance: bool = False
               ) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor], Tensor, Tensor | None]:
    """Token top-k gating on float32 logits (`_TopKGateFn`): (probs_TE, expert_ids_TK,
    weights_TK, weighted aux losses, counts_E, lse_T of the clean logits or None).
    `first_choice_balance`: the balance loss's f_e counts each token's first expert only
    (GShard); otherwise every slot (sum_e f_e = 1 for any k)."""
    probs_TE, weights_TK, lb, z, ids_TK, counts_E, lse_T = _TopKGateFn.apply(
        routed_TE, clean_TE, k, renormalize, cfg.aux_loss_coef, cfg.z_loss_coef, pad_mask_T,
        first_choice_balance)
    aux = {}
    if cfg.aux_loss_coef > 0:
        aux["load_balance"] = lb
    if cfg.z_loss_coef > 0:
        aux["z_loss"] = z
    return probs_TE, ids_TK, weights_TK, aux, counts_E, lse_T if cfg.z_loss_coef > 0 else None


def _token_stats(expert_ids_TK: Tensor, num_experts: int, pad_mask_T: Tensor | None,
                 probs_TE: Tensor | None, *, counts_E: Tensor | None = None,
                 logits_TE: Tensor | None = None, lse_T: Tensor | None = None
                 ) -> dict[str, Tensor]:
    """Detached statistics: tokens per expert (`counts_E` if given) and the mean routing
    entropy of probs_TE. Given the logits of probs_TE and their logsumexp, the entropy is
    lse - sum_e p_e l_e (two passes over T x E instead of `losses.routing_entropy`'s four)."""
    if counts_E is None:
        counts_E = losses.tokens_per_expert(expert_ids_TK.detach(), num_experts, pad_mask_T)
    stats = {"tokens_per_expert": counts_E}
    if probs_TE is not None:
        if logits_TE is not None and lse_T is not None:
            with torch.no_grad():
                p32_TE, l32_TE = probs_TE.detach().float(), logits_TE.detach().float()
                entropy_T = lse_T.detach() - (p32_TE * l32_TE).sum(-1)
                stats["routing_entropy"] = losses.masked_mean(entropy_T, pad_mask_T)
        else:
            stats["routing_entropy"] = losses.routing_entropy(probs_TE, pad_mask_T)
    return stats


def _require_sentences(rctx: RoutingContext | None, router: str) -> RoutingContext:
    if rctx is None or rctx.sentence_ids_T is None:
        raise ValueError(f"the {router} router needs RoutingContext.sentence_ids_T "
                         "(build it with RoutingContext.from_forward / from_batch)")
    return rctx


def sentence_repr(x_TD: Tensor, rctx: RoutingContext, router: str) -> Tensor:
    """What a sentence-level router decides from, (B, D): the stack's sentence representation
    when given, else (encoder only) the mean of the sentence's non-pad token states here."""
    if rctx.sentence_repr_BD is not None:
        return rctx.sentence_repr_BD.to(x_TD.dtype)
    if rctx.side == "decoder":
        raise ConfigError(f"moe.router: the {router} router on the decoder side needs the "
                          "encoder's sentence representation in ForwardContext.extras"
                          "['sentence_repr_BD'] (pooling decoder states sees future tokens)")
    return sentence_mean(x_TD, rctx.sentence_ids_T, rctx.num_sentences, rctx.pad_mask_T)


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
    soft = False
    """True for a router that mixes every expert into every token with its weights (no
    selection): routing statistics count such a token at its largest-weight expert."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def route(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        """Route the T tokens of `x_TD` (T, D)."""
        return self(x_TD, rctx)

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        raise NotImplementedError
