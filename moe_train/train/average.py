"""Checkpoint averaging: the mean of several checkpoints' weights as one standalone export.

Averaging the last few checkpoints of a run is common MT practice (fairseq's
``average_checkpoints.py``; the Transformer paper averaged the last 5 or 20 checkpoints of a
converged run), a smoother model at no training cost. It does not always pay: on OPUS de-en
at 1500 steps, far from converged (benchmarks/average_checkpoints.py), the last 2 and 5
checkpoints averaged lost 0.45 and 0.77 test BLEU against the last one. Compare the two on
dev before serving the average.

The inputs are exports, training checkpoint directories (their ``latest``) or step directories,
or the last N complete steps of one training checkpoint directory. They must be one model: the
same architecture (the config's model-shaping sections, ``moe.ep_size`` aside), the same weight
names and shapes, the same vocabulary, tags and corpora, byte-identical tokenizer files, and
equal non-float tensors (task tables, counters). Float weights are summed in float64 and
divided once, so averaging a checkpoint with itself gives it back bit for bit. The last
input's config and manifest (with ``--last``: the newest step's) go into the export, beside
``average.json`` (the inputs, in order).
Memory: the float64 sum plus one input's fp32 weights at a time, about three times the fp32
model (a step directory's optimizer state is mapped from its file, not read). Extracted
sub-networks must keep the same experts (their ``extract.json``); otherwise average the full
checkpoints, then extract.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from moe_train.config.schema import ExperimentConfig
from moe_train.data.prepare import tokenizer_files
from moe_train.errors import CheckpointError, ConfigError
from moe_train.eval.extract import read_experts_kept
from moe_train.models.build import shape_model
from moe_train.models.hf_config import HF_SPECIAL_IDS
from moe_train.train.checkpoint import consolidated_state_dict, list_tags, read_meta, verify
from moe_train.train.export import (check_weights, export_inference, export_streamed,
                                    load_export_weights, read_parts)
from moe_train.train.resume import flatten_config, vocabulary_identity
from moe_train.utils.provenance import finish, provenance

AVERAGE_REPORT = "average.json"
"""The file only `moe-train average` writes into its output (the inputs it averaged)."""
MODEL_SECTIONS = ("model.", "moe.", "adapters.", "thor.", "gated.", "qwen.")
"""Config sections that shape the model or its routing: equal in every averaged input."""
LAYOUT_FIELDS = frozenset({"moe.ep_size"})
"""Fields of those sections that only say how training was laid out (experts are saved whole)."""


@dataclass
class AveragedInput:
    """One checkpoint of the average, every file checked before its weights are read."""

    path: Path
    kind: str
    """``export`` or ``step``."""
    cfg: ExperimentConfig
    manifest: dict[str, Any]
    step: int | None
    """The training step of a step directory (None for an export)."""

    def weights(self) -> dict[str, torch.Tensor]:
        if self.kind == "export":
            return load_export_weights(self.path)
        return consolidated_state_dict(self.path)


def last_steps(ckpt_dir: str | Path, n: int) -> list[Path]:
    """The `n` newest complete step directories of a training checkpoint directory, oldest
    first; one line when it has fewer."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not found; expected a training checkpoint directory "
                              "(checkpoint.dir) with --last")
    complete = [tag for tag in list_tags(ckpt_dir) if verify(ckpt_dir / tag) is None]
    if len(complete) < n:
        found = ", ".join(complete) or "none"
        raise CheckpointError(f"{ckpt_dir}: holds {len(complete)} complete step directories "
                              f"({found}); expected at least --last {n} (checkpoint.keep_last "
                              "keeps that many during training)")
    return [ckpt_dir / tag for tag in complete[-n:]]


def resolve_inputs(paths: Sequence[str | Path]) -> list[AveragedInput]:
    """Each path read as `load_for_inference` reads it (an export, a checkpoint directory's
    latest step, a step directory); the same directory twice is refused."""
    inputs: list[AveragedInput] = []
    seen: dict[Path, str] = {}
    for given in paths:
        kind, where, cfg, manifest, _ = read_parts(given)
        resolved = where.resolve()
        if resolved in seen:
            raise ConfigError(f"{given}: the same checkpoint as {seen[resolved]} ({where}); "
                              "expected each checkpoint once")
        seen[resolved] = str(given)
        step = int(read_meta(where)["step"]) if kind == "step" else None
        inputs.append(AveragedInput(where, kind, cfg, manifest, step))
    if len(inputs) < 2:
        raise ConfigError(f"average: {len(inputs)} checkpoint given; expected at least 2 "
                          "(several paths, or one checkpoint directory with --last N)")
    return inputs


def _model_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    flat = flatten_config(cfg.to_dict())
    return {k: v for k, v in flat.items()
            if k.startswith(MODEL_SECTIONS) and k not in LAYOUT_FIELDS}


def check_same_model(inputs: Sequence[AveragedInput]) -> None:
    """One line naming the first input that is not the same model as the first one: a
    model-shaping config field, a vocabulary / corpus fact, or a tokenizer file."""
    first = inputs[0]
    fields, data = _model_fields(first.cfg), vocabulary_identity(first.manifest)
    files = {p.name: p.read_bytes() for p in tokenizer_files(first.path, first.manifest)
             if p.is_file()}
    for other in inputs[1:]:
        their_files = {p.name for p in tokenizer_files(other.path, other.manifest)
                       if p.is_file()}
        theirs = _model_fields(other.cfg)
        differ = [f"{k} {fields.get(k)!r} vs {theirs.get(k)!r}"
                  for k in sorted(fields.keys() | theirs.keys()) if fields.get(k) != theirs.get(k)]
        their_data = vocabulary_identity(other.manifest)
        differ += [f"manifest {k} {data[k]!r} vs {their_data[k]!r}" for k in data
                   if data[k] != their_data[k]]
        if first.manifest.get(HF_SPECIAL_IDS) != other.manifest.get(HF_SPECIAL_IDS):
            differ.append(f"manifest {HF_SPECIAL_IDS} {first.manifest.get(HF_SPECIAL_IDS)!r} "
                          f"vs {other.manifest.get(HF_SPECIAL_IDS)!r}")
        differ += [f"tokenizer file {name}" for name, blob in files.items()
                   if not (other.path / name).is_file()
                   or (other.path / name).read_bytes() != blob]
        differ += [f"tokenizer file {name} (only {other.path} has it)"
                   for name in sorted(their_files - files.keys())]
        differ += _kept_experts_differ(first, other)
        if differ:
            raise CheckpointError(f"{other.path}: not the same model as {first.path} "
                                  f"({'; '.join(differ[:3])}"
                                  f"{f'; {len(differ) - 3} more' if len(differ) > 3 else ''}); "
                                  "expected checkpoints of one architecture and vocabulary")


def _kept_experts(item: AveragedInput) -> dict[str, Any] | None:
    """The global experts an extracted sub-network kept per layer (its extract.json), None
    for a full model."""
    return read_experts_kept(item.path) if item.cfg.moe.extracted_task else None


def _kept_experts_differ(first: AveragedInput, other: AveragedInput) -> list[str]:
    """Extracted sub-networks whose slots hold other experts: each layer that differs."""
    mine, theirs = _kept_experts(first), _kept_experts(other)
    if mine == theirs:
        return []
    if mine is None or theirs is None:
        return ["one is an extracted sub-network, the other not"]
    layers = sorted(layer for layer in mine.keys() | theirs.keys()
                    if mine.get(layer) != theirs.get(layer))
    return [f"experts kept in {layer} {mine.get(layer)} vs {theirs.get(layer)} (average the "
            "full checkpoints, then extract)" for layer in layers]


def average_weights(inputs: Sequence[AveragedInput], same: list[tuple[Path, Path]] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The mean of the inputs' float weights (float64 sum, one division, fp32 result); their
    non-float tensors, which must be equal. One input's weights are held at a time.
    `same` collects (input, earlier input) whose weights are identical: an export and the
    step it was written from are two paths to one checkpoint, which the mean counts twice."""
    first = inputs[0]
    state = first.weights()
    digests = {_digest(state): first.path}
    total = {k: v.double() if v.is_floating_point() else v.clone() for k, v in state.items()}
    del state
    for item in inputs[1:]:
        state = item.weights()
        digest = _digest(state)
        if digest in digests and same is not None:
            same.append((item.path, digests[digest]))
        digests.setdefault(digest, item.path)
        _add(total, state, item, first)
        del state  # one input's weights at a time
    n = len(inputs)
    return {k: v.div_(n).float() if v.is_floating_point() else v for k, v in total.items()}


def _digest(state: dict[str, torch.Tensor]) -> str:
    """A digest of the weights' names, shapes, dtypes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    return h.hexdigest()


def _add(total: dict[str, torch.Tensor], state: dict[str, torch.Tensor], item: AveragedInput,
         first: AveragedInput) -> None:
    """Add one input's float weights to `total`; its non-float tensors must equal the first's."""
    missing, extra = total.keys() - state.keys(), state.keys() - total.keys()
    if missing or extra:
        names = sorted(missing)[:2] + sorted(extra)[:2]
        raise CheckpointError(f"{item.path}: its weights are not {first.path}'s "
                              f"({len(missing)} missing, {len(extra)} extra: "
                              f"{', '.join(names)}); expected one model's weights")
    for name, value in state.items():
        acc = total[name]
        if tuple(value.shape) != tuple(acc.shape) or (
                value.is_floating_point() != acc.is_floating_point()):
            raise CheckpointError(f"{item.path}: {name} is {value.dtype} "
                                  f"{tuple(value.shape)}, {first.path} has {acc.dtype} "
                                  f"{tuple(acc.shape)}; expected one model's weights")
        if acc.is_floating_point():
            acc.add_(value.double())
        elif not torch.equal(acc, value):
            raise CheckpointError(f"{item.path}: {name} ({value.dtype}, not averaged) "
                                  f"differs from {first.path}'s; expected equal tables "
                                  "in checkpoints of one model")


def write_average(inputs: Sequence[AveragedInput], out_dir: str | Path,
                  prov: dict[str, Any] | None = None) -> dict[str, Any]:
    """Average `inputs` (checked to be one model) into the export `out_dir`, atomically; the
    report that `average.json` holds, with `prov` (`provenance()` taken when the command
    started; now when not given) finished."""
    prov = prov or provenance()
    check_same_model(inputs)
    newest = inputs[-1]  # the last given: with --last, the newest step
    same: list[tuple[Path, Path]] = []
    state = average_weights(inputs, same)
    # the export's config must take these weights
    check_weights(shape_model(newest.cfg, newest.manifest), state, Path(out_dir))
    report = {"format": "moe_train-average-1", "count": len(inputs),
              "inputs": [{"path": str(Path(item.path).resolve()), "kind": item.kind,
                          "step": item.step} for item in inputs]}
    if same:  # kept (a copy averaged with itself is a valid check), but said
        report["identical_inputs"] = [[str(a), str(b)] for a, b in same]
    recorded = {**report, "provenance": finish(prov)}  # average.json: its origin too
    # a model converted from a Hugging Face directory without tokenizer files has none
    tokenizer = [p for p in tokenizer_files(newest.path, newest.manifest) if p.is_file()]
    if newest.cfg.optim.zero_stage == 3:  # as its run exported it: tensor by tensor, sharded
        export_streamed(out_dir, state.items(), newest.cfg, newest.manifest, tokenizer,
                        extra_json={AVERAGE_REPORT: recorded})
    else:
        export_inference(out_dir, state, newest.cfg, newest.manifest, tokenizer,
                         extra_json={AVERAGE_REPORT: recorded})
    return report

