"""SwiGLU experts: `swiglu_ffn` (CPU, expert by expert), `swiglu_grouped` (grouped GEMMs) and
the `SwiGLUExperts` module against a plain autograd loop over the experts.

The Triton grouped path runs interpreted on CPU in a child process (TRITON_INTERPRET=1 must be
set before triton is imported: `python tests/unit/test_swiglu_experts.py --triton-interpret`),
as in tests/unit/test_kernels.py; natively in tests/gpu/test_swiglu_experts_cuda.py.

Shape legend: N rows sorted by expert, E experts, D model dim, F FFN dim.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a script (the interpreted-Triton child)
    sys.path.insert(0, str(ROOT))

from moe_train.kernels.grad_buffers import GradBuffers  # noqa: E402
from moe_train.kernels.swiglu_ffn import swiglu_ffn, swiglu_grouped  # noqa: E402
from moe_train.moe import experts as experts_mod  # noqa: E402
from moe_train.moe.experts import SwiGLUExperts  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}
COUNTS = [[3, 0, 5, 1], [0, 0, 0, 0], [0, 6, 0, 0], [1, 2, 0, 4, 0, 3]]
D, F_ = 6, 10


def make(counts: list[int], seed: int = 0, dtype=torch.float32, D: int = D, F_: int = F_):
    """(x_ND, [w_gate_EDF, w_up_EDF, w_down_EFD], g_ND) for `counts`, values of order one."""
    gen = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    ws = [torch.randn(E, D, F_, generator=gen) * 0.5, torch.randn(E, D, F_, generator=gen) * 0.5,
          torch.randn(E, F_, D, generator=gen) * 0.5]
    x = torch.randn(N, D, generator=gen)
    g = torch.randn(N, D, generator=gen)
    return x.to(dtype), [w.to(dtype) for w in ws], g.to(dtype)


def ref_swiglu(x_ND, w_gate_EDF, w_up_EDF, w_down_EFD, counts: list[int]) -> torch.Tensor:
    """The per-expert loop in plain torch ops (indexes the stacked weights: fine here)."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        x_e = x_ND[start:start + c]
        outs.append((F.silu(x_e @ w_gate_EDF[e]) * (x_e @ w_up_EDF[e])) @ w_down_EFD[e])
        start += c
    # `+ 0 * sums`: every leaf gets a (zero) gradient even when no expert has rows
    return torch.cat(outs) + 0 * sum(w.sum() for w in (w_gate_EDF, w_up_EDF, w_down_EFD))


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(grad)


def reference(x, ws, g, counts):
    """(y, dx, [dW_gate, dW_up, dW_down]) by plain autograd."""
    x_ref, w_ref = _leaf(x), [_leaf(w) for w in ws]
    y = ref_swiglu(x_ref, *w_ref, counts)
    y.backward(g)
    return y.detach(), x_ref.grad, [w.grad for w in w_ref]


def run(fn, x, ws, g, counts, **kw):
    """(y, dx, [dW...]) through `fn` (swiglu_ffn or swiglu_grouped)."""
    x_got, w_got = _leaf(x), [_leaf(w) for w in ws]
    y = fn(x_got, *w_got, torch.tensor(counts), **kw)
    y.backward(g)
    return y.detach(), x_got.grad, [w.grad for w in w_got]


def assert_same(got, want, **tol):
    tol = tol or TOL
    y, dx, dws = got
    y_ref, dx_ref, dws_ref = want
    torch.testing.assert_close(y, y_ref, **tol, msg="y")
    torch.testing.assert_close(dx, dx_ref, **tol, msg="dx")
    for name, dw, dw_ref in zip(("w_gate", "w_up", "w_down"), dws, dws_ref):
        torch.testing.assert_close(dw, dw_ref, **tol, msg=name)


# --- (a) CPU path against plain autograd ---------------------------------------------------------

@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_swiglu_ffn_matches_autograd_reference(counts):
    x, ws, g = make(counts)
    got = run(swiglu_ffn, x, ws, g, counts)
    assert got[0].shape == (sum(counts), D)
    assert_same(got, reference(x, ws, g, counts))
    for e, c in enumerate(counts):  # experts without rows: exact zero gradients
        if c == 0:
            assert all(torch.all(dw[e] == 0) for dw in got[2])


@pytest.mark.parametrize("needs", ["x", "w_gate", "w_up", "w_down", "w_down+x", "weights"])
def test_swiglu_ffn_partial_gradients(needs):
    """Only the inputs that require grad get one, and those equal the full computation's."""
    counts = [3, 0, 5, 1]
    x, ws, g = make(counts, seed=1)
    names = ["x", "w_gate", "w_up", "w_down"]
    wanted = set(names[1:]) if needs == "weights" else set(needs.split("+"))
    leaves = [_leaf(t, name in wanted) for name, t in zip(names, [x, *ws])]
    swiglu_ffn(*leaves, torch.tensor(counts)).backward(g)
    _, dx_ref, dws_ref = reference(x, ws, g, counts)
    for name, leaf, want in zip(names, leaves, [dx_ref, *dws_ref]):
        if name in wanted:
            torch.testing.assert_close(leaf.grad, want, **TOL, msg=name)
        else:
            assert leaf.grad is None, name


def test_swiglu_ffn_inference_saves_nothing_and_matches():
    counts = [4, 0, 2, 3]
    x, ws, _ = make(counts, seed=2)
    with torch.no_grad():
        y = swiglu_ffn(x, *ws, torch.tensor(counts))
    torch.testing.assert_close(y, ref_swiglu(x, *ws, counts), **TOL)
    y = swiglu_ffn(x, *ws, torch.tensor(counts))  # grad enabled, nothing requires grad
    assert y.grad_fn is None
    torch.testing.assert_close(y, ref_swiglu(x, *ws, counts), **TOL)


# --- (b) grouped path (torch backend) equals the CPU path ----------------------------------------

@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_grouped_path_equals_cpu_path(counts):
    x, ws, g = make(counts, seed=3)
    cpu = run(swiglu_ffn, x, ws, g, counts, grad_buffers=GradBuffers())
    grouped = run(swiglu_grouped, x, ws, g, counts, backend="torch", grad_buffers=GradBuffers())
    assert_same(grouped, cpu)
    assert_same(run(swiglu_grouped, x, ws, g, counts, backend="torch"), cpu)


# --- (c) reused gradient storage -----------------------------------------------------------------

@pytest.mark.parametrize("reset", ["set_to_none", "zero", "accumulate"])
def test_grad_buffers_two_steps(reset):
    """Two steps with one GradBuffers, the second with other counts (expert 0 loses its rows,
    expert 1 gains some): each step's gradients are the reference's; nothing of the first
    step's buffer content leaks into the second; with .grad dropped the storage is reused."""
    counts1, counts2 = [3, 0, 4], [0, 5, 2]
    x1, ws, g1 = make(counts1, seed=4)
    x2, _, g2 = make(counts2, seed=5)
    w_got, bufs = [_leaf(w) for w in ws], GradBuffers()
    swiglu_ffn(x1, *w_got, torch.tensor(counts1), bufs).backward(g1)
    ref1 = reference(x1, ws, g1, counts1)[2]
    for w, dw_ref in zip(w_got, ref1):  # (no loop variable may keep a .grad alive)
        torch.testing.assert_close(w.grad, dw_ref, **TOL)
    ptrs = [w.grad.data_ptr() for w in w_got]
    if reset == "set_to_none":
        for w in w_got:
            w.grad = None
    elif reset == "zero":
        for w in w_got:
            w.grad.zero_()
    swiglu_ffn(x2, *w_got, torch.tensor(counts2), bufs).backward(g2)
    ref2 = reference(x2, ws, g2, counts2)[2]
    for w, dw1, dw2 in zip(w_got, ref1, ref2):
        want = dw1 + dw2 if reset == "accumulate" else dw2
        torch.testing.assert_close(w.grad, want, **TOL)
        if reset != "accumulate":
            assert torch.all(w.grad[0] == 0)  # no rows on step 2: stale values must not leak
    assert [w.grad.data_ptr() for w in w_got] == ptrs  # adopted buffer, or added into
    n_bufs = 1 if reset == "set_to_none" else 2
    assert bufs.nbytes() == n_bufs * sum(w.numel() for w in ws) * 4


# --- (d) shapes ----------------------------------------------------------------------------------

def test_bad_shapes_raise_value_error():
    counts = torch.tensor([2, 0, 3])
    x, (wg, wu, wd), _ = make([2, 0, 3])
    bad = [
        (x[:, :4], wg, wu, wd, counts),                 # x's width is not D
        (x, wg, wu[:, :, :7], wd, counts),             # up's F differs
        (x, wg, wu, wd.transpose(1, 2), counts),       # down given as E x D x F
        (x, wg, wu, wd, torch.tensor([2, 3])),         # counts for 2 experts
        (x, wg[0], wu, wd, counts),                    # 2-D gate weight
        (x[None], wg, wu, wd, counts),                 # 3-D x
        (x.double(), wg, wu, wd, counts),              # dtypes differ
    ]
    for fn in (swiglu_ffn, lambda *a: swiglu_grouped(*a, backend="torch")):
        for args in bad:
            with pytest.raises(ValueError, match="do not match"):
                fn(*args)
        with pytest.raises(ValueError, match="do not sum"):
            fn(x, wg, wu, wd, torch.tensor([2, 0, 2]))


# --- (e) the module ------------------------------------------------------------------------------

def test_swiglu_experts_module():
    E, Dm, Fm = 4, 16, 24
    m = SwiGLUExperts(E, Dm, Fm, backend="torch")
    names = dict(m.expert_parameters())
    assert list(names) == ["w_gate_EDF", "w_up_EDF", "w_down_EFD"]
    assert [tuple(p.shape) for p in names.values()] == [(E, Dm, Fm), (E, Dm, Fm), (E, Fm, Dm)]
    assert sorted(names) == sorted(n for n, _ in m.named_parameters())
    big = SwiGLUExperts(2, 64, 128, init_std=0.05)
    assert abs(big.w_up_EDF.std().item() - 0.05) < 0.005 and abs(big.w_gate_EDF.mean()) < 0.005
    assert abs(SwiGLUExperts(2, 64, 128).w_down_EFD.std().item() - 0.02) < 0.002

    counts = torch.tensor([5, 0, 2, 3])
    x = torch.randn(10, Dm)
    y = m(x, counts)
    assert y.shape == (10, Dm)
    y.square().sum().backward()
    ref = copy.deepcopy(m)
    ref.zero_grad(set_to_none=True)
    ref_swiglu(x, ref.w_gate_EDF, ref.w_up_EDF, ref.w_down_EFD, counts.tolist()
               ).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.shape == p.shape
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    assert m.grad_buffers.nbytes() > 0 and ref.grad_buffers.nbytes() == 0
    with pytest.raises(ValueError, match="4 experts"):
        m(x, torch.tensor([5, 5]))


def test_module_picks_grouped_path_when_triton(monkeypatch):
    """With `use_triton` true the module runs `swiglu_grouped` (here on its torch backend)."""
    m = SwiGLUExperts(3, D, F_, backend="torch")
    counts, x = torch.tensor([2, 0, 4]), torch.randn(6, D)
    calls = []
    real = experts_mod.swiglu_grouped
    monkeypatch.setattr(experts_mod, "use_triton", lambda t, b: True)
    monkeypatch.setattr(experts_mod, "swiglu_grouped",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    y = m(x, counts)
    assert calls and calls[0]["backend"] == "torch" and calls[0]["grad_buffers"] is m.grad_buffers
    torch.testing.assert_close(y, swiglu_ffn(x, *m.parameters(), counts), **TOL)


# --- (f) Triton grouped path, interpreted on CPU (child process) ---------------------------------

def check_triton_interpreted() -> int:
    """swiglu_grouped on the Triton kernels equals swiglu_ffn; returns how many cases ran."""
    # 70 rows: more than one 64-row tile; D 40 > BLOCK_K 32 and F 70 > BLOCK_N 64: the GEMMs'
    # K loops and column blocks, and the weight gradients' tiles, run more than once
    cases = [([3, 0, 5, 1], D, F_), ([0, 70, 0, 2], D, F_), ([5, 0, 3], 40, 70)]
    for i, (counts, d, f) in enumerate(cases):
        x, ws, g = make(counts, seed=10 + i, D=d, F_=f)
        cpu = run(swiglu_ffn, x, ws, g, counts)
        assert_same(run(swiglu_grouped, x, ws, g, counts, backend="triton"), cpu,
                    atol=1e-4, rtol=1e-4)
    return len(cases)


def test_triton_interpreted_matches_cpu_path():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--triton-interpret"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok 3"


if __name__ == "__main__" and sys.argv[1:] == ["--triton-interpret"]:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (lazily)
    assert "triton" not in sys.modules
    print(f"ok {check_triton_interpreted()}")
