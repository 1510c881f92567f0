"""Stages `tag`, `ad` and `gad` of the Gated Adapters recipe (seed 004 Sec. 3-4).

- `ad` (AD): one adapter per domain after every encoder and decoder layer, routed by the gold
  domain (`task` router, identity assignment), on the frozen MIX backbone.
- `gad` (GAD): the same adapters mixed by the per-layer soft gates (``adapters.router: gated``),
  initialised from MIX as AD is (004 Sec. 3.2.2; ``gated.gad_init: ad`` starts from AD's
  adapters), gates new, base frozen, gates distilled from the classifier's
  training-split probabilities (`TeacherProbs`) or trained with CE on the gold domain.
- `tag` (TAG): MIX fine-tuned, every parameter, on the same corpora prepared with a domain tag
  in the source (``gated.tag_prepared_dir``, same sentencepiece model).
AD and GAD draw every corpus equally often (``gated.upsample``; with one language pair per
domain that is every domain up-sampled to the largest, 004's setting). After training, each
stage checks that every frozen parameter is bitwise what training started from (the engine's
copy: same device and precision) and records it.
Artifacts: ``checkpoints/export`` of each stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.data.shards import read_manifest
from moe_train.errors import ConfigError
from moe_train.moe.gated_router import GatedRouter
from moe_train.stages.adapters import freeze_base, load_backbone
from moe_train.stages.classifier import load_probs
from moe_train.stages.common import StageContext, load_matching, stage_config, training_summary
from moe_train.train.export import load_export_weights
from moe_train.train.hooks import InitModel, TeacherProbs, TrainerHooks
from moe_train.train.trainer import Trainer
from moe_train.utils.safe_load import require_file

UPSAMPLE_TEMPERATURE = 1e6
"""data.temperature that draws every corpus equally often: the proportions of 004's up-sampling
to the largest (an epoch keeps the total size, so a larger corpus is sub-sampled in each)."""


def export_dir(ctx: StageContext, stage: str) -> Path:
    return ctx.stage_dir(stage) / "checkpoints" / "export"


def _num_domains(cfg: ExperimentConfig) -> int:
    return len(read_manifest(cfg.data.prepared_dir)["domains"])


def check_recipe_config(cfg: ExperimentConfig) -> int:
    """The gad recipe's adapters: the gated router, one adapter per domain of the prepared
    data (checked before the first stage runs, and again by each adapter stage). Returns the
    number of domains."""
    E = _num_domains(cfg)
    if cfg.adapters.router != "gated":
        raise ConfigError(f"adapters.router: the gad recipe trains the gated router, got "
                          f"{cfg.adapters.router!r}")
    if cfg.adapters.num_experts != E:
        raise ConfigError(f"adapters.num_experts: expected one adapter per domain ({E} in "
                          f"{cfg.data.prepared_dir}), got {cfg.adapters.num_experts}")
    return E


def adapter_stage_config(ctx: StageContext, stage: str) -> ExperimentConfig:
    """AD (oracle task routing) or GAD (the config's gated router): one adapter per domain on
    both sides, gated.lr, gated.{ad,gad}_steps, up-sampled corpora."""
    cfg, g = ctx.cfg, ctx.cfg.gated
    E = check_recipe_config(cfg)
    adapters: dict[str, Any] = {"sides": "both"}
    if stage == "ad":
        adapters |= {"router": "task", "task_source": "domain", "k": 1, "num_tasks": 0,
                     "assignment": [[e] for e in range(E)]}
    data = {"temperature": UPSAMPLE_TEMPERATURE} if g.upsample else {}
    return stage_config(cfg, ctx.stage_dir(stage), adapters=adapters, data=data,
                        optim={"lr": g.lr},
                        train={"max_steps": g.ad_steps if stage == "ad" else g.gad_steps})


def _gate_keys(model: nn.Module) -> set[str]:
    return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, GatedRouter)
            for p, _ in m.named_parameters()}


class FrozenCheck:
    """Snapshot of a model's frozen parameters (in their dtype, in host memory: no second copy
    of the base on the accelerator), compared bitwise after training."""

    def __init__(self, model: nn.Module) -> None:
        self.frozen = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()
                       if not p.requires_grad}

    def report(self, model: nn.Module) -> dict[str, Any]:
        params = dict(model.named_parameters())
        changed = [n for n, p in self.frozen.items()
                   if not torch.equal(params[n].detach().cpu(), p)]
        return {"frozen_parameters": int(sum(p.numel() for p in self.frozen.values())),
                "frozen_unchanged": not changed, "frozen_changed": changed[:5]}


def _train(ctx: StageContext, stage: str, cfg: ExperimentConfig, init: Any,
           extra: list[TrainerHooks], source: Path) -> dict[str, Any]:
    trainer = Trainer(cfg, ctx.rt, resume=ctx.resume_training(stage, cfg),
                      hooks=[InitModel(init), *extra])
    model = trainer.engine.module
    check = FrozenCheck(model)  # as training starts: on its device, in its precision
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    summary = trainer.fit()
    return ctx.finish(stage, training_summary(summary) | check.report(model)
                      | {"router": cfg.adapters.router, "trainable_parameters": trainable,
                         "precision": str(next(model.parameters()).dtype),
                         "initialised_from": str(source)}, cfg)


def run_ad(ctx: StageContext) -> dict[str, Any]:
    cfg = adapter_stage_config(ctx, "ad")
    done = ctx.reuse("ad", cfg)
    if done is not None:
        return done
    source = ctx.require("backbone", "ad") / "checkpoints" / "export"
    backbone = load_export_weights(source)

    def init(model: nn.Module) -> None:
        load_backbone(model, backbone, source)
        freeze_base(model, cfg)

    return _train(ctx, "ad", cfg, init, [], source)


def run_gad(ctx: StageContext) -> dict[str, Any]:
    cfg = adapter_stage_config(ctx, "gad")
    done = ctx.reuse("gad", cfg)
    if done is not None:
        return done
    from_ad = cfg.gated.gad_init == "ad"
    ctx.require("ad" if from_ad else "backbone", "gad")  # read: a rerun makes GAD stale
    source = export_dir(ctx, "ad" if from_ad else "backbone")
    start = load_export_weights(source)
    extra: list[TrainerHooks] = []
    if cfg.gated.gate_loss == "kl":  # one row per training sentence, one column per adapter
        extra.append(TeacherProbs(load_probs(ctx, "train", "gad")))

    def init(model: nn.Module) -> None:
        if from_ad:  # AD's adapters, new gates
            load_matching(model, start, source, new=_gate_keys(model))
        else:  # MIX, new adapters and gates, as AD starts
            load_backbone(model, start, source)
        freeze_base(model, cfg)

    return _train(ctx, "gad", cfg, init, extra, source)


def run_tag(ctx: StageContext) -> dict[str, Any]:
    g = ctx.cfg.gated
    if not g.tag_prepared_dir:
        raise ConfigError("gated.tag_prepared_dir: the tag stage needs the corpora prepared "
                          "with data.domain_tags=true; got none")
    cfg = stage_config(ctx.cfg, ctx.stage_dir("tag"),
                       data={"prepared_dir": g.tag_prepared_dir},
                       adapters={"num_experts": 0, "router": "single", "k": 1},
                       optim={"lr": g.lr}, train={"max_steps": g.tag_steps})
    done = ctx.reuse("tag", cfg)
    if done is not None:
        return done
    source = ctx.require("backbone", "tag") / "checkpoints" / "export"
    tagged = Path(g.tag_prepared_dir)
    manifest = read_manifest(tagged)
    if not manifest.get("domain_tags"):
        raise ConfigError(f"gated.tag_prepared_dir: {tagged} was prepared without domain tags "
                          "(prepare it again with data.domain_tags=true)")
    spm = require_file(tagged / manifest["spm_model"], "the tagged data's sentencepiece model")
    if spm.read_bytes() != require_file(source / "spm.model", "MIX's sentencepiece model"
                                        ).read_bytes():
        raise ConfigError(f"gated.tag_prepared_dir: {tagged} has another sentencepiece model "
                          f"than the backbone; prepare the same corpora with the same data "
                          "settings plus data.domain_tags=true")
    backbone = load_export_weights(source)

    def init(model: nn.Module) -> None:
        load_matching(model, backbone, source, new=set())

    return _train(ctx, "tag", cfg, init, [], source)
