"""Strict resume: the config stored in a checkpoint must match the current one.

Everything that shapes the model, the data order or the optimisation must be unchanged; the
fields in `RESUME_MAY_CHANGE` (schedule length, logging, evaluation, checkpoint cadence, the
expert-parallel layout, ...) may change, and each change is logged. Anything else that differs
is one `CheckpointError` line naming every differing field (old -> new). `data.prepared_dir`
may move, but must hold the same prepared data: the checkpoint's copies of the tokenizer and the
manifest are compared with it (`check_resume_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from moe_train.errors import CheckpointError
from moe_train.utils.safe_load import read_json_object

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


DATA_IDENTITY: tuple[str, ...] = ("tokenizer", "vocab_size", "pad_id", "unk_id", "bos_id",
                                  "eos_id", "lang_tags", "domain_tags", "domains", "langs")
"""Manifest fields that a resumed run's prepared data must share with the checkpoint's."""


def vocabulary_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a model's ids mean: the `DATA_IDENTITY` fields and the corpus names (task ids)."""
    return {**{k: manifest.get(k) for k in DATA_IDENTITY},
            "corpora": [c.get("name") for c in manifest.get("corpora", [])]}


def _data_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    train = manifest.get("splits", {}).get("train", {})
    return {**vocabulary_identity(manifest),
            **{f"train {k}": train.get(k)
               for k in ("corpus_sizes", "src_tokens", "tgt_tokens", "sha256")}}


def check_resume_data(tag_dir: Path, manifest: dict[str, Any], tokenizer_files: Sequence[Path]
                      ) -> None:
    """Refuse to resume from `tag_dir` on other prepared data than it trained on: a tokenizer
    file that differs from the checkpoint's copy, or a manifest that differs in the vocabulary,
    the tags, the corpora or the training split's sizes or content digest (where both
    manifests have one; one CheckpointError line). The data may have moved: file paths are not
    compared; dev and test may have been carved again."""
    for path in tokenizer_files:
        stored = tag_dir / path.name
        if stored.is_file() and stored.read_bytes() != path.read_bytes():
            raise CheckpointError(f"{path}: not the tokenizer that {tag_dir} trained with; "
                                  "expected data.prepared_dir to hold the same prepared data "
                                  "on resume")
    if not (tag_dir / "manifest.json").is_file():
        return
    old = _data_identity(read_json_object(tag_dir / "manifest.json",
                                          "the manifest of the data it trained on"))
    new = _data_identity(manifest)
    differ = [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if _norm(old[k]) != _norm(new[k])
              and not (k == "train sha256" and None in (old[k], new[k]))]  # older manifests
    if differ:
        raise CheckpointError(f"{tag_dir}: data.prepared_dir holds other prepared data than the "
                              f"checkpoint trained on: {'; '.join(differ)}")


@dataclass(frozen=True)
class ResumeState:
    """What a resumed run continues from a checkpoint's meta.json (the trainer's
    `_checkpoint_meta`), each field checked in `resume_state`."""

    step: int
    tokens_seen: int
    data_state: dict[str, Any]
    """The batch iterator's `state_dict()`: position (epoch, step) and data-order identity."""
    early_stop: dict[str, Any]
    """Early stopping's `state_dict()` and the best checkpoint's tag ({} when absent)."""
    nonfinite_total: int
    nonfinite_in_a_row: int
    validated_step: int
    """The last step whose validation early stopping has seen (-1: none)."""
    world_size: int
    """The ranks that wrote the checkpoint."""


def _field(meta: dict[str, Any], key: str, kinds: tuple[type, ...], expected: str,
           where: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CheckpointError(f"{where}: '{key}' is {value!r}; expected {expected}, as a "
                              "checkpoint's save writes it")
    return value


def resume_state(meta: dict[str, Any], where: Path) -> ResumeState:
    """The resume fields of `meta` (meta.json at `where`), checked: a damaged file is one line
    naming the field, before any weights are loaded."""
    number, integer, null = (int, float), (int,), type(None)
    data = _field(meta, "data_state", (dict,), "the data order's state", str(where))
    for key in ("epoch", "step_in_epoch"):
        _field(data, key, integer, "an integer", f"{where}: data_state")
    early = _field(meta, "early_stop", (dict, null), "early stopping's state", str(where)) or {}
    for key, kinds, expected, default in (
            ("best", (*number, null), "a number or null", None),
            ("bar", (*number, null), "a number or null", None),
            ("best_step", integer, "an integer", 0), ("bad", integer, "an integer", 0),
            ("best_values", (dict, null), "a mapping", None),
            ("best_tag", (str, null), "a step tag", None)):
        _field(early, key, kinds, expected, f"{where}: early_stop", default)
    nonfinite = _field(meta, "nonfinite", (dict, null), "the skipped-step counts",
                       str(where)) or {}
    total, in_a_row = (_field(nonfinite, key, integer, "an integer", f"{where}: nonfinite", 0)
                       for key in ("total", "in_a_row"))
    return ResumeState(
        step=_field(meta, "step", integer, "an integer", str(where)),
        tokens_seen=_field(meta, "tokens_seen", integer, "an integer", str(where), 0),
        data_state=data, early_stop=early, nonfinite_total=total, nonfinite_in_a_row=in_a_row,
        validated_step=_field(meta, "validated_step", integer, "an integer", str(where), -1),
        world_size=_field(meta, "world_size", integer, "an integer", str(where), 1))
