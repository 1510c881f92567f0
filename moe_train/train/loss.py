"""Label-smoothed cross-entropy, summed over non-pad target tokens.

Legend: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits_BTV: torch.Tensor, target_BT: torch.Tensor, pad_id: int,
                       epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (smoothed loss sum, nll sum) over non-pad positions.

    loss = (1 - eps) * nll + eps * mean_v(-log p_v): the uniform-prior smoothing of
    Szegedy et al. as implemented in fairseq (eps spread over the whole vocabulary). Pad
    positions are zeroed, not selected: a selection's size depends on the values (a host sync
    on an accelerator).
    """
    lprobs_BTV = F.log_softmax(logits_BTV.float(), dim=-1)
    keep_BT = target_BT.ne(pad_id)
    nll_BT = -lprobs_BTV.gather(-1, target_BT.unsqueeze(-1)).squeeze(-1)
    smooth_BT = -lprobs_BTV.mean(dim=-1)
    nll = torch.where(keep_BT, nll_BT, 0.0).sum()
    smooth = torch.where(keep_BT, smooth_BT, 0.0).sum()
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss, nll


def per_token_bits(loss: float, nll: float, tokens: float, prefix: str) -> dict[str, float]:
    """``{prefix}loss`` and ``{prefix}nll`` in bits per target token (sums in nats) and
    ``{prefix}ppl`` = 2^nll: inf where that passes the float range (a diverging model's log line
    must not stop the run), as fairseq's `get_perplexity`."""
    tokens = max(tokens, 1.0)
    nll_bits = nll / tokens / math.log(2)
    try:
        ppl = 2.0 ** nll_bits
    except OverflowError:
        ppl = math.inf
    return {f"{prefix}loss": loss / tokens / math.log(2), f"{prefix}nll": nll_bits,
            f"{prefix}ppl": ppl}
