"""Expert FFN run expert by expert: y_e = act(x_e w1[e] + b1[e]) w2[e] + b2[e] per row segment.

The CPU path of `moe_train.moe.experts.Experts`. Two grouped GEMMs with the activation between
them (the GPU path) write all N x F hidden rows before reading them back; this Function runs
GEMM1 -> bias + activation -> GEMM2 on one expert's rows at a time, so an expert's hidden rows
(n_e x F) are still in cache when GEMM2 reads them, and no N x F block is allocated at once
(each expert's hidden rows are their own small allocation, saved for backward). The backward
goes expert by expert as well: dh = g w2^T, activation backward, dW2 = h^T g, dW1 = x^T dz,
dx = dz w1^T, bias sums. Every step is the op the grouped path runs on the same operands, so
outputs and gradients are the same. Weight and bias gradients are written into a `GradBuffers`
when one is given (see grad_buffers.py), with only the slices of experts without rows zeroed.

Saved for backward: x_ND, the weights, and per expert the post-activation rows (relu: its
derivative reads them) or the pre-activation rows (gelu: recomputed in backward).

Shape legend: N rows sorted by expert, E experts, D model dim, F FFN dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_train.kernels.grad_buffers import GradBuffers
from moe_train.kernels.grouped_gemm import segment_sizes

ACTIVATIONS = ("relu", "gelu")
GRAD_NAMES = ("w1_EDF", "b1_EF", "w2_EFD", "b2_ED")


class _ExpertFFNFn(torch.autograd.Function):
    """y_ND = per expert act(x w1 + b1) w2 + b2; backward to x, w1, b1, w2, b2."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, w1_EDF: Tensor, b1_EF: Tensor, w2_EFD: Tensor, b2_ED: Tensor,
                sizes: list[int], activation: str, grads: GradBuffers | None) -> Tensor:
        relu = activation == "relu"
        y_ND = x_ND.new_empty(x_ND.size(0), w2_EFD.size(2))
        saved: list[Tensor] = []  # per non-empty expert: h (relu) or z (gelu), n_e x F
        for x_nD, y_nD, w1_DF, b1_F, w2_FD, b2_D, n in zip(
                x_ND.split(sizes), y_ND.split(sizes), w1_EDF.unbind(0), b1_EF.unbind(0),
                w2_EFD.unbind(0), b2_ED.unbind(0), sizes):
            if not n:
                continue
            z_nF = torch.addmm(b1_F, x_nD, w1_DF)
            h_nF = z_nF.relu_() if relu else F.gelu(z_nF)
            torch.addmm(b2_D, h_nF, w2_FD, out=y_nD)
            saved.append(h_nF if relu else z_nF)
        ctx.sizes, ctx.relu, ctx.grads = sizes, relu, grads
        ctx.save_for_backward(x_ND, w1_EDF, w2_EFD, *saved)
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        x_ND, w1_EDF, w2_EFD, *saved = ctx.saved_tensors
        g_ND = grad_ND.contiguous()
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_dz = need_x or need_w1 or need_b1
        sizes = ctx.sizes
        E, D, F_ = w1_EDF.shape

        def out(need: bool, name: str, shape: tuple[int, ...]) -> Tensor | None:
            if not need:
                return None
            if ctx.grads is None:
                return torch.empty(shape, dtype=w1_EDF.dtype, device=w1_EDF.device)
            return ctx.grads.take(name, shape, w1_EDF)

        grads = (out(need_w1, "w1_EDF", (E, D, F_)), out(need_b1, "b1_EF", (E, F_)),
                 out(need_w2, "w2_EFD", (E, F_, D)), out(need_b2, "b2_ED", (E, D)))
        per_expert = [[None] * E if g is None else g.unbind(0) for g in grads]
        dx_ND = torch.empty_like(x_ND) if need_x else None
        dxs = dx_ND.split(sizes) if need_x else [None] * E
        scratch_nF = x_ND.new_empty(max(sizes, default=0), F_)
        acts = iter(saved)
        for x_nD, g_nD, dx_nD, w1_DF, w2_FD, dw1, db1, dw2, db2, n in zip(
                x_ND.split(sizes), g_ND.split(sizes), dxs, w1_EDF.unbind(0), w2_EFD.unbind(0),
                *per_expert, sizes):
            if not n:  # no rows: zero gradients (the buffers hold the last step's values)
                for grad in (dw1, db1, dw2, db2):
                    if grad is not None:
                        grad.zero_()
                continue
            act_nF = next(acts)
            h_nF = act_nF if ctx.relu else F.gelu(act_nF)
            if dw2 is not None:
                torch.mm(h_nF.t(), g_nD, out=dw2)
            if db2 is not None:
                torch.sum(g_nD, 0, out=db2)
            if not need_dz:
                continue
            dh_nF = torch.mm(g_nD, w2_FD.t(), out=scratch_nF[:n])
            if ctx.relu:  # relu's backward as autograd runs it: 0 where the output is 0
                dz_nF = torch.ops.aten.threshold_backward(dh_nF, act_nF, 0)
            else:
                dz_nF = torch.ops.aten.gelu_backward(dh_nF, act_nF)
            if dw1 is not None:
                torch.mm(x_nD.t(), dz_nF, out=dw1)
            if db1 is not None:
                torch.sum(dz_nF, 0, out=db1)
            if dx_nD is not None:
                torch.mm(dz_nF, w1_DF.t(), out=dx_nD)
        return dx_ND, *grads, None, None, None


def expert_ffn(x_ND: Tensor, w1_EDF: Tensor, b1_EF: Tensor, w2_EFD: Tensor, b2_ED: Tensor,
               counts_E: Tensor, activation: str = "relu",
               grad_buffers: GradBuffers | None = None) -> Tensor:
    """y_ND[rows of e] = act(x_ND[rows of e] @ w1_EDF[e] + b1_EF[e]) @ w2_EFD[e] + b2_ED[e],
    rows grouped by expert as `counts_E` says; differentiable in x and every weight.

    torch ops only (the CPU path; one host sync for the counts on an accelerator). Gradients of
    the weights go into `grad_buffers` (names "w1_EDF", "b1_EF", "w2_EFD", "b2_ED") if given.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert_ffn: activation must be one of {ACTIVATIONS}, got "
                         f"{activation!r}")
    E, D, F_ = w1_EDF.shape
    if x_ND.dim() != 2 or x_ND.size(1) != D or counts_E.numel() != E \
            or b1_EF.shape != (E, F_) or w2_EFD.shape != (E, F_, D) or b2_ED.shape != (E, D):
        raise ValueError(f"expert_ffn: x_ND {tuple(x_ND.shape)}, w1 {tuple(w1_EDF.shape)}, "
                         f"b1 {tuple(b1_EF.shape)}, w2 {tuple(w2_EFD.shape)}, b2 "
                         f"{tuple(b2_ED.shape)} and counts_E {tuple(counts_E.shape)} do not "
                         "match")
    sizes = segment_sizes(counts_E, x_ND.size(0))
    return _ExpertFFNFn.apply(x_ND.contiguous(), w1_EDF, b1_EF, w2_EFD, b2_ED, sizes,
                              activation, grad_buffers)
