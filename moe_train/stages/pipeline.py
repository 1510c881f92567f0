"""Stage-wise recipes: which stages run, in which order (`moe-train pipeline moa|gad`).

moa -- MoA (gumbel adapter router): backbone -> features -> cluster -> distill -> adapters ->
evaluate. The baselines share the machinery: Switch-SL / SGMoE-SL (`sentence` router) and ADPT
(`task` router by domain) skip features / cluster / distill; with ``adapters.num_experts: 0``
the recipe is the backbone alone (Mixed-nat).
gad -- Gated Adapters (seed 004): backbone (MIX, no pre-injected adapter) -> [tag] ->
classifier -> ad -> gad -> evaluate; `tag` runs when ``gated.tag_prepared_dir`` is set.
Each stage is reused when finished, so rerunning the pipeline resumes it; ``--stage`` runs one
stage (its inputs must exist), after a look over the stages before it that names any made from
something else (`StageContext.upstream_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from moe_train.errors import ConfigError
from moe_train.stages import (adapters, backbone, classifier, cluster, distill, evaluate,
                              features, gad, gad_eval)
from moe_train.stages.common import NotFinished, StageContext, moa_stages

Stage = Callable[[StageContext], dict[str, Any]]
RECIPES: dict[str, dict[str, Stage]] = {
    "moa": {"backbone": backbone.run, "features": features.run, "cluster": cluster.run,
            "distill": distill.run, "adapters": adapters.run, "evaluate": evaluate.run},
    "gad": {"backbone": backbone.run, "tag": gad.run_tag, "classifier": classifier.run,
            "ad": gad.run_ad, "gad": gad.run_gad, "evaluate": gad_eval.run},
}
STAGES = sorted({name for stages in RECIPES.values() for name in stages})


def recipe_stages(ctx: StageContext, recipe: str = "moa") -> list[str]:
    """The stages of this config's recipe, in order."""
    if recipe == "gad":
        tag = ["tag"] if ctx.cfg.gated.tag_prepared_dir else []
        return ["backbone", *tag, "classifier", "ad", "gad", "evaluate"]
    return moa_stages(ctx.cfg)


def check_request(recipe: str, stage: str | None) -> None:
    """A known recipe and stage (checked before any process group starts)."""
    if recipe not in RECIPES:
        raise ConfigError(f"pipeline: unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    if stage is not None and stage not in RECIPES[recipe]:
        raise ConfigError(f"--stage: unknown stage {stage!r} of recipe {recipe} (known: "
                          f"{', '.join(RECIPES[recipe])})")


def recipe_context(ctx: StageContext, recipe: str) -> StageContext:
    """The context the recipe's stages see. gad: the backbone is MIX, a plain Transformer, and
    AD / GAD train adapters and gates only, whatever moa.pre_inject / moa.unfreeze_decoder
    (MoA's settings) say."""
    cfg = ctx.cfg
    if recipe == "gad":
        moa = dataclasses.replace(cfg.moa, pre_inject=False, unfreeze_decoder=False)
        cfg = dataclasses.replace(cfg, moa=moa)
    return StageContext(cfg, ctx.rt, recipe, rerun_stale=ctx.rerun_stale,
                        process_provenance=ctx.process_provenance)


def run_pipeline(ctx: StageContext, recipe: str = "moa", stage: str | None = None
                 ) -> dict[str, Any]:
    """Run the recipe (or one `stage` of it); returns {stage: summary}."""
    check_request(recipe, stage)
    ctx = recipe_context(ctx, recipe)
    if recipe == "gad":  # what the later stages need, before the first one trains
        gad.check_recipe_config(ctx.cfg)
    order = recipe_stages(ctx, recipe)
    if recipe == "moa":
        adapters.check_recipe_config(ctx)
        if "features" in order:
            features.check_recipe_config(ctx.cfg)
    if stage is not None:
        if stage not in order and recipe == "moa":  # gad's optional tag stage says why itself
            raise ConfigError(f"--stage: {stage} is not a stage of this config's moa recipe "
                              f"({', '.join(order)}: adapters.router and adapters.num_experts "
                              f"decide)")
        look = dataclasses.replace(ctx, upstream_of=stage, read={})
        for name in order[:order.index(stage)] if stage in order else []:
            try:
                RECIPES[recipe][name](look)  # returns at once: reuse() never lets it run
            except NotFinished:
                pass  # the stage's own require() says so if it needs it
        order = [stage]
    done = {}
    for name in order:
        try:
            done[name] = RECIPES[recipe][name](ctx)
        finally:  # a failed stage leaves its directory free (and no lock file behind)
            ctx.release(name)
    return done
