"""Pre-norm encoder-decoder Transformer for NMT, with pluggable FFN and adapter slots.

Each layer's FFN comes from ``ffn_factory(side, layer_idx, cfg)`` (dense `FeedForward` by
default; an MoE layer later) and its optional adapter from ``adapter_factory``. Whatever aux
losses those modules return are summed per key into `ModelOutput.aux_losses`. The model knows
nothing about ranks or distribution.

Context providers compute model-provided router inputs once per sentence: provider ``i`` is
called as ``provider(x_BSD, ctx) -> (extras, aux)`` on the encoder's residual stream before
layer i (i = number of layers: on the normed encoder output); its extras join
`ForwardContext.extras` for every later slot and the whole decoder (`EncoderOut.extras`), its
aux losses the model's. THOR's task predictor is one. An optional learned [CLS] vector is
prepended to every source (position 0; never padding).

Shape legend: B batch, S source length, T target length, D model dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from moe_train.config.schema import ModelConfig
from moe_train.models.context import SENTENCE_REPR_KEY, ForwardContext, mean_pool, per_sentence
from moe_train.models.layers import (
    AuxLosses,
    DecoderLayer,
    DecoderLayerCache,
    EncoderLayer,
    FeedForward,
    SinusoidalPositions,
    add_aux,
)

FFNFactory = Callable[[str, int, ModelConfig], nn.Module]
AdapterFactory = Callable[[str, int, ModelConfig], "nn.Module | None"]


def dense_ffn_factory(side: str, layer_idx: int, cfg: ModelConfig) -> nn.Module:
    """The default FFN slot: a dense `FeedForward` built from the config."""
    return FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.activation_dropout,
                       cfg.dropout)


def no_adapter_factory(side: str, layer_idx: int, cfg: ModelConfig) -> None:
    """The default adapter slot: no adapter."""
    return None


@dataclass
class ModelOutput:
    """Result of a full forward pass."""

    logits_BTV: Tensor
    aux_losses: AuxLosses = field(default_factory=dict)
    """Aux losses of all FFN / adapter slots and providers (both stacks), summed per key."""
    extras: dict[str, Any] = field(default_factory=dict)
    """What the context providers computed (e.g. task_probs_BK), for metrics and hooks."""


@dataclass
class EncoderOut:
    """Encoder result, consumed by `decode`."""

    states_BSD: Tensor
    pad_mask_BS: Tensor
    """True at source padding."""
    aux_losses: AuxLosses = field(default_factory=dict)
    sentence_repr_BD: Tensor | None = None
    """Mean-pooled encoder output over non-pad positions (MoA Eq. 1); the decoder's sentence
    representation. Filled by `Seq2SeqTransformer.encode`."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The context providers' outputs, handed to every decoder slot."""

    def __post_init__(self) -> None:
        if self.sentence_repr_BD is None:
            self.sentence_repr_BD = mean_pool(self.states_BSD, self.pad_mask_BS)

    def index_select(self, index_B: Tensor) -> EncoderOut:
        """Rows reordered / repeated by `index_B` (beam search); aux losses are kept as is."""
        extras = {**self.extras, **{key: value.index_select(0, index_B) for key, value
                                    in per_sentence(self.extras).items()}}
        return EncoderOut(self.states_BSD.index_select(0, index_B),
                          self.pad_mask_BS.index_select(0, index_B), self.aux_losses,
                          self.sentence_repr_BD.index_select(0, index_B), extras)


class DecoderCache:
    """Incremental-decoding state of the whole decoder (one entry per layer)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [DecoderLayerCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        return self.layers[0].self_attn.length if self.layers else 0

    def reorder(self, index_B: Tensor) -> DecoderCache:
        """Reorder (or repeat) the batch rows in place (beam search); returns self."""
        for layer in self.layers:
            layer.reorder(index_B)
        return self


class TiedOutput(nn.Module):
    """The output projection onto a shared embedding table: logits = x @ table^T. The table
    stays its embedding's parameter, held here by reference (state dicts are unchanged); being a
    module lets ZeRO-3 gather it for this forward (parallel.zero3.register_tied_outputs)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self._table = (table,)  # a tuple: not registered as a submodule

    @property
    def weight(self) -> Tensor:
        return self._table[0].weight

    def forward(self, x_BTD: Tensor) -> Tensor:
        return F.linear(x_BTD, self.weight)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer (pre-norm, sinusoidal positions, optionally tied embeddings)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int,
                 ffn_factory: FFNFactory | None = None,
                 adapter_factory: AdapterFactory | None = None,
                 providers: dict[int, nn.Module] | None = None, cls_token: bool = False) -> None:
        super().__init__()
        if not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id {pad_id} outside the vocabulary (size {vocab_size})")
        ffn_factory = ffn_factory or dense_ffn_factory
        adapter_factory = adapter_factory or no_adapter_factory
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.max_positions = cfg.max_positions
        self.embed_scale = math.sqrt(cfg.d_model)

        # One table for source, target and output when tied (joint vocabulary).
        self.embed_tokens = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed_tokens: nn.Embedding | None = None
        self.output_proj: nn.Linear | None = None
        self.tied_output: TiedOutput | None = None
        if cfg.tie_embeddings:
            self.tied_output = TiedOutput(self.embed_tokens)
        else:
            self.tgt_embed_tokens = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
            self.output_proj = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.positions = SinusoidalPositions(cfg.d_model, cfg.max_positions)
        self.dropout = nn.Dropout(cfg.dropout)

        self.encoder_layers = nn.ModuleList(
            EncoderLayer(cfg, ffn_factory("encoder", i, cfg), adapter_factory("encoder", i, cfg))
            for i in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(cfg, ffn_factory("decoder", i, cfg), adapter_factory("decoder", i, cfg))
            for i in range(cfg.decoder_layers))
        self.encoder_norm = nn.LayerNorm(cfg.d_model)
        self.decoder_norm = nn.LayerNorm(cfg.d_model)
        bad = sorted(i for i in (providers or {}) if not 0 <= i <= cfg.encoder_layers)
        if bad:
            raise ValueError(f"context provider at encoder layer {bad[0]}: expected 0 .. "
                             f"{cfg.encoder_layers}")
        self.providers = nn.ModuleDict({str(i): p for i, p in sorted((providers or {}).items())})
        self.cls_embed_D = nn.Parameter(torch.empty(cfg.d_model)) if cls_token else None
        self.reset_embeddings()

    def reset_embeddings(self) -> None:
        """N(0, D^-1/2) embeddings (and untied output projection) with a zero padding row.

        Layers initialise themselves (xavier-uniform linears); factory-built slots own their init.
        """
        std = self.cfg.d_model ** -0.5
        tables = [self.embed_tokens.weight]
        if self.tgt_embed_tokens is not None:
            tables.append(self.tgt_embed_tokens.weight)
        for weight in tables:
            nn.init.normal_(weight, mean=0.0, std=std)
            weight.data[self.pad_id].zero_()
        if self.output_proj is not None:
            nn.init.normal_(self.output_proj.weight, mean=0.0, std=std)
        if self.cls_embed_D is not None:
            nn.init.normal_(self.cls_embed_D, mean=0.0, std=std)

    @property
    def max_source_tokens(self) -> int:
        """Most source tokens a sentence may have (the [CLS] takes one position)."""
        return self.max_positions - (self.cls_embed_D is not None)

    @property
    def decoder_embed(self) -> nn.Embedding:
        """The target-side embedding (the shared table when tied)."""
        return self.embed_tokens if self.tgt_embed_tokens is None else self.tgt_embed_tokens

    def output_weight(self) -> Tensor:
        """(V, D) output projection weight (the shared embedding table when tied)."""
        return self.embed_tokens.weight if self.output_proj is None else self.output_proj.weight

    def num_parameters(self) -> int:
        """Number of distinct parameters (shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters())

    def _embed(self, table: nn.Embedding, tokens_BT: Tensor) -> Tensor:
        """Scaled token embeddings (no positions, no dropout)."""
        return table(tokens_BT) * self.embed_scale

    def _add_positions(self, emb_BTD: Tensor, offset: int = 0) -> Tensor:
        x_BTD = emb_BTD + self.positions(emb_BTD.size(1), offset).to(emb_BTD.dtype)
        return self.dropout(x_BTD)

    def encode(self, src_tokens_BS: Tensor, ctx: ForwardContext | None = None) -> EncoderOut:
        """Run the encoder on right-padded source tokens."""
        pad_mask_BS = src_tokens_BS.eq(self.pad_id)
        ctx = ctx or ForwardContext()
        # Sentence-level routers in the encoder decide from the mean source embedding.
        emb_BSD = self._embed(self.embed_tokens, src_tokens_BS)
        if self.cls_embed_D is not None:
            cls_B1D = self.cls_embed_D.to(emb_BSD.dtype).expand(emb_BSD.size(0), 1, -1)
            emb_BSD = torch.cat([cls_B1D, emb_BSD], dim=1)
            pad_mask_BS = torch.cat([pad_mask_BS.new_zeros(pad_mask_BS.size(0), 1),
                                     pad_mask_BS], dim=1)
        ctx = ctx.replace(side="encoder", src_pad_mask_BS=pad_mask_BS,
                          extras={**ctx.extras,
                                  SENTENCE_REPR_KEY: mean_pool(emb_BSD, pad_mask_BS)})
        x_BSD = self._add_positions(emb_BSD)
        aux: AuxLosses = {}
        provided: dict[str, Any] = {}
        for i, layer in enumerate(self.encoder_layers):
            ctx = self._provide(i, x_BSD, ctx, provided, aux)
            x_BSD, layer_aux = self._run(layer, x_BSD, pad_mask_BS, ctx)
            add_aux(aux, layer_aux)
        states_BSD = self.encoder_norm(x_BSD)
        self._provide(len(self.encoder_layers), states_BSD, ctx, provided, aux)
        return EncoderOut(states_BSD, pad_mask_BS, aux, extras=provided)

    def _run(self, layer: nn.Module, *args: Any) -> tuple[Tensor, AuxLosses]:
        """One layer; with `model.activation_checkpointing` in training its activations are
        recomputed in backward (non-reentrant checkpoint: the RNG state is replayed, so dropout
        and noisy routing recompute the same values)."""
        if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def _provide(self, i: int, x_BSD: Tensor, ctx: ForwardContext, provided: dict[str, Any],
                 aux: AuxLosses) -> ForwardContext:
        """Run the provider at encoder layer i (if any); its extras join `provided` and ctx."""
        provider = self.providers[str(i)] if str(i) in self.providers else None
        if provider is None:
            return ctx
        extras, provider_aux = provider(x_BSD, ctx)
        provided.update(extras)
        add_aux(aux, provider_aux)
        return ctx.replace(extras={**ctx.extras, **extras})

    def new_decoder_cache(self) -> DecoderCache:
        """An empty cache for incremental decoding with `decode`."""
        return DecoderCache(len(self.decoder_layers))

    def decode(self, tgt_in_BT: Tensor, enc: EncoderOut, ctx: ForwardContext | None = None,
               cache: DecoderCache | None = None) -> tuple[Tensor, AuxLosses]:
        """Logits (B, T, V) for the decoder inputs `tgt_in_BT` (right-padded, starting with bos).

        With `cache`, `tgt_in_BT` holds only the new position(s): positions continue from
        `cache.length` and the cache is extended.
        """
        offset = 0
        if cache is not None:
            if len(cache.layers) != len(self.decoder_layers):
                raise ValueError(f"decoder cache has {len(cache.layers)} layers, "
                                 f"the model {len(self.decoder_layers)}")
            offset = cache.length
        ctx = ctx or ForwardContext()
        ctx = ctx.replace(side="decoder", src_pad_mask_BS=enc.pad_mask_BS,
                          tgt_pad_mask_BT=tgt_in_BT.eq(self.pad_id), offset=offset,
                          extras={**ctx.extras, **enc.extras,
                                  SENTENCE_REPR_KEY: enc.sentence_repr_BD})
        x_BTD = self._add_positions(self._embed(self.decoder_embed, tgt_in_BT), offset)
        aux: AuxLosses = {}
        for i, layer in enumerate(self.decoder_layers):
            x_BTD, layer_aux = self._run(layer, x_BTD, enc.states_BSD, enc.pad_mask_BS, ctx,
                                         None if cache is None else cache.layers[i])
            add_aux(aux, layer_aux)
        x_BTD = self.decoder_norm(x_BTD)
        # a module call, so ZeRO-3 gathers the projection (or the tied table) for it
        logits_BTV = self.output_proj(x_BTD) if self.output_proj is not None else \
            self.tied_output(x_BTD)
        return logits_BTV, aux

    def forward(self, src_tokens_BS: Tensor, tgt_in_BT: Tensor,
                ctx: ForwardContext | None = None) -> ModelOutput:
        """Teacher-forced pass: logits for every target position plus summed aux losses."""
        enc = self.encode(src_tokens_BS, ctx)
        logits_BTV, dec_aux = self.decode(tgt_in_BT, enc, ctx)
        aux = add_aux(dict(enc.aux_losses), dec_aux)
        return ModelOutput(logits_BTV, aux, enc.extras)
