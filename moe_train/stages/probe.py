"""A small classifier trained data-parallel on stored features (MoA's distilled gate, Gated
Adapters' encoder domain classifier).

Each step draws one global batch of `batch` rows (fixed by the seed and the step, not by the
number of ranks); rank r takes rows r, r+P, ... and the DeepSpeed engine averages the gradients,
so P ranks train the model one rank would.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moe_train.errors import ConfigError
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train.engine import data_parallel_engine


def fit_probe(module: nn.Module, features_ND: np.ndarray, labels_N: np.ndarray, steps: int,
              lr: float, batch: int, seed: int, rt: ParallelRuntime) -> tuple[nn.Module, float]:
    """Train `module` (features -> logits) with cross-entropy and Adam; returns the trained
    module and the mean loss of the last tenth of the steps. Call it with the same initial
    `module` on every rank (seed the constructor)."""
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
    losses = []
    for _ in range(steps):
        rows = torch.from_numpy(rng.choice(n, size=batch, replace=False)[rt.dp_rank::rt.dp_world])
        loss = F.cross_entropy(engine(x_ND[rows].to(rt.device)), y_N[rows].to(rt.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    tail = losses[-max(1, len(losses) // 10):]
    return engine.module.eval(), float(np.mean(tail)) if tail else float("nan")


@torch.no_grad()
def predict_probs(module: nn.Module, features_ND: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """softmax(module(features)) row by row, (N, C) float32."""
    module.eval()
    device = next(module.parameters()).device
    out = [module(torch.from_numpy(features_ND[i:i + chunk]).to(device)).float().softmax(-1).cpu()
           for i in range(0, len(features_ND), chunk)]
    return torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)
