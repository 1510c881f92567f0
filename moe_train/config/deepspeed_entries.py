"""Raw DeepSpeed entries (a config's `deepspeed:` section, `train --deepspeed-config FILE`):
which ones moe_train owns, which it cannot run, and the check that refuses both in one line.

Every other entry passes through to DeepSpeed (e.g. ``zero_optimization.overlap_comm``).
"""

from __future__ import annotations

from typing import Any

from moe_train.errors import ConfigError

DEEPSPEED_OWNED: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "data.max_tokens (token-budget batches)",
    "train_batch_size": "data.max_tokens and optim.grad_accum (token-budget batches)",
    "gradient_accumulation_steps": "optim.grad_accum",
    "gradient_clipping": "optim.clip_norm",
    "zero_optimization.stage": "optim.zero_stage",
    "bf16.enabled": "optim.precision",
    "bfloat16": "optim.precision (moe_train writes DeepSpeed's bf16 section, which DeepSpeed "
                "reads instead of its old bfloat16 alias: other bf16 options go under bf16)",
    "fp16.enabled": "optim.precision",
    "amp": "optim.precision",
    "torch_autocast": "optim.precision",
    "optimizer": "optim.lr / betas / eps / weight_decay (moe_train builds the optimizer)",
    "scheduler": "optim.lr and optim.warmup_steps (moe_train's schedule)",
    "activation_checkpointing": "model.activation_checkpointing (moe_train recomputes with "
                                "torch.utils.checkpoint; DeepSpeed would ignore this section)",
}
"""DeepSpeed config keys (dotted: nested) that moe_train sets from its own fields
(train/ds_config.py) or owns (the optimizer, its schedule): the trainer acts on its own fields
(ZeRO-0 clipping and the non-finite guard, the logged precision), so a raw entry would make the
run differ from what its config and log say."""

DEEPSPEED_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "zero_optimization.round_robin_gradients": (
        True, "moe_train reads ZeRO partitions in parameter order (checkpoints, exports, "
              "resharding); DeepSpeed's round-robin layout would scramble them"),
    "zero_optimization.elastic_checkpoint": (
        True, "moe_train resumes at another world size from its own per-parameter stores"),
    "zero_optimization.load_from_fp32_weights": (
        False, "a resume must restore the fp32 masters for training to continue exactly"),
    "checkpoint.load_universal": (
        True, "moe_train resumes at another world size from its own per-parameter stores"),
    "wall_clock_breakdown": (
        True, "DeepSpeed's timers need a tensor forward output; moe_train's models return a "
              "ModelOutput (the log has tokens/s and memory)"),
    "flops_profiler.enabled": (
        True, "DeepSpeed's profiler needs a tensor forward output; moe_train's models return "
              "a ModelOutput"),
    "autotuning.enabled": (
        True, "DeepSpeed's autotuning turns on its flops profiler and timers, which need a "
              "tensor forward output; moe_train's models return a ModelOutput"),
}
"""Boolean entries DeepSpeed accepts but moe_train cannot run with that value: (value, why).
Any other value than true or false is refused too: DeepSpeed would read a string such as
"true" as true."""

_ABSENT = object()


def _lookup(entries: dict[str, Any], key: str, where: str) -> Any:
    """The value at dotted `key`, or _ABSENT; a scalar where `key` needs a section (e.g.
    ``zero_optimization: true``, DeepSpeed's old form) is refused: it would replace the whole
    section moe_train generates."""
    node: Any = entries
    parts = key.split(".")
    for i, part in enumerate(parts):
        node = node.get(part, _ABSENT)
        if node is _ABSENT or i == len(parts) - 1:
            return node
        if not isinstance(node, dict):
            raise ConfigError(f"{where}{'.'.join(parts[:i + 1])}: expected a mapping (its keys "
                              f"as DeepSpeed documents them), got {node!r}")
    return node


def check_deepspeed_entries(entries: dict[str, Any], where: str) -> None:
    """Refuse raw DeepSpeed entries that would override what moe_train sets itself
    (`DEEPSPEED_OWNED`) or that it cannot run (`DEEPSPEED_UNSUPPORTED`), in one line naming
    the key; other entries pass through."""
    for key, field_ in DEEPSPEED_OWNED.items():
        value = _lookup(entries, key, where)
        if value is not _ABSENT:
            raise ConfigError(f"{where}{key}: set by moe_train from {field_}; expected it "
                              f"absent, got {value!r}")
    for key, (bad, why) in DEEPSPEED_UNSUPPORTED.items():
        value = _lookup(entries, key, where)
        if value is _ABSENT:
            continue
        if not isinstance(value, bool):
            raise ConfigError(f"{where}{key}: expected true or false, got {value!r}")
        if value == bad:
            raise ConfigError(f"{where}{key}: {value!r} is not supported: {why}; expected it "
                              "absent")
