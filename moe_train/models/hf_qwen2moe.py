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

THOR-MoE (``moe.decoder_router=thor``, seed 003 OD-1): every sparse block gets a `ThorRouter`
and the model one `TaskPredictor`, run by the block `thor.predictor_layer` names (-1: the
first sparse block) on its FFN input, max-pooled over the prompt positions only
(``extras[PROMPT_MASK_KEY]``). The prompt is the source segment: under causal attention its
last position sees the whole source, so it plays the task token at the end of the source
segment and no [CLS] is added. E_p is computed once per forward and put into the shared
context before that block routes, so it and every later block read it; the task CE joins the
aux losses. While decoding, `new_routing_state` carries E_p (fixed at prefill) and each
block's causal context mean across calls; search reorders it with the KV cache.

Shape legend: B sequences, T positions, D hidden size, V vocabulary, E routed experts.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext, StateCell, per_sentence
from moe_train.models.layers import AuxLosses, add_aux
from moe_train.models.lm_batch import PROMPT_MASK_KEY
from moe_train.models.transformer import ModelOutput
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import SwiGLUExperts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router
from moe_train.moe.shared_expert import GatedSharedExpert
from moe_train.moe.thor_router import TaskPredictor


def _transformers():
    try:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    except ImportError as exc:  # a dependency, but say what is missing in one line
        raise ConfigError(f"model.arch: hf_qwen2_moe needs transformers>=5 ({exc})") from None
    return Qwen2MoeConfig, Qwen2MoeForCausalLM


def aux_coef_from_hf(router_aux_loss_coef: float, k: int, sparse_layers: int) -> float:
    """Our moe.aux_loss_coef for transformers' router_aux_loss_coef, so that the balance term
    added to the loss is the same at balanced routing. transformers computes one loss over all
    sparse layers' tokens pooled, with top-k fractions summing to k (k at balance); ours is a
    loss per layer with fractions summing to 1 (1 at balance), summed over the layers."""
    return float(f"{router_aux_loss_coef * k / sparse_layers:.12g}")


def aux_coef_to_hf(aux_loss_coef: float, k: int, sparse_layers: int) -> float:
    """transformers' router_aux_loss_coef for our moe.aux_loss_coef (`aux_coef_from_hf`'s
    inverse)."""
    return float(f"{aux_loss_coef * sparse_layers / k:.12g}")


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
        norm_topk_prob=moe.renormalize,
        router_aux_loss_coef=aux_coef_to_hf(moe.aux_loss_coef, moe.k, len(sparse)),
        output_router_logits=False)
    values.update(overrides)
    return Qwen2MoeConfig(**values)


class TaskState:
    """The task predictor's per-row extras (E_p, P^t; EMB1 unchanged), fixed at prefill."""

    def __init__(self, extras: dict[str, Any]) -> None:
        self.extras = extras

    def reorder(self, index_N: Tensor) -> None:
        rows = {k: v.index_select(0, index_N) for k, v in per_sentence(self.extras).items()}
        self.extras = {**self.extras, **rows}


class QwenRoutingState:
    """Routing state of one decoding batch: a `StateCell` per sparse block (THOR's prefix
    sums) and one for the task predictor's output; rows follow the KV cache (`reorder`)."""

    def __init__(self, num_blocks: int) -> None:
        self.cells = [StateCell() for _ in range(num_blocks)]
        self.task = StateCell()

    def reorder(self, index_N: Tensor) -> None:
        """Reorder, repeat or drop rows in place (beam search, batch pruning)."""
        for cell in (*self.cells, self.task):
            cell.reorder(index_N)


class BlockCalls:
    """What the MoE blocks of one model share during a forward: the batch's context (set by
    the model before the HF forward), the routing state while decoding, the task predictor
    (THOR) and the aux losses they return (summed per key)."""

    def __init__(self) -> None:
        self.ctx: ForwardContext | None = None
        self.state: QwenRoutingState | None = None
        self.predictor: TaskPredictor | None = None
        self.aux: AuxLosses = {}
        self.provided: dict[str, Any] = {}

    def start(self, ctx: ForwardContext, state: QwenRoutingState | None = None) -> None:
        """A new forward: this context, no aux losses yet. The context stays until the next
        forward, so that activation checkpointing can recompute a block in backward."""
        self.ctx, self.state, self.aux, self.provided = ctx, state, {}, {}

    def provide(self, x_BTD: Tensor) -> None:
        """Run the task predictor on the FFN input (pooled over the prompt positions) and put
        its extras into the shared context; with a filled state, reuse the prefill's."""
        ctx = self.ctx
        cell = None if self.state is None else self.state.task
        if cell is not None and cell.value is not None:
            extras = cell.value.extras
        else:
            prompt_BT = ctx.extras.get(PROMPT_MASK_KEY)
            pad_BT = ctx.tgt_pad_mask_BT if prompt_BT is None else ~prompt_BT.bool()
            extras, aux = self.predictor(x_BTD, ctx.replace(src_pad_mask_BS=pad_BT))
            add_aux(self.aux, aux)
            if cell is not None:
                cell.value = TaskState({k: (v.detach() if isinstance(v, Tensor) else v)
                                        for k, v in extras.items()})
        self.provided = dict(extras)
        self.ctx = ctx.replace(extras={**ctx.extras, **extras})


class QwenMoEBlock(nn.Module):
    """A Qwen2-MoE sparse block as transformers calls it: ``mlp(x_BTD) -> y_BTD``."""

    def __init__(self, moe: MoELayer, calls: BlockCalls, index: int = 0,
                 provides: bool = False) -> None:
        """`index`: this block's place among the sparse blocks (its routing state cell);
        `provides`: it runs the model's task predictor before routing (THOR)."""
        super().__init__()
        self.moe = moe
        self.calls = calls
        self.index, self.provides = index, provides

    def forward(self, x_BTD: Tensor) -> Tensor:
        if self.calls.ctx is None:
            raise RuntimeError("QwenMoEBlock: called outside Qwen2MoEForCausalLM.forward "
                               "(no ForwardContext)")
        if self.provides:
            self.calls.provide(x_BTD)
        ctx, state = self.calls.ctx, self.calls.state
        if state is not None:
            ctx = ctx.replace(state=state.cells[self.index])
        y_BTD, aux = self.moe(x_BTD, ctx)
        add_aux(self.calls.aux, aux)
        return y_BTD


def build_moe_block(cfg: ExperimentConfig, calls: BlockCalls, router_cfg, index: int = 0,
                    provides: bool = False) -> QwenMoEBlock:
    """One sparse block: registry router (THOR: with build.py's settings), local dispatcher,
    SwiGLU experts, shared expert."""
    from moe_train.models.build import num_thor_layers

    q, moe = cfg.qwen, cfg.moe
    D, E, std = q.hidden_size, moe.num_experts, q.initializer_range
    settings = {}
    if moe.router_name("decoder") == "thor":
        settings = {"thor": cfg.thor, "loss_scale": 1.0 / num_thor_layers(cfg)}
    router = build_router(moe.decoder_router, D, E, router_cfg, **settings)
    gate = getattr(getattr(router, "gate", None), "weight", None)
    if isinstance(gate, nn.Linear):  # Qwen initialises its router like every linear
        nn.init.normal_(gate.weight, mean=0.0, std=std)
    shared = (GatedSharedExpert(D, q.shared_expert_intermediate_size, std)
              if q.shared_expert_intermediate_size else None)
    layer = MoELayer(router, LocalDispatcher(E, moe.capacity_factor),
                     SwiGLUExperts(E, D, moe.expert_ffn_dim, init_std=std), dropout=0.0,
                     shared_expert=shared)
    return QwenMoEBlock(layer, calls, index, provides)


def predictor_layer(cfg: ExperimentConfig) -> int:
    """The sparse layer whose block runs the task predictor: `thor.predictor_layer`, -1 for
    the first sparse layer (which every THOR block follows, so it is the only other choice)."""
    first = sparse_layers(cfg)[0]
    layer = cfg.thor.predictor_layer
    if layer not in (-1, first):
        raise ConfigError(f"thor.predictor_layer: expected -1 or the first MoE layer ({first}) "
                          f"with model.arch hf_qwen2_moe, got {layer}")
    return first


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
        from moe_train.models.build import _pivot_id, router_config, thor_num_tasks

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
        # transformers 5.2x renamed forward's past_key_values to cache (the old name warns on
        # every call and is to be removed): the name this version takes
        self.cache_kw = ("cache" if "cache" in inspect.signature(self.hf.forward).parameters
                         else "past_key_values")
        rcfg = router_config(cfg, "decoder", manifest)
        thor = cfg.uses_thor
        if thor:  # a model attribute (``task_predictor.*``); BlockCalls only points at it
            self.task_predictor = TaskPredictor(cfg.qwen.hidden_size,
                                                thor_num_tasks(cfg, manifest or {}), cfg.thor,
                                                _pivot_id(cfg, manifest or {}))
            self.calls.predictor = self.task_predictor
        at = predictor_layer(cfg) if thor else -1
        self.num_blocks = 0
        for i in sparse_layers(cfg):
            self.hf.model.layers[i].mlp = build_moe_block(cfg, self.calls, rcfg,
                                                          self.num_blocks, provides=i == at)
            self.num_blocks += 1
        if cfg.model.activation_checkpointing:  # transformers' per-layer recomputation
            self.hf.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = int((manifest or {}).get("pad_id", 0))
        self.max_positions = cfg.qwen.max_position_embeddings
        self.positions_field = "qwen.max_position_embeddings"  # what messages name

    def forward(self, input_ids_BT: Tensor, ctx: ForwardContext | None = None,
                attention_mask_BT: Tensor | None = None, position_ids_BT: Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False,
                logits_to_keep: int = 0,
                routing_state: QwenRoutingState | None = None) -> ModelOutput:
        """Logits (B, T, V) of every position and the MoE blocks' aux losses.

        Padding is where `attention_mask_BT` is 0 (default: none; over the cached and the new
        positions when decoding with `past_key_values`); it is never routed. Positions count
        the real tokens before each one (left padding shifts nothing) unless given. With
        `use_cache`, ``extras["past_key_values"]`` holds transformers' cache for the next call.
        `logits_to_keep` > 0: logits of the last that many positions only (B, that, V).
        `routing_state` (`new_routing_state`, incremental decoding): the routers' state across
        calls, created at the first (prefill) call and reordered by the caller with the cache.
        """
        ctx = (ctx or ForwardContext()).replace(side="decoder")
        T = input_ids_BT.size(1)
        if attention_mask_BT is not None:
            if ctx.tgt_pad_mask_BT is None:
                ctx = ctx.replace(tgt_pad_mask_BT=attention_mask_BT[:, -T:].eq(0))
            if position_ids_BT is None:
                position_ids_BT = (attention_mask_BT.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
        self.calls.start(ctx, routing_state)
        out = self.hf(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                      position_ids=position_ids_BT, use_cache=use_cache,
                      logits_to_keep=logits_to_keep, **{self.cache_kw: past_key_values})
        extras = dict(self.calls.provided)  # THOR: task_probs_BK etc. (task accuracy)
        if use_cache:
            extras["past_key_values"] = getattr(out, self.cache_kw)
        return ModelOutput(out.logits, dict(self.calls.aux), extras)

    def new_routing_state(self) -> QwenRoutingState:
        """Empty routing state for a decoding batch (pass it to every `forward` call)."""
        return QwenRoutingState(self.num_blocks)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied tensors counted once)."""
        return sum(p.numel() for p in self.parameters())


def moe_blocks(model: nn.Module) -> list[QwenMoEBlock]:
    """The `QwenMoEBlock` modules of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, QwenMoEBlock)]


__all__ = ["PROMPT_MASK_KEY", "BlockCalls", "QwenRoutingState", "TaskState",
           "Qwen2MoEForCausalLM", "QwenMoEBlock", "build_moe_block",
           "moe_blocks", "qwen_hf_config", "sparse_layers"]
