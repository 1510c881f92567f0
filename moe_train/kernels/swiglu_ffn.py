"""SwiGLU expert FFN: y_e = (silu(x_e w_gate[e]) * (x_e w_up[e])) w_down[e] per row segment.

The experts of Qwen2-MoE-style blocks (no biases). Two paths, same math:
- `swiglu_ffn` (CPU): one custom autograd Function running gate GEMM, up GEMM, silu * up and
  the down GEMM on one expert's rows at a time, like `expert_ffn` does for relu/gelu: the
  expert's n_e x F hidden rows are still in cache when the down GEMM reads them, and no N x F
  hidden block is allocated beyond the pre-activations saved for backward. The backward goes
  expert by expert as well: s = silu(a) and h = s * b recomputed (elementwise), dW_down =
  h^T g, dh = g w_down^T, d_up = dh * s, d_gate = silu'(a) * dh * b, dW_gate = x^T d_gate,
  dW_up = x^T d_up, dx = d_gate w_gate^T + d_up w_up^T. Weight gradients go into a
  `GradBuffers` when one is given (grad_buffers.py), only the slices of experts without rows
  zeroed.
- `swiglu_grouped` (GPU): three `grouped_gemm` calls with silu * up between them, on the
  Triton kernels when `use_triton(x, backend)` says so; `SwiGLUExperts` picks it exactly as
  `Experts` picks its grouped path.

Saved for backward (CPU path): x_ND, the weights, and per non-empty expert the gate and up
pre-activations a = x w_gate[e], b = x w_up[e] (n_e x F each); silu(a) is recomputed.

Shape legend: N rows sorted by expert, E experts, D model dim, F FFN dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_train.kernels.grad_buffers import GradBuffers
from moe_train.kernels.grouped_gemm import grouped_gemm, segment_sizes

GRAD_NAMES = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")

_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input


class _SwiGLUFFNFn(torch.autograd.Function):
    """y_ND = per expert (silu(x w_gate) * (x w_up)) w_down; backward to x and the weights."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, w_gate_EDF: Tensor, w_up_EDF: Tensor, w_down_EFD: Tensor,
                sizes: list[int], grads: GradBuffers | None, save: bool) -> Tensor:
        F_ = w_gate_EDF.size(2)
        y_ND = x_ND.new_empty(x_ND.size(0), w_down_EFD.size(2))
        # n x F scratch rows reused by every expert: h, and a, b when nothing is saved
        scratch = x_ND.new_empty(1 if save else 3, max(sizes, default=0), F_).unbind(0)
        h_scr, a_scr, b_scr = scratch if not save else (scratch[0], None, None)
        saved: list[Tensor] = []  # per non-empty expert: a (gate), b (up), n_e x F each
        for x_nD, y_nD, wg_DF, wu_DF, wd_FD, n in zip(
                x_ND.split(sizes), y_ND.split(sizes), w_gate_EDF.unbind(0), w_up_EDF.unbind(0),
                w_down_EFD.unbind(0), sizes):
            if not n:
                continue
            if save:
                a_nF, b_nF = torch.mm(x_nD, wg_DF), torch.mm(x_nD, wu_DF)
                saved += (a_nF, b_nF)
            else:
                a_nF = torch.mm(x_nD, wg_DF, out=a_scr[:n])
                b_nF = torch.mm(x_nD, wu_DF, out=b_scr[:n])
            h_nF = _silu_out(a_nF, out=h_scr[:n]).mul_(b_nF)
            torch.mm(h_nF, wd_FD, out=y_nD)
        ctx.sizes, ctx.grads = sizes, grads
        ctx.save_for_backward(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, *saved)
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND: Tensor):
        x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, *saved = ctx.saved_tensors
        if not saved and any(ctx.sizes):
            raise RuntimeError("swiglu_ffn: backward through a forward run without grad")
        g_ND = grad_ND.contiguous()
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        need_d_gate, need_d_up = need_x or need_gate, need_x or need_up
        sizes = ctx.sizes
        E, D, F_ = w_gate_EDF.shape

        def out(need: bool, name: str, shape: tuple[int, ...]) -> Tensor | None:
            if not need:
                return None
            if ctx.grads is None:
                return torch.empty(shape, dtype=w_gate_EDF.dtype, device=w_gate_EDF.device)
            return ctx.grads.take(name, shape, w_gate_EDF)

        grads = (out(need_gate, GRAD_NAMES[0], (E, D, F_)),
                 out(need_up, GRAD_NAMES[1], (E, D, F_)),
                 out(need_down, GRAD_NAMES[2], (E, F_, D)))
        per_expert = [[None] * E if g is None else g.unbind(0) for g in grads]
        dx_ND = torch.empty_like(x_ND) if need_x else None
        dxs = dx_ND.split(sizes) if need_x else [None] * E
        # three n x F scratch rows reused by every expert: s (then d_up), h (then dh), d_gate
        s_scr, h_scr, dg_scr = x_ND.new_empty(3, max(sizes, default=0), F_).unbind(0)
        acts = iter(saved)
        for x_nD, g_nD, dx_nD, wg_DF, wu_DF, wd_FD, dwg, dwu, dwd, n in zip(
                x_ND.split(sizes), g_ND.split(sizes), dxs, w_gate_EDF.unbind(0),
                w_up_EDF.unbind(0), w_down_EFD.unbind(0), *per_expert, sizes):
            if not n:  # no rows: zero gradients (the buffers hold the last step's values)
                for grad in (dwg, dwu, dwd):
                    if grad is not None:
                        grad.zero_()
                continue
            a_nF, b_nF = next(acts), next(acts)
            need_s = dwd is not None or need_d_up  # silu(a): for h and for d_up
            s_nF = _silu_out(a_nF, out=s_scr[:n]) if need_s else None
            if dwd is not None:
                torch.mm(torch.mul(s_nF, b_nF, out=h_scr[:n]).t(), g_nD, out=dwd)
            if not (need_d_gate or need_d_up):
                continue
            dh_nF = torch.mm(g_nD, wd_FD.t(), out=h_scr[:n])
            d_up_nF = s_nF.mul_(dh_nF) if need_d_up else None  # s is not needed after this
            d_gate_nF = None
            if need_d_gate:
                d_gate_nF = _silu_backward_out(dh_nF.mul_(b_nF), a_nF, grad_input=dg_scr[:n])
            if dwg is not None:
                torch.mm(x_nD.t(), d_gate_nF, out=dwg)
            if dwu is not None:
                torch.mm(x_nD.t(), d_up_nF, out=dwu)
            if dx_nD is not None:
                torch.mm(d_gate_nF, wg_DF.t(), out=dx_nD)
                dx_nD.addmm_(d_up_nF, wu_DF.t())
        return dx_ND, *grads, None, None, None


def _check_shapes(fn: str, x_ND: Tensor, w_gate_EDF: Tensor, w_up_EDF: Tensor,
                  w_down_EFD: Tensor, counts_E: Tensor) -> None:
    """One ValueError naming every shape (and dtype) when they do not fit together."""
    ok = w_gate_EDF.dim() == 3 and x_ND.dim() == 2
    if ok:
        E, D, F_ = w_gate_EDF.shape
        ok = (x_ND.size(1) == D and counts_E.numel() == E and w_up_EDF.shape == (E, D, F_)
              and w_down_EFD.shape == (E, F_, D)
              and x_ND.dtype == w_gate_EDF.dtype == w_up_EDF.dtype == w_down_EFD.dtype)
    if not ok:
        raise ValueError(f"{fn}: x_ND {tuple(x_ND.shape)} {x_ND.dtype}, w_gate "
                         f"{tuple(w_gate_EDF.shape)}, w_up {tuple(w_up_EDF.shape)}, w_down "
                         f"{tuple(w_down_EFD.shape)} {w_down_EFD.dtype} and counts_E "
                         f"{tuple(counts_E.shape)} do not match")


def swiglu_ffn(x_ND: Tensor, w_gate_EDF: Tensor, w_up_EDF: Tensor, w_down_EFD: Tensor,
               counts_E: Tensor, grad_buffers: GradBuffers | None = None) -> Tensor:
    """y_ND[rows of e] = (silu(x_e @ w_gate_EDF[e]) * (x_e @ w_up_EDF[e])) @ w_down_EFD[e],
    x_e = x_ND[rows of e], rows grouped by expert as `counts_E` says; differentiable in x and
    the three weights.

    torch ops only, expert by expert (the CPU path; one host sync for the counts on an
    accelerator). Weight gradients go into `grad_buffers` (names "w_gate_EDF", "w_up_EDF",
    "w_down_EFD") if given.
    """
    _check_shapes("swiglu_ffn", x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E)
    sizes = segment_sizes(counts_E, x_ND.size(0))
    save = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_ND, w_gate_EDF, w_up_EDF, w_down_EFD))
    return _SwiGLUFFNFn.apply(x_ND.contiguous(), w_gate_EDF, w_up_EDF, w_down_EFD, sizes,
                              grad_buffers, save)


def swiglu_grouped(x_ND: Tensor, w_gate_EDF: Tensor, w_up_EDF: Tensor, w_down_EFD: Tensor,
                   counts_E: Tensor, *, backend: str = "auto",
                   grad_buffers: GradBuffers | None = None) -> Tensor:
    """What `swiglu_ffn` computes, as grouped GEMMs: gate and up each one `grouped_gemm`
    over all N rows, silu * up elementwise on the N x F block, then the down `grouped_gemm`.

    The GPU path (Triton kernels when `use_triton(x_ND, backend)`); on the torch backend the
    weight gradients go into `grad_buffers` under the names `swiglu_ffn` uses.
    """
    _check_shapes("swiglu_grouped", x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E)

    def gemm(x: Tensor, w: Tensor, name: str) -> Tensor:
        return grouped_gemm(x, w, counts_E, backend=backend, grad_buffers=grad_buffers,
                            grad_names=(name, name + ".bias"))

    a_NF = gemm(x_ND, w_gate_EDF, GRAD_NAMES[0])
    b_NF = gemm(x_ND, w_up_EDF, GRAD_NAMES[1])
    return gemm(F.silu(a_NF) * b_NF, w_down_EFD, GRAD_NAMES[2])
