"""Stage `backbone`: the Transformer trained on the mixed corpus (MoA Sec. 4.1).

With ``moa.pre_inject`` one adapter is injected after every decoder layer and trained with the
backbone; the adapter stage copies it into all K adapters ("Pre-A"). Without it this is the
plain backbone ("Mixed-nat", and the "naive MoA" ablation's starting point). Resumable: an
interrupted run continues from its last checkpoint. Artifact: ``export/`` (standalone weights).
"""

from __future__ import annotations

from typing import Any

from moe_train.stages.common import StageContext, stage_config, training_summary
from moe_train.train.trainer import Trainer

STAGE = "backbone"


def backbone_config(ctx: StageContext):
    """The backbone's training config: one pre-injected decoder adapter (or none; dropless,
    whatever adapters.capacity_factor says for the adapter stage's K), no EP."""
    cfg = ctx.cfg
    adapters = {"num_experts": 1 if cfg.moa.pre_inject else 0, "router": "single",
                "sides": "decoder", "k": 1, "capacity_factor": 0.0}
    return stage_config(cfg, ctx.stage_dir(STAGE), adapters=adapters,
                        moe={"ep_size": 1 if not cfg.moe.enabled else cfg.moe.ep_size})


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = backbone_config(ctx)
    done = ctx.reuse(STAGE, cfg)
    if done is not None:
        return done
    summary = Trainer(cfg, ctx.rt, resume=ctx.resume_training(STAGE, cfg)).fit()
    return ctx.finish(STAGE, training_summary(summary)
                      | {"pre_inject": cfg.moa.pre_inject}, cfg)
