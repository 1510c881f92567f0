"""Stacked expert modules against per-expert loops and a single dense adapter.

Shape legend: N routed rows, E experts, D model dim, F FFN dim, R adapter dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_train.errors import ConfigError
from moe_train.moe.adapters import AdapterExperts
from moe_train.moe.dispatcher import DenseDispatcher, LocalDispatcher
from moe_train.moe.experts import Experts, StackedExperts, rows_expert
from moe_train.moe.routing import Routing

COUNTS = [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 2], [0, 0, 0, 0]]


def loop_ffn(x_ND, counts, m: Experts, act) -> torch.Tensor:
    """Per-expert reference: act(x_e w1[e] + b1[e]) w2[e] + b2[e] (eval mode, no dropout)."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        x_e = x_ND[start:start + c]
        outs.append(act(x_e @ m.w1_EDF[e] + m.b1_EF[e]) @ m.w2_EFD[e] + m.b2_ED[e])
        start += c
    return torch.cat(outs)


def _randomize_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("counts", COUNTS)
def test_experts_match_per_expert_loop(counts, activation):
    torch.manual_seed(0)
    E, D, Fdim = 4, 8, 12
    m = Experts(E, D, Fdim, activation=activation, backend="torch").double()
    _randomize_(m, 1)
    x = torch.randn(sum(counts), D, dtype=torch.float64, requires_grad=True)
    y = m(x, torch.tensor(counts))
    ref = Experts(E, D, Fdim, activation=activation).double()
    ref.load_state_dict(m.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = loop_ffn(x_ref, counts, ref, F.relu if activation == "relu" else F.gelu)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.shape == p.shape, name
        want = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(p.grad, want, msg=name)


def test_activation_dropout_applies_in_training_only():
    torch.manual_seed(0)
    counts = torch.tensor([4, 6])
    m = Experts(2, 8, 64, activation_dropout=0.5, backend="torch")
    _randomize_(m, 2)
    x = torch.randn(10, 8)
    eval_out = m.eval()(x, counts)
    torch.testing.assert_close(eval_out, loop_ffn(x, [4, 6], m, F.relu))
    m.train()
    torch.manual_seed(5)
    train_out = m(x, counts)
    torch.manual_seed(5)  # same dropout mask on the concatenated hidden rows
    h = F.relu(torch.cat([x[:4] @ m.w1_EDF[0] + m.b1_EF[0], x[4:] @ m.w1_EDF[1] + m.b1_EF[1]]))
    h = F.dropout(h, 0.5, True)
    want = torch.cat([h[:4] @ m.w2_EFD[0] + m.b2_ED[0], h[4:] @ m.w2_EFD[1] + m.b2_ED[1]])
    torch.testing.assert_close(train_out, want)
    assert not torch.allclose(train_out, eval_out)


def test_experts_init_is_xavier_per_expert_and_zero_bias():
    torch.manual_seed(0)
    E, D, Fdim = 3, 64, 256
    m = Experts(E, D, Fdim)
    bound = math.sqrt(6.0 / (D + Fdim))  # per-expert fans, not the 3-D tensor's
    for w in (m.w1_EDF, m.w2_EFD):
        assert w.abs().max() <= bound
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.05 * bound
    assert torch.all(m.b1_EF == 0) and torch.all(m.b2_ED == 0)


def test_expert_parameters_are_all_parameters_stacked_on_dim0():
    for m in (Experts(5, 8, 16), AdapterExperts(5, 8, 4)):
        assert isinstance(m, StackedExperts)
        named = dict(m.expert_parameters())
        assert set(named) == {n for n, _ in m.named_parameters()}
        assert all(p.size(0) == 5 for p in named.values())


def test_rows_expert_and_bad_counts():
    assert rows_expert(torch.tensor([2, 0, 1, 3]), 6).tolist() == [0, 0, 2, 3, 3, 3]
    m = Experts(3, 4, 8)
    with pytest.raises(ValueError, match="3 experts"):
        m(torch.randn(4, 4), torch.tensor([2, 2]))
    with pytest.raises(ConfigError, match="model.activation"):
        Experts(3, 4, 8, activation="tanh")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_two_steps_equal_reference_with_reused_gradient_storage(set_to_none):
    """Two training steps (zero_grad in between, gradients set to None or zeroed in place) give
    the per-expert loop's gradients each time; a gradient captured by a hook after step 1 keeps
    its values through step 2; with set_to_none step 2 writes into step 1's storage."""
    torch.manual_seed(0)
    E, D, Fdim, counts = 4, 8, 12, [3, 0, 5, 1]
    m = Experts(E, D, Fdim, backend="torch").double()
    _randomize_(m, 3)
    ref = Experts(E, D, Fdim).double()
    ref.load_state_dict(m.state_dict())
    hooked = []
    m.w1_EDF.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad))
    ptrs = []
    for step in range(2):
        x = torch.randn(sum(counts), D, dtype=torch.float64)
        g = torch.randn(sum(counts), D, dtype=torch.float64)
        m.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=True)
        m(x, torch.tensor(counts)).backward(g)
        loop_ffn(x, counts, ref, F.relu).backward(g)
        for (name, p), p_ref in zip(m.named_parameters(), ref.parameters()):
            want = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(p.grad, want, msg=name)
        ptrs.append(m.w2_EFD.grad.data_ptr())
        if step == 0:
            first_w1 = m.w1_EDF.grad.clone()
    assert ptrs[0] == ptrs[1]
    if set_to_none:  # the hook's reference from step 1 still holds step 1's gradient
        assert torch.equal(hooked[0], first_w1) and not torch.equal(hooked[1], first_w1)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_all_experts_equals_the_grouped_rows(activation, monkeypatch):
    """counts_E None: every expert on every row, (E, T, D). The CPU path is the grouped path's
    own arithmetic on the rows repeated per expert (bit for bit); the GPU formula (batched
    GEMMs, run here through backend "triton", which all_experts takes for CUDA, and which a
    CPU tensor may ask for under TRITON_INTERPRET; no kernel runs) agrees."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    E, T, D, F_ = 3, 7, 8, 16
    m = Experts(E, D, F_, activation)
    _randomize_(m, 1)
    x = torch.randn(T, D)
    grouped = m(x.repeat(E, 1), torch.full((E,), T)).view(E, T, D)
    assert torch.equal(m(x, None), grouped)
    pytest.importorskip("triton")
    gpu_formula = Experts(E, D, F_, activation, backend="triton")
    gpu_formula.load_state_dict(m.state_dict())
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y2 = m(x1, None), gpu_formula(x2, None)
    torch.testing.assert_close(y2, y1, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(m.named_parameters(), gpu_formula.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_all_experts_on_no_rows() -> None:
    """A batch of padding only reaches every expert with zero rows: (E, 0, D), as the sorting
    dispatcher gives (it was a reshape error)."""
    E, D = 3, 4
    m = Experts(E, D, 5)
    assert m(torch.zeros(0, D), None).shape == (E, 0, D)
    routing = Routing(torch.full((2, E), -1), torch.rand(2, E), None, E)  # every token padding
    x = torch.randn(2, D)
    for dispatcher in (LocalDispatcher(E), DenseDispatcher(E)):
        x_ND, counts_E, meta = dispatcher.dispatch(x, routing)
        assert torch.equal(dispatcher.combine(m(x_ND, counts_E), meta), torch.zeros(2, D))
