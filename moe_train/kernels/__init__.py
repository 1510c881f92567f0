"""Dispatch ops for MoE layers: expert histogram, permute, unpermute (combine), grouped GEMM.

Each op has a torch reference (also the CPU path) and a Triton kernel for CUDA, chosen by
``backend="auto" | "torch" | "triton"`` (see `backend.use_triton`), and an autograd Function so
training runs through either. Triton is optional and imported only when its path runs.

Typical use (T tokens, K slots, E experts, N kept rows):

    x_ND, row_map_N, counts_E = permute(x_TD, expert_ids_TK, E)
    y_ND = experts(x_ND, counts_E)      # CPU: expert_ffn; GPU: grouped_gemm (GradBuffers: dW)
    y_TD = unpermute(y_ND, row_map_N, weights_TK, T)
"""

from moe_train.kernels.backend import BACKENDS, triton_available, use_triton
from moe_train.kernels.expert_ffn import expert_ffn
from moe_train.kernels.grad_buffers import GradBuffers
from moe_train.kernels.grouped_gemm import grouped_gemm
from moe_train.kernels.histogram import expert_histogram
from moe_train.kernels.permute import (
    Permuted,
    inverse_row_map,
    permute,
    sort_sentence_slots,
    sort_slots,
    unpermute,
)

__all__ = [
    "BACKENDS", "GradBuffers", "Permuted", "expert_ffn", "expert_histogram", "grouped_gemm",
    "inverse_row_map", "permute", "sort_sentence_slots", "sort_slots", "triton_available",
    "unpermute", "use_triton",
]
