"""Grouped GEMM: the rows of expert e (contiguous after `permute`) times w_EDF[e] (+ b_EF[e]).

The torch path is one custom autograd Function that runs one plain `torch.mm` (`torch.addmm`
with a bias) per non-empty expert segment, writing into preallocated outputs, and in backward
computes dW[e] = x_e^T g_e (and db[e] = sum of g_e) straight into one E x D x F buffer.
Autograd never sees a per-expert slice of the stacked weight, so no slice gradient
materialises a whole E x D x F tensor, and the cost is that of the per-expert matmuls
themselves: the floor. Given a `GradBuffers`, that buffer is reused from step to step instead
of allocated (see grad_buffers.py: a fresh 128 MiB block costs ~33k page faults on CPU), and
only the slices of experts without rows are zeroed. benchmarks/kernels.py measures it against
torch's own grouped_mm and a padded bmm. The Triton path (CUDA) runs the same Function with
the kernels of `triton_gemm`. `Experts` on CPU runs `expert_ffn` instead (both GEMMs expert by
expert); this grouped form is its GPU path.

Shape legend: N rows sorted by expert, E experts, D input dim, F output dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_train.kernels.backend import use_triton
from moe_train.kernels.grad_buffers import GradBuffers


def segment_sizes(counts_E: Tensor, num_rows: int) -> list[int]:
    """counts_E as host ints, checked to cover the rows (a host sync on CUDA; free on CPU)."""
    sizes = counts_E.tolist()
    if sum(sizes) != num_rows or min(sizes, default=0) < 0:
        raise ValueError(f"grouped_gemm: counts_E {sizes} do not sum to the {num_rows} rows")
    return sizes


def grouped_mm_torch(x_NK: Tensor, w_EKM: Tensor, sizes: list[int],
                     bias_EM: Tensor | None = None) -> Tensor:
    """out_NM[rows of e] = x_NK[rows of e] @ w_EKM[e] (+ bias_EM[e]); w may be a transposed
    view."""
    out = x_NK.new_empty(x_NK.size(0), w_EKM.size(2))
    start = 0
    for e, size in enumerate(sizes):
        if size:
            rows = slice(start, start + size)
            if bias_EM is None:
                torch.mm(x_NK[rows], w_EKM[e], out=out[rows])
            else:
                torch.addmm(bias_EM[e], x_NK[rows], w_EKM[e], out=out[rows])
            start += size
    return out


def grouped_mm_dw_torch(x_ND: Tensor, g_NF: Tensor, sizes: list[int], dtype: torch.dtype,
                        out: Tensor | None = None) -> Tensor:
    """dw_EDF[e] = x_e^T @ g_e over the rows of expert e; zeros for experts without rows.
    Written into `out` (E x D x F, contiguous, any content) when given."""
    dw = out if out is not None else torch.empty(len(sizes), x_ND.size(1), g_NF.size(1),
                                                 dtype=dtype, device=x_ND.device)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            torch.mm(x_ND[start:start + size].t(), g_NF[start:start + size], out=dw[e])
            start += size
        else:
            dw[e].zero_()
    return dw


def segment_sum_torch(g_NF: Tensor, sizes: list[int], dtype: torch.dtype,
                      out: Tensor | None = None) -> Tensor:
    """db_EF[e] = sum of the rows of expert e (the bias gradient), into `out` when given."""
    db = out if out is not None else torch.empty(len(sizes), g_NF.size(1), dtype=dtype,
                                                 device=g_NF.device)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            torch.sum(g_NF[start:start + size], 0, out=db[e])
            start += size
        else:
            db[e].zero_()
    return db


class _GroupedGemmFn(torch.autograd.Function):
    """x_NF = grouped x_ND @ w_EDF (+ b_EF); backward gives dx_ND, the whole dw_EDF and db_EF."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, w_EDF: Tensor, bias_EF: Tensor | None, counts_E: Tensor,
                triton: bool, grads: tuple[GradBuffers, str, str] | None) -> Tensor:
        ctx.triton, ctx.grads = triton, grads
        ctx.has_bias = bias_EF is not None
        ctx.save_for_backward(x_ND, w_EDF, counts_E)
        if triton:
            from moe_train.kernels.triton_gemm import grouped_mm_triton
            return grouped_mm_triton(x_ND, w_EDF, counts_E, bias_EF)
        ctx.sizes = segment_sizes(counts_E, x_ND.size(0))
        return grouped_mm_torch(x_ND, w_EDF, ctx.sizes, bias_EF)

    @staticmethod
    def backward(ctx, grad_NF: Tensor):
        x_ND, w_EDF, counts_E = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if ctx.triton:
            from moe_train.kernels.triton_gemm import (grouped_mm_dw_triton, grouped_mm_triton,
                                                       segment_sum_triton)
            if need_x:
                grad_x = grouped_mm_triton(grad_NF, w_EDF.transpose(1, 2), counts_E)
            if need_w:
                grad_w = grouped_mm_dw_triton(x_ND, grad_NF, counts_E, w_EDF.dtype)
            if need_b:
                grad_b = segment_sum_triton(grad_NF, counts_E, w_EDF.dtype)
        else:
            bufs, w_name, b_name = ctx.grads or (None, "", "")
            E, _, F_ = w_EDF.shape
            if need_x:
                grad_x = grouped_mm_torch(grad_NF, w_EDF.transpose(1, 2), ctx.sizes)
            if need_w:
                out = None if bufs is None else bufs.take(w_name, w_EDF.shape, w_EDF)
                grad_w = grouped_mm_dw_torch(x_ND, grad_NF, ctx.sizes, w_EDF.dtype, out)
            if need_b:
                out = None if bufs is None else bufs.take(b_name, (E, F_), w_EDF)
                grad_b = segment_sum_torch(grad_NF, ctx.sizes, w_EDF.dtype, out)
        return grad_x, grad_w, grad_b, None, None, None


def grouped_gemm(x_ND: Tensor, w_EDF: Tensor, counts_E: Tensor, bias_EF: Tensor | None = None,
                 *, backend: str = "auto", grad_buffers: GradBuffers | None = None,
                 grad_names: tuple[str, str] = ("weight", "bias")) -> Tensor:
    """x_NF[rows of e] = x_ND[rows of e] @ w_EDF[e] (+ bias_EF[e]), rows grouped by expert as
    `counts_E` says (expert 0's rows first).

    Differentiable in x_ND, w_EDF and bias_EF; all three share a dtype and device. The bias is
    fused into the GEMM's output write (no separate N x F gather-and-add). With `grad_buffers`
    (torch path) the weight and bias gradients are written into its buffers named `grad_names`.
    """
    if x_ND.dim() != 2 or w_EDF.dim() != 3 or x_ND.size(1) != w_EDF.size(1) \
            or counts_E.numel() != w_EDF.size(0) or x_ND.dtype != w_EDF.dtype \
            or (bias_EF is not None and (bias_EF.shape != (w_EDF.size(0), w_EDF.size(2))
                                         or bias_EF.dtype != w_EDF.dtype)):
        bias = None if bias_EF is None else (tuple(bias_EF.shape), bias_EF.dtype)
        raise ValueError(f"grouped_gemm: x_ND {tuple(x_ND.shape)} {x_ND.dtype}, w_EDF "
                         f"{tuple(w_EDF.shape)} {w_EDF.dtype}, bias_EF {bias} and counts_E "
                         f"{tuple(counts_E.shape)} do not match")
    grads = None if grad_buffers is None else (grad_buffers, *grad_names)
    return _GroupedGemmFn.apply(x_ND.contiguous(), w_EDF, bias_EF, counts_E,
                                use_triton(x_ND, backend), grads)
