"""DeepSpeed's checkpoint reads, weights-only.

DeepSpeed's own checkpoint engine unpickles its files (model states, ZeRO optimizer
partitions) in full: a crafted `mp_rank_00_model_states.pt` would run code on `train
--resume`. While moe_train loads a checkpoint, the engine's `load` goes through
`utils.safe_load.load_torch` instead, which allows only the few DeepSpeed classes its files hold
(`DEEPSPEED_GLOBALS`); anything else, or a damaged file, is a one-line CheckpointError.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from moe_train.utils.safe_load import load_torch

DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # the ZeRO stage, an int enum
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # the loss scaler's plain fields
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # a namedtuple (numel, start)
)
"""(module, name) of the classes DeepSpeed pickles into its checkpoint files: plain values whose
reconstruction runs none of their code beyond setting fields."""


def deepspeed_globals() -> list[Any]:
    """The classes of `DEEPSPEED_GLOBALS` this DeepSpeed has."""
    found = []
    for module, name in DEEPSPEED_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: not in its files
            pass
    return found


@contextlib.contextmanager
def weights_only_loads(engine: Any) -> Iterator[None]:
    """Inside the block, `engine.checkpoint_engine.load(path, map_location)` reads with
    weights_only (the engine's other methods are untouched)."""
    loader = getattr(engine, "checkpoint_engine", None)
    if loader is None:
        yield
        return
    allowed = deepspeed_globals()

    def load(path: str, map_location: Any = None) -> Any:
        return load_torch(path, "DeepSpeed checkpoint file", safe_globals=allowed,
                          map_location="cpu" if map_location is None else map_location)

    own = vars(loader).get("load")
    loader.load = load
    try:
        yield
    finally:
        if own is not None:
            loader.load = own
        else:
            del loader.load
