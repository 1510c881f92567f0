"""Strict resume: the config stored in a checkpoint must match the current one.

Everything that shapes the model, the data order or the optimisation must be unchanged; the
fields in `RESUME_MAY_CHANGE` (schedule length, logging, evaluation, checkpoint cadence, the
expert-parallel layout, ...) may change, and each change is logged. Anything else that differs
is one `CheckpointError` line naming every differing field (old -> new).
"""

from __future__ import annotations

from typing import Any, Callable

from moe_train.errors import CheckpointError

RESUME_MAY_CHANGE: tuple[str, ...] = (
    "train.max_steps", "train.max_minutes", "train.log_every", "train.validate_every",
    "train.bleu_every", "train.bleu_sentences", "train.progress_bar", "train.export_best",
    "train.init_from",  # the start of the run only; a resumed run reads its checkpoint
    "checkpoint.dir", "checkpoint.save_every", "checkpoint.keep_last",
    "logging.*", "eval.*",
    "data.prepared_dir", "data.num_workers",  # where the (identical) data lives, how it is read
    "moe.ep_size",  # experts and their moments are resharded (parallel/expert_checkpoint.py)
    "optim.max_nonfinite_steps",
)
"""Dotted config fields (``section.*`` for a whole section) that may change on resume."""


def flatten_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict as {dotted field: value} (the deepspeed section stays one value)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name != "deepspeed":
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def may_change(field: str) -> bool:
    return any(field == allowed or (allowed.endswith(".*") and field.startswith(allowed[:-1]))
               for allowed in RESUME_MAY_CHANGE)


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_resume_config(stored: dict[str, Any], current: dict[str, Any], where: str,
                        log: Callable[[str], None] = print) -> None:
    """Raise CheckpointError naming every field that differs and may not; log allowed changes.

    `where` names the checkpoint (for the message). Fields present on one side only (a field
    added to the schema after the checkpoint was written) are logged, not refused.
    """
    old, new = flatten_config(stored), flatten_config(current)
    refused = []
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            side = "checkpoint" if name not in old else "current config"
            log(f"| resume: {name} is not in the {side}; using "
                f"{_norm(new.get(name, old.get(name)))!r}")
            continue
        a, b = _norm(old[name]), _norm(new[name])
        if a == b:
            continue
        if may_change(name):
            log(f"| resume: {name} changed {a!r} -> {b!r}")
        else:
            refused.append(f"{name} {a!r} -> {b!r}")
    if refused:
        raise CheckpointError(f"{where}: the config differs from the checkpoint's in fields that "
                              f"cannot change on resume: {'; '.join(refused)}")
