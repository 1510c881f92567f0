"""Triton grouped GEMM: rows of expert e times w[e] (+ b[e]), and its weight and bias gradients.

Imported lazily (Triton path only). The forward kernel tiles the expert-sorted rows: each
row tile belongs to one expert (tiles never straddle two), so the launch grid is
(tiles, column blocks) with tiles <= cdiv(N, BLOCK_M) + E, known on the host without a sync;
surplus tiles are empty and store nothing. The same kernel computes dX = g_NF w_e^T by reading
w through transposed strides. The weight-gradient kernel gives each (expert, D block, F block)
one program that reduces over the expert's rows, writing straight into one E x D x F buffer;
the bias gradient is the same reduction without the x factor.

fp32 inputs follow torch's matmul precision (`torch.get_float32_matmul_precision`): full fp32
products under "highest" (torch's default), TF32 tensor cores only where the user allowed them
("high" / "medium"), as torch's own fp32 matmuls do. bf16 and fp16 inputs are unaffected.

Shape legend: N rows (sorted by expert), E experts, D input dim, F output dim; in the kernels
M rows, Kd the reduced dim, Nc the output columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, tile_expert_ptr, tile_row0_ptr,
                       tile_row1_ptr, Kd, Nc, stride_am, stride_ak, stride_be, stride_bk,
                       stride_bn, stride_bias_e, stride_cm, stride_cn, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + pid_m).to(tl.int64)
    row1 = tl.load(tile_row1_ptr + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < row1
    col_mask = cols < Nc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_k = tl.where(row1 > row0, tl.cdiv(Kd, BLOCK_K), 0)
    for kb in range(0, num_k):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < Kd
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + e * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_bias_e + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_dw_kernel(x_ptr, g_ptr, dw_ptr, row_start_ptr, counts_ptr, D, F,
                          stride_xm, stride_xd, stride_gm, stride_gf,
                          stride_we, stride_wd, stride_wf,
                          BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                          PRECISION: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    fs = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    d_mask = ds < D
    f_mask = fs < F
    start = tl.load(row_start_ptr + e).to(tl.int64)
    end = start + tl.load(counts_ptr + e).to(tl.int64)
    acc = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)
    for mb in range(0, tl.cdiv(end - start, BLOCK_M)):
        rows = start + mb * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < end
        x_t = tl.load(x_ptr + rows[None, :] * stride_xm + ds[:, None] * stride_xd,
                      mask=r_mask[None, :] & d_mask[:, None], other=0.0)
        g = tl.load(g_ptr + rows[:, None] * stride_gm + fs[None, :] * stride_gf,
                    mask=r_mask[:, None] & f_mask[None, :], other=0.0)
        acc = tl.dot(x_t, g, acc, input_precision=PRECISION)
    tl.store(dw_ptr + e * stride_we + ds[:, None] * stride_wd + fs[None, :] * stride_wf,
             acc.to(dw_ptr.dtype.element_ty), mask=d_mask[:, None] & f_mask[None, :])


@triton.jit
def _segment_sum_kernel(g_ptr, out_ptr, row_start_ptr, counts_ptr, F, stride_gm, stride_oe,
                        BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    fs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = fs < F
    start = tl.load(row_start_ptr + e).to(tl.int64)
    end = start + tl.load(counts_ptr + e).to(tl.int64)
    acc = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for mb in range(0, tl.cdiv(end - start, BLOCK_M)):
        rows = start + mb * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.load(g_ptr + rows[:, None] * stride_gm + fs[None, :],
                    mask=(rows < end)[:, None] & f_mask[None, :], other=0.0)
        acc += tl.sum(g.to(tl.float32), axis=0)
    tl.store(out_ptr + e * stride_oe + fs, acc.to(out_ptr.dtype.element_ty), mask=f_mask)


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for inputs of `dtype`: "ieee" (full fp32 products) for fp32
    unless torch's float32 matmul precision allows TF32; "tf32" otherwise (ignored by Triton
    for 16-bit inputs)."""
    if dtype == torch.float32 and not _fp32_matmul_allows_tf32():
        return "ieee"
    return "tf32"


def _fp32_matmul_allows_tf32() -> bool:
    """Whether torch's CUDA matmuls may use TF32 for fp32. Read through the per-backend setting
    where torch has it: once a user sets `torch.backends.*.fp32_precision`, torch refuses the
    legacy `get_float32_matmul_precision()` query (mixing the two APIs is an error)."""
    matmul = torch.backends.cuda.matmul
    prec = getattr(matmul, "fp32_precision", None)
    if prec is None:
        return torch.get_float32_matmul_precision() != "highest"
    if prec == "none":  # inherits the global setting
        prec = getattr(torch.backends, "fp32_precision", "none")
    return prec == "tf32"


def _tile_map(counts_E: Tensor, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per row tile: its expert, first row and end row (end == first: an empty surplus tile)."""
    E = counts_E.numel()
    tiles_E = (counts_E + BLOCK_M - 1) // BLOCK_M
    tile_end_E = tiles_E.cumsum(0)
    row_start_E = counts_E.cumsum(0) - counts_E
    tile = torch.arange(triton.cdiv(num_rows, BLOCK_M) + E, device=counts_E.device)
    expert = torch.searchsorted(tile_end_E, tile, right=True).clamp_(max=E - 1)
    row0 = row_start_E[expert] + (tile - (tile_end_E - tiles_E)[expert]) * BLOCK_M
    row1 = torch.where(tile < tile_end_E[-1], row_start_E[expert] + counts_E[expert], row0)
    return expert, row0, row1


def grouped_mm_triton(a_MK: Tensor, b_EKN: Tensor, counts_E: Tensor,
                      bias_EN: Tensor | None = None) -> Tensor:
    """c_MN[rows of e] = a_MK[rows of e] @ b_EKN[e] (+ bias_EN[e]); `b_EKN` may be a
    transposed view."""
    M, Kd = a_MK.shape
    Nc = b_EKN.size(2)
    c = a_MK.new_empty(M, Nc)
    if M == 0 or Nc == 0:
        return c
    if bias_EN is not None:
        bias_EN = bias_EN.contiguous()
    expert, row0, row1 = _tile_map(counts_E, M)
    grid = (expert.numel(), triton.cdiv(Nc, BLOCK_N))
    _grouped_mm_kernel[grid](
        a_MK, b_EKN, bias_EN if bias_EN is not None else c, c, expert, row0, row1, Kd, Nc,
        a_MK.stride(0), a_MK.stride(1), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        bias_EN.stride(0) if bias_EN is not None else 0, c.stride(0), c.stride(1),
        HAS_BIAS=bias_EN is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(a_MK.dtype))
    return c


def grouped_mm_dw_triton(x_ND: Tensor, g_NF: Tensor, counts_E: Tensor, dtype: torch.dtype
                         ) -> Tensor:
    """dw_EDF[e] = x_ND[rows of e]^T @ g_NF[rows of e]; experts without rows get zeros."""
    E, D, F = counts_E.numel(), x_ND.size(1), g_NF.size(1)
    dw = torch.empty(E, D, F, dtype=dtype, device=x_ND.device)
    if x_ND.size(0) == 0:
        return dw.zero_()
    row_start_E = counts_E.cumsum(0) - counts_E
    grid = (E, triton.cdiv(D, BLOCK_N), triton.cdiv(F, BLOCK_N))
    _grouped_mm_dw_kernel[grid](
        x_ND, g_NF, dw, row_start_E, counts_E, D, F, x_ND.stride(0), x_ND.stride(1),
        g_NF.stride(0), g_NF.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        BLOCK_D=BLOCK_N, BLOCK_F=BLOCK_N, BLOCK_M=BLOCK_K, PRECISION=dot_precision(x_ND.dtype))
    return dw


def segment_sum_triton(g_NF: Tensor, counts_E: Tensor, dtype: torch.dtype) -> Tensor:
    """db_EF[e] = sum of the rows of expert e; zeros for experts without rows."""
    E, F = counts_E.numel(), g_NF.size(1)
    db = torch.empty(E, F, dtype=dtype, device=g_NF.device)
    if g_NF.size(0) == 0:
        return db.zero_()
    row_start_E = counts_E.cumsum(0) - counts_E
    _segment_sum_kernel[(E, triton.cdiv(F, BLOCK_N))](
        g_NF, db, row_start_E, counts_E, F, g_NF.stride(0), db.stride(0),
        BLOCK_F=BLOCK_N, BLOCK_M=BLOCK_K)
    return db
