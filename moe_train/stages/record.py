"""What a finished stage was made from, so that rerunning a recipe reuses only what still holds.

Every stage's ``done.json`` records ``made_from``:

- ``config``: the config fields the stage depends on, flattened (``train.max_steps``), taken
  from the config the stage actually ran with (a training stage's own, e.g. the adapter
  stage's step count). Fields that do not change an artifact are left out (`IGNORED`), and so
  are the parts of the config a MoA stage never reads (`STAGE_IGNORES`, `MOA_READS`): the
  backbone does not depend on MoA's clustering or adapter-stage settings, so a baseline may
  share it, and a new adapter step count leaves the features, clusters and gate current.
  The gad recipe's backbone (MIX, the same stage) follows the same rules; its TAG,
  classifier, AD and GAD stages depend on the ``gated`` fields they read (`GATED_READS`) and
  not on MoA's, the classifier not on the model's either (`GAD_STAGE_IGNORES`), its evaluate
  stage on the whole config. No stage depends on a section its model never reads
  (`unread_sections`: THOR's without THOR, the gated router's in a MoA model without one).
- ``data``: a digest of the prepared data's ``manifest.json`` (its path may change, its
  content may not), which holds a digest of the data's files (``content_sha256``).
- ``inputs``: a digest of the record of every other stage whose output it read.
- ``recipe``: the recipe that ran it (all but the backbone, which every recipe shares): two
  recipes in one workdir have stages of the same name (evaluate) that are not the same.

A later run compares these with what it would use now. Equal: the stage is reused. Different:
the run stops with one line naming what changed (old -> new), so a config edit never silently
reuses a stale backbone, gate or adapter model; with ``--rerun-stale`` the stage's directory is
deleted and the stage runs again, and every stage that read it then differs in its inputs and
follows (a backbone shared from another workdir through ``moa.backbone_dir`` is never
deleted). Each record carries a fresh ``record_id``, so a rerun always changes its digest.
Records written before ``made_from`` existed are reused with a warning.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from moe_train.config.adapters import AdapterConfig
from moe_train.config.schema import ExperimentConfig
from moe_train.data.shards import MANIFEST
from moe_train.errors import ConfigError
from moe_train.train.resume import flatten_config

IGNORED: tuple[str, ...] = (
    "logging.*", "checkpoint.*", "train.progress_bar", "train.log_every", "data.num_workers",
    "data.prepared_dir",  # its manifest's digest stands for it
    "moa.workdir", "moa.backbone_dir",
)
"""Dotted fields (``section.*``: a whole section) that no stage's artifact depends on."""

_BACKBONE_ADAPTER_FIELDS = {"num_experts", "dim", "sides", "router", "k"}
STAGE_IGNORES: dict[str, tuple[str, ...]] = {
    # One pre-injected adapter (or none) with the single router: only its shape matters.
    "backbone": ("gated.*", *(f"adapters.{f.name}" for f in fields(AdapterConfig)
                              if f.name not in _BACKBONE_ADAPTER_FIELDS)),
    # Encoder features, clusters and the distilled gate read the data and the moa section.
    **{stage: ("model.*", "moe.*", "adapters.*", "thor.*", "gated.*", "qwen.*", "optim.*",
               "train.*", "eval.*") for stage in ("features", "cluster", "distill")},
}
"""Per stage, the further fields it does not read."""

GAD_STAGE_IGNORES: dict[str, tuple[str, ...]] = {
    # The domain classifier reads the data, its `gated` fields and moa.seed; the backbone whose
    # encoder it may use is an input (its record stands for the model's settings).
    "classifier": ("model.*", "moe.*", "adapters.*", "thor.*", "qwen.*", "optim.*", "train.*",
                   "eval.*"),
}
"""Per gad-recipe stage (other than the shared backbone), the further fields it does not read."""


def unread_sections(cfg: ExperimentConfig, recipe: str) -> tuple[str, ...]:
    """Fields the model `cfg` configures never reads: THOR's without a THOR router, Qwen's
    without the decoder-only model, the adapters' settings beside their count when there are
    none, and (moa recipe) the gated router's without it. A change there changes no artifact."""
    out = [*(() if cfg.uses_thor else ("thor.*",)), *(() if cfg.decoder_only else ("qwen.*",))]
    if not cfg.adapters.enabled:
        out += [f"adapters.{f.name}" for f in fields(AdapterConfig) if f.name != "num_experts"]
    if recipe == "moa" and cfg.adapters.router != "gated":
        out.append("gated.*")
    return tuple(out)


MOA_READS: dict[str, frozenset[str]] = {
    "backbone": frozenset(),  # moa.pre_inject shows as its adapters.num_experts
    "features": frozenset({"sample_size", "anchors_per_domain", "anchor_domains", "seed"}),
    "cluster": frozenset({"sample_size", "anchors_per_domain", "anchor_domains", "seed",
                          "num_clusters", "pca_dim", "clusterer", "cluster_inits",
                          "standardize", "whiten", "unit_norm"}),
    "distill": frozenset({"num_clusters", "seed", "distill_steps", "distill_batch_sentences",
                          "distill_lr"}),
    "adapters": frozenset({"num_clusters", "pre_inject", "adapter_steps", "adapter_lr",
                           "adapter_warmup_steps", "unfreeze_decoder"}),
    "evaluate": frozenset({"num_clusters", "seed", "eval_sentences", "eval_beam"}),
}
"""The ``moa`` fields each MoA stage reads (what it reads of the stages before it, their
records stand for); stages not named here depend on the whole section."""

GATED_READS: dict[str, frozenset[str]] = {
    "tag": frozenset({"tag_steps", "lr", "tag_prepared_dir"}),
    "classifier": frozenset({"classifier", "classifier_steps", "classifier_lr",
                             "classifier_batch_sentences", "tfidf_ngrams"}),
    "ad": frozenset({"ad_steps", "lr", "upsample"}),
    "gad": frozenset({"gad_steps", "gad_init", "encoder_loss_norm", "alpha", "tau",
                      "teacher_as_logits", "temperature", "gate_loss", "lr", "upsample"}),
}
"""The ``gated`` fields each gad-recipe training stage reads (what it reads of other stages,
their records stand for); of the ``moa`` section these stages read only the seed. The
evaluate stage depends on the whole config."""

MAX_NAMED = 6
"""Differing fields named in the error before '(+N more)'."""


def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or (p.endswith(".*") and name.startswith(p[:-1])) for p in patterns)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def config_fields(stage: str, cfg: ExperimentConfig, recipe: str = "moa") -> dict[str, Any]:
    """The flattened config fields `stage` of `recipe` depends on."""
    shared = recipe == "moa" or stage == "backbone"  # every recipe's backbone is one stage
    moa_reads = MOA_READS.get(stage) if shared else None
    patterns = IGNORED + unread_sections(cfg, recipe) + \
        (STAGE_IGNORES.get(stage, ()) if shared else GAD_STAGE_IGNORES.get(stage, ()))
    gated_reads = GATED_READS.get(stage) if recipe == "gad" else None
    if gated_reads is not None:
        moa_reads = frozenset({"seed"})

    def unread(name: str) -> bool:
        section, _, field = name.partition(".")
        return (section == "moa" and moa_reads is not None and field not in moa_reads) or \
            (section == "gated" and gated_reads is not None and field not in gated_reads)

    return {name: value for name, value in flatten_config(_jsonable(cfg.to_dict())).items()
            if not _ignored(name, patterns) and not unread(name)}


def file_digest(path: Path) -> str | None:
    """sha256 of a file's bytes (None when it does not exist)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def made_from(stage: str, cfg: ExperimentConfig, inputs: dict[str, Path],
              recipe: str = "moa") -> dict[str, Any]:
    """What `stage` of `recipe` is made from when it runs with `cfg` and reads the stages in
    `inputs` ({stage: its done.json})."""
    shared = stage == "backbone"  # every recipe's backbone is one stage
    return {"config": config_fields(stage, cfg, recipe),
            **({} if shared else {"recipe": recipe}),
            "data": file_digest(Path(cfg.data.prepared_dir) / MANIFEST),
            "inputs": {name: file_digest(path) for name, path in sorted(inputs.items())}}


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between two `made_from` records, one short phrase each."""
    out = []
    old_cfg, new_cfg = old.get("config", {}), new.get("config", {})
    for name in sorted(old_cfg.keys() | new_cfg.keys()):
        if name not in old_cfg or name not in new_cfg:
            continue  # a field added to the schema since: its default is what ran
        if old_cfg[name] != new_cfg[name]:
            out.append(f"{name}: {_show(old_cfg[name])} -> {_show(new_cfg[name])}")
    if old.get("data") != new.get("data"):
        out.append("the prepared data (manifest.json differs)")
    for name, digest in sorted(old.get("inputs", {}).items()):
        if new.get("inputs", {}).get(name, digest) != digest:
            out.append(f"the output of stage {name} (rerun since)")
    return out


def stale_error(stage: str, where: Path, changed: list[str], recipe: str,
                shared: bool) -> ConfigError:
    """The one-line error for a finished stage made from something else (`changed`, from
    `differences`); `shared`: it lives outside this recipe's workdir (moa.backbone_dir)."""
    more = f" (+{len(changed) - MAX_NAMED} more)" if len(changed) > MAX_NAMED else ""
    fix = (f"it is shared through moa.backbone_dir and is not deleted for you: point "
           f"moa.backbone_dir elsewhere, or delete {where} yourself" if shared else
           f"rerun with `moe-train pipeline {recipe} --rerun-stale` (deletes it and reruns "
           f"it and the stages after it), delete {where} yourself, or restore what changed")
    return ConfigError(f"stage {stage}: {where} was made from something else: "
                       f"{'; '.join(changed[:MAX_NAMED])}{more}; {fix}")
