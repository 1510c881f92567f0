"""Stage `adapters`: K adapter experts per layer on the frozen backbone (MoA Sec. 4.3).

The model is the backbone plus an `AdapterSlot` after every decoder layer (and every encoder
layer for ``adapters.sides: both``, the ADPT baseline). Before training:
- every parameter the backbone has is loaded from it;
- with ``moa.pre_inject`` each layer's K adapters start as copies of its pre-injected adapter;
- the `gumbel` router (MoA) gets the distilled gate, frozen; learned routers (the Switch-SL /
  SGMoE-SL `sentence` baselines, a learned `task` gate) train with the adapters;
- the backbone is frozen (``moa.unfreeze_decoder``: the decoder layers train too, "Unf-D").
Training then runs on the usual trainer (DeepSpeed, data + expert parallel: adapters are
experts, so ``moe.ep_size`` spreads them over ranks). Artifact: ``checkpoints/export``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.moe.adapters import AdapterSlot
from moe_train.stages.common import StageContext, load_matching, stage_config, training_summary
from moe_train.stages.distill import GATE, load_gate
from moe_train.train.export import load_export_weights
from moe_train.train.trainer import Trainer
from moe_train.train.hooks import InitModel

STAGE = "adapters"
LEARNED_ROUTERS = ("sentence", "switch", "topk", "gshard", "task", "gated")


def adapters_config(ctx: StageContext) -> ExperimentConfig:
    """The adapter stage's training config (K = moa.num_clusters for the gumbel router)."""
    cfg = ctx.cfg
    adapters: dict[str, Any] = {}
    if cfg.adapters.router == "gumbel":
        adapters["num_experts"] = cfg.moa.num_clusters
    optim: dict[str, Any] = {"lr": cfg.moa.adapter_lr}
    if cfg.moa.adapter_warmup_steps is not None:
        optim["warmup_steps"] = cfg.moa.adapter_warmup_steps
    return stage_config(cfg, ctx.stage_dir(STAGE), adapters=adapters, optim=optim,
                        train={"max_steps": cfg.moa.adapter_steps})


def check_recipe_config(ctx: StageContext) -> None:
    """The adapter stage's model, built on the meta device before the moa recipe's first stage:
    what only that model reads (adapters.k against moa.num_clusters, the router's settings)
    fails now, not after the backbone, features, clustering and distillation have run."""
    from moe_train.eval.params import count_parameters

    cfg = ctx.cfg
    if cfg.adapters.router == "gumbel" and cfg.adapters.sides != "decoder":
        raise ConfigError(f"adapters.sides: the distilled MoA gate reads the final encoder "
                          f"output, which encoder-side gates never see; expected decoder, got "
                          f"{cfg.adapters.sides!r}")
    if cfg.adapters.router == "gated" and cfg.gated.gate_loss == "kl":
        raise ConfigError("gated.gate_loss: kl distils the gad recipe's domain classifier, "
                          "which the moa recipe has none of; expected ce here (or run "
                          "`moe-train pipeline gad`)")
    count_parameters(adapters_config(ctx), cfg.data.vocab_size)


def load_backbone(model: nn.Module, backbone: dict[str, torch.Tensor], source: Path) -> None:
    """Load every non-adapter weight; adapter weights are handled by `_init_adapters`."""
    load_matching(model, {k: v for k, v in backbone.items() if ".adapter." not in k}, source,
                  new={k for k in model.state_dict() if ".adapter." in k})


def _init_adapters(model: nn.Module, backbone: dict[str, torch.Tensor], pre_inject: bool) -> int:
    """Copy each pre-injected (single) adapter into all K adapters of its layer; returns the
    number of layers initialised that way."""
    copied = 0
    for name, module in model.named_modules():
        if not isinstance(module, AdapterSlot) or not pre_inject:
            continue
        prefix = f"{name}.moe.experts."
        for pname, param in module.moe.experts.named_parameters():
            source = backbone.get(prefix + pname)
            if source is None:
                break
            with torch.no_grad():
                param.copy_(source[:1].expand_as(param))
        else:
            copied += 1
    return copied


DECODER_PARTS = ("decoder_layers.", "decoder_norm.", "tgt_embed_tokens.", "output_proj.")
"""What Unf-D trains besides the adapters: the decoder (000 Sec. 4.3, theta = the decoder and
the adapters), except a table it shares with the encoder (tied embeddings: the encoder feeds
the gate and stays as it was)."""


def freeze_base(model: nn.Module, cfg: ExperimentConfig) -> None:
    """Train only the adapters, learned routers and (Unf-D) the decoder."""
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, AdapterSlot):
            module.moe.experts.requires_grad_(True)
            if cfg.adapters.router in LEARNED_ROUTERS:
                module.moe.router.requires_grad_(True)
    if cfg.moa.unfreeze_decoder:
        encoder = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
                   if not name.startswith(DECODER_PARTS)}
        for name, p in model.named_parameters():
            if name.startswith(DECODER_PARTS) and ".adapter." not in name and \
                    id(p) not in encoder:
                p.requires_grad_(True)


def make_init(ctx: StageContext, cfg: ExperimentConfig):
    """The trainer's `init_model` hook for this stage."""
    export = ctx.require("backbone", STAGE) / "checkpoints" / "export"
    backbone = load_export_weights(export)
    gate = load_gate(ctx, STAGE) if cfg.adapters.router == "gumbel" else None
    gate_file = ctx.stage_dir("distill") / GATE

    def init_model(model: nn.Module) -> None:
        load_backbone(model, backbone, export)
        _init_adapters(model, backbone, cfg.moa.pre_inject)
        if gate is not None:
            for module in model.modules():
                if isinstance(module, AdapterSlot):
                    load_matching(module.moe.router.inner.gate, gate, gate_file, set())
        freeze_base(model, cfg)

    return init_model


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = adapters_config(ctx)
    done = ctx.reuse(STAGE, cfg)
    if done is not None:
        return done
    init_model = make_init(ctx, cfg)
    trainer = Trainer(cfg, ctx.rt, resume=ctx.resume_training(STAGE, cfg),
                      hooks=[InitModel(init_model)])
    trainable = sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
    summary = trainer.fit()
    return ctx.finish(STAGE, training_summary(summary)
                      | {"router": cfg.adapters.router, "num_adapters": cfg.adapters.num_experts,
                         "trainable_parameters_local": trainable}, cfg)
