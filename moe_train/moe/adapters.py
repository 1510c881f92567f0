"""Adapter experts (MoA, Gated Adapters, ADPT) and the adapter slot that holds them.

An adapter layer is an MoE layer over `AdapterExperts` placed in the Transformer's adapter slot
(after a layer's FFN): `AdapterSlot` runs it and adds the residual, o = z + sum_k w_k A_k(z)
(Eq. 4 for one adapter with weight 1). Routing, dispatch and expert parallelism are the MoE
layer's, so K adapters spread over expert-parallel ranks like FFN experts. A single
pre-injected adapter is the same thing with one expert and the `single` router.

Shape legend: B sentences, T positions, N routed rows, E experts, D model dim, R adapter dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.kernels import grouped_gemm
from moe_train.models.context import ForwardContext
from moe_train.moe.experts import StackedExperts, _xavier_uniform_stacked_, rows_expert
from moe_train.moe.layer import MoELayer


class AdapterExperts(StackedExperts):
    """E adapters (MoA Eq. 3-4 without the residual): y = up(relu(down(LN_e(x)))), per expert.

    Each adapter has its own LayerNorm affine parameters, a D x R down and an R x D up
    projection with biases. The residual is added by `AdapterSlot` after the combine, so a
    router's combine weight scales the adapter's contribution, never the residual stream.
    `activation_dropout` drops units after the ReLU in training.
    """

    no_weight_decay = ("ln_weight_ED", "ln_bias_ED", "b_down_ER", "b_up_ED")

    def __init__(self, num_experts: int, d_model: int, adapter_dim: int = 128, *,
                 eps: float = 1e-5, backend: str = "auto",
                 activation_dropout: float = 0.0) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.eps = eps
        self.activation_dropout = activation_dropout
        self.backend = backend
        self.ln_weight_ED = nn.Parameter(torch.empty(num_experts, d_model))
        self.ln_bias_ED = nn.Parameter(torch.empty(num_experts, d_model))
        self.w_down_EDR = nn.Parameter(torch.empty(num_experts, d_model, adapter_dim))
        self.b_down_ER = nn.Parameter(torch.empty(num_experts, adapter_dim))
        self.w_up_ERD = nn.Parameter(torch.empty(num_experts, adapter_dim, d_model))
        self.b_up_ED = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """LayerNorm at identity, xavier-uniform down projections, zero up projections and
        biases: a fresh adapter adds nothing, so inserting it into a trained (frozen) network
        starts from that network's function (near-identity adapter initialisation)."""
        nn.init.ones_(self.ln_weight_ED)
        nn.init.zeros_(self.ln_bias_ED)
        _xavier_uniform_stacked_(self.w_down_EDR.data)
        nn.init.zeros_(self.w_up_ERD)
        nn.init.zeros_(self.b_down_ER)
        nn.init.zeros_(self.b_up_ED)

    def forward(self, x_ND: Tensor, counts_E: Tensor | None) -> Tensor:
        """Rows grouped by expert (`counts_E`) -> (N, D); with counts_E None every adapter
        runs on all rows (`DenseDispatcher`) -> (E, N, D)."""
        if counts_E is None:
            return self.all_experts(x_ND)
        self._check_rows(x_ND, counts_E)
        expert_N = rows_expert(counts_E, x_ND.size(0))
        z_ND = F.layer_norm(x_ND, x_ND.shape[-1:], eps=self.eps)
        z_ND = z_ND * self.ln_weight_ED.index_select(0, expert_N) \
            + self.ln_bias_ED.index_select(0, expert_N)
        h_NR = F.relu(grouped_gemm(z_ND, self.w_down_EDR, counts_E, self.b_down_ER,
                                   backend=self.backend))
        h_NR = F.dropout(h_NR, self.activation_dropout, self.training)
        return grouped_gemm(h_NR, self.w_up_ERD, counts_E, self.b_up_ED, backend=self.backend)

    def all_experts(self, x_TD: Tensor) -> Tensor:
        """Every adapter on every row, (E, T, D): the normalisation once, then one batched
        GEMM per projection over the E adapters (Gated Adapters' "parallel" adapters)."""
        z_TD = F.layer_norm(x_TD, x_TD.shape[-1:], eps=self.eps)
        z_ETD = torch.addcmul(self.ln_bias_ED[:, None], z_TD[None], self.ln_weight_ED[:, None])
        h_ETR = torch.baddbmm(self.b_down_ER[:, None], z_ETD, self.w_down_EDR).relu_()
        h_ETR = F.dropout(h_ETR, self.activation_dropout, self.training)
        return torch.baddbmm(self.b_up_ED[:, None], h_ETR, self.w_up_ERD)



class AdapterSlot(nn.Module):
    """Adapter-slot module: ``forward(x_BTD, ctx) -> (x_BTD + moe(x_BTD), aux)``.

    Padding rows are not routed (the MoE layer leaves them at zero), so they pass unchanged.
    """

    def __init__(self, moe: MoELayer) -> None:
        super().__init__()
        if not isinstance(moe.experts, AdapterExperts):
            raise TypeError("AdapterSlot holds an MoELayer over AdapterExperts")
        self.moe = moe

    def forward(self, x_BTD: Tensor, ctx: ForwardContext) -> tuple[Tensor, dict[str, Tensor]]:
        y_BTD, aux = self.moe(x_BTD, ctx)
        return x_BTD + y_BTD, aux
