"""Build the model a config describes (the one place that maps config -> modules).

Dense FFNs everywhere unless `moe.num_experts > 0`; then the layers `moe.layers` selects on each
side get an `MoELayer` with that side's router (the encoder/decoder hybrids of seed 002), a
`LocalDispatcher` and stacked experts. A `sentence` router is built once per side and shared by
all of that side's MoE layers (one decision per sentence for every layer it serves). With
`adapters.num_experts > 0` every layer of the chosen sides gets an `AdapterSlot`: an MoE layer
over adapter experts whose sentence-level router is likewise shared by the side's layers.
A side routed by ``thor`` gets a `ThorRouter` per MoE layer (its losses averaged over those
layers) and the model one `TaskPredictor` (a context provider at `thor.predictor_layer`) and a
[CLS] source position (the decoder-only Qwen wires its own predictor, no [CLS]:
moe_train.models.hf_qwen2moe). Expert parallelism is wired in afterwards by
moe_train.parallel, so the model itself never knows about ranks.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from moe_train.config.moe import RouterConfig, task_count
from moe_train.config.schema import ExperimentConfig, ModelConfig
from moe_train.models.transformer import Seq2SeqTransformer, dense_ffn_factory
from moe_train.moe.adapters import AdapterExperts, AdapterSlot
from moe_train.moe.dispatcher import DenseDispatcher, LocalDispatcher
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router, build_shared_router
from moe_train.moe.thor_router import TaskPredictor
from moe_train.errors import ConfigError


def router_config(cfg: ExperimentConfig, side: str, manifest: dict[str, Any] | None):
    """The side's router settings; a learned task router without `moe.num_tasks` gets the
    data's number of tasks of its source."""
    rcfg = cfg.moe.router_config(side)
    if cfg.moe.learned_task_router(side) and not rcfg.num_tasks and manifest is not None:
        rcfg.num_tasks = task_count(rcfg.task_source, manifest)
    return rcfg


def dispatcher(router: str, num_experts: int, k: int, capacity_factor: float):
    """`DenseDispatcher` where every token uses all of the layer's experts: a task router
    with k = E (an extracted sub-network keeps its task's k experts), dropless (with k = E a
    capacity of at least 1 never drops); `LocalDispatcher` otherwise."""
    if router == "task" and k == num_experts and (capacity_factor == 0 or capacity_factor >= 1):
        return DenseDispatcher(num_experts, capacity_factor)
    return LocalDispatcher(num_experts, capacity_factor)


@contextmanager
def named_fields(names: dict[str, str]) -> Iterator[None]:
    """Routers name their settings as the ``moe.*`` fields; a router built from another section
    (adapters.*) or a side's own field (moe.decoder_num_experts, moe.decoder_router) has its
    errors name that field instead."""
    try:
        yield
    except ConfigError as exc:
        message = str(exc)
        pattern = "|".join(re.escape(old) for old in names)
        raise ConfigError(re.sub(rf"(?<![\w.])({pattern})(?![\w])",
                                 lambda m: names[m.group(1)], message)) from None


def _side_fields(moe: Any, side: str) -> dict[str, str]:
    names = {"moe.router": f"moe.{side}_router"}
    if getattr(moe, f"{side}_num_experts"):
        names["moe.num_experts"] = f"moe.{side}_num_experts"
    return names


ADAPTER_FIELDS = {**{f"moe.{f.name}": f"adapters.{f.name}" for f in fields(RouterConfig)},
                  "moe.num_experts": "adapters.num_experts", "moe.router": "adapters.router"}
"""An adapter router's settings are the adapters section's own (AdapterConfig extends
RouterConfig): its errors name them."""


def moe_ffn_factory(cfg: ExperimentConfig, manifest: dict[str, Any] | None = None):
    """An ffn_factory placing MoE layers where `cfg.moe` says, dense FFNs elsewhere."""
    moe = cfg.moe
    shared: dict[str, nn.Module] = {}  # side -> its sentence router, built once

    def factory(side: str, layer_idx: int, mcfg: ModelConfig) -> nn.Module:
        num_layers = mcfg.encoder_layers if side == "encoder" else mcfg.decoder_layers
        if not moe.is_moe_layer(side, layer_idx, num_layers):
            return dense_ffn_factory(side, layer_idx, mcfg)
        name, num_experts = moe.router_name(side), moe.side_experts(side)
        rcfg = router_config(cfg, side, manifest)
        settings = {}
        if name == "thor":
            settings = {"thor": cfg.thor, "loss_scale": 1.0 / num_thor_layers(cfg)}
        if name == "task":
            settings = {"task_table": getattr(moe, f"{side}_task_table")}
        with named_fields(_side_fields(moe, side)):
            if name == "sentence":
                if side not in shared:
                    shared[side] = build_shared_router(name, mcfg.d_model, num_experts, rcfg)
                router = shared[side]
            else:
                router = build_router(name, mcfg.d_model, num_experts, rcfg, **settings)
        experts = Experts(num_experts, mcfg.d_model, moe.expert_ffn_dim or mcfg.ffn_dim,
                          mcfg.activation, mcfg.activation_dropout)
        return MoELayer(router, dispatcher(name, num_experts, rcfg.k, moe.capacity_factor),
                        experts, dropout=mcfg.dropout)

    return factory


def adapter_factory(cfg: ExperimentConfig):
    """An adapter_factory putting an `AdapterSlot` after every layer of `adapters.sides`:
    sentence-level routers are shared by a side's layers; a `gated` router is one soft gate
    per layer over all adapters (`DenseDispatcher`)."""
    acfg = cfg.adapters
    shared: dict[str, nn.Module] = {}

    def factory(side: str, layer_idx: int, mcfg: ModelConfig) -> nn.Module | None:
        if not acfg.on_side(side):
            return None
        experts = AdapterExperts(acfg.num_experts, mcfg.d_model, acfg.dim,
                                 activation_dropout=acfg.activation_dropout)
        if acfg.router == "gated":
            with named_fields(ADAPTER_FIELDS):
                router = build_router("gated", mcfg.d_model, acfg.num_experts,
                                      acfg.router_config(), gated=cfg.gated)
            return AdapterSlot(MoELayer(router, DenseDispatcher(acfg.num_experts), experts,
                                        dropout=acfg.dropout))
        if side not in shared:
            with named_fields(ADAPTER_FIELDS):
                shared[side] = build_shared_router(acfg.router, mcfg.d_model, acfg.num_experts,
                                                   acfg.router_config())
        dispatcher = LocalDispatcher(acfg.num_experts, acfg.capacity_factor)
        return AdapterSlot(MoELayer(shared[side], dispatcher, experts,
                                    dropout=acfg.dropout))

    return factory


def _thor_layers(cfg: ExperimentConfig, side: str) -> list[int]:
    num = cfg.model.encoder_layers if side == "encoder" else cfg.model.decoder_layers
    if cfg.decoder_only:  # hf_qwen2_moe: its sparse layers, no encoder
        num = cfg.qwen.num_hidden_layers if side == "decoder" else 0
    if cfg.moe.router_name(side) != "thor":
        return []
    return [i for i in range(num) if cfg.moe.is_moe_layer(side, i, num)]


def num_thor_layers(cfg: ExperimentConfig) -> int:
    """MoE layers routed by thor, both sides (THOR's losses are averaged over them)."""
    return max(len(_thor_layers(cfg, "encoder")) + len(_thor_layers(cfg, "decoder")), 1)


def thor_num_tasks(cfg: ExperimentConfig, manifest: dict[str, Any]) -> int:
    """K: `thor.num_tasks`, or the number of tasks of `thor.task_source` in the data."""
    if cfg.thor.num_tasks:
        return cfg.thor.num_tasks
    num = task_count(cfg.thor.task_source, manifest)
    if num < 1:
        raise ConfigError(f"thor.num_tasks: the data names no {cfg.thor.task_source} tasks; "
                          "expected a positive thor.num_tasks")
    return num


def _pivot_id(cfg: ExperimentConfig, manifest: dict[str, Any]) -> int | None:
    """The language id of thor.pivot_lang when the task is the other language of the pair."""
    if cfg.thor.task_source != "other_lang":
        return None
    langs = list(manifest.get("langs", []))
    if cfg.thor.pivot_lang not in langs:
        raise ConfigError(f"thor.pivot_lang: expected one of the data's languages "
                          f"({', '.join(langs) or 'none'}), got {cfg.thor.pivot_lang!r}")
    return langs.index(cfg.thor.pivot_lang)


def thor_predictor_layer(cfg: ExperimentConfig) -> int:
    """Encoder layer whose input the task predictor reads (see `ThorConfig.predictor_layer`);
    no encoder THOR layer may come before it."""
    enc = _thor_layers(cfg, "encoder")
    layer = cfg.thor.predictor_layer
    if layer == -1:
        return enc[0] if enc else cfg.model.encoder_layers
    if layer > cfg.model.encoder_layers:
        raise ConfigError(f"thor.predictor_layer: expected at most model.encoder_layers "
                          f"({cfg.model.encoder_layers}), got {layer}")
    if enc and layer > enc[0]:
        raise ConfigError(f"thor.predictor_layer: expected at most {enc[0]} (the first encoder "
                          f"THOR layer needs the task representation), got {layer}")
    return layer


def build_model(cfg: ExperimentConfig, manifest: dict[str, Any]) -> nn.Module:
    """The single-device model of `model.arch`: a Seq2SeqTransformer sized to the prepared
    data's vocabulary, or the decoder-only Qwen2-MoE (moe_train.models.hf_qwen2moe)."""
    if cfg.decoder_only:
        from moe_train.models.hf_qwen2moe import Qwen2MoEForCausalLM

        return Qwen2MoEForCausalLM(cfg, manifest)
    ffn_factory = moe_ffn_factory(cfg, manifest) if cfg.moe.enabled else None
    adapters = adapter_factory(cfg) if cfg.adapters.enabled else None
    providers = {}
    if cfg.uses_thor:
        providers[thor_predictor_layer(cfg)] = TaskPredictor(
            cfg.model.d_model, thor_num_tasks(cfg, manifest), cfg.thor, _pivot_id(cfg, manifest))
    return Seq2SeqTransformer(cfg.model, vocab_size=manifest["vocab_size"],
                              pad_id=manifest["pad_id"], ffn_factory=ffn_factory,
                              adapter_factory=adapters, providers=providers,
                              cls_token=cfg.uses_thor)


class _SkipInit(TorchFunctionMode):
    """Returns the tensor of every random or constant initialisation untouched."""

    SKIPPED = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_,
                         nn.init.constant_, nn.init.kaiming_uniform_, torch.Tensor.normal_,
                         torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def skip_init() -> Iterator[None]:
    """Modules built inside leave their parameters as allocated: for a model whose every
    parameter is loaded next (strict) or that only gives names and shapes. The random and
    constant fills of `torch.nn.init` and of tensors are skipped (through a torch function
    mode, not by replacing torch.nn.init's functions: transformers keeps references to them
    when first imported, possibly inside): no random init to overwrite, and on the meta device
    none of the Python meta kernels whose first use imports torch._dynamo (2-3 s)."""
    with _SkipInit():
        yield


def shape_model(cfg: ExperimentConfig, manifest: dict[str, Any]) -> nn.Module:
    """`build_model` on the meta device, uninitialised: names, shapes and counts, no memory."""
    with torch.device("meta"), skip_init():
        return build_model(cfg, manifest)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """(name, layer) of every MoE layer in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
