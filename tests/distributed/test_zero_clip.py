"""Under ZeRO 1/2 with expert parallelism, DeepSpeed's own clipping norm is the exact global norm.

Earlier code patched DeepSpeedZeroOptimizer.scaled_global_norm to pin an "exact" norm, but on the
pinned deepspeed 0.19.8 the patch behaved exactly as no patch, at every layout tried (world 2 /
ep 2, and world 4 / ep 2 with expert-data-parallel groups of 2, where older DeepSpeed averaged
expert norms over the wrong group): it was removed. This test checks the product instead: one
spawn of four gloo ranks, each with its own batch, under ep 2 (expert-data-parallel groups of 2)
and ep 4 (groups of 1), ZeRO 1 and 2, one SGD step with lr 1 (the update is the clipped gradient).
The reference is computed here without DeepSpeed: the gradient of the mean of the four ranks'
losses, its L2 norm, and the update grad * clip / (norm + 1e-6). A DeepSpeed whose expert norm
is averaged over the wrong group, counts experts twice or only locally fails these checks; so
does the trainer's pre-step norm (`step_guard.zero_grad_norm`), which must equal it.
"""


import pytest
import torch

from moe_train.config import load_config
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext
from moe_train.parallel.expert_parallel import (deepspeed_sees_moe_layers, moe_param_groups,
                                                setup_expert_parallel, wire_expert_parallel)
from moe_train.parallel.runtime import free_port, shutdown
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks
from moe_train.parallel.step_guard import zero_grad_norm
from moe_train.train.ds_config import build_deepspeed_config

V, E, CLIP, WORLD = 30, 4, 1.0, 4
RUNS = [("ep2_zero1", 2, 1), ("ep2_zero2", 2, 2), ("ep4_zero1", 4, 1), ("ep4_zero2", 4, 2)]
"""(name, ep_size, zero_stage)"""


def _config(ep_size: int, zero_stage: int):
    return load_config(overrides=[
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=1",
        "model.decoder_layers=1", "model.dropout=0.0", f"moe.num_experts={E}", "moe.k=2",
        "moe.layers=all", f"moe.ep_size={ep_size}", f"optim.zero_stage={zero_stage}",
        f"optim.clip_norm={CLIP}"])


def _model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": V, "pad_id": 0})


def _loss(model, rank: int) -> torch.Tensor:
    """Summed target cross-entropy plus the MoE aux losses on rank `rank`'s batch."""
    g = torch.Generator().manual_seed(rank)
    src = torch.randint(4, V, (3, 7), generator=g)
    src[rank % 3, 5:] = 0  # some padding
    tgt = torch.randint(4, V, (3, 6), generator=g)
    out = model(src, tgt, ForwardContext(src_pad_mask_BS=src.eq(0)))
    loss = torch.nn.functional.cross_entropy(out.logits_BTV.reshape(-1, V), tgt.reshape(-1),
                                             reduction="sum")
    return loss + sum(out.aux_losses.values())


def _run(rt0, ep_size: int, zero_stage: int) -> dict:
    import deepspeed  # heavy: imported in the rank processes only

    rt = setup_expert_parallel(rt0, ep_size)
    cfg = _config(ep_size, zero_stage)
    model = _model(cfg)
    wire_expert_parallel(model, rt)
    groups = moe_param_groups(model, [{"name": "all", "params": list(model.parameters())}],
                              ep_size)
    with deepspeed_sees_moe_layers():
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(groups, lr=1.0), dist_init_required=False,
            config=build_deepspeed_config(cfg, rt.world_size, rt.device))
    engine.backward(_loss(engine, rt.rank))
    pre_step = zero_grad_norm(engine.optimizer)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.step()
    return {"norm": float(engine.get_global_grad_norm()), "pre_step": pre_step,
            "ep_rank": rt.ep_rank, "ep_size": ep_size,
            "update": {n: before[n] - p.detach() for n, p in engine.module.named_parameters()}}


def _worker(rank: int, port: int, out: str) -> None:
    rt = init_launched_rank(rank, port, WORLD)
    results = {name: _run(rt, ep, zero) for name, ep, zero in RUNS}
    torch.save(results, f"{out}.{rank}.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("zero_clip") / "r")
    spawn_ranks(_worker, (free_port(), out), WORLD)
    return [torch.load(f"{out}.{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict:
    """EP=1 gradient of the mean of all ranks' losses (what DeepSpeed averages to)."""
    model = _model(_config(1, 0))
    (sum(_loss(model, r) for r in range(WORLD)) / WORLD).backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    norm = float(sum(g.pow(2).sum() for g in grads.values()).sqrt())
    return {"grads": grads, "norm": norm}


def _slice(ref_g: torch.Tensor, name: str, got: dict) -> torch.Tensor:
    """The part of an EP=1 tensor that an EP rank holds (stacked experts: dim 0)."""
    if got["ep_size"] > 1 and ".experts." in name:
        n = ref_g.size(0) // got["ep_size"]
        return ref_g[got["ep_rank"] * n:(got["ep_rank"] + 1) * n]
    return ref_g


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_deepspeed_zero_ep_norm_and_update_are_exact(runs, reference, name):
    ref_norm = reference["norm"]
    assert ref_norm > 5 * CLIP  # clipping is active
    coef = CLIP / (ref_norm + 1e-6)  # DeepSpeed's clip coefficient
    for rank in range(WORLD):
        got = runs[rank][name]
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-5)  # DeepSpeed's own norm
        assert got["pre_step"] == pytest.approx(ref_norm, rel=1e-5)  # the trainer's
        for n, g in reference["grads"].items():
            torch.testing.assert_close(got["update"][n].double(), _slice(g, n, got) * coef,
                                       rtol=1e-4, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    # the ranks of one expert-parallel group hold different experts, and together all of them
    ep = runs[0][name]["ep_size"]
    seen = {runs[r][name]["ep_rank"] for r in range(WORLD)}
    assert seen == set(range(ep))
