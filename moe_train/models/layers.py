"""Transformer building blocks: attention with a KV cache, the dense FFN, pre-norm layers.

The FFN slot protocol: a module called as ``ffn(x_BTD, ctx) -> (y_BTD, aux)`` that receives the
layer-normed input and returns the residual branch (its own dropout included) plus a dict of
auxiliary losses (``{}`` for the dense FFN). An MoE layer replaces `FeedForward` through it.
Adapters use the same call signature but own their residual: ``x_BTD = adapter(x_BTD, ctx)[0]``.

Shape legend: B batch, S source (key) length, T target (query) length, D model dim, F FFN dim,
H heads, d head dim (D / H).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.config.schema import ModelConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext, StateCell

AuxLosses = dict[str, Tensor]


class FFNSlot(Protocol):
    """What an FFN (dense or MoE) or adapter module looks like to a layer."""

    def __call__(self, x_BTD: Tensor, ctx: ForwardContext) -> tuple[Tensor, AuxLosses]: ...


def add_aux(total: AuxLosses, new: AuxLosses) -> AuxLosses:
    """Add the losses of `new` into `total` key by key (in place) and return `total`."""
    for key, value in new.items():
        total[key] = total[key] + value if key in total else value
    return total


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position embeddings: sin on the first half of D, cos on the second."""

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        # Computed on the CPU whatever device the module is built on (the same values
        # everywhere; on the meta device no Python meta kernel, whose first use imports
        # torch._dynamo), then placed there. Not persistent: a function of the config.
        half, cpu = d_model // 2, torch.device("cpu")
        inv_freq_H = torch.exp(-math.log(10000.0) * torch.arange(half, device=cpu)
                               / max(half - 1, 1))
        angle_PH = torch.arange(max_positions, dtype=torch.float32, device=cpu)[:, None] \
            * inv_freq_H[None]
        table_PD = torch.cat([angle_PH.sin(), angle_PH.cos()], dim=1)
        if d_model % 2:
            table_PD = F.pad(table_PD, (0, 1))
        self.register_buffer("table_PD", table_PD.to(torch.empty(0).device), persistent=False)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """Embeddings of positions offset .. offset+length-1, shape (length, D)."""
        if offset + length > self.max_positions:
            raise ConfigError(
                f"model.max_positions: expected at least {offset + length} (sequence length), "
                f"got {self.max_positions}")
        return self.table_PD[offset:offset + length]


class KVCache:
    """Keys and values of one attention module during incremental decoding.

    Self-attention appends the new positions each step; cross-attention stores the projected
    encoder states once and reuses them.
    """

    def __init__(self) -> None:
        self.k_BHSd: Tensor | None = None
        self.v_BHSd: Tensor | None = None

    @property
    def length(self) -> int:
        """Number of cached key positions."""
        return 0 if self.k_BHSd is None else self.k_BHSd.size(2)

    def append(self, k_BHTd: Tensor, v_BHTd: Tensor) -> tuple[Tensor, Tensor]:
        """Add new positions; return all cached keys and values."""
        if self.k_BHSd is None:
            self.k_BHSd, self.v_BHSd = k_BHTd, v_BHTd
        else:
            self.k_BHSd = torch.cat([self.k_BHSd, k_BHTd], dim=2)
            self.v_BHSd = torch.cat([self.v_BHSd, v_BHTd], dim=2)
        return self.k_BHSd, self.v_BHSd

    def reorder(self, index_B: Tensor) -> None:
        """Reorder (or repeat) the batch rows in place."""
        if self.k_BHSd is not None:
            self.k_BHSd = self.k_BHSd.index_select(0, index_B)
            self.v_BHSd = self.v_BHSd.index_select(0, index_B)


class MultiheadAttention(nn.Module):
    """Multi-head attention via `F.scaled_dot_product_attention`, self or cross, with a cache."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0,
                 cross: bool = False) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.attention_dropout = attention_dropout
        self.cross = cross
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def _split(self, x_BTD: Tensor) -> Tensor:
        B, T, _ = x_BTD.shape
        return x_BTD.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x_BTD: Tensor, kv_BSD: Tensor | None = None,
                key_pad_mask_BS: Tensor | None = None, causal: bool = False,
                cache: KVCache | None = None) -> Tensor:
        """Attend from `x_BTD` to itself (self) or to `kv_BSD` (cross).

        key_pad_mask_BS: True at key positions to ignore. causal: query t sees keys <= t, where
        positions continue after those already in `cache`. With a cache, self-attention appends
        this call's keys/values to it; cross-attention projects `kv_BSD` only when the cache is
        empty (`kv_BSD` may then be None).
        """
        B, T, D = x_BTD.shape
        q_BHTd = self._split(self.q_proj(x_BTD))
        past = 0
        if self.cross:
            if cache is not None and cache.k_BHSd is not None:
                k_BHSd, v_BHSd = cache.k_BHSd, cache.v_BHSd
            else:
                assert kv_BSD is not None, "cross-attention needs kv_BSD or a filled cache"
                k_BHSd = self._split(self.k_proj(kv_BSD))
                v_BHSd = self._split(self.v_proj(kv_BSD))
                if cache is not None:
                    cache.append(k_BHSd, v_BHSd)
        else:
            k_BHSd = self._split(self.k_proj(x_BTD))
            v_BHSd = self._split(self.v_proj(x_BTD))
            if cache is not None:
                past = cache.length
                k_BHSd, v_BHSd = cache.append(k_BHSd, v_BHSd)

        S = k_BHSd.size(2)
        keep_B1TS: Tensor | None = None  # True where attention is allowed
        use_is_causal = False
        if causal and T > 1:
            if past == 0 and key_pad_mask_BS is None and S == T:
                use_is_causal = True
            else:
                q_pos_T = torch.arange(past, past + T, device=x_BTD.device)
                k_pos_S = torch.arange(S, device=x_BTD.device)
                keep_B1TS = (k_pos_S[None, :] <= q_pos_T[:, None])[None, None]
        if key_pad_mask_BS is not None:
            keep_pad_B11S = ~key_pad_mask_BS[:, None, None, :]
            keep_B1TS = keep_pad_B11S if keep_B1TS is None else keep_B1TS & keep_pad_B11S

        out_BHTd = F.scaled_dot_product_attention(
            q_BHTd, k_BHSd, v_BHSd, attn_mask=keep_B1TS,
            dropout_p=self.attention_dropout if self.training else 0.0, is_causal=use_is_causal)
        return self.out_proj(out_BHTd.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """Dense position-wise FFN: fc2(dropout(act(fc1(x)))), then (residual) dropout.

    Implements the FFN-slot protocol: returns ``(y_BTD, {})``; the layer adds the residual.
    """

    def __init__(self, d_model: int, ffn_dim: int, activation: str = "relu",
                 activation_dropout: float = 0.0, dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ConfigError(f"model.activation: expected one of relu, gelu, got {activation!r}")
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.activation = F.relu if activation == "relu" else F.gelu
        self.activation_dropout = nn.Dropout(activation_dropout)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases."""
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x_BTD: Tensor, ctx: ForwardContext) -> tuple[Tensor, AuxLosses]:
        h_BTF = self.activation_dropout(self.activation(self.fc1(x_BTD)))
        return self.dropout(self.fc2(h_BTF)), {}


class DecoderLayerCache:
    """Incremental-decoding state of one decoder layer: the attention KV caches and the routing
    state of its FFN and adapter slots (filled by stateful routers only)."""

    def __init__(self) -> None:
        self.self_attn = KVCache()
        self.cross_attn = KVCache()
        self.ffn_state = StateCell()
        self.adapter_state = StateCell()

    def reorder(self, index_B: Tensor) -> None:
        """Reorder (or repeat, or drop) the batch rows in place."""
        self.self_attn.reorder(index_B)
        self.cross_attn.reorder(index_B)
        self.ffn_state.reorder(index_B)
        self.adapter_state.reorder(index_B)


def _apply_adapter(adapter: nn.Module | None, x_BTD: Tensor, ctx: ForwardContext,
                   aux: AuxLosses) -> Tensor:
    if adapter is None:
        return x_BTD
    x_BTD, adapter_aux = adapter(x_BTD, ctx)
    add_aux(aux, adapter_aux)
    return x_BTD


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: x + SelfAttn(LN(x)), x + FFN(LN(x)), then the optional adapter."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module, adapter: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = ffn
        self.adapter = adapter
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BSD: Tensor, pad_mask_BS: Tensor | None,
                ctx: ForwardContext) -> tuple[Tensor, AuxLosses]:
        """pad_mask_BS: True at padding (ignored as keys)."""
        h_BSD = self.self_attn(self.self_attn_norm(x_BSD), key_pad_mask_BS=pad_mask_BS)
        x_BSD = x_BSD + self.dropout(h_BSD)
        h_BSD, aux = self.ffn(self.ffn_norm(x_BSD), ctx)
        x_BSD = x_BSD + h_BSD
        aux = dict(aux)
        return _apply_adapter(self.adapter, x_BSD, ctx, aux), aux


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention, cross-attention, FFN, optional adapter."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module, adapter: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = MultiheadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                             cross=True)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = ffn
        self.adapter = adapter
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: Tensor, enc_BSD: Tensor, enc_pad_mask_BS: Tensor | None,
                ctx: ForwardContext,
                cache: DecoderLayerCache | None = None) -> tuple[Tensor, AuxLosses]:
        """With `cache`, x_BTD holds only the new positions and the cache is extended."""
        h_BTD = self.self_attn(self.self_attn_norm(x_BTD), causal=True,
                               cache=None if cache is None else cache.self_attn)
        x_BTD = x_BTD + self.dropout(h_BTD)
        h_BTD = self.cross_attn(self.cross_attn_norm(x_BTD), kv_BSD=enc_BSD,
                                key_pad_mask_BS=enc_pad_mask_BS,
                                cache=None if cache is None else cache.cross_attn)
        x_BTD = x_BTD + self.dropout(h_BTD)
        ffn_ctx, adapter_ctx = ctx, ctx
        if cache is not None:  # stateful routers continue from the cache
            ffn_ctx = ctx.replace(state=cache.ffn_state)
            adapter_ctx = ctx.replace(state=cache.adapter_state)
        h_BTD, aux = self.ffn(self.ffn_norm(x_BTD), ffn_ctx)
        x_BTD = x_BTD + h_BTD
        aux = dict(aux)
        return _apply_adapter(self.adapter, x_BTD, adapter_ctx, aux), aux
