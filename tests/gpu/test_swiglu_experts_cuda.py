"""SwiGLU experts on a CUDA GPU (skipped without CUDA): the Triton grouped path against the
expert-by-expert `swiglu_ffn` on the same CUDA tensors.

Shape legend: N rows sorted by expert, E experts, D model dim, F FFN dim.
"""

from __future__ import annotations

import pytest
import torch

from moe_train.moe.experts import SwiGLUExperts

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_experts_triton_equals_torch_on_cuda(dtype):
    pytest.importorskip("triton")
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 17, 700], device="cuda")
    m_tri = SwiGLUExperts(4, 128, 256, backend="triton", init_std=0.05).to("cuda", dtype)
    m_ref = SwiGLUExperts(4, 128, 256, backend="torch").to("cuda", dtype)
    m_ref.load_state_dict(m_tri.state_dict())
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=dtype)
    y_tri, y_ref = m_tri(x, counts), m_ref(x, counts)
    # fp32: full fp32 products (torch's default matmul precision); bf16 rounds every output.
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(y_tri.float(), y_ref.float(), atol=tol * y_ref.abs().max().item(),
                               rtol=tol)
    (y_tri.float().square().mean() * 1e4).backward()
    (y_ref.float().square().mean() * 1e4).backward()
    for (name, p), q in zip(m_tri.named_parameters(), m_ref.parameters()):
        assert torch.all(p.grad[1] == 0) and torch.all(q.grad[1] == 0), name  # no rows
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol * scale, rtol=tol,
                                   msg=name)
