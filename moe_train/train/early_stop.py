"""Early stopping on a dev metric: stop once `patience` validations in a row did not improve
the best value by more than `min_delta` (dev loss: lower is better; dev BLEU: higher). The
state travels in checkpoints, so a resumed run keeps its best value, its count and its best
checkpoint (``train.export_best``)."""

from __future__ import annotations

import math
from typing import Any

METRICS = {"loss": ("dev/loss", -1.0), "bleu": ("dev/bleu", 1.0)}
"""train.early_stop_metric -> (validation key, sign: +1 when higher is better)."""


class EarlyStop:
    """Tracks the best dev value; `update` says when the run has plateaued and `improved`
    whether the last validation set a new best."""

    def __init__(self, metric: str, patience: int, min_delta: float = 0.0) -> None:
        self.key, self.sign = METRICS[metric]
        self.patience, self.min_delta = patience, min_delta
        self.bar = -math.inf
        """The best scheduled validation (sign-adjusted): what patience measures against."""
        self.bad = 0
        self.best = -math.inf
        """The best of every validation (sign-adjusted), off-schedule ones included: the
        checkpoint `train.export_best` exports. As in Keras' EarlyStopping, a value is a new
        best only when it beats this one by more than `min_delta`: a later validation that
        is better by less keeps the earlier best."""
        self.best_step = 0
        self.best_values: dict[str, float] = {}
        """The validation values (numbers only) of the best step."""
        self.improved = False

    def update(self, step: int, values: dict[str, Any], scheduled: bool = True) -> bool:
        """Record one validation; True when the last `patience` brought no improvement.
        Validations without the metric (e.g. no BLEU that time) are ignored. One off the
        train.validate_every schedule (a run's end at max_steps or its time limit) may become
        the best checkpoint to export but neither counts towards patience nor raises the bar
        later validations are measured against: an interrupted, resumed run then stops where
        an uninterrupted one does."""
        self.improved = False
        if self.patience <= 0 or self.key not in values:
            return False
        value = self.sign * float(values[self.key])
        if value > self.best + self.min_delta:
            self.best, self.best_step = value, step
            self.best_values = {k: float(v) for k, v in values.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.improved = True
        if scheduled:
            if value > self.bar + self.min_delta:
                self.bar, self.bad = value, 0
            else:
                self.bad += 1
        return self.bad >= self.patience

    @property
    def plateaued(self) -> bool:
        """Whether the last `patience` validations brought no improvement: a checkpoint with
        this state is where its run stopped early."""
        return self.patience > 0 and self.bad >= self.patience

    def state(self) -> dict[str, Any]:
        """What the summary reports: the best value and its step."""
        return {"metric": self.key, "best": self.sign * self.best, "best_step": self.best_step}

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state for checkpoints (no best yet: ``best`` is None)."""
        return {"metric": self.key, "best": None if math.isinf(self.best) else self.best,
                "bar": None if math.isinf(self.bar) else self.bar,
                "best_step": self.best_step, "bad": self.bad, "best_values": self.best_values}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s state; a different metric starts over (nothing kept)."""
        if state.get("metric") != self.key:
            return
        self.best = -math.inf if state.get("best") is None else float(state["best"])
        bar = state.get("bar", state.get("best"))  # older checkpoints: one value for both
        self.bar = -math.inf if bar is None else float(bar)
        self.best_step = int(state.get("best_step", 0))
        self.bad = int(state.get("bad", 0))
        self.best_values = dict(state.get("best_values") or {})
