"""Router auxiliary losses and statistics, as pure functions of the routing tensors.

Every function takes an optional ``pad_mask_T`` (True at padding): padded positions are routed
like any token but never count in a loss or a statistic. Averages are over the real tokens; with
no real token at all a loss is 0 (still attached to the graph).

Shape legend: T tokens (flattened batch positions), E experts, K expert slots per token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _keep(pad_mask_T: Tensor | None, like_T: Tensor) -> Tensor:
    """Float weights (T,): 1 at real tokens, 0 at padding."""
    if pad_mask_T is None:
        return torch.ones(like_T.size(0), dtype=torch.float32, device=like_T.device)
    return (~pad_mask_T).to(torch.float32)


def masked_mean(value_T: Tensor, pad_mask_T: Tensor | None) -> Tensor:
    """Mean of a per-token value over the real tokens, in float32 (0 without any)."""
    if pad_mask_T is None:
        return value_T.float().sum() / max(value_T.size(0), 1)
    keep_T = (~pad_mask_T).to(torch.float32)
    return (value_T.float() * keep_T).sum() / keep_T.sum().clamp_min(1.0)


def mean_probs(probs_TE: Tensor, pad_mask_T: Tensor | None) -> Tensor:
    """P_E: the mean of probs_TE over the real tokens, in one pass (no T x E temporary)."""
    p32_TE = probs_TE.float()
    if pad_mask_T is None:
        return p32_TE.sum(0) / max(p32_TE.size(0), 1)
    keep_T = (~pad_mask_T).to(torch.float32)
    return (keep_T @ p32_TE) / keep_T.sum().clamp_min(1.0)


def tokens_per_expert(expert_ids_TK: Tensor, num_experts: int,
                      pad_mask_T: Tensor | None = None) -> Tensor:
    """Assignments per expert (long, E): count_e = #{(t, k) : expert_ids[t, k] = e, t real}.

    Unused slots (id -1) and padding are not counted. A scatter-add into E + 1 bins (bin E takes
    the uncounted slots): no boolean indexing and no host sync (`bincount` on a GPU reads its
    maximum first).
    """
    valid_TK = expert_ids_TK >= 0
    if pad_mask_T is not None:
        valid_TK = valid_TK & ~pad_mask_T[:, None]
    bins_S = torch.where(valid_TK, expert_ids_TK, num_experts).reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=bins_S.device)
    return counts.scatter_add_(0, bins_S, torch.ones_like(bins_S))[:num_experts]


def assignment_fractions(counts_E: Tensor) -> Tensor:
    """f_E = count_e / sum_e' count_e' (float32; zeros when nothing was routed)."""
    counts32_E = counts_E.to(torch.float32)
    return counts32_E / counts32_E.sum().clamp_min(1.0)


def load_balance_loss(probs_TE: Tensor, expert_ids_TK: Tensor,
                      pad_mask_T: Tensor | None = None, counts_E: Tensor | None = None
                      ) -> Tensor:
    """Switch Transformer load-balancing loss: E * sum_e f_e * P_e.

    f_e = count_e / sum_e' count_e' is the fraction of (real-token) assignments that went to
    expert e (for k > 1 or top-p, every slot counts, so sum_e f_e = 1 for any k) and
    P_e = mean over real tokens of probs[t, e]. It equals 1 when the assignments are uniform
    (f_e = 1/E) whatever the probabilities, and grows up to E as routing collapses. Gradients
    flow through P only (f comes from an argmax). `counts_E` (`tokens_per_expert` of the ids)
    is reused when the caller already has it.
    """
    E = probs_TE.size(1)
    if counts_E is None:
        counts_E = tokens_per_expert(expert_ids_TK, E, pad_mask_T)
    return E * (assignment_fractions(counts_E) * mean_probs(probs_TE, pad_mask_T)).sum()


def cv_squared(values_E: Tensor) -> Tensor:
    """Squared coefficient of variation, var / mean^2, with the population variance (as in
    Shazeer et al.'s own code); 0 for fewer than two values."""
    v_E = values_E.float()
    if v_E.numel() < 2:
        return v_E.sum() * 0.0
    return v_E.var(unbiased=False) / (v_E.mean().square() + 1e-10)


def prob_in_top_k(clean_NE: Tensor, noisy_NE: Tensor, std_NE: Tensor, k: int) -> Tensor:
    """P(x, i) of Shazeer et al. (2017), Appendix A: the probability that expert i is among the
    k largest noisy logits when only its own noise is drawn again,
    Phi((clean_i - kth_excluding(noisy, k, i)) / std_i). The threshold is the k-th largest
    noisy logit for an expert outside the top k and the (k+1)-th for one inside. All ones when
    k >= E (no expert can leave)."""
    N, E = noisy_NE.shape
    if k >= E:
        return torch.ones_like(clean_NE, dtype=torch.float32)
    top_NK = noisy_NE.float().topk(k + 1, dim=-1).values
    inside_N1, outside_N1 = top_NK[:, k:k + 1], top_NK[:, k - 1:k]
    is_in_NE = noisy_NE.float() > inside_N1
    threshold_NE = torch.where(is_in_NE, inside_N1, outside_N1)
    z_NE = (clean_NE.float() - threshold_NE) / std_NE.float()
    return 0.5 * (1.0 + torch.erf(z_NE / math.sqrt(2.0)))


def importance_load_losses(gates_NE: Tensor, clean_NE: Tensor, noisy_NE: Tensor,
                           std_NE: Tensor, k: int, pad_mask_N: Tensor | None = None
                           ) -> tuple[Tensor, Tensor]:
    """SGMoE's auxiliary losses (Shazeer et al. 2017, Appendix A) over the real rows:
    (CV(Importance)^2, CV(Load)^2), Importance_e the sum of the rows' gate values G(x)_e (zero
    outside the top k), Load_e the sum of `prob_in_top_k` (differentiable through the clean
    logits and the noise's scale)."""
    keep_N = _keep(pad_mask_N, gates_NE)
    importance_E = keep_N @ gates_NE.float()
    load_E = keep_N @ prob_in_top_k(clean_NE, noisy_NE, std_NE, k)
    return cv_squared(importance_E), cv_squared(load_E)


def z_loss(logits_TE: Tensor, pad_mask_T: Tensor | None = None, lse_T: Tensor | None = None
           ) -> Tensor:
    """Router z-loss (ST-MoE): mean over real tokens of (log sum_e exp(logits[t, e]))^2.

    Keeps the router logits small, which keeps the softmax numerically stable in low precision.
    `lse_T` (the logsumexp of the logits) is reused when the caller already has it.
    """
    if lse_T is None:
        lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return masked_mean(lse_T.square(), pad_mask_T)


def entropy_loss(probs_TE: Tensor, pad_mask_T: Tensor | None = None) -> Tensor:
    """Dynamic-routing (top-p) loss, Eq. 13 of the THOR-MoE paper: -sum_i P_i log P_i.

    The entropy (nats) of each real token's router distribution, averaged over real tokens.
    Minimising it makes top-p routing pick few experts instead of spreading mass to activate
    many. P log P is taken as 0 at P = 0 (log is clamped, so gradients stay finite).
    """
    p32_TE = probs_TE.float()
    tiny = torch.finfo(torch.float32).tiny
    entropy_T = -(p32_TE * p32_TE.clamp_min(tiny).log()).sum(-1)
    return masked_mean(entropy_T, pad_mask_T)


@torch.no_grad()
def routing_entropy(probs_TE: Tensor, pad_mask_T: Tensor | None = None) -> Tensor:
    """Mean per-token router entropy in nats (the quantity of `entropy_loss`), detached.

    0 for one-hot routing, log E for uniform routing: how decided the router is.
    """
    return entropy_loss(probs_TE.detach(), pad_mask_T)


def token_balance_loss(probs_TE: Tensor, counts_E: Tensor, pad_mask_T: Tensor | None,
                       set_size: float) -> Tensor:
    """THOR-MoE Eq. 12 (L_bt): |S^t| * sum_e F_e Q_e with F_e the fraction of real tokens that
    use expert e and Q_e its mean (candidate-restricted) probability; `set_size` is |S^t|."""
    n_real = _keep(pad_mask_T, probs_TE).sum().clamp_min(1.0)
    return set_size * ((counts_E.float() / n_real) * mean_probs(probs_TE, pad_mask_T)).sum()


def task_balance_loss(task_probs_KE: Tensor, candidates_KC: Tensor) -> Tensor:
    """THOR-MoE Eq. 11 (L_bd) over the K task embeddings: N * sum_e F_e Q_e, F_e the fraction
    of tasks whose candidate set holds e, Q_e the mean task-router probability of e."""
    K, E = task_probs_KE.shape
    in_set_KE = torch.zeros_like(task_probs_KE).scatter_(1, candidates_KC, 1.0)
    return E * ((in_set_KE.mean(0)) * task_probs_KE.float().mean(0)).sum()


def distillation_kl(logits_NE: Tensor, teacher_NE: Tensor, tau: float,
                    teacher_as_logits: bool = False) -> Tensor:
    """Per-row KL(P_t,tau || P_s,tau) (Gated Adapters Eq. 4, without the tau^2): the student
    P_s,tau = softmax(logits / tau); the teacher's probabilities softened as softmax(log p / tau)
    or, `teacher_as_logits` (the reference code), softmax(p / tau). float32, (N,)."""
    t32_NE = teacher_NE.float()
    t_logits_NE = t32_NE if teacher_as_logits else t32_NE.clamp_min(1e-12).log()
    log_t_NE = torch.log_softmax(t_logits_NE / tau, -1)
    log_s_NE = torch.log_softmax(logits_NE.float() / tau, -1)
    return (log_t_NE.exp() * (log_t_NE - log_s_NE)).sum(-1)
