"""Triton kernels for the dispatch ops: expert histogram, row gather, row combine.

Imported lazily, only when the Triton path is chosen (see `moe_train.kernels.backend`). On a
CPU machine they run under ``TRITON_INTERPRET=1`` (tests); on CUDA they are compiled.
- histogram: one atomic add per kept slot into int32 bins.
- gather: out[n] = scale[n] * src[index[n]], optionally also dot[n] = <src[index[n]], other[n]>
  (permute forward; unpermute backward, where the dot is the combine-weight gradient).
- combine: out[t] = sum_k w[t, k] * src[pos[t, k]] over pos >= 0, a gather per token, so no
  float atomics and a deterministic sum (unpermute forward; permute backward with w = 1).

Shape legend: T tokens, K slots per token, E experts, N routed rows, D row width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_SLOTS = 1024


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(max(D, 16)), 1024)


@triton.jit
def _histogram_kernel(ids_ptr, counts_ptr, num_slots, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    tl.atomic_add(counts_ptr + ids, 1, mask=ids >= 0)


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr, D,
                        stride_src, stride_other, stride_out,
                        HAS_SCALE: tl.constexpr, COMPUTE_DOT: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    src_row = tl.load(index_ptr + n).to(tl.int64)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + n).to(tl.float32)
    else:
        scale = 1.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        v = tl.load(src_ptr + src_row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * stride_out + cols, (v * scale).to(out_ptr.dtype.element_ty),
                 mask=mask)
        if COMPUTE_DOT:
            o = tl.load(other_ptr + n * stride_other + cols, mask=mask, other=0.0)
            acc += v * o.to(tl.float32)
    if COMPUTE_DOT:
        tl.store(dot_ptr + n, tl.sum(acc, axis=0))


@triton.jit
def _combine_rows_kernel(src_ptr, pos_ptr, weight_ptr, out_ptr, D, stride_src, stride_out,
                         K: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + k).to(tl.int64)
        kept = row >= 0
        width = tl.where(kept, D, 0)  # a dropped slot (row -1) loads nothing
        v = tl.load(src_ptr + row * stride_src + cols, mask=cols < width, other=0.0)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + t * K + k).to(tl.float32)
            acc += tl.where(kept, w, 0.0) * v.to(tl.float32)
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def expert_histogram_triton(expert_ids_TK: Tensor, num_experts: int) -> Tensor:
    """int64 counts_E of the ids in [0, E); -1 is skipped."""
    ids = expert_ids_TK.reshape(-1).contiguous()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    if ids.numel():
        grid = (triton.cdiv(ids.numel(), _BLOCK_SLOTS),)
        _histogram_kernel[grid](ids, counts, ids.numel(), BLOCK=_BLOCK_SLOTS)
    return counts.long()


def gather_rows_triton(src_MD: Tensor, index_N: Tensor, scale_N: Tensor | None = None,
                       other_ND: Tensor | None = None) -> tuple[Tensor, Tensor] | Tensor:
    """out_ND[n] = scale_N[n] * src_MD[index_N[n]]; with `other_ND`, also return the fp32
    dots_N[n] = <src_MD[index_N[n]], other_ND[n]> as (out_ND, dots_N)."""
    src_MD = src_MD.contiguous()
    N, D = index_N.numel(), src_MD.size(1)
    out = src_MD.new_empty(N, D)
    dots = torch.empty(N if other_ND is not None else 0, dtype=torch.float32,
                       device=src_MD.device)
    other = other_ND.contiguous() if other_ND is not None else out
    if N and D:
        _gather_rows_kernel[(N,)](
            src_MD, index_N, scale_N if scale_N is not None else index_N, other, out, dots, D,
            src_MD.stride(0), other.stride(0), out.stride(0),
            HAS_SCALE=scale_N is not None, COMPUTE_DOT=other_ND is not None,
            BLOCK_D=_block_d(D))
    elif other_ND is not None:
        dots.zero_()
    return (out, dots) if other_ND is not None else out


def combine_rows_triton(src_ND: Tensor, pos_TK: Tensor, weights_TK: Tensor | None) -> Tensor:
    """out_TD[t] = sum over pos_TK[t, k] >= 0 of weights_TK[t, k] * src_ND[pos_TK[t, k]]."""
    T, K = pos_TK.shape
    D = src_ND.size(1)
    out = src_ND.new_empty(T, D)
    if T and D:
        block_d = _block_d(D)
        _combine_rows_kernel[(T, triton.cdiv(D, block_d))](
            src_ND, pos_TK.contiguous(), weights_TK if weights_TK is not None else pos_TK, out,
            D, src_ND.stride(0), out.stride(0), K=K, HAS_WEIGHT=weights_TK is not None,
            BLOCK_D=block_d)
    return out


def unpermute_backward_triton(grad_TD: Tensor, y_ND: Tensor | None, row_map_N: Tensor,
                              weights_TK: Tensor) -> tuple[Tensor, Tensor | None]:
    """Gradients of the combine: wrt y_ND (always) and wrt weights_TK (when `y_ND` is given)."""
    T, K = weights_TK.shape
    token_N = row_map_N // K
    w_N = weights_TK.reshape(-1).index_select(0, row_map_N)
    if y_ND is None:
        return gather_rows_triton(grad_TD, token_N, w_N), None
    grad_y, dots_N = gather_rows_triton(grad_TD, token_N, w_N, y_ND)
    grad_w = torch.zeros(T * K, dtype=torch.float32, device=grad_TD.device)
    grad_w.index_copy_(0, row_map_N, dots_N)
    return grad_y, grad_w.view(T, K).to(weights_TK.dtype)
