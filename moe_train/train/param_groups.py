"""The optimizer's parameter groups: what weight decay applies to."""

from __future__ import annotations

from typing import Any

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases, norms and embeddings; stacked expert parameters say which of
    theirs are biases or norms (`no_weight_decay`: 2-D, they look like weights). Without weight
    decay the groups keep the layout they had before experts declared theirs, so optimizer
    states saved then still load."""
    declared = {id(getattr(m, name)) for m in model.modules()
                for name in getattr(m, "no_weight_decay", ())} if weight_decay > 0 else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name or id(p) in declared else decay).append(p)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"name": "no_decay", "params": no_decay, "weight_decay": 0.0})
    return groups
