"""MoE configuration: the router settings (`RouterConfig`) and where MoE layers go (`MoEConfig`).

`MoEConfig` is the ``moe`` section of an experiment; it extends the router settings with the
layer placement, the router of each side (the encoder/decoder hybrids of seed 002 Table 1, e.g.
token routing in the encoder and target-language task routing in the decoder), the expert size
and the expert-parallel degree. Errors name the field as ``moe.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from moe_train.errors import ConfigError

TASK_SOURCES = ("lang_pair", "tgt_lang", "src_lang", "domain", "task_ids")
"""Where a sentence's task id comes from: its language pair, target or source language,
domain, or explicit task ids supplied with the batch."""

LAYER_PATTERNS = ("every_other", "all")


def _layer_list(layers: Any) -> str:
    """moe.layers as its string form: a YAML integer (``layers: 3``, ``moe.layers=3``) or list
    of integers (``[1, 3]``) becomes ``"3"`` / ``"1,3"``."""
    def index(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if index(layers):
        return str(layers)
    if isinstance(layers, (list, tuple)) and layers and all(index(v) for v in layers):
        return ",".join(str(v) for v in layers)
    if not isinstance(layers, str):
        raise ConfigError("moe.layers: expected every_other, all, or layer indices such as "
                          f"0,2,4, [0, 2, 4] or 3, got {layers!r}")
    return layers


def task_count(source: str, manifest: dict) -> int:
    """Number of tasks of a task source in a prepared data manifest (0 when it names none)."""
    langs, domains = len(manifest.get("langs", [])), len(manifest.get("domains", []))
    return {"domain": domains, "tgt_lang": langs, "src_lang": langs, "other_lang": langs,
            "lang_pair": langs * langs}.get(source, 0)

ROUTER_NAMES = ("gated", "gshard", "gumbel", "random", "sentence", "single", "switch", "task",
                "thor", "topk", "topp")
"""The names moe_train.moe.registry.ROUTERS registers (kept equal by a test); checked here so
a misspelt router fails when the config is read, naming its field."""


def _expect(cond: bool, path: str, expected: str, got: object) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


MAX_SIZE = 2**31 - 1
"""Largest dimension, vocabulary, length or row count a config may give (an int32 index; no real
model comes near it): an absurd value fails here, naming its field, not inside torch."""
MAX_LAYERS = 1024
"""Most layers a stack may have (no real model has more)."""
MAX_EXPERTS = 65536
"""Most experts (or adapters) a layer may have (no real model has more)."""
_LIMITS = {
    "size": (MAX_SIZE, "a size below 2**31 (no real model has a larger dimension, vocabulary "
             "or length)"),
    "layers": (MAX_LAYERS, f"at most {MAX_LAYERS} layers (no real model has more)"),
    "experts": (MAX_EXPERTS, f"at most {MAX_EXPERTS} (no real model has more experts)"),
}


def _at_most(kind: str, obj: object, section: str, *names: str) -> None:
    """Upper bounds of the integer fields `names` of `obj` (kind: size, layers or experts)."""
    limit, expected = _LIMITS[kind]
    for name in names:
        value = getattr(obj, name)
        _expect(value <= limit, f"{section}.{name}", expected, value)


BALANCE_LOSSES = ("switch", "cv2")
"""`RouterConfig.balance_loss` values."""


@dataclass
class RouterConfig:
    """Router settings (the ``moe.*`` router fields); checked on construction."""

    k: int = 2
    """Experts per token for topk / sentence / task routers (switch is 1, gshard 2, topp
    varies); at most the number of experts (checked when the router is built)."""
    renormalize: bool = True
    """topk router: renormalise the k weights to sum 1; False keeps the raw softmax
    probabilities (Qwen's ``norm_topk_prob: false``, e.g. Qwen1.5-MoE-A2.7B)."""
    second_expert_sampling: bool = True
    """gshard router, training only: a token goes to its second expert with probability
    min(1, 2 g2), g2 its renormalised second weight (GShard's random routing, Sec. 2.2), so a
    small second weight frees the expert's capacity and compute; false: always (plain top-2).
    Evaluation is deterministic top-2 either way."""
    capacity_factor: float = 0.0
    """Expert capacity as a multiple of the even share T*K/E, read by the dispatcher;
    0 means dropless (no token is ever dropped)."""
    noisy_gating: bool = False
    """Add Shazeer's learned Gaussian noise, softplus(x W_noise) * N(0, 1), to the router logits
    (training only)."""
    jitter_eps: float = 0.0
    """Multiply router inputs by Uniform(1 - eps, 1 + eps) (training only; Switch uses 0.01)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (`balance_loss`; 0 disables it)."""
    balance_loss: str = "switch"
    """switch: E * sum_e f_e P_e (Switch Transformer; GShard's with first choices). cv2: SGMoE's
    CV(Importance)^2 + CV(Load)^2 of Shazeer et al. (2017), each weighted by aux_loss_coef, Load
    from the noise's smooth estimator: sentence router with noisy_gating only."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE; 0 disables it)."""
    entropy_coef: float = 1e-4
    """Weight of the top-p entropy (dynamic routing) loss, delta in THOR-MoE Eq. 15."""
    top_p: float = 0.5
    """Top-p threshold in (0, 1]: the mass the chosen experts must reach (THOR-MoE uses 0.5)."""
    task_source: str = "lang_pair"
    """Task of a sentence for the task router: lang_pair, tgt_lang, src_lang, domain or
    task_ids."""
    num_tasks: int = 0
    """Number of task ids (language pairs = num_langs^2, languages, domains) for the learned
    task router; 0 with a fixed `assignment` means its number of rows."""
    assignment: list[list[int]] = field(default_factory=list)
    """Fixed task -> experts table for the task router: row i lists the k experts of task i
    (each gets weight 1/k unless `assignment_weights` says otherwise). Empty: the task router
    learns its gate."""
    assignment_weights: list[list[float]] = field(default_factory=list)
    """Combine weights of the fixed `assignment`, row by row (k non-negative numbers per row,
    e.g. a learned GATE(task) frozen into a table); empty: 1/k each."""
    sentence_pool: str = "mean"
    """How the sentence router condenses a sentence: mean over its non-pad tokens."""
    tau: float = 1.0
    """Gumbel-Max temperature of the `gumbel` router (MoA Eq. 8): the sampled candidate follows
    softmax(top-k(s) / tau); 0 means no sampling (top-1, as at inference)."""

    section: ClassVar[str] = "moe"
    """Config section named in error messages."""

    def __post_init__(self) -> None:
        s = self.section
        _expect(self.k >= 1, f"{s}.k", "a positive integer", self.k)
        _at_most("experts", self, s, "k")
        _expect(self.capacity_factor >= 0, f"{s}.capacity_factor",
                "a non-negative number (0: dropless)", self.capacity_factor)
        _expect(0.0 <= self.jitter_eps < 1.0, f"{s}.jitter_eps", "a number in [0, 1)",
                self.jitter_eps)
        for name in ("aux_loss_coef", "z_loss_coef", "entropy_coef"):
            _expect(getattr(self, name) >= 0, f"{s}.{name}", "a non-negative number",
                    getattr(self, name))
        _expect(self.balance_loss in BALANCE_LOSSES, f"{s}.balance_loss",
                f"one of {', '.join(BALANCE_LOSSES)}", self.balance_loss)
        _expect(self.balance_loss != "cv2" or self.noisy_gating or not self.aux_loss_coef,
                f"{s}.noisy_gating", "true with balance_loss cv2 (Load is the probability, "
                "under the gate's noise, that an expert stays in the top k)", self.noisy_gating)
        _expect(0.0 < self.top_p <= 1.0, f"{s}.top_p", "a number in (0, 1]", self.top_p)
        _expect(self.task_source in TASK_SOURCES, f"{s}.task_source",
                f"one of {', '.join(TASK_SOURCES)}", self.task_source)
        _expect(self.num_tasks >= 0, f"{s}.num_tasks", "a non-negative integer", self.num_tasks)
        _at_most("size", self, s, "num_tasks")
        _expect(self.tau >= 0, f"{s}.tau", "a non-negative temperature (0: plain top-1)",
                self.tau)
        _expect(self.sentence_pool == "mean", f"{s}.sentence_pool", "mean", self.sentence_pool)
        for i, row in enumerate(self.assignment):
            where = f"{s}.assignment[{i}]"
            _expect(isinstance(row, (list, tuple)) and len(row) == self.k, where,
                    f"a list of moe.k ({self.k}) expert ids", row)
            _expect(all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in row),
                    where, "non-negative integer expert ids", row)
            _expect(len(set(row)) == len(row), where, "distinct expert ids", row)
        if self.assignment_weights:
            _expect(len(self.assignment_weights) == len(self.assignment),
                    f"{s}.assignment_weights", f"one row per moe.assignment row "
                    f"({len(self.assignment)})", len(self.assignment_weights))
        for i, row in enumerate(self.assignment_weights):
            _expect(isinstance(row, (list, tuple)) and len(row) == self.k
                    and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0
                            for w in row), f"{s}.assignment_weights[{i}]",
                    f"a list of moe.k ({self.k}) non-negative weights", row)
        if self.assignment and self.num_tasks:
            _expect(self.num_tasks == len(self.assignment), f"{s}.num_tasks",
                    f"the number of moe.assignment rows ({len(self.assignment)})", self.num_tasks)


@dataclass
class MoEConfig(RouterConfig):
    """The ``moe`` section: router settings plus placement, sizes and expert parallelism."""

    num_experts: int = 0
    """Experts per MoE layer; 0 keeps the model dense (no MoE layer anywhere)."""
    layers: str | int | list[int] = "every_other"
    """Which layers of a side are MoE: every_other (layers 1, 3, 5, ... counting from 0, as in
    GShard and seed 002; a one-layer side's layer 0), all, or 0-based layer indices: ``1,3``,
    a YAML list ``[1, 3]`` or one index ``3`` (kept as the string ``"1,3"`` / ``"3"``)."""
    encoder_router: str = "topk"
    """Router of the encoder's MoE layers (see moe_train.moe.registry.ROUTERS); "dense" keeps
    the encoder dense."""
    decoder_router: str = "topk"
    """Router of the decoder's MoE layers; "dense" keeps the decoder dense."""
    encoder_task_source: str = "lang_pair"
    """Task id of the encoder's task router: lang_pair, tgt_lang, src_lang, domain or task_ids."""
    decoder_task_source: str = "tgt_lang"
    """Task id of the decoder's task router: lang_pair, tgt_lang, src_lang, domain or task_ids."""
    encoder_num_experts: int = 0
    """Experts per encoder MoE layer; 0 means `num_experts` (seed 002 sizes each side)."""
    decoder_num_experts: int = 0
    """Experts per decoder MoE layer; 0 means `num_experts`."""
    encoder_task_table: int = 0
    """Rows of a frozen task table the encoder's task router keeps in its state instead of a
    gate or `assignment`: row n holds task n's experts and combine weights in each layer, read
    from the checkpoint; a row of -1 ids is a task the model does not serve. Written by
    `moe-train extract`; 0: no table."""
    decoder_task_table: int = 0
    """The decoder's `encoder_task_table`."""
    extracted_task: str = ""
    """The task a sub-network was extracted for (`moe-train extract`); empty for a full model."""
    expert_ffn_dim: int = 0
    """Inner dimension of each expert FFN; 0 means model.ffn_dim."""
    ep_size: int = 1
    """Expert-parallel degree: the experts of a layer are spread over this many ranks; must
    divide num_experts and the world size."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _expect(self.num_experts >= 0, "moe.num_experts", "a non-negative integer",
                self.num_experts)
        _expect(self.expert_ffn_dim >= 0, "moe.expert_ffn_dim", "a non-negative integer",
                self.expert_ffn_dim)
        _expect(self.ep_size >= 1, "moe.ep_size", "a positive integer", self.ep_size)
        _at_most("experts", self, "moe", "num_experts", "encoder_num_experts",
                 "decoder_num_experts", "ep_size")
        _at_most("size", self, "moe", "expert_ffn_dim", "encoder_task_table",
                 "decoder_task_table")
        if self.num_experts:
            _expect(self.num_experts % self.ep_size == 0, "moe.num_experts",
                    f"a multiple of moe.ep_size ({self.ep_size})", self.num_experts)
        for side in ("encoder", "decoder"):
            name = f"{side}_num_experts"
            value = getattr(self, name)
            _expect(value >= 0, f"moe.{name}", "a non-negative integer (0: moe.num_experts)",
                    value)
            _expect(value % self.ep_size == 0, f"moe.{name}",
                    f"a multiple of moe.ep_size ({self.ep_size})", value)
            # num_experts 0 is a dense model: a per-side count alone built no expert
            _expect(not value or self.num_experts, f"moe.{name}",
                    "0 unless moe.num_experts > 0 (moe.num_experts 0 is a dense model; set it "
                    "too)", value)
            name = f"{side}_task_table"
            _expect(getattr(self, name) >= 0, f"moe.{name}", "a non-negative number of rows",
                    getattr(self, name))
            _expect(not getattr(self, name) or self.router_name(side) == "task", f"moe.{name}",
                    f"0 unless moe.{side}_router is task", getattr(self, name))
            name = f"{side}_router"
            _expect(getattr(self, name) in ("dense", *ROUTER_NAMES), f"moe.{name}",
                    f"dense or one of {', '.join(ROUTER_NAMES)}", getattr(self, name))
            name = f"{side}_task_source"
            _expect(getattr(self, name) in TASK_SOURCES, f"moe.{name}",
                    f"one of {', '.join(TASK_SOURCES)}", getattr(self, name))
        self.layers = _layer_list(self.layers)
        if self.layers not in LAYER_PATTERNS:
            parts = [p.strip() for p in self.layers.split(",")]
            _expect(all(p.isascii() and p.isdigit() for p in parts) and parts, "moe.layers",
                    "every_other, all, or a comma list of layer indices such as 0,2,4",
                    self.layers)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def router_name(self, side: str) -> str:
        return getattr(self, f"{side}_router")

    def learned_task_router(self, side: str) -> bool:
        """Whether `side` routes by a learned GATE(task) (not a fixed assignment, not a frozen
        table): its number of tasks is `num_tasks`, or the data's when that is 0."""
        return (self.enabled and self.router_name(side) == "task" and not self.assignment
                and not getattr(self, f"{side}_task_table"))

    def side_experts(self, side: str) -> int:
        """Experts per MoE layer of `side`: its own count, else `num_experts`."""
        return getattr(self, f"{side}_num_experts") or self.num_experts

    def is_moe_layer(self, side: str, layer_idx: int, num_layers: int) -> bool:
        """Whether layer `layer_idx` (0-based) of `side` gets an MoE FFN."""
        if not self.enabled or self.router_name(side) == "dense":
            return False
        if self.layers == "all":
            return True
        if self.layers == "every_other":
            return layer_idx % 2 == 1 or num_layers == 1
        wanted = {int(p) for p in self.layers.split(",")}
        bad = sorted(i for i in wanted if i >= num_layers)
        if bad:
            raise ConfigError(f"moe.layers: layer {bad[0]} does not exist ({side} has "
                              f"{num_layers} layers)")
        return layer_idx in wanted

    def router_config(self, side: str) -> RouterConfig:
        """The plain router settings of one side (its task source filled in)."""
        values = {f.name: getattr(self, f.name) for f in fields(RouterConfig)}
        values["task_source"] = getattr(self, f"{side}_task_source")
        if getattr(self, f"{side}_task_table"):  # the table replaces the fixed assignment
            values["assignment"], values["assignment_weights"] = [], []
        return RouterConfig(**values)
