"""Triton dispatch kernels compiled on a CUDA GPU against the references (skipped without CUDA).

The small cases reuse the checks of tests/unit/test_kernels.py (there run interpreted on CPU);
the large ones compare the Triton path with the torch path on the same CUDA tensors.

Shape legend: T tokens, K slots per token, E experts, N kept rows, D model dim, F FFN dim.
"""

from __future__ import annotations

import pytest
import torch

from moe_train.kernels import grouped_gemm, permute, unpermute, use_triton
from moe_train.moe.experts import Experts
from tests.unit.test_kernels import (CASE_IDS, CASES, check_grouped_gemm, check_histogram,
                                     check_permute, check_unpermute)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
# fp32 products are full fp32 under torch's default matmul precision ("highest"), as on CPU;
# bf16 rounds every output.
TOL = {torch.float32: {"permute": 1e-6, "unpermute": 1e-5, "gemm": 1e-4},
       torch.bfloat16: {"permute": 2e-2, "unpermute": 5e-2, "gemm": 6e-2}}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernels_match_reference(case, dtype):
    tol = TOL[dtype]
    check_histogram(case, "triton", "cuda")
    check_permute(case, "triton", "cuda", dtype=dtype, tol=tol["permute"])
    check_unpermute(case, "triton", "cuda", dtype=dtype, tol=tol["unpermute"])
    check_grouped_gemm(case, "triton", "cuda", dtype=dtype, tol=tol["gemm"])


def test_fp32_grouped_gemm_follows_torch_matmul_precision():
    """TF32 only where torch allows it: "high" changes the Triton result (10-bit mantissa
    products), "highest" gives full fp32 products, close to float64."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=gen).cuda()
    w = torch.randn(4, 256, 128, generator=gen).cuda()
    counts = torch.tensor([100, 0, 300, 112], device="cuda")
    want = grouped_gemm(x.double(), w.double(), counts, backend="torch")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        ieee = grouped_gemm(x, w, counts, backend="triton")
        torch.set_float32_matmul_precision("high")
        tf32 = grouped_gemm(x, w, counts, backend="triton")
    finally:
        torch.set_float32_matmul_precision(before)
    err_ieee = (ieee.double() - want).abs().max().item()
    err_tf32 = (tf32.double() - want).abs().max().item()
    assert err_ieee < 1e-3 < err_tf32 < 0.5, (err_ieee, err_tf32)


def test_auto_backend_picks_triton_for_cuda_tensors():
    assert use_triton(torch.zeros(1, device="cuda"), "auto")
    assert not use_triton(torch.zeros(1), "auto")


def _grads(backend: str, x_TD, ids_TK, w_TK, w_EDF, E):
    x, w, wt = (t.detach().clone().requires_grad_(True) for t in (x_TD, w_TK, w_EDF))
    x_ND, row_map, counts = permute(x, ids_TK, E, backend=backend)
    h_NF = grouped_gemm(x_ND, wt, counts, backend=backend)
    y_TD = unpermute(h_NF, row_map, w, x_TD.size(0), backend=backend)
    y_TD.backward(torch.ones_like(y_TD))
    return y_TD, x.grad, w.grad, wt.grad


@pytest.mark.parametrize("E", [8, 64])
def test_large_dispatch_chain_triton_equals_torch(E):
    torch.manual_seed(0)
    T, K, D, F = 4096, 2, 256, 512
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    ids[torch.rand(T, K, device="cuda") < 0.1] = -1
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w_TK = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
    w_EDF = (torch.randn(E, D, F, device="cuda") / D ** 0.5).bfloat16()
    got = _grads("triton", x, ids, w_TK, w_EDF, E)
    want = _grads("torch", x, ids, w_TK, w_EDF, E)
    for name, a, b in zip(("y", "dx", "dweights", "dw"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=5e-2, msg=name)


def test_experts_module_triton_equals_torch_on_cuda():
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 17, 700], device="cuda")
    m_tri = Experts(4, 128, 256, activation="gelu", backend="triton").cuda()
    m_ref = Experts(4, 128, 256, activation="gelu", backend="torch").cuda()
    m_ref.load_state_dict(m_tri.state_dict())
    x = torch.randn(int(counts.sum()), 128, device="cuda")
    y_tri, y_ref = m_tri(x, counts), m_ref(x, counts)
    torch.testing.assert_close(y_tri, y_ref, atol=3e-2, rtol=3e-2)
    y_tri.square().mean().backward()
    y_ref.square().mean().backward()
    for (name, p), q in zip(m_tri.named_parameters(), m_ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=3e-3, rtol=5e-2, msg=name)
