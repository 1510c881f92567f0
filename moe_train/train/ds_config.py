"""Our typed config -> the DeepSpeed config dict.

Batches are token-budget batches built by our iterator, so DeepSpeed's own batch size is nominal
(1 sequence-batch per micro step); gradient accumulation, clipping, ZeRO and precision are real.
`cfg.deepspeed` entries are merged last, so any DeepSpeed option can be passed through.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from moe_train.config.loader import merge
from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> fp32 on CPU, bf16 on GPUs that support it, fp16 otherwise."""
    if precision != "auto":
        if device.type == "cpu" and precision == "fp16":
            raise ConfigError("optim.precision: fp16 needs a GPU; use fp32 or bf16 on CPU")
        return precision
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def check_layout(precision: str, zero_stage: int, ep_size: int) -> None:
    """Refuse 16-bit at ZeRO 0 with expert parallelism: DeepSpeed's 16-bit optimizer wrapper
    keeps the fp32 master weights in rank 0's model file, which every rank loads, so on resume
    each rank would take rank 0's experts."""
    if precision != "fp32" and zero_stage == 0 and ep_size > 1:
        raise ConfigError(f"optim.zero_stage: 0 with {precision} and moe.ep_size {ep_size} "
                          "cannot checkpoint the experts' master weights; expected 1 or 2 (or "
                          "optim.precision fp32)")


_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
           "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "fp16": "fp16",
           "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
"""The names of a floating-point type that DeepSpeed's training config reads
(deepspeed.runtime.config.DtypeEnum; its inference config also takes "bfloat", this one does
not) -> ours."""


def check_grad_accum_dtype(precision: str, zero_stage: int, ds: dict[str, Any]) -> None:
    """`data_types.grad_accum_dtype` (a raw DeepSpeed entry) where DeepSpeed and moe_train can
    run it: fp32 sums of 16-bit micro-batch gradients need ZeRO 2 or 3 (DeepSpeed refuses them
    at ZeRO 0, with a traceback, and at ZeRO 1 swaps in its BF16_Optimizer, whose state our
    checkpoints and non-finite step guard do not read); never below the model's precision.
    Every `data_types` dtype (param_dtype, buffer_dtype too) must be a name DeepSpeed reads."""
    node = ds.get("data_types")
    if node is not None and not isinstance(node, dict):
        raise ConfigError(f"deepspeed.data_types: expected a mapping (grad_accum_dtype: ...), "
                          f"got {node!r}")
    for key, value in (node or {}).items():  # DeepSpeed reads them with a traceback
        if key in ("param_dtype", "buffer_dtype", "grad_accum_dtype") and value is not None \
                and _DTYPES.get(value if isinstance(value, str) else "") is None:
            raise ConfigError(f"deepspeed.data_types.{key}: expected one of "
                              f"{', '.join(_DTYPES)}, got {value!r}")
    value = node.get("grad_accum_dtype") if node else None
    if value is None:
        return
    field_ = "deepspeed.data_types.grad_accum_dtype"
    dtype = _DTYPES[value]
    if dtype == precision:
        return
    if dtype != "fp32":
        allowed = "fp32" if precision == "fp32" else f"fp32 or {precision}"
        raise ConfigError(f"{field_}: {value} below the model's {precision} (optim.precision); "
                          f"expected {allowed}")
    if zero_stage < 2:
        raise ConfigError(f"{field_}: fp32 sums of {precision} gradients need optim.zero_stage "
                          f"2 or 3 (DeepSpeed refuses them at ZeRO 0 and swaps in an "
                          f"optimizer moe_train does not support at ZeRO 1); got "
                          f"optim.zero_stage {zero_stage}")


def build_deepspeed_config(cfg: ExperimentConfig, world_size: int, device: torch.device
                           ) -> dict[str, Any]:
    """The DeepSpeed JSON config for this run."""
    precision = resolve_precision(cfg.optim.precision, device)
    check_layout(precision, cfg.optim.zero_stage, cfg.moe.ep_size)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.optim.grad_accum,
        "train_batch_size": cfg.optim.grad_accum * world_size,
        # ZeRO 0: the trainer clips itself (a global norm that counts each expert once)
        "gradient_clipping": cfg.optim.clip_norm if cfg.optim.zero_stage > 0 else 0.0,
        "zero_optimization": {"stage": cfg.optim.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "dump_state": False,
    }
    ds = merge(ds, cfg.deepspeed)
    check_grad_accum_dtype(precision, cfg.optim.zero_stage, ds)
    return ds


def plain_deepspeed_config(world_size: int) -> dict[str, Any]:
    """A minimal fp32, ZeRO-0 config for small auxiliary models (e.g. a distilled gate):
    data-parallel gradient averaging and nothing else."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": world_size, "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "wall_clock_breakdown": False}


@contextlib.contextmanager
def deepspeed_config_errors(raw: dict[str, Any] | None = None) -> Iterator[None]:
    """DeepSpeed's own validation of the config it is given (pydantic, e.g. a ZeRO stage of 7,
    or an unknown key under a typed section) as one ConfigError line naming the key; and, when
    the run has `raw` DeepSpeed entries, DeepSpeed's refusals of option combinations at
    start-up (its config and ZeRO errors, its assertions) as one line naming those entries.
    Without raw entries, or when the error was raised in our own code (a hook or module that
    DeepSpeed calls), it is a bug of ours and keeps its traceback."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    try:
        yield
    except pydantic.ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or exc.title
        raise ConfigError(f"deepspeed config ({exc.title}): {where}: "
                          f"{first.get('msg', 'invalid value')}") from None
    except (DeepSpeedConfigError, ZeRORuntimeException, AssertionError, ValueError, TypeError,
            AttributeError, NotImplementedError) as exc:  # AttributeError: a scalar section
        if not raw or not _raised_by_deepspeed(exc):
            raise
        keys = ", ".join(sorted(_dotted(raw)))
        text = " ".join(str(exc).split()) or "(no message)"
        raise ConfigError(f"deepspeed config: DeepSpeed refused the run with the raw entries "
                          f"{keys} ({type(exc).__name__}: {text[:300]})") from None


def _raised_by_deepspeed(exc: BaseException) -> bool:
    """Whether `exc` is DeepSpeed's own: its config / ZeRO error types, or raised under a
    frame of the deepspeed package with none of ours below it (its assertions and ValueErrors,
    also from the standard library it calls; not ours under its calls)."""
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    if isinstance(exc, (DeepSpeedConfigError, ZeRORuntimeException)):
        return True
    import os

    import deepspeed

    import moe_train

    packages = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                for m in (deepspeed, moe_train)]
    owner = None  # the innermost frame of either package: the standard library's (an Enum
    tb = exc.__traceback__  # refusing a name DeepSpeed passed it) count for their caller
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        owner = next((i for i, pkg in enumerate(packages) if path.startswith(pkg)), owner)
        tb = tb.tb_next
    return owner == 0


def _dotted(entries: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of nested `entries`."""
    keys = []
    for key, value in entries.items():
        name = f"{prefix}{key}"
        keys += _dotted(value, f"{name}.") if isinstance(value, dict) and value else [name]
    return keys
