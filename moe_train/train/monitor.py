"""Rank-0 monitoring: console lines, an optional progress bar, TensorBoard scalars."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch

from moe_train.parallel.runtime import ParallelRuntime


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory (GPU) or peak resident set size (CPU) of this process, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Monitor:
    """Writes scalars to TensorBoard and progress to the console, on rank 0 only."""

    def __init__(self, rt: ParallelRuntime, tensorboard_dir: str, total_steps: int,
                 initial_step: int, progress_bar: bool) -> None:
        self.enabled = rt.is_main
        self.writer = None
        self.bar = None
        self.start = time.time()
        if not self.enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run drops what an interrupted one logged after its checkpoint.
            self.writer = SummaryWriter(log_dir=tensorboard_dir,
                                        purge_step=initial_step + 1 if initial_step else None)
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

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        if self.writer is not None:
            self.writer.add_histogram(tag, values.detach().float().cpu(), step)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
