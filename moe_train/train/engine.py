"""DeepSpeed engines for the stages' small auxiliary models (the trainer builds its own)."""

from __future__ import annotations

import logging
from typing import Any

import deepspeed
import torch

from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train.ds_config import plain_deepspeed_config


def data_parallel_engine(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         rt: ParallelRuntime) -> Any:
    """`module` on a data-parallel DeepSpeed engine (fp32, ZeRO 0): `engine(x)`,
    `engine.backward(loss)` averages gradients over the ranks, `engine.step()` updates."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    engine, _, _, _ = deepspeed.initialize(model=module.to(rt.device), optimizer=optimizer,
                                           config=plain_deepspeed_config(rt.world_size),
                                           dist_init_required=False)
    return engine
