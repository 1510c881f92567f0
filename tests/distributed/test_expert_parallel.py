"""EP=2 (two gloo ranks, all-to-all dispatch) equals EP=1 in outputs and gradients (1e-5).

Each rank routes its own tokens. The EP=1 reference runs the unsharded layer: its outputs and
router gradients on a rank's own tokens, and its expert gradients summed over both ranks' tokens
(an expert on one rank serves the tokens of the whole ep group).
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from moe_train.config import RouterConfig
from moe_train.models.context import ForwardContext
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router
from moe_train.parallel.expert_parallel import wire_expert_parallel
from moe_train.parallel.runtime import ParallelRuntime, free_port
from tests.distributed.two_ranks import spawn_ranks

E, D, F, B, T = 4, 8, 16, 3, 5


def _inputs(rank: int, skew: bool):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(B, T, D, generator=g)
    if skew:  # push every token towards one expert: heavy imbalance
        x = x * 0.01 + 3.0
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3 + rank:] = True
    ctx = ForwardContext(src_pad_mask_BS=pad, side="encoder",
                         tgt_lang_B=torch.tensor([0, 1, 2]) if rank == 0 else torch.tensor([2, 2, 1]))
    return x, ctx


def _layer(router_name: str, capacity: float) -> MoELayer:
    torch.manual_seed(0)
    cfg = RouterConfig(k=2 if router_name != "task" else 1, capacity_factor=capacity,
                       task_source="tgt_lang", num_tasks=3)
    router = build_router(router_name, D, E, cfg)
    return MoELayer(router, LocalDispatcher(E, capacity), Experts(E, D, F))


def _loss(layer, x, ctx):
    y, aux = layer(x, ctx)
    w = torch.linspace(-1, 1, D)
    return (y * w).sum() + sum(aux.values()), y


def _worker(rank: int, port: int, router_name: str, capacity: float, skew: bool, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    rt = ParallelRuntime(rank=rank, world_size=2, backend="gloo", ep_size=2, ep_rank=rank,
                         ep_group=group)
    ref = _layer(router_name, capacity)
    ep = copy.deepcopy(ref)
    assert wire_expert_parallel(torch.nn.ModuleList([ep]), rt) == 1
    x, ctx = _inputs(rank, skew)
    x_ep = x.clone().requires_grad_(True)
    loss, y_ep = _loss(ep, x_ep, ctx)
    loss.backward()
    # EP=1: outputs / input and router grads from this rank's tokens
    x_ref = x.clone().requires_grad_(True)
    loss_ref, y_ref = _loss(ref, x_ref, ctx)
    loss_ref.backward()
    router_grads = {n: p.grad.clone() for n, p in ref.router.named_parameters() if p.grad is not None}
    # expert grads: both ranks' tokens
    ref.zero_grad()
    for r in range(2):
        xr, cr = _inputs(r, skew)
        _loss(ref, xr, cr)[0].backward()
    torch.save({"y_ep": y_ep.detach(), "y_ref": y_ref.detach(), "gx_ep": x_ep.grad,
                "gx_ref": x_ref.grad,
                "router_ep": {n: p.grad for n, p in ep.router.named_parameters() if p.grad is not None},
                "router_ref": router_grads,
                "experts_ep": {n: p.grad for n, p in ep.experts.named_parameters()},
                "experts_ref": {n: p.grad[rank * 2:(rank + 1) * 2]
                                for n, p in ref.experts.named_parameters()},
                "dropped": int(ep.dropped_slots)}, f"{out}.{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("router_name", ["topk", "sentence", "task"])
@pytest.mark.parametrize("capacity, skew", [(0.0, False), (0.0, True), (1.0, True)])
def test_ep2_equals_ep1(tmp_path, router_name, capacity, skew):
    out = str(tmp_path / "r")
    spawn_ranks(_worker, (free_port(), router_name, capacity, skew, out), 2)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}.pt")
        close = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["y_ep"], got["y_ref"], **close)
        torch.testing.assert_close(got["gx_ep"], got["gx_ref"], **close)
        assert got["router_ep"].keys() == got["router_ref"].keys()
        for n in got["router_ref"]:
            torch.testing.assert_close(got["router_ep"][n], got["router_ref"][n], **close, msg=n)
        for n in got["experts_ref"]:
            torch.testing.assert_close(got["experts_ep"][n], got["experts_ref"][n], **close, msg=n)
        if capacity == 0.0:
            assert got["dropped"] == 0
