"""Encoder-decoder Transformer with pluggable FFN / adapter slots and incremental decoding."""

from moe_train.models.context import ForwardContext
from moe_train.models.layers import (
    AuxLosses,
    DecoderLayer,
    DecoderLayerCache,
    EncoderLayer,
    FeedForward,
    FFNSlot,
    KVCache,
    MultiheadAttention,
    SinusoidalPositions,
    add_aux,
)
from moe_train.models.transformer import (
    DecoderCache,
    EncoderOut,
    ModelOutput,
    Seq2SeqTransformer,
    dense_ffn_factory,
    no_adapter_factory,
)

__all__ = [
    "AuxLosses", "DecoderCache", "DecoderLayer", "DecoderLayerCache", "EncoderLayer",
    "EncoderOut", "FFNSlot", "FeedForward", "ForwardContext", "KVCache", "ModelOutput",
    "MultiheadAttention", "Seq2SeqTransformer", "SinusoidalPositions", "add_aux",
    "dense_ffn_factory", "no_adapter_factory",
]
