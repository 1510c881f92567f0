"""ZeRO-3 fine-tuning from a Hugging Face directory (`train.init_from`) on two gloo ranks: the
Qwen2-MoE is built partitioned (no rank ever holds a whole parameter it does not load: each
keeps its half), the main rank reads the sharded safetensors one tensor at a time and scatters
them, and the gathered weights equal the file's. Three AdamW steps from there equal ZeRO 0
from the same directory (1e-5); the per-parameter export gather keeps weights on rank 0 only."""

import pytest
import torch

from moe_train.parallel.runtime import free_port, shutdown
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks
from tests.unit.test_init_from import MANIFEST, V, qwen

WORLD, STEPS = 2, 3


def _loss(engine, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(1, V, (3, 9), generator=g)
    out = engine(ids)
    logits = out.logits_BTV[:, :-1].reshape(-1, V)
    return torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1)) + \
        sum(out.aux_losses.values())


def _run(rt, hf_dir: str, zero_stage: int) -> dict:
    import deepspeed

    from moe_train.parallel.collectives import grad_norm_and_clip
    from moe_train.parallel.zero3 import gathered_state_dict, is_partitioned, \
        mark_moe_leaf_modules
    from moe_train.train.ds_config import build_deepspeed_config
    from moe_train.train.init_from import build_start_model

    cfg = qwen(f"train.init_from={hf_dir}", f"optim.zero_stage={zero_stage}",
               "optim.precision=fp32")
    ds_config = build_deepspeed_config(cfg, rt.world_size, rt.device)
    torch.manual_seed(rt.rank)  # different on each rank: only the file's weights may count
    model, loaded = build_start_model(cfg, MANIFEST, ds_config, rt.is_main)
    params = list(model.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    held = sum(p.numel() for p in params)  # what the module itself holds between forwards
    start = gathered_state_dict(model) if is_partitioned(model) else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    if zero_stage == 3:
        mark_moe_leaf_modules(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
        dist_init_required=False, config=ds_config)
    for step in range(STEPS):
        engine.backward(_loss(engine, rt.rank, step))
        if zero_stage == 0:  # the trainer clips under ZeRO 0, DeepSpeed under ZeRO 3
            grad_norm_and_clip(engine.module, set(), rt, cfg.optim.clip_norm)
        engine.step()
    module = engine.module
    final = gathered_state_dict(module) if is_partitioned(module) else \
        {k: v.detach().clone() for k, v in module.state_dict().items()}
    kept = gathered_state_dict(module, keep=rt.is_main) if is_partitioned(module) else None
    return {"loaded": loaded, "local": local, "held": held, "start": start, "final": final,
            "kept": None if kept is None else len(kept), "partitioned": is_partitioned(module)}


def _worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    rt = init_launched_rank(rank, port, WORLD)
    results = {stage: _run(rt, hf_dir, stage) for stage in (3, 0)}
    torch.save(results, f"{out}.{rank}.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    transformers = pytest.importorskip("transformers")
    from moe_train.models.build import build_model
    from moe_train.models.hf_io import ours_to_hf
    from moe_train.models.hf_qwen2moe import qwen_hf_config

    tmp = tmp_path_factory.mktemp("z3-init")
    cfg = qwen()
    torch.manual_seed(11)
    source = build_model(cfg, MANIFEST)
    hf = transformers.Qwen2MoeForCausalLM(qwen_hf_config(cfg))
    hf.load_state_dict(ours_to_hf(source.state_dict(), "test"), strict=True)
    hf.save_pretrained(tmp / "hf", max_shard_size="40KB")
    out = str(tmp / "r")
    spawn_ranks(_worker, (free_port(), str(tmp / "hf"), out), WORLD)
    results = [torch.load(f"{out}.{rank}.pt", weights_only=True) for rank in range(WORLD)]
    return results, source.state_dict()


def test_zero3_builds_partitioned_and_loads_the_directory_exactly(runs):
    results, source = runs
    total = sum(v.numel() for v in source.values())
    for rank in range(WORLD):
        z3, z0 = results[rank][3], results[rank][0]
        assert z3["partitioned"] and not z0["partitioned"]
        assert z3["held"] == 0  # the module holds no parameter data outside a forward
        assert z3["local"] <= total // WORLD + 64 * len(source)  # its half (padded), not all
        assert z0["local"] == total
        assert z3["loaded"] == z0["loaded"] == total
        for run in (z3, z0):
            assert set(run["start"]) == set(source)
            unequal = [k for k, v in source.items() if not torch.equal(run["start"][k], v)]
            assert not unequal, unequal


def test_zero3_from_the_directory_trains_like_zero0(runs):
    results, _ = runs
    for rank in range(WORLD):
        z3, z0 = results[rank][3], results[rank][0]
        for name, value in z0["final"].items():
            torch.testing.assert_close(z3["final"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(z0["final"][name], z0["start"][name])  # it trained
    # the export gather keeps the weights on the main rank only
    assert results[0][3]["kept"] == len(results[0][3]["final"])
    assert results[1][3]["kept"] == 0
