"""Local experts with stacked weights, run as grouped GEMMs over expert-sorted rows.

Every module takes ``forward(x_ND, counts_E) -> y_ND``: x_ND holds the rows routed to this
module's experts, grouped by expert (expert 0's `counts_E[0]` rows first, as
`moe_train.kernels.permute` leaves them), and y_ND is in the same order. `Experts` and
`AdapterExperts` also take ``counts_E=None``: every expert on every row, (E, N, D), for
`DenseDispatcher`.

Convention for parallel/ (no attributes are hung on tensors): every parameter of a
`StackedExperts` module is an expert parameter, stacked along dim 0 over the module's local
experts (its name ends in a shape suffix starting with E). `expert_parameters()` lists them;
expert-parallel code shards or reduces them over the expert groups, everything else in the
model is dense. A module built with E local experts holds experts [offset, offset + E) of the
global set; the offset is the parallel code's business, not this module's.

Shape legend: N routed rows, E experts, D model dim, F FFN dim, R adapter bottleneck dim.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.errors import ConfigError
from moe_train.kernels import grouped_gemm, use_triton
from moe_train.kernels.expert_ffn import expert_ffn
from moe_train.kernels.grad_buffers import GradBuffers
from moe_train.kernels.swiglu_ffn import swiglu_ffn, swiglu_grouped


def rows_expert(counts_E: Tensor, num_rows: int) -> Tensor:
    """expert_N: the expert of each row of an expert-sorted batch (no host sync)."""
    experts_E = torch.arange(counts_E.numel(), device=counts_E.device)
    return torch.repeat_interleave(experts_E, counts_E, output_size=num_rows)


def _xavier_uniform_stacked_(w_EIO: Tensor) -> None:
    """Xavier-uniform per expert: fan_in = I, fan_out = O for each E slice (not the 3-D fans)."""
    bound = math.sqrt(6.0 / (w_EIO.size(1) + w_EIO.size(2)))
    nn.init.uniform_(w_EIO, -bound, bound)


class StackedExperts(nn.Module):
    """Base of expert modules: `num_experts` local experts, all parameters stacked on dim 0."""

    num_experts: int
    no_weight_decay: tuple[str, ...] = ()
    """Parameters that are biases or norm affines per expert: stacked, they are 2-D, so the
    optimizer's groups cannot tell them from weights by their shape."""

    def expert_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of every expert parameter: all of this module's parameters."""
        return self.named_parameters()

    def _check_rows(self, x_ND: Tensor, counts_E: Tensor) -> None:
        if counts_E.numel() != self.num_experts:
            raise ValueError(f"{type(self).__name__}: counts_E has {counts_E.numel()} entries "
                             f"for {self.num_experts} experts")


class Experts(StackedExperts):
    """E feed-forward experts: y = act(x w1[e] + b1[e]) w2[e] + b2[e], dropout after act.

    Like `models.layers.FeedForward` per expert (xavier-uniform weights, zero biases) but
    without the residual-branch dropout, which the MoE layer applies after the combine.

    Two paths, same numbers: on the torch backend (CPU) `kernels.expert_ffn` runs GEMM1,
    activation and GEMM2 one expert at a time (no N x F hidden block, the expert's rows stay in
    cache); with Triton (GPU), or with activation dropout in training (one mask over all hidden
    rows), two grouped GEMMs with the activation between. On the torch backend the weight
    gradients are written into `grad_buffers`, reused from step to step (see
    kernels/grad_buffers.py); `grad_buffers.clear()` gives that memory back.
    """

    no_weight_decay = ("b1_EF", "b2_ED")

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int, activation: str = "relu",
                 activation_dropout: float = 0.0, *, backend: str = "auto") -> None:
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ConfigError(f"model.activation: expected one of relu, gelu, got {activation!r}")
        self.num_experts = num_experts
        self.activation_name = activation
        self.activation = F.relu if activation == "relu" else F.gelu
        self.activation_dropout = activation_dropout
        self.backend = backend
        self.grad_buffers = GradBuffers()
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim))
        self.b1_EF = nn.Parameter(torch.empty(num_experts, ffn_dim))
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, d_model))
        self.b2_ED = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights per expert, zero biases."""
        _xavier_uniform_stacked_(self.w1_EDF.data)
        _xavier_uniform_stacked_(self.w2_EFD.data)
        nn.init.zeros_(self.b1_EF)
        nn.init.zeros_(self.b2_ED)

    def forward(self, x_ND: Tensor, counts_E: Tensor | None) -> Tensor:
        """Rows grouped by expert (`counts_E`) -> (N, D); with counts_E None every expert runs
        on all rows (`DenseDispatcher`) -> (E, N, D)."""
        if counts_E is None:
            return self.all_experts(x_ND)
        self._check_rows(x_ND, counts_E)
        dropout = self.activation_dropout if self.training else 0.0
        bufs = self.grad_buffers
        if not use_triton(x_ND, self.backend) and dropout == 0:
            return expert_ffn(x_ND, self.w1_EDF, self.b1_EF, self.w2_EFD, self.b2_ED, counts_E,
                              self.activation_name, bufs)
        h_NF = self.activation(grouped_gemm(x_ND, self.w1_EDF, counts_E, self.b1_EF,
                                            backend=self.backend, grad_buffers=bufs,
                                            grad_names=("w1_EDF", "b1_EF")))
        if dropout > 0:
            h_NF = F.dropout(h_NF, dropout, self.training)
        return grouped_gemm(h_NF, self.w2_EFD, counts_E, self.b2_ED, backend=self.backend,
                            grad_buffers=bufs, grad_names=("w2_EFD", "b2_ED"))

    def all_experts(self, x_TD: Tensor) -> Tensor:
        """Every expert on every row, (E, T, D), with no sort and no host sync.

        On the torch backend (CPU) the very GEMMs the grouped path runs, expert by expert on
        the same T rows (`expert_ffn` over the rows repeated once per expert), so a layer whose
        tokens each use all its experts (an extracted task sub-network) gives the numbers of
        the full model, bit for bit. On the GPU two batched GEMMs over the stacked weights.
        """
        E, T = self.num_experts, x_TD.size(0)
        dropout = self.activation_dropout if self.training else 0.0
        if not use_triton(x_TD, self.backend) and dropout == 0:
            counts_E = torch.full((E,), T, dtype=torch.long)  # on the host: no device sync
            return expert_ffn(x_TD.repeat(E, 1), self.w1_EDF, self.b1_EF, self.w2_EFD,
                              self.b2_ED, counts_E, self.activation_name,
                              self.grad_buffers).unflatten(0, (E, T))  # T may be 0
        h_ETF = self.activation(torch.baddbmm(self.b1_EF[:, None], x_TD.expand(E, T, -1),
                                              self.w1_EDF))
        if dropout > 0:
            h_ETF = F.dropout(h_ETF, dropout, self.training)
        return torch.baddbmm(self.b2_ED[:, None], h_ETF, self.w2_EFD)


class SwiGLUExperts(StackedExperts):
    """E SwiGLU experts (Qwen2-MoE): y = (silu(x w_gate[e]) * (x w_up[e])) w_down[e], no biases.

    Our layout, stacked on dim 0: w_gate_EDF, w_up_EDF (E x D x F), w_down_EFD (E x F x D).
    Hugging Face's Qwen2-MoE stores gate and up fused and transposed (gate_up_proj E x 2F x D,
    gate rows first) and down_proj as E x D x F: a checkpoint converter maps between the two.
    Weights start normal(0, init_std) (0.02 is Qwen's initializer_range). Paths as in
    `Experts`: on the torch backend (CPU) `kernels.swiglu_ffn` runs the three GEMMs expert by
    expert, writing weight gradients into `grad_buffers`; with Triton (GPU) three grouped GEMMs
    with silu * up between them (`kernels.swiglu_ffn.swiglu_grouped`).
    """

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int, *, backend: str = "auto",
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.backend = backend
        self.init_std = init_std
        self.grad_buffers = GradBuffers()
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, init_std) for all three weights."""
        for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD):
            nn.init.normal_(w, 0.0, self.init_std)

    def forward(self, x_ND: Tensor, counts_E: Tensor) -> Tensor:
        self._check_rows(x_ND, counts_E)
        weights = (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD)
        if not use_triton(x_ND, self.backend):
            return swiglu_ffn(x_ND, *weights, counts_E, self.grad_buffers)
        return swiglu_grouped(x_ND, *weights, counts_E, backend=self.backend,
                              grad_buffers=self.grad_buffers)
