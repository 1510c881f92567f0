"""Label-smoothed cross-entropy, summed over non-pad target tokens.

Legend: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits_BTV: torch.Tensor, target_BT: torch.Tensor, pad_id: int,
                       epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (smoothed loss sum, nll sum) over non-pad positions.

    loss = (1 - eps) * nll + eps * mean_v(-log p_v): the uniform-prior smoothing of
    Szegedy et al. as implemented in fairseq (eps spread over the whole vocabulary).
    """
    lprobs_BTV = F.log_softmax(logits_BTV.float(), dim=-1)
    keep_BT = target_BT.ne(pad_id)
    nll_BT = -lprobs_BTV.gather(-1, target_BT.unsqueeze(-1)).squeeze(-1)
    smooth_BT = -lprobs_BTV.mean(dim=-1)
    nll = nll_BT.masked_select(keep_BT).sum()
    smooth = smooth_BT.masked_select(keep_BT).sum()
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss, nll
