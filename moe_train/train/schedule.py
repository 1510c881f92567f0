"""Inverse-square-root (Noam) learning-rate schedule with linear warm-up."""

from __future__ import annotations

import math

import torch


def inverse_sqrt_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (1-based).

    Linear warm-up to 1 at `warmup_steps`, then sqrt(warmup_steps / step): the Noam schedule
    d^-0.5 * min(step^-0.5, step * warmup^-1.5) normalised so that its peak equals the peak lr.
    """
    step = max(step, 1)
    if warmup_steps <= 0:
        return 1.0
    if step < warmup_steps:
        return step / warmup_steps
    return math.sqrt(warmup_steps / step)


def inverse_sqrt_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int
                           ) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose k-th `step()` call sets lr for optimizer step k+1."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: inverse_sqrt_factor(i + 1, warmup_steps))
