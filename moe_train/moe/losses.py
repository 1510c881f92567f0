"""Router auxiliary losses and statistics, as pure functions of the routing tensors.

Every function takes an optional ``pad_mask_T`` (True at padding): padded positions are routed
like any token but never count in a loss or a statistic. Averages are over the real tokens; with
no real token at all a loss is 0 (still attached to the graph).

Shape legend: T tokens (flattened batch positions), E experts, K expert slots per token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _keep(pad_mask_T: Tensor | None, like_T: Tensor) -> Tensor:
    """Float weights (T,): 1 at real tokens, 0 at padding."""
    if pad_mask_T is None:
        return torch.ones(like_T.size(0), dtype=torch.float32, device=like_T.device)
    return (~pad_mask_T).to(torch.float32)


def _masked_mean(value_T: Tensor, pad_mask_T: Tensor | None) -> Tensor:
    keep_T = _keep(pad_mask_T, value_T)
    return (value_T.float() * keep_T).sum() / keep_T.sum().clamp_min(1.0)


def tokens_per_expert(expert_ids_TK: Tensor, num_experts: int,
                      pad_mask_T: Tensor | None = None) -> Tensor:
    """Assignments per expert (long, E): count_e = #{(t, k) : expert_ids[t, k] = e, t real}.

    Unused slots (id -1) and padding are not counted.
    """
    valid_TK = expert_ids_TK >= 0
    if pad_mask_T is not None:
        valid_TK = valid_TK & ~pad_mask_T[:, None]
    # Invalid slots go to an overflow bin E that is cut off (no boolean indexing, no sync).
    ids_N = torch.where(valid_TK, expert_ids_TK, num_experts).flatten()
    return torch.bincount(ids_N, minlength=num_experts + 1)[:num_experts]


def load_balance_loss(probs_TE: Tensor, expert_ids_TK: Tensor,
                      pad_mask_T: Tensor | None = None) -> Tensor:
    """Switch Transformer load-balancing loss: E * sum_e f_e * P_e.

    f_e = count_e / sum_e' count_e' is the fraction of (real-token) assignments that went to
    expert e (for k > 1 or top-p, every slot counts, so sum_e f_e = 1 for any k) and
    P_e = mean over real tokens of probs[t, e]. It equals 1 when the assignments are uniform
    (f_e = 1/E) whatever the probabilities, and grows up to E as routing collapses. Gradients
    flow through P only (f comes from an argmax).
    """
    E = probs_TE.size(1)
    counts_E = tokens_per_expert(expert_ids_TK, E, pad_mask_T).to(torch.float32)
    f_E = counts_E / counts_E.sum().clamp_min(1.0)
    keep_T = _keep(pad_mask_T, probs_TE)
    P_E = (probs_TE.float() * keep_T[:, None]).sum(0) / keep_T.sum().clamp_min(1.0)
    return E * (f_E * P_E).sum()


def z_loss(logits_TE: Tensor, pad_mask_T: Tensor | None = None) -> Tensor:
    """Router z-loss (ST-MoE): mean over real tokens of (log sum_e exp(logits[t, e]))^2.

    Keeps the router logits small, which keeps the softmax numerically stable in low precision.
    """
    lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return _masked_mean(lse_T.square(), pad_mask_T)


def entropy_loss(probs_TE: Tensor, pad_mask_T: Tensor | None = None) -> Tensor:
    """Dynamic-routing (top-p) loss, Eq. 13 of the THOR-MoE paper: -sum_i P_i log P_i.

    The entropy (nats) of each real token's router distribution, averaged over real tokens.
    Minimising it makes top-p routing pick few experts instead of spreading mass to activate
    many. P log P is taken as 0 at P = 0 (log is clamped, so gradients stay finite).
    """
    p32_TE = probs_TE.float()
    tiny = torch.finfo(torch.float32).tiny
    entropy_T = -(p32_TE * p32_TE.clamp_min(tiny).log()).sum(-1)
    return _masked_mean(entropy_T, pad_mask_T)


@torch.no_grad()
def routing_entropy(probs_TE: Tensor, pad_mask_T: Tensor | None = None) -> Tensor:
    """Mean per-token router entropy in nats (the quantity of `entropy_loss`), detached.

    0 for one-hot routing, log E for uniform routing: how decided the router is.
    """
    return entropy_loss(probs_TE.detach(), pad_mask_T)
