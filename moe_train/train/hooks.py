"""Trainer hooks: how a method adds model set-up, per-batch inputs, losses and metrics without
editing the training loop.

The `Trainer` calls, in order: `init_model(model)` once on the freshly built single-device model
(before expert parallelism and the engine: load earlier weights, freeze parameters);
`batch_extras(batch)` for every forward (train and dev), merged into `ForwardContext.extras`
(e.g. teacher probabilities looked up by `Batch.indices_B`); `extra_losses(out, batch)` after
every training forward, added to the loss as given (already weighted) and logged like aux
losses; `metrics(out, batch)` after every forward, summed as (numerator, denominator) pairs
over the log window (train) or the dev set (all ranks) and logged as their ratio.
`hooks_for(cfg)` composes the hooks the config's methods register with the caller's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from moe_train.data.batching import Batch
from moe_train.errors import DataError
from moe_train.models.transformer import ModelOutput
from moe_train.moe.gated_router import TEACHER_PROBS_KEY
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_PROBS_KEY
from moe_train.utils.safe_load import load_array

Ratio = tuple[float | Tensor, float | Tensor]
"""A metric as (numerator, denominator), e.g. (correct, total), so windows and ranks sum: Python
floats or 0-dim tensors left on the device (summed there, read once per log line)."""


def accumulate(total: float | Tensor, value: float | Tensor) -> float | Tensor:
    """total + value in float64 (a 0-dim device tensor once either is one): sums losses and
    metrics over a window without reading each from the device."""
    if isinstance(value, Tensor):
        value = value.detach().double()
    return total + value


def add_ratios(window: dict[str, list[float | Tensor]], ratios: dict[str, Ratio]) -> None:
    """Add a batch's (numerator, denominator) pairs to a window's sums, by name."""
    for name, (num, den) in ratios.items():
        acc = window.setdefault(name, [0.0, 0.0])
        acc[0] = accumulate(acc[0], num)
        acc[1] = accumulate(acc[1], den)


def window_ratios(names: list[str], sums: list[float], prefix: str) -> dict[str, float]:
    """``prefix + name`` -> numerator / denominator from the read sums (2 per name, in order);
    names without a denominator are left out."""
    return {prefix + n: sums[2 * i] / sums[2 * i + 1] for i, n in enumerate(names)
            if sums[2 * i + 1] > 0}


class TrainerHooks:
    """Base class: every hook does nothing."""

    metric_names: tuple[str, ...] = ()
    """The names `metrics` may return: every rank reduces them even when its window has none."""

    def init_model(self, model: nn.Module) -> None:
        """Runs once on the built model before the engine wraps it."""

    def batch_extras(self, batch: Batch) -> dict[str, Any]:
        """Entries for `ForwardContext.extras` of this batch (per-sentence keys end in ``_B*``)."""
        return {}

    def extra_losses(self, out: ModelOutput, batch: Batch) -> dict[str, Tensor]:
        """Weighted losses to add to this training micro-batch's loss."""
        return {}

    def metrics(self, out: ModelOutput, batch: Batch) -> dict[str, Ratio]:
        """(numerator, denominator) per metric name for this batch."""
        return {}


class HookList(TrainerHooks):
    """Several hooks as one: called in order; extras, losses and metrics merged (a name given
    twice is an error: two methods would silently share it)."""

    def __init__(self, hooks: Sequence[TrainerHooks]) -> None:
        self.hooks = list(hooks)
        self.metric_names = tuple(n for h in self.hooks for n in h.metric_names)

    def init_model(self, model: nn.Module) -> None:
        for hook in self.hooks:
            hook.init_model(model)

    def _merge(self, name: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in parts:
            twice = sorted(set(merged) & set(part))
            if twice:
                raise ValueError(f"trainer hooks: two hooks return {name} {twice[0]!r}")
            merged.update(part)
        return merged

    def batch_extras(self, batch: Batch) -> dict[str, Any]:
        return self._merge("extra", [h.batch_extras(batch) for h in self.hooks])

    def extra_losses(self, out: ModelOutput, batch: Batch) -> dict[str, Tensor]:
        return self._merge("loss", [h.extra_losses(out, batch) for h in self.hooks])

    def metrics(self, out: ModelOutput, batch: Batch) -> dict[str, Ratio]:
        return self._merge("metric", [h.metrics(out, batch) for h in self.hooks])


class InitModel(TrainerHooks):
    """A plain ``init_model(model)`` function as a hook (what stages pass)."""

    def __init__(self, fn: Callable[[nn.Module], None]) -> None:
        self.fn = fn

    def init_model(self, model: nn.Module) -> None:
        self.fn(model)


class TaskAccuracy(TrainerHooks):
    """Accuracy of a task predictor (argmax of ``task_probs_BK`` vs the gold task) over the
    real sentences of a batch, as ``task_accuracy``."""

    metric_names = ("task_accuracy",)

    def metrics(self, out: ModelOutput, batch: Batch) -> dict[str, Ratio]:
        probs_BK, gold_B = out.extras.get(TASK_PROBS_KEY), out.extras.get(GOLD_TASK_KEY)
        if probs_BK is None or gold_B is None or batch.is_padding:
            return {}
        with torch.no_grad():  # the count stays on the device (a Ratio may be a tensor)
            correct = (probs_BK.argmax(-1) == gold_B.to(probs_BK.device)).sum()
        return {"task_accuracy": (correct, float(gold_B.numel()))}


class TeacherProbs(TrainerHooks):
    """A teacher's per-sentence distribution over E domains for the training split (Gated
    Adapters' distillation target), handed to the gates as ``extras[TEACHER_PROBS_KEY]`` by
    `Batch.indices_B`; dev and test batches get none (their indices are another split's)."""

    def __init__(self, probs_NE: np.ndarray | Tensor) -> None:
        self.probs_NE = torch.as_tensor(np.asarray(probs_NE, dtype=np.float32))
        self._on_device: Tensor | None = None  # probs_NE where the batches are, copied once

    @classmethod
    def from_file(cls, path: str | Path, num_sentences: int, num_domains: int) -> TeacherProbs:
        """The teacher's (N, E) probabilities from a numpy file (`load_probability_rows`)."""
        return cls(load_probability_rows(
            path, num_sentences, num_domains, "teacher probabilities",
            "one row per training sentence, one column per domain adapter"))

    def batch_extras(self, batch: Batch) -> dict[str, Any]:
        if batch.split != "train" or batch.is_padding:
            return {}
        idx_B = batch.indices_B
        if self._on_device is None or self._on_device.device != idx_B.device:
            self._on_device = self.probs_NE.to(idx_B.device)  # rows looked up there: no sync
        return {TEACHER_PROBS_KEY: self._on_device.index_select(0, idx_B)}


def load_probability_rows(path: str | Path, rows: int, cols: int, what: str, layout: str
                          ) -> np.ndarray:
    """An (rows, cols) array of per-row probability distributions saved with numpy, never
    unpickled; a file that is unreadable, of another shape (`layout` says which is expected) or
    whose rows are not distributions is one DataError naming it."""
    probs = load_array(path, what, "f", 2, error=DataError)
    if probs.shape != (rows, cols):
        raise DataError(f"{path}: {what} of shape {probs.shape}, expected ({rows}, {cols}): "
                        f"{layout}")
    if not np.all(np.isfinite(probs)) or probs.min(initial=0) < 0 or \
            np.abs(probs.sum(1) - 1.0).max(initial=0) > 1e-3:
        raise DataError(f"{path}: {what} must be finite, non-negative and sum to 1 per row")
    return probs


def hooks_for(cfg: Any, extra: Sequence[TrainerHooks] = ()) -> HookList:
    """The hooks of the config's methods (THOR: task accuracy) followed by `extra`."""
    hooks: list[TrainerHooks] = []
    if getattr(cfg, "uses_thor", False):
        hooks.append(TaskAccuracy())
    return HookList([*hooks, *extra])
