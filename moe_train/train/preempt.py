"""A graceful stop on SIGTERM or SIGUSR1: a scheduler's preemption or time limit.

SLURM sends SIGTERM (or, with `--signal=USR1@120`, SIGUSR1 ahead of the limit), the DeepSpeed
launcher passes SIGTERM on to each rank, torchrun to its workers. The handler only notes the
signal; the training loop checks it at the next step boundary, every rank agreeing (one rank
signalled is enough), saves a checkpoint there and ends with `Preempted`, which the CLI reports
in one line with exit status 128 + the signal's number. `train --resume` (a pipeline or the
demo: the same command) continues bitwise. A signal during a validation or a save takes effect
once that is done; one during the run's final validation, save or export once those are done,
so that a pipeline's next stage does not start. The DeepSpeed launcher and torchrun SIGKILL
their ranks 30 s after passing SIGTERM on: where a step and a save take longer, send SIGUSR1.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Training stopped by a signal after saving `checkpoint` at `step`."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}: saved {checkpoint}; "
                         "run the same command again to continue (train: with --resume)")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Notes SIGTERM / SIGUSR1 while active (a context manager) and restores the previous
    handlers after. Off the main thread (where Python cannot set handlers) it notes nothing."""

    def __init__(self) -> None:
        self.received = 0
        """The number of the first stop signal received, 0 for none."""
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
