"""ZeRO-3 on the decoder-only Qwen2-MoE: two gloo ranks, each with its own batch, train a tiny
Qwen-MoE three AdamW steps with gradient clipping under ZeRO 0 and ZeRO 3 from the same weights.
The MoE layers are ZeRO-3 leaf modules; the ranks' batches route to different experts (one
rank's tokens are padding-heavy), which must not hang. Weights after three steps, the trainer's
pre-step gradient norms (ours under ZeRO 0, `zero3_grad_norm` under ZeRO 3) and the per-parameter
state getters (full fp32 value and Adam moments, as checkpoints store them) agree within 1e-5."""


import pytest
import torch

from moe_train.config import load_config
from moe_train.models.build import build_model
from moe_train.parallel.runtime import free_port, shutdown
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks

V, WORLD, CLIP, STEPS = 80, 2, 0.5, 3


def _config(zero_stage: int):
    return load_config(overrides=[
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=2", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", "moe.num_experts=4", "moe.k=2",
        "moe.expert_ffn_dim=24", "moe.layers=all", f"optim.zero_stage={zero_stage}",
        f"optim.clip_norm={CLIP}", "optim.precision=fp32"])


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(1, V, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    if rank == 1:
        mask[:, 4:] = 0  # mostly padding: this rank routes few tokens
    return ids, mask


def _loss(engine, rank: int, step: int) -> torch.Tensor:
    ids, mask = _batch(rank, step)
    out = engine(ids, None, mask)
    logits = out.logits_BTV[:, :-1].reshape(-1, V)
    labels = ids[:, 1:].masked_fill(mask[:, 1:].eq(0), -100).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    return loss + sum(out.aux_losses.values())


def _run(rt, zero_stage: int) -> dict:
    import deepspeed

    from moe_train.parallel.collectives import grad_norm_and_clip
    from moe_train.parallel.optim_state import fp32_param, get_moments
    from moe_train.parallel.zero3 import (gathered_state_dict, is_partitioned,
                                          mark_moe_leaf_modules, zero3_grad_norm)
    from moe_train.train.ds_config import build_deepspeed_config

    cfg = _config(zero_stage)
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": V, "pad_id": 0})
    if zero_stage == 3:
        assert mark_moe_leaf_modules(model) == 2
    engine, _, _, _ = deepspeed.initialize(
        # eps 1e-6: a key bias has a zero gradient up to rounding, which Adam with a tiny eps
        # would blow up to +-lr either way; with it the comparison is well conditioned.
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
        dist_init_required=False, config=build_deepspeed_config(cfg, rt.world_size, rt.device))
    norms = []
    for step in range(STEPS):
        engine.backward(_loss(engine, rt.rank, step))
        if zero_stage == 3:
            norms.append(zero3_grad_norm(engine.optimizer))
        else:
            norms.append(grad_norm_and_clip(engine.module, set(), rt, CLIP))
        engine.step()
    module = engine.module
    state = gathered_state_dict(module) if is_partitioned(module) else \
        {k: v.detach().clone() for k, v in module.state_dict().items()}
    name, p = next((n, p) for n, p in module.named_parameters() if "w_gate_EDF" in n)
    return {"state": state, "norms": norms, "partitioned": is_partitioned(module),
            "getter": {"value": fp32_param(engine.optimizer, p),
                       "moments": get_moments(engine.optimizer, p)}, "getter_name": name}


def _worker(rank: int, port: int, out: str) -> None:
    rt = init_launched_rank(rank, port, WORLD)
    results = {stage: _run(rt, stage) for stage in (0, 3)}
    torch.save(results, f"{out}.{rank}.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("zero3") / "r")
    spawn_ranks(_worker, (free_port(), out), WORLD)
    return [torch.load(f"{out}.{rank}.pt", weights_only=True) for rank in range(WORLD)]


def test_zero3_equals_zero0_over_three_steps(runs):
    for rank in range(WORLD):
        z0, z3 = runs[rank][0], runs[rank][3]
        assert z3["partitioned"] and not z0["partitioned"]
        assert set(z0["state"]) == set(z3["state"])
        for name, value in z0["state"].items():
            torch.testing.assert_close(z3["state"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        assert z0["norms"][0] > CLIP  # clipping was active
        assert z3["norms"] == pytest.approx(z0["norms"], rel=1e-5)
    # the checkpoint getters under ZeRO-3 give the full value and moments (collective)
    z0, z3 = runs[0][0], runs[0][3]
    name = z3["getter_name"]
    torch.testing.assert_close(z3["getter"]["value"], z3["state"][name], atol=0, rtol=0)
    for key, value in z0["getter"]["moments"].items():
        torch.testing.assert_close(z3["getter"]["moments"][key], value, atol=1e-6, rtol=1e-5)
