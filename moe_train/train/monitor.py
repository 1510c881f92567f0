"""Rank-0 monitoring: console lines, an optional progress bar, TensorBoard scalars."""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
import time
from typing import Any, Callable

import torch

from moe_train.parallel.runtime import ParallelRuntime


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory (GPU) or peak resident set size (CPU) of this process, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _quiet_tensorboard_thread(args: Any, previous: Any = threading.excepthook) -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk) as a traceback;
    the Monitor reports it in one line instead."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and \
            issubclass(args.exc_type, OSError):
        return
    previous(args)


class Monitor:
    """Writes scalars to TensorBoard and progress to the console, on rank 0 only. A failed
    TensorBoard write (a full disk) is one warning line and ends TensorBoard logging, not the
    run: its checkpoints matter more."""

    def __init__(self, rt: ParallelRuntime, tensorboard_dir: str, total_steps: int,
                 initial_step: int, progress_bar: bool) -> None:
        self.enabled = rt.is_main
        self.writer = None
        self.bar = None
        self.start = time.time()
        if not self.enabled:
            return
        self.tensorboard_dir = tensorboard_dir
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            threading.excepthook = _quiet_tensorboard_thread
            # A resumed run drops what an interrupted one logged after its checkpoint; one
            # starting at step 0 (an attempt that died before its first save, run again)
            # drops all of it.
            self._tensorboard(lambda _: setattr(self, "writer", SummaryWriter(
                log_dir=tensorboard_dir, purge_step=initial_step + 1)), always=True)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, dynamic_ncols=True,
                            desc="train")

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def _tensorboard(self, write: Callable[[Any], None], always: bool = False) -> None:
        """Run `write(writer)`; on an OSError warn once and stop TensorBoard logging."""
        if self.writer is None and not always:
            return
        try:
            write(self.writer)
        except OSError as exc:
            writer, self.writer = self.writer, None
            if writer is not None:
                with contextlib.suppress(OSError):
                    writer.close()
            print(f"warning: logging.tensorboard_dir {self.tensorboard_dir}: "
                  f"{exc.strerror or exc}; TensorBoard logging stopped, training goes on",
                  file=sys.stderr, flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        def write(writer: Any) -> None:
            for key, value in values.items():
                writer.add_scalar(key, value, step)

        self._tensorboard(write)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        self._tensorboard(lambda w: w.add_histogram(tag, values.detach().float().cpu(), step))

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._tensorboard(lambda w: (w.flush(), w.close()))
