"""Stage-wise recipes: which stages run, in which order (`moe-train pipeline moa`).

MoA (gumbel adapter router): backbone -> features -> cluster -> distill -> adapters -> evaluate.
The baselines share the machinery: Switch-SL / SGMoE-SL (`sentence` router) and ADPT (`task`
router by domain) skip features / cluster / distill; with ``adapters.num_experts: 0`` the recipe
is the backbone alone (Mixed-nat). Each stage is reused when finished, so rerunning the pipeline
resumes it; ``--stage`` runs one stage (its inputs must exist).
"""

from __future__ import annotations

from typing import Any, Callable

from moe_train.errors import ConfigError
from moe_train.stages import adapters, backbone, cluster, distill, evaluate, features
from moe_train.stages.common import StageContext

STAGES: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "backbone": backbone.run,
    "features": features.run,
    "cluster": cluster.run,
    "distill": distill.run,
    "adapters": adapters.run,
    "evaluate": evaluate.run,
}
RECIPES = ("moa",)


def recipe_stages(ctx: StageContext) -> list[str]:
    """The stages of this config's recipe, in order."""
    a = ctx.cfg.adapters
    if a.router == "gumbel":  # K = moa.num_clusters adapters
        return ["backbone", "features", "cluster", "distill", "adapters", "evaluate"]
    if not a.enabled:
        return ["backbone", "evaluate"]
    return ["backbone", "adapters", "evaluate"]


def check_request(recipe: str, stage: str | None) -> None:
    """A known recipe and stage (checked before any process group starts)."""
    if recipe not in RECIPES:
        raise ConfigError(f"pipeline: unknown recipe {recipe!r} (known: {', '.join(RECIPES)})")
    if stage is not None and stage not in STAGES:
        raise ConfigError(f"--stage: unknown stage {stage!r} (known: {', '.join(STAGES)})")


def run_pipeline(ctx: StageContext, recipe: str = "moa", stage: str | None = None
                 ) -> dict[str, Any]:
    """Run the recipe (or one `stage` of it); returns {stage: summary}."""
    check_request(recipe, stage)
    order = recipe_stages(ctx) if stage is None else [stage]
    return {name: STAGES[name](ctx) for name in order}
