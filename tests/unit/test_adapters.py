"""Adapter experts (stacked, grouped GEMM) and the adapter slot.

Shape legend: N routed rows, E experts, D model dim, R adapter dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_train.moe.adapters import AdapterExperts


def _randomize_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _dense_adapter(D: int, R: int) -> nn.ModuleDict:
    return nn.ModuleDict({"ln": nn.LayerNorm(D), "down": nn.Linear(D, R), "up": nn.Linear(R, D)})


def _apply_adapter(a: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return a["up"](F.relu(a["down"](a["ln"](x))))


def _copy_adapter_into(m: AdapterExperts, e: int, a: nn.ModuleDict) -> None:
    with torch.no_grad():
        m.ln_weight_ED[e] = a["ln"].weight
        m.ln_bias_ED[e] = a["ln"].bias
        m.w_down_EDR[e] = a["down"].weight.t()
        m.b_down_ER[e] = a["down"].bias
        m.w_up_ERD[e] = a["up"].weight.t()
        m.b_up_ED[e] = a["up"].bias


def test_identical_adapter_experts_equal_one_adapter_on_every_row():
    torch.manual_seed(0)
    E, D, R, counts = 4, 16, 8, [5, 0, 3, 4]
    adapter = _dense_adapter(D, R).double()
    _randomize_(adapter, 3)
    m = AdapterExperts(E, D, R, backend="torch").double()
    for e in range(E):
        _copy_adapter_into(m, e, adapter)
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    y = m(x, torch.tensor(counts))
    y_ref = _apply_adapter(adapter, x)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    # identical adapters: the experts' gradients sum to the single adapter's
    torch.testing.assert_close(m.w_down_EDR.grad.sum(0), adapter["down"].weight.grad.t())
    torch.testing.assert_close(m.w_up_ERD.grad.sum(0), adapter["up"].weight.grad.t())
    torch.testing.assert_close(m.ln_weight_ED.grad.sum(0), adapter["ln"].weight.grad)
    assert torch.all(m.w_down_EDR.grad[1] == 0)  # expert 1 got no rows


def test_distinct_adapter_experts_match_per_expert_loop():
    torch.manual_seed(0)
    E, D, R, counts = 3, 8, 4, [2, 4, 3]
    adapters = [_dense_adapter(D, R).double() for _ in range(E)]
    m = AdapterExperts(E, D, R, backend="torch").double()
    for e, a in enumerate(adapters):
        _randomize_(a, 10 + e)
        _copy_adapter_into(m, e, a)
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    y = m(x, torch.tensor(counts))
    want = torch.cat([_apply_adapter(a, part) for a, part in zip(adapters, x.split(counts))])
    torch.testing.assert_close(y, want)


def test_fresh_adapter_experts_are_finite_and_default_dim_is_128():
    m = AdapterExperts(2, 16)
    assert m.w_down_EDR.shape == (2, 16, 128) and m.w_up_ERD.shape == (2, 128, 16)
    y = m(torch.randn(5, 16), torch.tensor([2, 3]))
    assert y.shape == (5, 16) and torch.all(y == 0)  # a fresh adapter adds nothing
    assert m.w_down_EDR.abs().max() > 0


def test_adapter_dropout_after_the_relu_and_on_the_combined_output():
    """adapters.activation_dropout drops hidden units after each adapter's ReLU (grouped and
    all-experts paths alike, scaled by 1/(1-p)); adapters.dropout drops the combined output
    before the residual. Both only in training; 0 (the default) changes nothing."""
    import pytest

    from moe_train.config import load_config
    from moe_train.errors import ConfigError
    from moe_train.models.build import build_model
    from moe_train.moe.adapters import AdapterSlot

    torch.manual_seed(0)
    m = AdapterExperts(2, 8, 64, backend="torch", activation_dropout=0.5).double()
    _randomize_(m, 3)
    x, counts = torch.randn(6, 8, dtype=torch.float64), torch.tensor([2, 4])
    m.eval()
    clean, clean_all = m(x, counts), m.all_experts(x)
    m.train()
    for run in (lambda: m(x, counts), lambda: m.all_experts(x)):
        a, b = run(), run()
        assert not torch.equal(a, b)  # a new mask each call
    # many masks average to the clean output (inverted dropout keeps the expectation)
    torch.manual_seed(1)
    mean = torch.stack([m(x, counts) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, clean, atol=0.05, rtol=0.05)
    torch.testing.assert_close(m.eval().all_experts(x), clean_all)

    cfg = load_config(None, ["adapters.num_experts=2", "adapters.router=gumbel", "adapters.k=1",
                             "adapters.dropout=0.3", "adapters.activation_dropout=0.2"])
    model = build_model(cfg, {"vocab_size": 40, "pad_id": 0, "langs": ["de", "en"],
                              "domains": ["a", "b"]})
    slots = [mod for mod in model.modules() if isinstance(mod, AdapterSlot)]
    assert slots and all(s.moe.dropout == 0.3 and s.moe.experts.activation_dropout == 0.2
                         for s in slots)
    for name in ("dropout", "activation_dropout"):
        with pytest.raises(ConfigError, match=rf"adapters.{name}: expected a probability in "
                                              r"\[0, 1\), got 1.0"):
            load_config(None, [f"adapters.{name}=1.0"])
