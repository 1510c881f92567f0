"""THOR-MoE on the decoder-only Qwen2-MoE (moe_train.models.hf_qwen2moe): training losses,
E_p from the prompt only, and cached decoding (fixed E_p, causal context mean) against naive
full recomputation."""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext
from moe_train.models.lm_batch import PROMPT_MASK_KEY, lm_inputs, teacher_forced
from moe_train.moe.thor_router import TASK_PROBS_KEY, TASK_REPR_KEY, ThorRouter

pytest.importorskip("transformers")

from moe_train.eval.lm_search import lm_beam_search, lm_greedy_search  # noqa: E402
from moe_train.models.hf_qwen2moe import moe_blocks  # noqa: E402
from tests.unit.test_lm_search import left_pad  # noqa: E402  (PAD 0 in both)

V, PAD, EOS, LONG = 96, 0, 58, 16  # EOS: reached after different lengths
MIXED = [7, 3, 12, 5, 9]


def thor_cfg(routing: str = "topk", *extra: str):
    return load_config(None, [
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=3", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", "qwen.tie_word_embeddings=false",
        "moe.num_experts=8", "moe.k=2", "moe.expert_ffn_dim=24", "moe.z_loss_coef=0",
        "moe.layers=all", "moe.decoder_router=thor", "thor.num_tasks=3", "thor.task_source=domain",
        "thor.num_candidates=4", f"thor.token_routing={routing}", "moe.top_p=0.5", *extra])


def build(routing: str = "topk", *extra: str, seed: int = 0):
    torch.manual_seed(seed)
    m = build_model(thor_cfg(routing, *extra), {"vocab_size": V, "pad_id": PAD}).eval()
    with torch.no_grad():  # large logits (near-ties are rare); strong routed experts, so
        m.hf.lm_head.weight.mul_(10)  # the output depends on the routing (E_p, H_ctx)
        for block in moe_blocks(m):
            block.moe.experts.w_down_EFD.mul_(30)
    return m


@pytest.fixture(scope="module", params=["topk", "topp"])
def model(request):
    return build(request.param)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def full_logits(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Last-position logits (V,) of prompt + out rerun without a cache (E_p from the prompt)."""
    ids = torch.tensor([prompt + out])
    prompt_BT = torch.zeros_like(ids, dtype=torch.bool)
    prompt_BT[:, :len(prompt)] = True
    ctx = ForwardContext(extras={PROMPT_MASK_KEY: prompt_BT})
    with torch.no_grad():
        return model(ids, ctx).logits_BTV[0, -1].float()


def naive_greedy(model, prompt: list[int], max_len: int = LONG) -> list[int]:
    out: list[int] = []
    while True:
        lp = torch.log_softmax(full_logits(model, prompt, out), -1)
        lp[PAD] = -torch.inf
        if len(out) + 1 >= max_len:
            return out
        tok = int(lp.argmax())
        if tok == EOS:
            return out
        out.append(tok)


def naive_beam(model, prompt: list[int], K: int, max_len: int = LONG) -> list[int]:
    """The fairseq rule on one sentence (test_lm_search), every hypothesis rerun in full."""
    scores = torch.full((K,), -torch.inf)
    scores[0] = 0.0
    beams: list[list[int]] = [[] for _ in range(K)]
    finished: list[tuple[float, list[int]]] = []
    for step in range(max_len):
        lp = torch.stack([torch.log_softmax(full_logits(model, prompt, b), -1) for b in beams])
        lp[:, PAD] = -torch.inf
        if step + 1 >= max_len:
            forced = torch.full_like(lp, -torch.inf)
            forced[:, EOS] = lp[:, EOS]
            lp = forced
        top_s, top_i = (scores[:, None] + lp).view(-1).topk(2 * K)
        cands = [(float(s), int(i) // V, int(i) % V) for s, i in zip(top_s, top_i)]
        for s, b, tok in cands[:K]:
            if tok == EOS and s > -float("inf"):
                finished.append((s / (step + 1), beams[b]))
        if len(finished) >= K or step + 1 >= max_len:
            break
        keep = [c for c in cands if c[2] != EOS][:K]
        beams = [beams[b] + [tok] for _, b, tok in keep]
        scores = torch.tensor([s for s, _, _ in keep])
    return max(finished, key=lambda item: item[0])[1]


def test_training_losses_reach_the_predictor() -> None:
    m = build("topp").train()
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])  # eos 2, right-padded sources
    tgt_in = torch.tensor([[1, 11, 12, 13], [1, 14, 15, 0]])
    ctx = ForwardContext(domain_ids_B=torch.tensor([0, 2]))
    out = teacher_forced(m, src, tgt_in, ctx, PAD, decoder_only=True)
    assert out.logits_BTV.shape == (2, 4, V)
    assert out.extras[TASK_PROBS_KEY].shape == (2, 3)  # for the task-accuracy hook
    assert out.extras["gold_task_B"].tolist() == [0, 2]
    for key in ("thor_task", "thor_task_balance", "thor_token_balance", "thor_topp_entropy"):
        assert key in out.aux_losses and torch.isfinite(out.aux_losses[key])
    (out.logits_BTV.float().logsumexp(-1).mean() + sum(out.aux_losses.values())).backward()
    p = m.task_predictor
    assert p.proj.weight.grad is not None and p.proj.weight.grad.abs().sum() > 0
    assert p.task_embed_KD.grad is not None and p.task_embed_KD.grad.abs().sum() > 0
    routers = [b.moe.router for b in moe_blocks(m)]
    assert len(routers) == 3 and all(isinstance(r, ThorRouter) for r in routers)
    assert all(r.loss_scale == pytest.approx(1 / 3) for r in routers)
    assert all(r.task_gate.weight.grad is not None for r in routers)


def test_prefill_task_repr_equals_teacher_forced(model) -> None:
    """E_p at prefill is the one a teacher-forced pass of the same prompt computes: it reads
    the prompt positions only, whatever the target."""
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
    tgt_in = torch.tensor([[1, 11, 12, 13], [1, 14, 15, 0]])
    seen = {}

    def grab(mod, args) -> None:  # the E_p the last block's router reads
        seen["e"] = mod.calls.ctx.extras[TASK_REPR_KEY].clone()

    hook = moe_blocks(model)[-1].register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            teacher_forced(model, src, tgt_in, ForwardContext(), PAD, decoder_only=True)
            tf = seen.pop("e")
            other = torch.tensor([[1, 40, 41, 42], [1, 43, 44, 45]])
            teacher_forced(model, src, other, ForwardContext(), PAD, decoder_only=True)
            tf2 = seen.pop("e")
            ids, mask = lm_inputs(src, tgt_in, PAD)
            P = ids.size(1) - 3
            state = model.new_routing_state()
            model(ids[:, :P], ForwardContext(extras={PROMPT_MASK_KEY: mask[:, :P].bool()}),
                  mask[:, :P], use_cache=True, routing_state=state)
    finally:
        hook.remove()
    torch.testing.assert_close(seen["e"], tf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tf2, tf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.task.value.extras[TASK_REPR_KEY], tf, atol=1e-5, rtol=1e-5)
    assert state.task.value.extras[TASK_PROBS_KEY].shape == (2, 3)


def test_incremental_greedy_equals_full_recomputation(model) -> None:
    rows = prompts(1, MIXED)
    ids, mask = left_pad(rows)
    got = lm_greedy_search(model, ids, mask, EOS, PAD, max_new_B=torch.full((5,), LONG))
    assert got == [naive_greedy(model, r) for r in rows]
    assert len({len(o) for o in got}) > 1  # sentences finished at different steps
    with torch.no_grad():  # and E_p matters: another task table decodes differently
        saved = model.task_predictor.task_embed_KD.clone()
        model.task_predictor.task_embed_KD.mul_(-3)
        try:
            other = lm_greedy_search(model, ids, mask, EOS, PAD, max_new_B=torch.full((5,), LONG))
        finally:
            model.task_predictor.task_embed_KD.copy_(saved)
    assert other != got


def test_beam_one_is_greedy_and_batch_equals_alone(model) -> None:
    rows = prompts(2, MIXED)
    ids, mask = left_pad(rows)
    lim = torch.full((5,), LONG)
    greedy = lm_greedy_search(model, ids, mask, EOS, PAD, max_new_B=lim)
    assert lm_beam_search(model, ids, mask, EOS, PAD, beam=1, max_new_B=lim) == greedy
    together = lm_beam_search(model, ids, mask, EOS, PAD, beam=3, max_new_B=lim)
    alone = []
    for r in rows:
        i, m = left_pad([r])
        alone += lm_beam_search(model, i, m, EOS, PAD, beam=3, max_new_B=lim[:1])
    assert together == alone
    assert len({len(o) for o in together}) > 1  # pruned: sentences finished at different steps
    assert together == [naive_beam(model, r, 3) for r in rows]


def test_routing_state_changes_nothing_without_thor() -> None:
    cfg = load_config(None, [
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=2", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "moe.num_experts=8", "moe.k=2", "moe.expert_ffn_dim=24"])
    torch.manual_seed(0)
    m = build_model(cfg, {"vocab_size": V, "pad_id": PAD}).eval()
    ids, mask = left_pad(prompts(3, [4, 6]))
    with torch.no_grad():
        a = m(ids, None, mask).logits_BTV
        b = m(ids, None, mask, routing_state=m.new_routing_state()).logits_BTV
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_params_and_predictor_layer() -> None:
    from moe_train.eval.params import count_parameters

    report = count_parameters(thor_cfg("topp"), V)
    assert report["thor_num_tasks"] == 3
    assert report["thor_predictor"] == 2 * 3 * 32
    assert report["thor_task_gates"] == 3 * 8 * 32
    assert report["thor_context_gates"] == 3 * (2 * 32 * 32 + 32)
    assert report["thor_cls"] == 0
    assert report["decoder_router"] == "thor"
    with pytest.raises(ConfigError, match="thor.predictor_layer"):
        build_model(thor_cfg("topk", "thor.predictor_layer=2"), {"vocab_size": V, "pad_id": PAD})
