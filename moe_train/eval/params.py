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
one token's forward pass multiplies with (dense parameters, routers, and the experts a token
uses in each MoE layer). ``{side}_experts_per_token`` says how many experts that is: the fixed
k of top-k / switch / gshard / sentence / task routing (THOR top-k: moe.k inside S^t), exact;
for top-p it depends on the data (Eqs. 5-7: as many as reach the mass p), so the count is its
upper bound, ``{side}_experts_per_token_exact`` is false and the table says "at most": E for
plain top-p, |S^t| (``thor.num_candidates``) for THOR top-p with candidate sets. The measured
average (003 Table 7) comes from a run: `moe-train routing-stats` / benchmarks/thor.py.

THOR-MoE (seed 003) adds, besides its per-layer routers (token gate E x D, task gate E x D,
context gate 2D x D + D or 2D x 1 + 1: all under ``{side}_routers``), one task predictor (W^p
K x D and the task embedding table EMB1 K x D) and the [CLS] vector (D), both under ``other``
and itemised as ``thor_*`` keys (see `count_parameters`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.models.build import shape_model
from moe_train.moe.adapters import AdapterExperts
from moe_train.moe.experts import StackedExperts
from moe_train.moe.layer import MoELayer
from moe_train.moe.thor_router import TaskPredictor, ThorRouter

SIDES = ("encoder", "decoder")
EMBEDDING_PREFIXES = ("embed_tokens.", "tgt_embed_tokens.", "output_proj.",
                      "hf.model.embed_tokens.", "hf.lm_head.")
DECODER_ONLY_PREFIXES = ("hf.model.layers.", "hf.model.norm.")
"""The decoder-only Qwen2-MoE's layers and final norm count as its decoder."""
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
    """Experts a token uses; for top-p (data-dependent) its upper bound."""
    exact: bool
    """Whether `k` is fixed by the router (False: top-p, `k` is the bound)."""
    extractable: bool
    routing: str
    """How a token picks its experts, for the table (e.g. "top-p p=0.5 inside |S^t|=4")."""
    kind: str = "MoE"
    """"MoE" (FFN experts) or "adapter" (adapter experts beside the FFN)."""

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
    return "decoder" if name.startswith(DECODER_ONLY_PREFIXES) else "other"


def experts_per_token(router: nn.Module, num_experts: int) -> tuple[int, bool, str]:
    """(experts one token uses, whether that is exact, how they are chosen) for a router: its
    k; for top-p the upper bound (all E, or THOR's |S^t|), not exact."""
    name = getattr(router, "name", "")
    if isinstance(router, ThorRouter):
        space = router.set_size
        inside = f"inside |S^t|={space} of {num_experts}" if router.candidates else \
            f"over all {space}"
        if router.thor.token_routing == "topk":
            k = min(router.cfg.k, space)
            return k, True, f"top-{k} {inside}"
        return space, False, f"top-p p={router.cfg.top_p} {inside}"
    if name == "topp":
        return num_experts, False, f"top-p p={router.cfg.top_p} over all {num_experts}"
    if name == "gated":  # Gated Adapters: a soft mixture of all adapters
        return num_experts, True, f"all {num_experts} (soft gate)"
    if name == "gumbel":  # MoA: one adapter per sentence, drawn among the k best
        return 1, True, f"1 of the top-{min(router.k, num_experts)} (Gumbel-Max)"
    k = min(int(getattr(router, "k", num_experts)), num_experts)
    return k, hasattr(router, "k"), f"top-{k}"


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
    k, exact, routing = experts_per_token(router, num_experts)
    return _MoECount(side=_side_of(name + "."), num_experts=num_experts,
                     per_expert=expert_numel // num_experts,
                     router=0 if id(router) in seen_routers else
                     sum(p.numel() for p in router.parameters()),
                     k=k, exact=exact,
                     extractable=getattr(router, "name", "") in EXTRACTABLE_ROUTERS,
                     routing=routing,
                     kind="adapter" if isinstance(experts, AdapterExperts) else "MoE")


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _thor_parts(model: nn.Module) -> dict[str, int]:
    """THOR-MoE's own parameters, itemised (empty for a model without THOR routing)."""
    predictors = [m for m in model.modules() if isinstance(m, TaskPredictor)]
    routers = {id(m): m for m in model.modules() if isinstance(m, ThorRouter)}.values()
    if not predictors and not routers:
        return {}
    cls = getattr(model, "cls_embed_D", None)
    return {"thor_num_tasks": sum(p.num_tasks for p in predictors),
            "thor_predictor": sum(_numel(p) for p in predictors),
            "thor_cls": 0 if cls is None else cls.numel(),
            "thor_token_gates": sum(_numel(r.gate) for r in routers),
            "thor_task_gates": sum(_numel(r.task_gate) for r in routers),
            "thor_context_gates": sum(_numel(r.context_gate) for r in routers)}


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
        report[f"{side}_experts_per_token"] = max((c.k for c in layers), default=0)
        report[f"{side}_experts_per_token_exact"] = all(c.exact for c in layers)
        report[f"{side}_routing"] = layers[0].routing if layers else "dense"
        # FFN experts and adapters on one side: each kind on its own
        groups = Counter((c.kind, c.num_experts, c.routing, c.k, c.exact) for c in layers)
        report[f"{side}_layer_groups"] = [
            {"kind": kind, "layers": n, "num_experts": e, "routing": r,
             "experts_per_token": k, "exact": x} for (kind, e, r, k, x), n in groups.items()]
    shared = by_part["embeddings"] + by_part["other"]
    report["serving_all"] = shared + report["serving_encoder"] + report["serving_decoder"]
    report["active_all"] = shared + report["active_encoder"] + report["active_decoder"]
    report.update(_thor_parts(model))
    return report


def count_parameters(cfg: ExperimentConfig, vocab_size: int,
                     manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parameter report of the model `cfg` describes, built on the meta device (no memory).

    Keys (all ints, parameters): total, embeddings, encoder, decoder, other; per side
    ``{side}_moe_layers`` (a count), ``{side}_num_experts``, ``{side}_experts`` (expert
    parameters), ``{side}_routers``, ``serving_{side}``, ``active_{side}``; and serving_all,
    active_all. Also ``encoder_router`` / ``decoder_router`` (router names, "dense" when the
    side has no MoE layer), per side ``{side}_experts_per_token`` (the experts per token counted
    in ``active_{side}``), ``{side}_experts_per_token_exact`` (false: a top-p bound) and
    ``{side}_routing`` (a description), and ``vocab_size``. A model routed by THOR also has
    ``thor_num_tasks`` (K), ``thor_predictor`` (W^p + EMB1: 2 K D), ``thor_cls`` (D), and, over
    all its THOR layers, ``thor_token_gates``, ``thor_task_gates`` and ``thor_context_gates``.
    """
    if manifest is None:
        _need_num_tasks(cfg)
        # No data: THOR's pivot language counts as the only language (ids do not change the
        # parameter count; numbers of tasks come from the config).
        manifest = {"langs": [cfg.thor.pivot_lang]}
    model = shape_model(cfg, {**manifest, "vocab_size": vocab_size, "pad_id": 0})
    report = count_model(model)
    for side in SIDES:
        router = "dense"
        if report[f"{side}_moe_layers"] > 0:
            router = cfg.moe.router_name(side) if cfg.moe.enabled else cfg.adapters.router
        report[f"{side}_router"] = router
    # the embedding's rows: a decoder-only model's table may be larger than its tokenizer
    report["vocab_size"] = cfg.qwen.vocab_size if cfg.decoder_only else vocab_size
    report["decoder_only"] = cfg.decoder_only
    return report


def _need_num_tasks(cfg: ExperimentConfig, command: str = "params") -> None:
    """Without the prepared data, numbers of tasks must come from the config (`command`: the
    one messages name)."""
    if cfg.uses_thor and not cfg.thor.num_tasks:
        raise ConfigError(f"thor.num_tasks: 0 takes K from the prepared data, which `{command}` "
                          "does not read; expected the number of tasks (e.g. "
                          "thor.num_tasks=5 for five domains)")
    for side in SIDES:
        if cfg.moe.learned_task_router(side) and not cfg.moe.num_tasks:
            raise ConfigError(f"moe.num_tasks: 0 takes the number of {side} tasks from the "
                              f"prepared data, which `{command} --config` does not read; "
                              "expected the number of tasks"
                              + (" (or use `params --checkpoint`)" if command == "params"
                                 else ""))


def human(n: int) -> str:
    """A parameter count with a K/M/B unit: 533_000_000 -> '533.0M'; 999_999 -> '1.0M' (not
    '1000.0K': a unit whose rounding reaches 1000 gives way to the next)."""
    units = (("", 1, 0), ("K", 10**3, 1), ("M", 10**6, 1), ("B", 10**9, 2))
    i = max(j for j, (_, scale, _) in enumerate(units) if j == 0 or abs(n) >= scale)
    while True:
        unit, scale, digits = units[i]
        text = str(n) if scale == 1 else f"{n / scale:.{digits}f}"
        if abs(float(text)) < 1000 or i == len(units) - 1:
            return text + unit
        i += 1


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
    ("thor_predictor", "    THOR task predictor (W^p, EMB1)"),
    ("thor_cls", "    THOR [CLS] vector"),
    ("thor_context_gates", "  THOR context gates (in routers)"),
    ("thor_task_gates", "  THOR task gates (in routers)"),
    ("serving_all", "serving all"),
    ("serving_encoder", "  serving encoder"),
    ("serving_decoder", "  serving decoder"),
    ("active_all", "active per token"),
    ("active_decoder", "  active per token, decoder"),
)


def format_params(report: dict[str, Any]) -> str:
    """A readable table of a `count_parameters` report (M/B units and exact counts)."""
    lines = []
    decoder_only = bool(report.get("decoder_only"))
    for side in SIDES:
        if side == "encoder" and decoder_only:  # no encoder at all, not a dense one
            lines.append("encoder: none (decoder-only model)")
            continue
        router = report.get(f"{side}_router", "?")
        groups = report.get(f"{side}_layer_groups") or []
        if len(groups) > 1:
            lines.append(f"{side}: " + "; ".join(
                f"{g['layers']} {g['kind']} layers x {g['num_experts']} experts, {g['routing']}, "
                + (f"{g['experts_per_token']} per token" if g["exact"] else
                   f"at most {g['experts_per_token']} per token") for g in groups))
        elif report[f"{side}_moe_layers"]:
            k = report.get(f"{side}_experts_per_token")
            per_token = "" if k is None else (
                f", {k} expert{'s' * (k != 1)} per token"
                if report[f"{side}_experts_per_token_exact"] else
                f", experts per token data-dependent (at most {k}: active counts {k})")
            lines.append(f"{side}: {report[f'{side}_moe_layers']} MoE layers x "
                         f"{report[f'{side}_num_experts']} experts, router {router}: "
                         f"{report.get(f'{side}_routing', router)}{per_token}")
        else:
            lines.append(f"{side}: dense")
    bound = not all(report.get(f"{side}_experts_per_token_exact", True) for side in SIDES)
    width = max(len(label) for _, label in _ROWS) + (len(" (upper bound)") if bound else 0)
    for key, label in _ROWS:
        if key not in report or (key == "other" and not report[key]) or (
                decoder_only and "encoder" in key):
            continue
        if bound and key.startswith("active_"):
            label += " (upper bound)"
        lines.append(f"{label:<{width}}  {human(report[key]):>9}  {report[key]:>15,}")
    return "\n".join(lines)
