"""The router registry: `moe.*_router` names -> router classes, and `build_router`."""

from __future__ import annotations

from typing import Any

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe.gated_router import GatedRouter
from moe_train.moe.gating import Router, _expect
from moe_train.moe.moa_router import (GumbelMaxRouter, RandomSentenceRouter, SharedRouter,
                                      SingleRouter)
from moe_train.moe.router import GShardRouter, SwitchRouter, TopKRouter, TopPRouter
from moe_train.moe.sentence_router import SentenceRouter, TaskRouter
from moe_train.moe.thor_router import ThorRouter

ROUTERS: dict[str, type[Router]] = {
    "gated": GatedRouter,
    "gshard": GShardRouter,
    "gumbel": GumbelMaxRouter,
    "random": RandomSentenceRouter,
    "sentence": SentenceRouter,
    "single": SingleRouter,
    "switch": SwitchRouter,
    "task": TaskRouter,
    "thor": ThorRouter,
    "topk": TopKRouter,
    "topp": TopPRouter,
}
"""Router name (``moe.router``) -> class; every class takes (d_model, num_experts, cfg), and
some keyword settings of their own (thor: ``thor``, ``loss_scale``; gated: ``gated``)."""


def build_router(name: str, d_model: int, num_experts: int, cfg: RouterConfig,
                 **settings: Any) -> Router:
    """The router registered as `name`; unknown names and impossible k are ConfigErrors.
    `settings` go to the router's constructor (see `ROUTERS`)."""
    if name not in ROUTERS:
        known = ", ".join(sorted(ROUTERS))
        raise ConfigError(f"moe.router: unknown router {name!r} (known: {known})")
    _expect(num_experts >= 1, "moe.num_experts", "a positive integer", num_experts)
    if cfg.balance_loss != "switch" and name != "sentence":
        raise ConfigError(f"moe.balance_loss: {cfg.balance_loss} (SGMoE's importance and load "
                          f"losses) is built for the sentence router, got router {name!r}")
    return ROUTERS[name](d_model, num_experts, cfg, **settings)


SENTENCE_LEVEL_ROUTERS = ("sentence", "gumbel", "random", "single", "task")
"""Routers whose decision depends only on the sentence (its representation or task), never on a
layer's token states: one `SharedRouter` can serve every adapter layer of a stack."""


def build_shared_router(name: str, d_model: int, num_experts: int, cfg: RouterConfig
                        ) -> SharedRouter:
    """A sentence-level router wrapped to make one decision per forward for all its layers."""
    if name not in SENTENCE_LEVEL_ROUTERS:
        raise ConfigError(f"moe.router: {name!r} routes tokens, so it cannot be shared across "
                          f"layers (sentence-level routers: {', '.join(SENTENCE_LEVEL_ROUTERS)})")
    return SharedRouter(build_router(name, d_model, num_experts, cfg))
