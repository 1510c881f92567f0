"""Single-process pieces of the non-finite step policy and of clipping under a loss scale.

The fp16 case: DeepSpeed's FP16 optimizer scales the loss by its LossScaler's `cur_scale` before
backward and divides the gradients by it in `step()`; our ZeRO-0 clipping runs in between, on
loss-scaled gradients. `grad_norm_and_clip` must report the norm of the unscaled gradients and clip
so that, after DeepSpeed's unscaling, the gradients equal clipping the unscaled gradients directly.
fp16 does not run on CPU, so the fixture scales real fp32 gradients by DeepSpeed's own LossScaler
(a power of two: the scaling is exact) and reads the scale the way the trainer does.
"""

import math
import types

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.parallel.collectives import (grad_norm_and_clip, parameters_are_finite,
                                            step_is_finite)
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.step_guard import loss_scale, skipped_update
from moe_train.parallel.zero3 import local_values


def _model_with_grads(scaler=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    loss = model(torch.randn(5, 8)).pow(2).sum() * 10
    if scaler is None:
        loss.backward()
    else:
        scaler.backward(loss)  # DeepSpeed's LossScaler: (loss * cur_scale).backward()
    return model


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_and_norm_use_unscaled_gradients(max_norm):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    scaler = LossScaler(scale=2.0 ** 16)
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(loss_scale_config=scaler))
    assert loss_scale(engine) == 2.0 ** 16  # how the trainer reads the scale
    ref = _model_with_grads()
    scaled = _model_with_grads(scaler)
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    assert ref_norm > 0.5  # clipping is active for max_norm 0.5
    rt = ParallelRuntime()
    norm = grad_norm_and_clip(scaled, set(), rt, max_norm, loss_scale(engine))
    assert norm == pytest.approx(ref_norm, rel=1e-6)  # the logged norm is unscaled
    for p_ref, p, g0 in zip(ref.parameters(), scaled.parameters(), ref_grads):
        unscaled = p.grad / scaler.cur_scale  # what DeepSpeed's fp16 step() does next
        torch.testing.assert_close(unscaled, p_ref.grad, rtol=1e-6, atol=0)
        if max_norm > 1e3:
            torch.testing.assert_close(unscaled, g0, rtol=0, atol=0)  # no clipping at all


def test_nonfinite_gradient_is_reported_and_not_clipped():
    model = _model_with_grads()
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    grads = [p.grad.clone() for p in model.parameters()]
    norm = grad_norm_and_clip(model, set(), ParallelRuntime(), 0.5)
    assert math.isinf(norm)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_step_decision_and_parameter_check_single_process():
    rt = ParallelRuntime()
    assert step_is_finite(rt, 3.0, 1.5) and step_is_finite(rt, 3.0, None)
    assert not step_is_finite(rt, float("nan"), 1.0)
    assert not step_is_finite(rt, 1.0, float("inf"))
    model = torch.nn.Linear(3, 3)
    assert parameters_are_finite(rt, model)
    model.bias.data[1] = float("-inf")
    assert not parameters_are_finite(rt, model)


def test_parameter_check_reads_a_zero3_partition_without_its_padding():
    """A ZeRO-3 parameter outside a forward is an empty placeholder; its values are the first
    ds_numel - rank * size elements of its partition, the rest uninitialised padding."""
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_numel, p.ds_process_group = 5, None
    p.ds_tensor = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, float("nan")])  # 5 values + padding
    assert local_values(p).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    model = torch.nn.Module()
    model.w = p
    assert parameters_are_finite(ParallelRuntime(), model)
    p.ds_tensor[4] = float("inf")
    assert not parameters_are_finite(ParallelRuntime(), model)


def test_skipped_update_on_a_plain_optimizer_restores_it():
    """ZeRO 0 in fp32: inside the block the client optimizer's step is a no-op that reports an
    overflow (what the engine reads); afterwards the real step is back and updates."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with skipped_update(types.SimpleNamespace(optimizer=opt)):
        opt.step()
        assert opt.overflow is True
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.state == {} and "step" not in vars(opt) and not hasattr(opt, "overflow")
    opt.step()
    assert not torch.equal(before[0], model.weight)


def test_skipped_update_rejects_an_unknown_optimizer():
    with pytest.raises(ConfigError, match=r"^optim\.zero_stage: cannot skip"):
        with skipped_update(types.SimpleNamespace(optimizer=object())):
            pass


def test_max_nonfinite_steps_is_validated():
    assert load_config(overrides=["optim.max_nonfinite_steps=3"]).optim.max_nonfinite_steps == 3
    with pytest.raises(ConfigError, match="optim.max_nonfinite_steps"):
        load_config(overrides=["optim.max_nonfinite_steps=0"])
