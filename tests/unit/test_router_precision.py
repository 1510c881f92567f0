"""Every learned gate computes its logits in float32 whatever its parameters' dtype: under bf16
training (DeepSpeed casts the parameters) a bf16 product ties or swaps near-equal experts, and
the fp32 export then chooses other experts than the ones that were trained. Each gate on bf16
parameters must give what the same weights give in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_train.config.gated import GatedConfig
from moe_train.config.moe import RouterConfig
from moe_train.config.thor import ThorConfig
from moe_train.models.context import ForwardContext
from moe_train.moe.gated_router import GatedRouter
from moe_train.moe.gating import linear_fp32
from moe_train.moe.moa_router import MoAGate
from moe_train.moe.routing import RoutingContext
from moe_train.moe.sentence_router import TaskRouter
from moe_train.moe.thor_router import TASK_PROBS_KEY, TaskPredictor, ThorRouter

pytestmark = pytest.mark.usefixtures("one_thread")
D, E, B = 64, 16, 256


def _pair(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module on bf16 parameters, an fp32 copy of those same bf16 values)."""
    low = module.to(torch.bfloat16)
    return low, copy.deepcopy(low).float()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_linear_fp32_is_the_float32_product() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(D, E).to(torch.bfloat16)
    x = torch.randn(B, D).to(torch.bfloat16)
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    _close(linear_fp32(x, layer), want.float())
    assert (layer(x).float() - want.float()).abs().max() > 1e-3  # what a bf16 product loses


def test_task_router_gate() -> None:
    torch.manual_seed(0)
    low, ref = _pair(TaskRouter(D, E, RouterConfig(k=2, num_tasks=B)))
    _close(low._gate_NE()[0], ref._gate_NE()[0])
    assert torch.equal(low.table()[0], ref.table()[0])


def test_thor_candidate_sets_and_task_predictor() -> None:
    torch.manual_seed(0)
    low, ref = _pair(ThorRouter(D, E, RouterConfig(), ThorConfig()))
    repr_BD = torch.randn(B, D).to(torch.bfloat16)
    got, want = low.candidate_sets(repr_BD), ref.candidate_sets(repr_BD)
    _close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    low, ref = _pair(TaskPredictor(D, 8, ThorConfig(num_tasks=8)))
    x_BSD = torch.randn(B, 5, D).to(torch.bfloat16)
    ctx = ForwardContext(src_pad_mask_BS=torch.zeros(B, 5, dtype=torch.bool))
    _close(low(x_BSD, ctx)[0][TASK_PROBS_KEY], ref(x_BSD.float(), ctx)[0][TASK_PROBS_KEY])


def test_moa_gate() -> None:
    torch.manual_seed(0)
    low, ref = _pair(MoAGate(D, E))
    h_BD = torch.randn(B, D).to(torch.bfloat16)
    _close(low(h_BD), ref(h_BD))


def test_gated_adapter_gate() -> None:
    torch.manual_seed(0)
    low, ref = _pair(GatedRouter(D, E, RouterConfig(), GatedConfig()))
    x_TD = torch.randn(2 * 3, D).to(torch.bfloat16)
    rctx = RoutingContext.from_batch(2, 3, pad_mask_BT=torch.zeros(2, 3, dtype=torch.bool),
                                     side="encoder")
    _close(low.gate_logits(x_TD, rctx)[1], ref.gate_logits(x_TD, rctx)[1])
