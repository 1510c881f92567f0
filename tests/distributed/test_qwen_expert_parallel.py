"""Expert parallelism (ep_size 2) on the decoder-only Qwen2-MoE equals ep_size 1 (1e-5).

One spawn of two gloo ranks, each with its own batch (rank 1's padded), runs both parts:

1. Forward / backward: the EP=2 model (each rank holds two of the four experts of every layer,
   all-to-all dispatch) against the EP=1 model with the same weights, run in-process. As in
   test_expert_parallel.py / test_thor_ep.py: logits, aux losses (the router's load balance is
   over the tokens a rank routes, its own batch, at either ep size), and the gradients of every
   dense parameter (embeddings, attention, routers, shared experts, LM head) equal the EP=1 model's
   on the rank's own batch; a rank's expert slices get the gradient of both ranks' losses (an
   expert serves the tokens of the whole ep group), i.e. that slice of the EP=1 gradient of the
   summed losses.
2. Training: DeepSpeed ZeRO 2 with ep_size 2 against ZeRO 2 with ep_size 1 (plain data
   parallel), same batches, three AdamW steps with active gradient clipping: weights (expert
   weights: the rank's slice) agree, and the trainer's pre-step norm (`zero_grad_norm`) equals
   DeepSpeed's `get_global_grad_norm()` and is the same at both ep sizes.
"""

import copy

import pytest
import torch

from moe_train.config import load_config
from moe_train.models.build import build_model
from moe_train.parallel.runtime import free_port, shutdown
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks

V, WORLD, E, CLIP, STEPS = 80, 2, 4, 0.5, 3
CLOSE = dict(atol=1e-5, rtol=1e-5)


def _config(ep_size: int, zero_stage: int = 0, init_std: float = 0.02):
    return load_config(overrides=[
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=2", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", f"qwen.initializer_range={init_std}",
        f"moe.num_experts={E}", "moe.k=2",
        "moe.expert_ffn_dim=24", "moe.layers=all", f"moe.ep_size={ep_size}",
        f"optim.zero_stage={zero_stage}", f"optim.clip_norm={CLIP}", "optim.precision=fp32"])


def _model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": V, "pad_id": 0})


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(1, V, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    if rank == 1:  # right padding of different lengths
        mask[0, 6:] = 0
        mask[2, 3:] = 0
    return ids, mask


def _forward(model, rank: int, step: int):
    ids, mask = _batch(rank, step)
    out = model(ids, None, mask)
    logits = out.logits_BTV[:, :-1].reshape(-1, V)
    labels = ids[:, 1:].masked_fill(mask[:, 1:].eq(0), -100).reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    return loss + sum(out.aux_losses.values()), out


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _slice(t: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    n = t.size(0) // ep_size
    return t[ep_rank * n:(ep_rank + 1) * n]


def _forward_backward(rt) -> dict:
    """Part 1: EP=2 against an in-process EP=1 copy (no DeepSpeed engine)."""
    from moe_train.parallel.expert_parallel import AllToAllDispatcher, wire_expert_parallel

    # init std 0.1, not Qwen's 0.02: the experts' share of the logits is then large enough that
    # a 0.1% error in one expert's weights shows far above 1e-5 (at 0.02 it would not)
    ref = _model(_config(1, init_std=0.1)).train()
    ep = copy.deepcopy(ref)
    assert wire_expert_parallel(ep, rt) == 2
    layers = [m for m in ep.modules() if type(m).__name__ == "MoELayer"]
    assert len(layers) == 2 and all(isinstance(m.dispatcher, AllToAllDispatcher) for m in layers)
    loss_ep, out_ep = _forward(ep, rt.rank, 0)
    loss_ep.backward()
    loss_ref, out_ref = _forward(ref, rt.rank, 0)
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()
                 if p.grad is not None and not _is_expert(n)}
    ref.zero_grad()
    for r in range(WORLD):  # expert gradients: the tokens of both ranks
        _forward(ref, r, 0)[0].backward()
    for n, p in ref.named_parameters():
        if _is_expert(n):
            grads_ref[n] = _slice(p.grad, rt.ep_rank, 2).clone()
    return {"logits": (out_ep.logits_BTV.detach(), out_ref.logits_BTV.detach()),
            "loss": (loss_ep.item(), loss_ref.item()),
            "aux": ({k: v.detach() for k, v in out_ep.aux_losses.items()},
                    {k: v.detach() for k, v in out_ref.aux_losses.items()}),
            "grads": ({n: p.grad.clone() for n, p in ep.named_parameters()
                       if p.grad is not None}, grads_ref),
            "expert_shapes": {n: tuple(p.shape) for n, p in ep.named_parameters()
                              if _is_expert(n)}}


def _train(rt0, ep_size: int) -> dict:
    """Part 2: three AdamW steps under DeepSpeed ZeRO 2 at `ep_size`."""
    import contextlib

    import deepspeed

    from moe_train.parallel.expert_parallel import (deepspeed_sees_moe_layers, moe_param_groups,
                                                    setup_expert_parallel, wire_expert_parallel)
    from moe_train.parallel.step_guard import zero_grad_norm
    from moe_train.train.ds_config import build_deepspeed_config

    rt = setup_expert_parallel(rt0, ep_size)
    cfg = _config(ep_size, zero_stage=2)
    model = _model(cfg)
    assert wire_expert_parallel(model, rt) == (2 if ep_size > 1 else 0)
    groups = moe_param_groups(model, [{"name": "all", "params": list(model.parameters())}],
                              ep_size)
    # eps 1e-6: a key bias has a zero gradient up to rounding, which Adam with a tiny eps
    # would blow up to +-lr either way; with it the comparison is well conditioned.
    optimizer = torch.optim.AdamW(groups, lr=1e-2, eps=1e-6)
    detect = deepspeed_sees_moe_layers() if ep_size > 1 else contextlib.nullcontext()
    with detect:
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, dist_init_required=False,
            config=build_deepspeed_config(cfg, rt.world_size, rt.device))
    assert engine.has_moe_layers == (ep_size > 1)
    pre, post = [], []
    for step in range(STEPS):
        engine.backward(_forward(engine, rt.rank, step)[0])
        pre.append(zero_grad_norm(engine.optimizer))
        engine.step()
        post.append(float(engine.get_global_grad_norm()))
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "pre": pre, "post": post, "ep_rank": rt.ep_rank}


def _worker(rank: int, port: int, out: str) -> None:
    from moe_train.parallel.expert_parallel import setup_expert_parallel

    rt = init_launched_rank(rank, port, WORLD)
    results = {"fb": _forward_backward(setup_expert_parallel(rt, 2)),
               "train": {ep: _train(rt, ep) for ep in (1, 2)}}
    torch.save(results, f"{out}.{rank}.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("qwen_ep") / "r")
    spawn_ranks(_worker, (free_port(), out), WORLD)
    return [torch.load(f"{out}.{rank}.pt", weights_only=True) for rank in range(WORLD)]


def test_qwen_ep2_equals_ep1_in_outputs_aux_losses_and_gradients(runs):
    for rank in range(WORLD):
        fb = runs[rank]["fb"]
        where = f"rank {rank}"
        torch.testing.assert_close(*fb["logits"], **CLOSE, msg=lambda m: f"{where} logits: {m}")
        assert fb["loss"][0] == pytest.approx(fb["loss"][1], rel=1e-5, abs=1e-5), where
        aux_ep, aux_ref = fb["aux"]
        assert aux_ref and aux_ep.keys() == aux_ref.keys(), (where, aux_ep.keys())
        for k in aux_ref:
            torch.testing.assert_close(aux_ep[k], aux_ref[k], **CLOSE,
                                       msg=lambda m, k=k: f"{where} aux {k}: {m}")
        grads_ep, grads_ref = fb["grads"]
        assert grads_ep.keys() == grads_ref.keys(), where
        for n, g in grads_ref.items():
            torch.testing.assert_close(grads_ep[n], g, **CLOSE,
                                       msg=lambda m, n=n: f"{where} grad {n}: {m}")
        # the comparison covers what matters, with non-zero gradients
        assert grads_ref["hf.model.embed_tokens.weight"].abs().sum() > 0
        for part in ("router", "shared_expert", "self_attn", "lm_head"):
            assert any(part in n and g.abs().sum() > 0 for n, g in grads_ref.items()), part
        experts = [n for n in grads_ref if _is_expert(n)]
        assert len(experts) == 6, experts  # w_gate, w_up, w_down of both layers
        for n in experts:
            assert fb["expert_shapes"][n][0] == E // 2, (n, fb["expert_shapes"][n])
            assert all(grads_ref[n][e].abs().sum() > 0 for e in range(E // 2)), (where, n)


def test_qwen_zero2_ep2_equals_ep1_over_three_clipped_adamw_steps(runs):
    for rank in range(WORLD):
        ep1, ep2 = runs[rank]["train"][1], runs[rank]["train"][2]
        assert ep2["ep_rank"] == rank
        assert ep1["params"].keys() == ep2["params"].keys()
        for n, w1 in ep1["params"].items():
            want = _slice(w1, rank, 2) if _is_expert(n) else w1
            torch.testing.assert_close(ep2["params"][n], want, **CLOSE,
                                       msg=lambda m, n=n: f"rank {rank} {n}: {m}")
        for run in (ep1, ep2):
            assert run["pre"][0] > CLIP  # clipping was active
            # the trainer's pre-step norm is DeepSpeed's clipping norm
            assert run["pre"] == pytest.approx(run["post"], rel=1e-5)
        assert ep2["pre"] == pytest.approx(ep1["pre"], rel=1e-5)
    # training moved the weights, differently on the two ranks' expert slices
    w = "hf.model.layers.0.mlp.moe.experts.w_gate_EDF"
    assert not torch.equal(runs[0]["train"][2]["params"][w], runs[1]["train"][2]["params"][w])
