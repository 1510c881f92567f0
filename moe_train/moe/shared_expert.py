"""The shared expert of Qwen2-MoE blocks: a SwiGLU MLP every token passes, behind a sigmoid gate.

y = sigmoid(x w_g) * down(silu(gate(x)) * up(x)), added to the routed experts' combine by
`MoELayer` (its ``shared_expert`` slot). The submodule names are Qwen's (``gate_proj``,
``up_proj``, ``down_proj``, and ``gate`` for its ``shared_expert_gate``), so weights map
one to one.

Shape legend: T tokens, D model dim, F shared-expert inner dim.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class GatedSharedExpert(nn.Module):
    """Bias-free SwiGLU MLP scaled per token by sigmoid of a learned (D -> 1) gate."""

    def __init__(self, d_model: int, ffn_dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False)
        for layer in (self.gate_proj, self.up_proj, self.down_proj, self.gate):
            nn.init.normal_(layer.weight, mean=0.0, std=init_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        h_TF = F.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD)
        return F.sigmoid(self.gate(x_TD)) * self.down_proj(h_TF)
