"""The ``qwen`` section: the shape of a decoder-only Hugging Face Qwen2-MoE model.

Read when ``model.arch`` is ``hf_qwen2_moe``. The fields mirror a Qwen2-MoE ``config.json``,
except the MoE ones, which stay in the ``moe`` section where every router and dispatcher reads
them: ``moe.num_experts`` (num_experts), ``moe.k`` (num_experts_per_tok),
``moe.expert_ffn_dim`` (moe_intermediate_size), ``moe.renormalize`` (norm_topk_prob),
``moe.layers`` (decoder_sparse_step / mlp_only_layers: "all" or the sparse layer indices) and
``moe.decoder_router`` (Qwen's own softmax top-k is ``topk``). `moe-train convert --from-hf`
fills both sections from a model directory; the defaults are Qwen1.5-MoE-A2.7B's.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.moe import _at_most, _expect


@dataclass
class QwenConfig:
    """Qwen2-MoE decoder-only shape (see the module docstring); checked on construction."""

    vocab_size: int = 151936
    """Rows of the token embedding and the LM head (the tokenizer's size, padded)."""
    hidden_size: int = 2048
    """Model dimension D."""
    num_hidden_layers: int = 24
    """Decoder layers."""
    num_attention_heads: int = 16
    """Query heads; must divide hidden_size."""
    num_key_value_heads: int = 16
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    intermediate_size: int = 5632
    """SwiGLU inner dimension of the dense MLP layers (the layers `moe.layers` leaves dense)."""
    shared_expert_intermediate_size: int = 5632
    """SwiGLU inner dimension of the shared expert in every MoE layer (0: no shared expert)."""
    max_position_embeddings: int = 8192
    """Longest sequence the rotary embedding is configured for."""
    rope_theta: float = 1_000_000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qkv_bias: bool = True
    """Biases on the query, key and value projections (Qwen2's attention has them)."""
    tie_word_embeddings: bool = False
    """Share the token embedding and the LM head."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of a randomly initialised model."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            _expect(getattr(self, name) > 0, f"qwen.{name}", "a positive integer",
                    getattr(self, name))
        _at_most("size", self, "qwen", "vocab_size", "hidden_size", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "shared_expert_intermediate_size",
                 "max_position_embeddings")
        _at_most("layers", self, "qwen", "num_hidden_layers")
        _expect(self.shared_expert_intermediate_size >= 0, "qwen.shared_expert_intermediate_size",
                "a non-negative integer (0: no shared expert)",
                self.shared_expert_intermediate_size)
        _expect(self.hidden_size % self.num_attention_heads == 0, "qwen.hidden_size",
                f"a multiple of qwen.num_attention_heads ({self.num_attention_heads})",
                self.hidden_size)
        _expect(self.num_attention_heads % self.num_key_value_heads == 0,
                "qwen.num_key_value_heads",
                f"a divisor of qwen.num_attention_heads ({self.num_attention_heads})",
                self.num_key_value_heads)
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            _expect(getattr(self, name) > 0, f"qwen.{name}", "a positive number",
                    getattr(self, name))
