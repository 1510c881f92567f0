"""Dispatch ops (histogram, permute, unpermute, grouped GEMM) against plain-Python references.

The `check_*` functions take a backend and a device so that three runs share them: the torch
path here, the Triton kernels under TRITON_INTERPRET=1 in a child process (the variable must
be set before triton is imported, so `python tests/unit/test_kernels.py --triton-interpret`
runs them), and the Triton kernels natively in tests/gpu/test_kernels_cuda.py.

Shape legend: T tokens, K slots per token, E experts, N kept rows, D model dim, F output dim.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a script (the interpreted-Triton child)
    sys.path.insert(0, str(ROOT))

from moe_train.kernels import expert_histogram, grouped_gemm, permute, unpermute  # noqa: E402
from moe_train.kernels.expert_ffn import expert_ffn  # noqa: E402
from moe_train.kernels.grad_buffers import GradBuffers  # noqa: E402

# (T, K, E, D, mode): mode picks the routing pattern of `make_ids`.
CASES = [
    (13, 1, 4, 8, "random"),
    (13, 2, 4, 8, "random"),
    (17, 2, 5, 12, "dropped"),
    (9, 2, 6, 8, "empty_experts"),
    (11, 1, 3, 8, "one_expert"),
    (11, 2, 3, 16, "one_expert_dropped"),
    (6, 2, 3, 8, "all_dropped"),
    (40, 2, 4, 20, "dropped"),
]
# (T, K, E, D, mode, F): past the kernels' blocks (BLOCK_M = BLOCK_N = 64 rows / columns,
# BLOCK_K = 32, combine columns up to 1024), so their tile loops run more than once: D > 32
# and F > 64 (GEMM K loop, column blocks, weight-gradient tiles), D > 1024 (combine columns),
# an expert with over 64 rows.
BLOCK_CASES = [
    (20, 2, 3, 33, "random", 65),
    (9, 3, 4, 1030, "dropped", 5),
    (150, 1, 2, 40, "one_expert", 70),
]
CASES = CASES + BLOCK_CASES
CASE_IDS = [f"T{c[0]}K{c[1]}E{c[2]}D{c[3]}-{c[4]}" for c in CASES]


def make_ids(T: int, K: int, E: int, mode: str, seed: int = 0) -> torch.Tensor:
    """expert_ids_TK for a routing pattern; -1 marks dropped slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if mode == "empty_experts":  # only experts 1 and 4 are used
        ids = torch.stack([torch.tensor([1, 4])[torch.randperm(2, generator=g)[:K]]
                           for _ in range(T)])
    if mode.startswith("one_expert"):
        ids = torch.full((T, K), -1)
        ids[:, 0] = E - 1
    if mode.endswith("dropped"):
        ids[torch.rand(T, K, generator=g) < 0.3] = -1
    if mode == "all_dropped":
        ids[:] = -1
    return ids


# --- plain-Python references --------------------------------------------------------------------

def ref_histogram(ids_TK: torch.Tensor, E: int) -> list[int]:
    counts = [0] * E
    for e in ids_TK.flatten().tolist():
        if e >= 0:
            counts[e] += 1
    return counts


def ref_row_map(ids_TK: torch.Tensor) -> list[int]:
    flat = ids_TK.flatten().tolist()
    return sorted((s for s, e in enumerate(flat) if e >= 0), key=lambda s: (flat[s], s))


def ref_unpermute(y_ND: torch.Tensor, row_map: list[int], w_TK: torch.Tensor) -> torch.Tensor:
    """Row by row, differentiable: out[t] += w[t, k] * y[n]."""
    T, K = w_TK.shape
    rows = [[] for _ in range(T)]
    for n, s in enumerate(row_map):
        rows[s // K].append(w_TK[s // K, s % K] * y_ND[n])
    zero = y_ND.new_zeros(y_ND.size(1)) + 0 * (y_ND.sum() + w_TK.sum())  # grads even if N=0
    return torch.stack([sum(r, zero) for r in rows])


def ref_grouped_gemm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The per-expert loop (indexes the stacked weight: fine for a reference)."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(x_ND[start:start + c] @ w_EDF[e])
        start += c
    return torch.cat(outs) if outs else x_ND.new_zeros(0, w_EDF.size(2))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# --- shared checks ------------------------------------------------------------------------------

def check_histogram(case, backend: str, device: str) -> None:
    T, K, E, _, mode = case[:5]
    ids = make_ids(T, K, E, mode)
    counts = expert_histogram(ids.to(device), E, backend=backend)
    assert counts.dtype == torch.long and counts.tolist() == ref_histogram(ids, E)


def check_permute(case, backend: str, device: str, dtype=torch.float32, tol=1e-6) -> None:
    T, K, E, D, mode = case[:5]
    ids = make_ids(T, K, E, mode)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    x_leaf = _leaf(x)
    x_ND, row_map, counts = permute(x_leaf, ids.to(device), E, backend=backend)
    expected_map = ref_row_map(ids)
    assert row_map.tolist() == expected_map
    assert counts.tolist() == ref_histogram(ids, E)
    assert torch.equal(x_ND, x[[s // K for s in expected_map]])
    g_ND = torch.randn(x_ND.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    x_ND.backward(g_ND)
    expected = torch.zeros(T, D, dtype=torch.float64)
    for n, s in enumerate(expected_map):
        expected[s // K] += g_ND[n].double().cpu()
    torch.testing.assert_close(x_leaf.grad.double().cpu(), expected, atol=tol, rtol=tol)


def check_unpermute(case, backend: str, device: str, dtype=torch.float32, tol=1e-5) -> None:
    T, K, E, D, mode = case[:5]
    ids = make_ids(T, K, E, mode)
    gen = torch.Generator().manual_seed(3)
    row_map = torch.tensor(ref_row_map(ids), dtype=torch.long)
    y = torch.randn(row_map.numel(), D, generator=gen).to(dtype)
    w = torch.rand(T, K, generator=gen).to(dtype)
    g_TD = torch.randn(T, D, generator=gen).to(dtype)
    y_ref, w_ref = _leaf(y.double()), _leaf(w.double())
    out_ref = ref_unpermute(y_ref, row_map.tolist(), w_ref)
    out_ref.backward(g_TD.double())
    y_dev, w_dev = _leaf(y.to(device)), _leaf(w.to(device))
    out = unpermute(y_dev, row_map.to(device), w_dev, T, backend=backend)
    assert out.shape == (T, D) and out.dtype == dtype
    out.backward(g_TD.to(device))
    for got, want in ((out, out_ref), (y_dev.grad, y_ref.grad), (w_dev.grad, w_ref.grad)):
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    dropped = (ids < 0)
    assert torch.all(w_dev.grad.cpu()[dropped] == 0)


def check_grouped_gemm(case, backend: str, device: str, dtype=torch.float32, tol=1e-4,
                       F: int = 24) -> None:
    """Values and gradients (x, stacked w, bias) against the per-expert loop, with and
    without the fused bias. `F`: the case's own, if it has one."""
    T, K, E, D, mode = case[:5]
    F = case[5] if len(case) > 5 else F
    ids = make_ids(T, K, E, mode)
    counts = ref_histogram(ids, E)
    N = sum(counts)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, D, generator=gen).to(dtype)
    w = torch.randn(E, D, F, generator=gen).to(dtype)
    b = torch.randn(E, F, generator=gen).to(dtype)
    g = torch.randn(N, F, generator=gen).to(dtype)
    expert_N = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    for with_bias in (False, True):
        x_ref, w_ref, b_ref = _leaf(x.double()), _leaf(w.double()), _leaf(b.double())
        want = ref_grouped_gemm(x_ref, w_ref, counts)
        if with_bias:
            want = want + b_ref[expert_N]
        want.backward(g.double())
        x_dev, w_dev, b_dev = _leaf(x.to(device)), _leaf(w.to(device)), _leaf(b.to(device))
        out = grouped_gemm(x_dev, w_dev, torch.tensor(counts, device=device),
                           b_dev if with_bias else None, backend=backend)
        assert out.shape == (N, F) and out.dtype == dtype
        out.backward(g.to(device))
        assert w_dev.grad.shape == (E, D, F)
        pairs = [(out, want), (x_dev.grad, x_ref.grad), (w_dev.grad, w_ref.grad)]
        if with_bias:
            pairs.append((b_dev.grad, b_ref.grad))
        else:
            assert b_dev.grad is None
        for got, expected in pairs:
            torch.testing.assert_close(got.double().cpu(), expected.detach(), atol=tol, rtol=tol)
        for e, c in enumerate(counts):  # experts without rows get an exact zero gradient
            if c == 0:
                assert torch.all(w_dev.grad[e] == 0)
                assert not with_bias or torch.all(b_dev.grad[e] == 0)


CHECKS = (check_histogram, check_permute, check_unpermute, check_grouped_gemm)


def run_all(backend: str, device: str) -> int:
    """Every check on every case; returns how many ran."""
    ran = 0
    for check in CHECKS:
        for case in CASES:
            check(case, backend, device)
            ran += 1
    return ran


# --- torch path (in process) --------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(check, case):
    check(case, "torch", "cpu")


def test_hand_computed_example():
    """Ids by hand: expert 0 gets slots 0 (t0) and 5 (t2), expert 1 slot 4, expert 2 slots
    1, 2, 8, 9; slot 3 and the whole of token 3 are dropped."""
    ids = torch.tensor([[0, 2], [2, -1], [1, 0], [-1, -1], [2, 2]])
    x = torch.arange(5.0)[:, None].repeat(1, 3)
    x_ND, row_map, counts = permute(x, ids, 4, backend="torch")
    assert counts.tolist() == [2, 1, 4, 0]
    assert row_map.tolist() == [0, 5, 4, 1, 2, 8, 9]
    assert x_ND[:, 0].tolist() == [0, 2, 2, 0, 1, 4, 4]
    w = torch.tensor([[0.5, 0.25], [1.0, 9.0], [0.1, 0.2], [7.0, 7.0], [0.3, 0.7]])
    y = unpermute(x_ND * 10, row_map, w, 5, backend="torch")
    # token t gets 10 * t * (sum of its kept weights); token 3 gets nothing
    assert torch.allclose(y[:, 0], torch.tensor([0.0, 10.0, 6.0, 0.0, 40.0]))


def test_unpermute_weights_only_grad_and_no_weight_grad():
    """Gradient to the weights alone, and to the rows alone, match the full computation."""
    ids = make_ids(10, 2, 3, "dropped")
    row_map = torch.tensor(ref_row_map(ids))
    y = torch.randn(row_map.numel(), 4)
    w = _leaf(torch.rand(10, 2))
    unpermute(y, row_map, w, 10, backend="torch").sum().backward()
    y2 = _leaf(y)
    unpermute(y2, row_map, w.detach(), 10, backend="torch").sum().backward()
    y3, w3 = _leaf(y), _leaf(w.detach())
    unpermute(y3, row_map, w3, 10, backend="torch").sum().backward()
    assert torch.equal(w.grad, w3.grad) and torch.equal(y2.grad, y3.grad)


def test_float64_weight_gradient_keeps_float64_and_unsigned_ids_are_refused():
    """The combine weights' gradient accumulates in fp32 for 16-bit rows but never narrows
    float64 (gradcheck's dtype); uint8 ids cannot mark a dropped slot (-1)."""
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])
    x = torch.randn(6, 4, dtype=torch.float64)
    w = _leaf(torch.rand(6, 2, dtype=torch.float64))
    x_ND, row_map, _ = permute(x, ids, 3, backend="torch")
    unpermute(x_ND / 3, row_map, w, 6, backend="torch").sum().backward()
    expected = (x / 3).sum(1, keepdim=True).expand(6, 2)
    assert w.grad.dtype == torch.float64
    torch.testing.assert_close(w.grad, expected, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="signed integer"):
        expert_histogram(ids.to(torch.uint8), 3)


def test_grouped_gemm_transposed_weight_and_bad_counts():
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4)
    w_EFD = torch.randn(3, 6, 4)
    out = grouped_gemm(x, w_EFD.transpose(1, 2), counts, backend="torch")
    torch.testing.assert_close(out, ref_grouped_gemm(x, w_EFD.transpose(1, 2), [2, 0, 3]))
    with pytest.raises(ValueError, match="do not sum"):
        grouped_gemm(x, w_EFD.transpose(1, 2), torch.tensor([2, 0, 2]), backend="torch")
    with pytest.raises(ValueError, match="backend"):
        grouped_gemm(x, w_EFD.transpose(1, 2), counts, backend="cuda")


# --- reused gradient storage and the expert-by-expert FFN -----------------------------------------

def _gemm_step(x, w, b, counts, g, bufs):
    grouped_gemm(x, w, counts, b, backend="torch", grad_buffers=bufs).backward(g)


@pytest.mark.parametrize("reset", ["set_to_none", "zero", "accumulate"])
def test_grad_buffers_two_steps_equal_reference(reset):
    """Two fwd+bwd steps through grouped_gemm with a GradBuffers give the reference gradients
    whether .grad is dropped, zeroed in place or accumulated between them; with .grad dropped
    the second step reuses the first step's storage (no new allocation)."""
    counts = torch.tensor([3, 0, 4])
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(7, 4, generator=gen), torch.randn(7, 5, generator=gen)
    w, b = _leaf(torch.randn(3, 4, 5, generator=gen)), _leaf(torch.randn(3, 5, generator=gen))
    w_ref, b_ref = _leaf(w), _leaf(b)
    expert_N = torch.repeat_interleave(torch.arange(3), counts)
    (ref_grouped_gemm(x, w_ref, counts.tolist()) + b_ref[expert_N]).backward(g)
    bufs = GradBuffers()
    _gemm_step(x, w, b, counts, g, bufs)
    first_ptr = w.grad.data_ptr()
    torch.testing.assert_close(w.grad, w_ref.grad)
    if reset == "set_to_none":
        w.grad = b.grad = None
    elif reset == "zero":
        w.grad.zero_(), b.grad.zero_()
    _gemm_step(x, w, b, counts, g, bufs)
    scale = 2.0 if reset == "accumulate" else 1.0
    torch.testing.assert_close(w.grad, scale * w_ref.grad)
    torch.testing.assert_close(b.grad, scale * b_ref.grad)
    assert torch.all(w.grad[1] == 0) and torch.all(b.grad[1] == 0)
    assert w.grad.data_ptr() == first_ptr  # the buffer adopted as .grad, or added into
    assert bufs.nbytes() == (1 if reset == "set_to_none" else 2) * (w.numel() + b.numel()) * 4


def test_grad_buffers_never_overwrite_a_live_gradient():
    """A gradient kept past `.grad = None` keeps its values: the next backward takes other
    storage; hooks on the parameter see every step's gradient."""
    counts = torch.tensor([2, 3])
    gen = torch.Generator().manual_seed(6)
    x, g = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    w = _leaf(torch.randn(2, 3, 4, generator=gen))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    bufs = GradBuffers()
    _gemm_step(x, w, None, counts, g, bufs)
    kept, kept_values = w.grad, w.grad.clone()
    w.grad = None
    _gemm_step(x, w, None, counts, 2 * g, bufs)
    assert torch.equal(kept, kept_values)
    assert kept.data_ptr() != w.grad.data_ptr()
    torch.testing.assert_close(w.grad, 2 * kept_values)
    del kept
    w.grad = None
    _gemm_step(x, w, None, counts, g, bufs)  # both buffers are free again: no third one
    assert bufs.nbytes() == 2 * w.numel() * 4 and len(seen) == 3
    torch.testing.assert_close(seen[1], 2 * seen[0])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 6, 0, 0]])
def test_expert_ffn_equals_grouped_chain(activation, counts):
    """The expert-by-expert Function computes what grouped GEMM -> activation -> grouped GEMM
    computes, outputs and every gradient, over two steps with reused gradient storage."""
    E, D, F = 4, 6, 10
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(E, D, F, generator=gen), torch.randn(E, F, generator=gen),
              torch.randn(E, F, D, generator=gen), torch.randn(E, D, generator=gen)]
    x = torch.randn(sum(counts), D, generator=gen, dtype=torch.float64)
    g = torch.randn(sum(counts), D, generator=gen, dtype=torch.float64)
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    c = torch.tensor(counts)
    ref = [_leaf(p.double()) for p in params]
    x_ref = _leaf(x)
    h = act(grouped_gemm(x_ref, ref[0], c, ref[1], backend="torch"))
    y_ref = grouped_gemm(h, ref[2], c, ref[3], backend="torch")
    y_ref.backward(g)
    got, bufs = [_leaf(p.double()) for p in params], GradBuffers()
    for _ in range(2):
        x_got = _leaf(x)
        for p in got:
            p.grad = None
        y = expert_ffn(x_got, *got, c, activation, bufs)
        y.backward(g)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(x_got.grad, x_ref.grad, rtol=0, atol=1e-12)
        for p, p_ref in zip(got, ref):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="activation"):
        expert_ffn(x, *got, c, "swish")


def test_expert_ffn_partial_gradients():
    """Only the inputs that require grad get one (frozen first layer, input without grad)."""
    E, D, F, counts = 3, 4, 6, torch.tensor([2, 0, 3])
    gen = torch.Generator().manual_seed(8)
    w1, b1 = torch.randn(E, D, F, generator=gen), torch.randn(E, F, generator=gen)
    w2, b2 = _leaf(torch.randn(E, F, D, generator=gen)), _leaf(torch.randn(E, D, generator=gen))
    x, g = torch.randn(5, D, generator=gen), torch.randn(5, D, generator=gen)
    expert_ffn(x, w1, b1, w2, b2, counts).backward(g)
    w2_ref, b2_ref = _leaf(w2), _leaf(b2)
    h = torch.relu(grouped_gemm(x, w1, counts, b1, backend="torch"))
    grouped_gemm(h, w2_ref, counts, b2_ref, backend="torch").backward(g)
    assert w1.grad is None and b1.grad is None and x.grad is None
    torch.testing.assert_close(w2.grad, w2_ref.grad)
    torch.testing.assert_close(b2.grad, b2_ref.grad)


def test_auto_backend_uses_torch_on_cpu_without_importing_triton():
    code = ("import sys, torch; from moe_train.kernels import permute; "
            "permute(torch.randn(4, 3), torch.tensor([[0], [1], [0], [-1]]), 2); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --- Triton path, interpreted on CPU (child process) ---------------------------------------------

def test_triton_interpreted_matches_reference():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--triton-interpret"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == f"ok {len(CHECKS) * len(CASES)}"


if __name__ == "__main__" and sys.argv[1:] == ["--triton-interpret"]:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (lazily, below)
    assert "triton" not in sys.modules
    print(f"ok {run_all('triton', 'cpu')}")


def test_triton_dot_precision_follows_torch():
    """fp32: TF32 only where torch's float32 matmul precision allows it; 16-bit: unaffected."""
    pytest.importorskip("triton")
    from moe_train.kernels.triton_gemm import dot_precision

    before = torch.get_float32_matmul_precision()
    try:
        for setting, fp32 in (("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")):
            torch.set_float32_matmul_precision(setting)
            assert dot_precision(torch.float32) == fp32
            assert dot_precision(torch.bfloat16) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    # torch's per-backend setting (after which the query above raises): read through it
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return
    try:
        for where, value, fp32 in ((matmul, "tf32", "tf32"), (matmul, "ieee", "ieee"),
                                   (torch.backends, "tf32", "tf32")):
            matmul.fp32_precision = torch.backends.fp32_precision = "none"
            setattr(where, "fp32_precision", value)
            assert dot_precision(torch.float32) == fp32, (where, value)
    finally:
        matmul.fp32_precision = torch.backends.fp32_precision = "none"
        torch.set_float32_matmul_precision(before)


def test_float64_never_takes_the_triton_path() -> None:
    """The Triton kernels compute in fp32 at most: "auto" keeps float64 on torch (gradcheck on
    a GPU), and asking for Triton with float64 is one clear error, not fp32-rounded results."""
    from types import SimpleNamespace

    from moe_train.kernels import backend
    from moe_train.kernels.backend import triton_available, use_triton

    with pytest.MonkeyPatch.context() as mp:  # a CUDA tensor where Triton imports
        mp.setattr(backend, "triton_available", lambda: True)
        cuda = SimpleNamespace(is_cuda=True, dtype=torch.float64)
        assert use_triton(cuda, "auto") is False
        assert use_triton(SimpleNamespace(is_cuda=True, dtype=torch.float32), "auto") is True
    x64 = torch.zeros(2, 2, dtype=torch.float64)
    if triton_available():
        with pytest.raises(ValueError, match="not float64"):
            use_triton(x64, "triton")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            assert use_triton(x64.float(), "triton") is True
            # a CPU tensor without the interpreter: one clear error, not "0 active drivers"
            mp.delenv("TRITON_INTERPRET")
            with pytest.raises(ValueError, match="runs on CUDA tensors, got one on cpu"):
                use_triton(x64.float(), "triton")
