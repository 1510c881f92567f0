"""Decoder-only Hugging Face Qwen2-MoE whose sparse blocks are moe_train MoE layers.

`build_qwen2_moe` builds transformers' ``Qwen2MoeForCausalLM`` from the config's ``qwen`` and
``moe`` sections and gives every sparse layer a `QwenMoEBlock` as its ``mlp``: our `MoELayer`
with a router from the registry (``topk`` with ``moe.renormalize`` is Qwen's softmax top-k and
its ``norm_topk_prob``), the local dispatcher (the all-to-all one under expert parallelism,
wired in by moe_train.parallel like for the seq2seq model), `SwiGLUExperts` and the
sigmoid-gated shared expert. Attention, RMSNorms, rotary embeddings and the LM head stay
transformers' own modules, so its attention kernels and KV cache work unchanged.

transformers calls ``mlp(hidden_states)`` with no side inputs, so the blocks read the batch's
`ForwardContext` from one `BlockCalls` object that `Qwen2MoEForCausalLM.forward` fills before
each forward (no global), and add their aux losses to it. The sparse blocks transformers
builds are never allocated at full size: the HF model is built with one-expert, width-1
placeholders, which the blocks then replace.

Shape legend: B sequences, T positions, D hidden size, V vocabulary, E routed experts.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext
from moe_train.models.layers import AuxLosses, add_aux
from moe_train.models.transformer import ModelOutput
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import SwiGLUExperts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router
from moe_train.moe.shared_expert import GatedSharedExpert


def _transformers():
    try:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    except ImportError as exc:  # a dependency, but say what is missing in one line
        raise ConfigError(f"model.arch: hf_qwen2_moe needs transformers>=5 ({exc})") from None
    return Qwen2MoeConfig, Qwen2MoeForCausalLM


def sparse_layers(cfg: ExperimentConfig) -> list[int]:
    """Indices of the layers whose MLP is an MoE block (`moe.layers` over the decoder)."""
    n = cfg.qwen.num_hidden_layers
    return [i for i in range(n) if cfg.moe.is_moe_layer("decoder", i, n)]


def qwen_hf_config(cfg: ExperimentConfig, **overrides: Any):
    """transformers' Qwen2MoeConfig of the model `cfg` describes (`overrides` replace fields)."""
    Qwen2MoeConfig, _ = _transformers()
    q, moe = cfg.qwen, cfg.moe
    sparse = set(sparse_layers(cfg))
    values = dict(
        vocab_size=q.vocab_size, hidden_size=q.hidden_size,
        intermediate_size=q.intermediate_size, num_hidden_layers=q.num_hidden_layers,
        num_attention_heads=q.num_attention_heads, num_key_value_heads=q.num_key_value_heads,
        hidden_act="silu", max_position_embeddings=q.max_position_embeddings,
        initializer_range=q.initializer_range, rms_norm_eps=q.rms_norm_eps,
        tie_word_embeddings=q.tie_word_embeddings, qkv_bias=q.qkv_bias,
        rope_parameters={"rope_type": "default", "rope_theta": q.rope_theta},
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(q.num_hidden_layers)
                                                if i not in sparse],
        num_experts=moe.num_experts, num_experts_per_tok=moe.k,
        moe_intermediate_size=moe.expert_ffn_dim,
        shared_expert_intermediate_size=q.shared_expert_intermediate_size,
        norm_topk_prob=moe.renormalize, router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False)
    values.update(overrides)
    return Qwen2MoeConfig(**values)


class BlockCalls:
    """What the MoE blocks of one model share during a forward: the batch's context (set by
    the model before the HF forward) and the aux losses they return (summed per key)."""

    def __init__(self) -> None:
        self.ctx: ForwardContext | None = None
        self.aux: AuxLosses = {}

    def start(self, ctx: ForwardContext) -> None:
        """A new forward: this context, no aux losses yet. The context stays until the next
        forward, so that activation checkpointing can recompute a block in backward."""
        self.ctx, self.aux = ctx, {}


class QwenMoEBlock(nn.Module):
    """A Qwen2-MoE sparse block as transformers calls it: ``mlp(x_BTD) -> y_BTD``."""

    def __init__(self, moe: MoELayer, calls: BlockCalls) -> None:
        super().__init__()
        self.moe = moe
        self.calls = calls

    def forward(self, x_BTD: Tensor) -> Tensor:
        ctx = self.calls.ctx
        if ctx is None:
            raise RuntimeError("QwenMoEBlock: called outside Qwen2MoEForCausalLM.forward "
                               "(no ForwardContext)")
        y_BTD, aux = self.moe(x_BTD, ctx)
        add_aux(self.calls.aux, aux)
        return y_BTD


def build_moe_block(cfg: ExperimentConfig, calls: BlockCalls, router_cfg) -> QwenMoEBlock:
    """One sparse block: registry router, local dispatcher, SwiGLU experts, shared expert."""
    q, moe = cfg.qwen, cfg.moe
    D, E, std = q.hidden_size, moe.num_experts, q.initializer_range
    router = build_router(moe.decoder_router, D, E, router_cfg)
    gate = getattr(getattr(router, "gate", None), "weight", None)
    if isinstance(gate, nn.Linear):  # Qwen initialises its router like every linear
        nn.init.normal_(gate.weight, mean=0.0, std=std)
    shared = (GatedSharedExpert(D, q.shared_expert_intermediate_size, std)
              if q.shared_expert_intermediate_size else None)
    layer = MoELayer(router, LocalDispatcher(E, moe.capacity_factor),
                     SwiGLUExperts(E, D, moe.expert_ffn_dim, init_std=std), dropout=0.0,
                     shared_expert=shared)
    return QwenMoEBlock(layer, calls)


class Qwen2MoEForCausalLM(nn.Module):
    """transformers' Qwen2MoeForCausalLM (as ``hf``) with `QwenMoEBlock` sparse blocks.

    ``forward(input_ids_BT, ctx, attention_mask_BT)`` returns a `ModelOutput` with the logits
    and the blocks' aux losses; parameter names are ``hf.`` + transformers' names, except
    inside the blocks (``hf.model.layers.{i}.mlp.moe.*``; moe_train.models.hf_io maps them).
    """

    decoder_only = True
    """Read by evaluation and training code that serves both architectures."""

    def __init__(self, cfg: ExperimentConfig, manifest: dict[str, Any] | None = None) -> None:
        super().__init__()
        from moe_train.models.build import router_config  # build.py dispatches here

        _, HFModel = _transformers()
        self.cfg = cfg
        vocab = (manifest or {}).get("vocab_size", cfg.qwen.vocab_size)
        if vocab > cfg.qwen.vocab_size:
            raise ConfigError(f"qwen.vocab_size: expected at least the tokenizer's "
                              f"{vocab} tokens, got {cfg.qwen.vocab_size}")
        self.calls = BlockCalls()
        # Placeholders of one expert, width 1, replaced below: never a full-size HF block.
        placeholder = qwen_hf_config(cfg, num_experts=1, num_experts_per_tok=1,
                                     moe_intermediate_size=1, shared_expert_intermediate_size=1)
        self.hf = HFModel(placeholder)
        self.hf.config = qwen_hf_config(cfg)
        rcfg = router_config(cfg, "decoder", manifest)
        for i in sparse_layers(cfg):
            self.hf.model.layers[i].mlp = build_moe_block(cfg, self.calls, rcfg)
        if cfg.model.activation_checkpointing:  # transformers' per-layer recomputation
            self.hf.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = int((manifest or {}).get("pad_id", 0))
        self.max_positions = cfg.qwen.max_position_embeddings

    def forward(self, input_ids_BT: Tensor, ctx: ForwardContext | None = None,
                attention_mask_BT: Tensor | None = None, position_ids_BT: Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False,
                logits_to_keep: int = 0) -> ModelOutput:
        """Logits (B, T, V) of every position and the MoE blocks' aux losses.

        Padding is where `attention_mask_BT` is 0 (default: none; over the cached and the new
        positions when decoding with `past_key_values`); it is never routed. Positions count
        the real tokens before each one (left padding shifts nothing) unless given. With
        `use_cache`, ``extras["past_key_values"]`` holds transformers' cache for the next call.
        `logits_to_keep` > 0: logits of the last that many positions only (B, that, V).
        """
        ctx = (ctx or ForwardContext()).replace(side="decoder")
        T = input_ids_BT.size(1)
        if attention_mask_BT is not None:
            if ctx.tgt_pad_mask_BT is None:
                ctx = ctx.replace(tgt_pad_mask_BT=attention_mask_BT[:, -T:].eq(0))
            if position_ids_BT is None:
                position_ids_BT = (attention_mask_BT.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        self.calls.start(ctx)
        out = self.hf(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                      position_ids=position_ids_BT, past_key_values=past_key_values,
                      use_cache=use_cache, logits_to_keep=logits_to_keep)
        extras = {"past_key_values": out.past_key_values} if use_cache else {}
        return ModelOutput(out.logits, dict(self.calls.aux), extras)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied tensors counted once)."""
        return sum(p.numel() for p in self.parameters())


def moe_blocks(model: nn.Module) -> list[QwenMoEBlock]:
    """The `QwenMoEBlock` modules of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, QwenMoEBlock)]


__all__ = ["BlockCalls", "Qwen2MoEForCausalLM", "QwenMoEBlock", "build_moe_block",
           "moe_blocks", "qwen_hf_config", "sparse_layers"]
