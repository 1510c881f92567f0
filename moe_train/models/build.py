"""Build the model a config describes (the one place that maps config -> modules).

Dense FFNs everywhere unless `moe.num_experts > 0`; then the layers `moe.layers` selects on each
side get an `MoELayer` with that side's router (the encoder/decoder hybrids of seed 002), a
`LocalDispatcher` and stacked experts. A `sentence` router is built once per side and shared by
all of that side's MoE layers (one decision per sentence for every layer it serves). With
`adapters.num_experts > 0` every layer of the chosen sides gets an `AdapterSlot`: an MoE layer
over adapter experts whose sentence-level router is likewise shared by the side's layers.
Expert parallelism is wired in afterwards by moe_train.parallel, so the model itself never
knows about ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moe_train.config.schema import ExperimentConfig, ModelConfig
from moe_train.models.transformer import Seq2SeqTransformer, dense_ffn_factory
from moe_train.moe.adapters import AdapterExperts, AdapterSlot
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router, build_shared_router


def moe_ffn_factory(cfg: ExperimentConfig):
    """An ffn_factory placing MoE layers where `cfg.moe` says, dense FFNs elsewhere."""
    moe = cfg.moe
    shared: dict[str, nn.Module] = {}  # side -> its sentence router, built once

    def factory(side: str, layer_idx: int, mcfg: ModelConfig) -> nn.Module:
        num_layers = mcfg.encoder_layers if side == "encoder" else mcfg.decoder_layers
        if not moe.is_moe_layer(side, layer_idx, num_layers):
            return dense_ffn_factory(side, layer_idx, mcfg)
        name = moe.router_name(side)
        if name == "sentence":
            if side not in shared:
                shared[side] = build_shared_router(name, mcfg.d_model, moe.num_experts,
                                                   moe.router_config(side))
            router = shared[side]
        else:
            router = build_router(name, mcfg.d_model, moe.num_experts, moe.router_config(side))
        experts = Experts(moe.num_experts, mcfg.d_model, moe.expert_ffn_dim or mcfg.ffn_dim,
                          mcfg.activation, mcfg.activation_dropout)
        return MoELayer(router, LocalDispatcher(moe.num_experts, moe.capacity_factor), experts,
                        dropout=mcfg.dropout)

    return factory


def adapter_factory(cfg: ExperimentConfig):
    """An adapter_factory putting an `AdapterSlot` after every layer of `adapters.sides`."""
    acfg = cfg.adapters
    shared: dict[str, nn.Module] = {}

    def factory(side: str, layer_idx: int, mcfg: ModelConfig) -> nn.Module | None:
        if not acfg.on_side(side):
            return None
        if side not in shared:
            shared[side] = build_shared_router(acfg.router, mcfg.d_model, acfg.num_experts,
                                               acfg.router_config())
        experts = AdapterExperts(acfg.num_experts, mcfg.d_model, acfg.dim)
        dispatcher = LocalDispatcher(acfg.num_experts, acfg.capacity_factor)
        return AdapterSlot(MoELayer(shared[side], dispatcher, experts, dropout=0.0))

    return factory


def build_model(cfg: ExperimentConfig, manifest: dict[str, Any]) -> Seq2SeqTransformer:
    """A single-device Seq2SeqTransformer sized to the prepared data's vocabulary."""
    ffn_factory = moe_ffn_factory(cfg) if cfg.moe.enabled else None
    adapters = adapter_factory(cfg) if cfg.adapters.enabled else None
    return Seq2SeqTransformer(cfg.model, vocab_size=manifest["vocab_size"],
                              pad_id=manifest["pad_id"], ffn_factory=ffn_factory,
                              adapter_factory=adapters)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """(name, layer) of every MoE layer in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
