"""The sums the next training log line averages, and their place in a checkpoint.

A log line every `train.log_every` steps averages what the steps since the last line summed on
this rank (loss, nll and target tokens, the aux losses per micro-batch, the hooks' metric
ratios) over all ranks, and divides the tokens by the training seconds. A checkpoint taken
between two lines (a preemption, `checkpoint.save_every` off the log cadence, a new best) keeps
this rank's sums in `log_window_rank{r}.pt`, so the resumed run's first line reports what an
uninterrupted run would, and TensorBoard's curve has no seam.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moe_train.errors import CheckpointError
from moe_train.train.hooks import accumulate
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import load_torch

STEP_SUMS = ("loss", "nll", "tokens")
"""What `Trainer.train_step` returns for each step and the window sums."""


def window_file(tag_dir: Path, rank: int) -> Path:
    return Path(tag_dir) / f"log_window_rank{rank}.pt"


@dataclass
class LogWindow:
    """This rank's sums since the last log line (floats, or float64 device tensors once a value
    from the device is added: nothing is read from the device until the line)."""

    sums: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(STEP_SUMS, 0.0))
    """loss, nll (summed over target tokens) and tokens of the window's steps."""
    aux: dict[str, Any] = field(default_factory=dict)
    """Aux losses summed over the window's training micro-batches."""
    aux_micro_batches: int = 0
    metrics: dict[str, list[Any]] = field(default_factory=dict)
    """Hook metrics: name -> [numerator sum, denominator sum]."""
    seconds: float = 0.0
    """Training seconds of the window before `started` (a resumed window's earlier part)."""
    started: float = field(default_factory=time.time)
    paused_at: float | None = None

    def add_step(self, step_sums: dict[str, Any]) -> None:
        for key in STEP_SUMS:
            self.sums[key] = accumulate(self.sums[key], step_sums[key])

    def mark(self) -> tuple[Any, ...]:
        """What `rollback` returns the window to: its aux losses, metrics and micro-batches now
        (the sums are new tensors at every addition, so references are a copy)."""
        return (dict(self.aux), {k: list(v) for k, v in self.metrics.items()},
                self.aux_micro_batches)

    def rollback(self, mark: tuple[Any, ...]) -> None:
        """Forget what was added since `mark` (a skipped step's aux losses and metrics, as its
        loss, nll and tokens are never added)."""
        aux, metrics, micro = mark
        self.aux, self.metrics, self.aux_micro_batches = dict(aux), metrics, micro

    def begin_pause(self) -> None:
        """Validation or checkpointing from now until `end_pause`: not training time."""
        self.paused_at = time.time()

    def end_pause(self) -> None:
        if self.paused_at is not None:
            self.started += time.time() - self.paused_at
            self.paused_at = None

    def elapsed(self) -> float:
        """Training seconds of the window so far."""
        now = time.time() if self.paused_at is None else self.paused_at
        return self.seconds + now - self.started

    def save(self, tag_dir: Path, rank: int) -> None:
        """This rank's window into `tag_dir` (tensors on the CPU, float64)."""
        def tensor(value: Any) -> Tensor:
            return torch.as_tensor(value, dtype=torch.float64).detach().cpu()

        state = {"sums": {k: tensor(v) for k, v in self.sums.items()},
                 "aux": {k: tensor(v) for k, v in self.aux.items()},
                 "aux_micro_batches": self.aux_micro_batches,
                 "metrics": {k: [tensor(n), tensor(d)] for k, (n, d) in self.metrics.items()},
                 "seconds": self.elapsed()}
        with atomic_path(window_file(tag_dir, rank)) as tmp:
            torch.save(state, tmp)

    @classmethod
    def load(cls, tag_dir: Path, rank: int, device: torch.device) -> LogWindow | None:
        """The window `save` left for this rank, on `device`; None when the checkpoint holds
        none (written before windows were kept)."""
        path = window_file(tag_dir, rank)
        if not path.is_file():
            return None
        state = load_torch(path, "log window")
        try:
            def value(t: Any) -> Tensor:
                if not isinstance(t, Tensor) or t.dim() != 0:
                    raise TypeError(f"{type(t).__name__}, not a 0-dim tensor")
                return t.to(device)

            sums = {k: value(state["sums"][k]) for k in STEP_SUMS}
            aux = {str(k): value(v) for k, v in state["aux"].items()}
            metrics = {str(k): [value(n), value(d)] for k, (n, d) in state["metrics"].items()}
            micro, seconds = state["aux_micro_batches"], state["seconds"]
            if not isinstance(micro, int) or not isinstance(seconds, float):
                raise TypeError("aux_micro_batches / seconds")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path}: not the log window a checkpoint holds ({exc}); "
                                  "expected its sums as 0-dim tensors") from None
        return cls(sums=sums, aux=aux, aux_micro_batches=micro, metrics=metrics,
                   seconds=seconds)


def moe_layer_stats(moe_layers: list[tuple[str, Any]]
                    ) -> list[tuple[str, Tensor, dict[str, Tensor]]]:
    """Per MoE layer of `moe_layers` ((name, layer); its last forward on this rank): (tag,
    tokens per expert, its scalars: drops, load CV, the router's stats such as entropy), all
    still on the device."""
    out = []
    for name, layer in moe_layers:
        counts = layer.tokens_per_expert_E.float()
        tag = name.replace(".ffn", "").replace("_layers.", "")
        cv = counts.std(unbiased=False) / counts.mean().clamp_min(1e-9)
        stats = {f"moe_dropped/{tag}": layer.dropped_slots, f"moe_load_cv/{tag}": cv}
        for key, value in layer.scalar_stats.items():  # entropy: routers with probabilities
            stats[f"moe_{'entropy' if key == 'routing_entropy' else key}/{tag}"] = value
        out.append((tag, counts, stats))
    return out
