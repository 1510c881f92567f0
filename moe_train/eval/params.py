"""Parameter counting (`moe-train params`): training size and serving size of a config's model.

The model is built on the meta device, so even the 13B-parameter 128-expert Transformer-Big is
counted without allocating its weights. Counts follow the columns of seed 002 Table 1
("Effective No. of Parameters"):

- ``total`` (Train All): every distinct parameter (tied tables counted once).
- ``serving_all`` (Serving All): what a server must hold to translate one task. A side whose
  MoE layers route by *task* is static: every sentence of a task uses the same k experts, so
  the task's sub-network can be extracted and only those k experts per MoE layer are kept (the
  task -> experts choice is then a constant, so the task router's own parameters are dropped
  too). A side routed by *token* or *sentence* (or top-p, switch, gshard) decides at run time,
  so all E experts of every MoE layer (and the router) must be kept (seed 002 Sec. 3.2).
  Embedding tables and the output projection are always served.
- ``serving_decoder`` (Serving Dec.): the decoder part of ``serving_all``: the decoder layers
  and final norm, *without* the target embedding and output projection (Table 1: 25M for the
  142M Transformer-Base, whose decoder layers alone hold 25.2M).

The paper's models do not tie the source embedding, target embedding and softmax (142M for
Transformer-Base = 3 x 64k x 512 + 44M of layers), so its configs set
``model.tie_embeddings: false``; tied tables would be counted once here, as they are stored.

Besides the paper's columns the report has ``active_all`` / ``active_decoder``: the parameters
one token's forward pass multiplies with (dense parameters plus k experts per MoE layer for
every router; routers without a fixed k, i.e. top-p, are counted at their bound, all E).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.models.build import build_model
from moe_train.moe.experts import StackedExperts
from moe_train.moe.layer import MoELayer

SIDES = ("encoder", "decoder")
EMBEDDING_PREFIXES = ("embed_tokens.", "tgt_embed_tokens.", "output_proj.")
EXTRACTABLE_ROUTERS = ("task",)
"""Routers whose choice depends only on the task: their sub-network can be served alone."""


@dataclass
class _MoECount:
    """Parameter counts of one MoE layer."""

    side: str
    num_experts: int
    per_expert: int
    router: int
    k: int
    """Experts a token uses (num_experts for routers without a fixed k)."""
    extractable: bool

    @property
    def experts(self) -> int:
        return self.num_experts * self.per_expert

    def served(self) -> int:
        """Expert and router parameters a server keeps for one task."""
        if self.extractable:
            return self.k * self.per_expert
        return self.experts + self.router

    def active(self) -> int:
        """Expert and router parameters one token's forward pass uses."""
        return self.k * self.per_expert + self.router


def _side_of(name: str) -> str:
    """encoder, decoder, embeddings or other, from a parameter's qualified name."""
    if name.startswith(EMBEDDING_PREFIXES):
        return "embeddings"
    for side in SIDES:
        if name.startswith((f"{side}_layers.", f"{side}_norm.")):
            return side
    return "other"


def _moe_count(name: str, layer: MoELayer, seen_routers: set[int]) -> _MoECount:
    """Counts of one MoE layer; a router shared by several layers (one sentence-level decision
    for all of them) is counted with the first."""
    experts = layer.experts
    if not isinstance(experts, StackedExperts):
        raise TypeError(f"{name}.experts: expected a StackedExperts module, got "
                        f"{type(experts).__name__}")
    expert_numel = sum(p.numel() for _, p in experts.expert_parameters())
    router = layer.router
    num_experts = experts.num_experts
    k = int(getattr(router, "k", num_experts))
    return _MoECount(side=_side_of(name + "."), num_experts=num_experts,
                     per_expert=expert_numel // num_experts,
                     router=0 if id(router) in seen_routers else
                     sum(p.numel() for p in router.parameters()),
                     k=min(k, num_experts),
                     extractable=getattr(router, "name", "") in EXTRACTABLE_ROUTERS)


def count_model(model: nn.Module) -> dict[str, Any]:
    """The parameter report of a built model (see the module docstring for the definitions)."""
    by_part = {"embeddings": 0, "encoder": 0, "decoder": 0, "other": 0}
    for name, p in model.named_parameters():  # shared (tied) tensors are listed once
        by_part[_side_of(name)] += p.numel()
    seen: set[int] = set()
    moe = []
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, MoELayer):
            moe.append(_moe_count(name, m, seen))
            seen.add(id(m.router))
    report: dict[str, Any] = {"total": sum(by_part.values()), **by_part}
    for side in SIDES:
        layers = [c for c in moe if c.side == side]
        report[f"{side}_moe_layers"] = len(layers)
        report[f"{side}_num_experts"] = max((c.num_experts for c in layers), default=0)
        report[f"{side}_experts"] = sum(c.experts for c in layers)
        report[f"{side}_routers"] = sum(c.router for c in layers)
        moe_part = sum(c.experts + c.router for c in layers)
        report[f"serving_{side}"] = by_part[side] - moe_part + sum(c.served() for c in layers)
        report[f"active_{side}"] = by_part[side] - moe_part + sum(c.active() for c in layers)
    shared = by_part["embeddings"] + by_part["other"]
    report["serving_all"] = shared + report["serving_encoder"] + report["serving_decoder"]
    report["active_all"] = shared + report["active_encoder"] + report["active_decoder"]
    return report


def count_parameters(cfg: ExperimentConfig, vocab_size: int) -> dict[str, Any]:
    """Parameter report of the model `cfg` describes, built on the meta device (no memory).

    Keys (all ints, parameters): total, embeddings, encoder, decoder, other; per side
    ``{side}_moe_layers`` (a count), ``{side}_num_experts``, ``{side}_experts`` (expert
    parameters), ``{side}_routers``, ``serving_{side}``, ``active_{side}``; and serving_all,
    active_all. Also ``encoder_router`` / ``decoder_router`` (router names, "dense" when the
    side has no MoE layer) and ``vocab_size``.
    """
    with torch.device("meta"):
        model = build_model(cfg, {"vocab_size": vocab_size, "pad_id": 0})
    report = count_model(model)
    for side in SIDES:
        moe_side = cfg.moe.enabled and report[f"{side}_moe_layers"] > 0
        report[f"{side}_router"] = cfg.moe.router_name(side) if moe_side else "dense"
    report["vocab_size"] = vocab_size
    return report


def human(n: int) -> str:
    """A parameter count with a K/M/B unit: 533_000_000 -> '533.0M'."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


_ROWS = (
    ("total", "train all (total)"),
    ("embeddings", "  embeddings + output projection"),
    ("encoder", "  encoder"),
    ("encoder_experts", "    encoder experts"),
    ("encoder_routers", "    encoder routers"),
    ("decoder", "  decoder"),
    ("decoder_experts", "    decoder experts"),
    ("decoder_routers", "    decoder routers"),
    ("other", "  other"),
    ("serving_all", "serving all"),
    ("serving_encoder", "  serving encoder"),
    ("serving_decoder", "  serving decoder"),
    ("active_all", "active per token"),
    ("active_decoder", "  active per token, decoder"),
)


def format_params(report: dict[str, Any]) -> str:
    """A readable table of a `count_parameters` report (M/B units and exact counts)."""
    lines = []
    for side in SIDES:
        router = report.get(f"{side}_router", "?")
        if report[f"{side}_moe_layers"]:
            lines.append(f"{side}: {report[f'{side}_moe_layers']} MoE layers x "
                         f"{report[f'{side}_num_experts']} experts, router {router}")
        else:
            lines.append(f"{side}: dense")
    width = max(len(label) for _, label in _ROWS)
    for key, label in _ROWS:
        if key == "other" and not report[key]:
            continue
        lines.append(f"{label:<{width}}  {human(report[key]):>9}  {report[key]:>15,}")
    return "\n".join(lines)
