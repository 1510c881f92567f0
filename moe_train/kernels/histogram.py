"""Tokens per expert: the histogram of routed expert ids (dropped slots, id -1, are ignored).

Shape legend: T tokens, K expert slots per token, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_train.kernels.backend import use_triton


def check_expert_ids(expert_ids_TK: Tensor) -> None:
    """Fail early on ids that are not a 2-D signed integer tensor (-1 marks a dropped slot;
    a router bug, not user input)."""
    if expert_ids_TK.dim() != 2 or expert_ids_TK.dtype.is_floating_point \
            or not expert_ids_TK.dtype.is_signed:
        raise ValueError(f"expert_ids_TK: expected a 2-D signed integer tensor, got "
                         f"{tuple(expert_ids_TK.shape)} {expert_ids_TK.dtype}")


def expert_histogram_torch(expert_ids_TK: Tensor, num_experts: int) -> Tensor:
    """Reference: int64 counts_E. A scatter-add into E+1 bins (bin E takes the dropped slots)
    keeps it free of host syncs, unlike boolean masking or `bincount` on CUDA."""
    ids = expert_ids_TK.reshape(-1).long()
    bins = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    return counts[:num_experts]


def expert_histogram(expert_ids_TK: Tensor, num_experts: int, *, backend: str = "auto") -> Tensor:
    """Number of slots routed to each expert, as int64 counts_E; ids of -1 are not counted.

    Ids must lie in [-1, num_experts); no gradient flows (the result is an integer tensor).
    """
    check_expert_ids(expert_ids_TK)
    if use_triton(expert_ids_TK, backend):
        from moe_train.kernels.triton_ops import expert_histogram_triton
        return expert_histogram_triton(expert_ids_TK, num_experts)
    return expert_histogram_torch(expert_ids_TK, num_experts)
