"""A small classifier trained data-parallel on stored features (MoA's distilled gate, Gated
Adapters' encoder domain classifier).

Each step draws one global batch of `batch` rows (fixed by the seed and the step, not by the
number of ranks); rank r takes rows r, r+P, ... and sums its rows' losses over `batch` / P, so
that the DeepSpeed engine's average of the gradients is the gradient of the global batch's mean
loss even when P does not divide `batch`: P ranks train the model one rank would.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moe_train.errors import ConfigError
from moe_train.parallel.collectives import all_reduce_sum
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train.engine import data_parallel_engine


def fit_probe(module: nn.Module, features_ND: np.ndarray, labels_N: np.ndarray, steps: int,
              lr: float, batch: int, seed: int, rt: ParallelRuntime) -> tuple[nn.Module, float]:
    """Train `module` (features -> logits) with cross-entropy and Adam; returns the trained
    module and the mean loss of the last tenth of the steps (over the whole batches, the same
    on every rank). Call it with the same initial `module` on every rank (seed the
    constructor)."""
    n = len(labels_N)
    batch = min(batch, n)
    if batch < rt.dp_world:  # a rank without rows would average a NaN loss into every rank
        raise ConfigError(f"batch sentences: {batch} rows per step cannot be shared by "
                          f"{rt.dp_world} ranks (raise the batch or use fewer ranks)")
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    engine = data_parallel_engine(module, optimizer, rt)
    x_ND = torch.from_numpy(np.ascontiguousarray(features_ND, dtype=np.float32))
    y_N = torch.from_numpy(np.asarray(labels_N, dtype=np.int64))
    rng = np.random.default_rng(seed)
    engine.train()
    sums = []  # this rank's summed loss per step
    for _ in range(steps):
        rows = torch.from_numpy(rng.choice(n, size=batch, replace=False)[rt.dp_rank::rt.dp_world])
        loss_sum = F.cross_entropy(engine(x_ND[rows].to(rt.device)), y_N[rows].to(rt.device),
                                   reduction="sum")
        engine.backward(loss_sum * (rt.dp_world / batch))
        engine.step()
        sums.append(loss_sum.item())
    if not sums:
        return engine.module.eval(), float("nan")
    tail = torch.tensor(sums[-max(1, len(sums) // 10):], dtype=torch.float64, device=rt.device)
    tail_mean = all_reduce_sum(rt, tail).mean().item() / batch  # over the global batches
    return engine.module.eval(), tail_mean


@torch.no_grad()
def predict_probs(module: nn.Module, features_ND: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """softmax(module(features)) row by row, (N, C) float32."""
    module.eval()
    device = next(module.parameters()).device
    out = [module(torch.from_numpy(features_ND[i:i + chunk]).to(device)).float().softmax(-1).cpu()
           for i in range(0, len(features_ND), chunk)]
    return torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)
