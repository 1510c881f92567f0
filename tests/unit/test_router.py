"""Routers (moe/router.py) and the routing context (moe/routing.py) on hand-computed cases.

Most cases use D = E = 4 and an identity gate, so a token's router logits are its own state:
states are chosen as log-probabilities, making the router distribution known exactly.

Shape legend: T tokens (flattened batch positions), B sentences, D model dim, E experts,
K expert slots per token.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext
from moe_train.moe.registry import ROUTERS, build_router
from moe_train.moe.gating import top_p_select
from moe_train.moe.routing import Routing, RoutingContext, sentence_mean

E = 4
# Router distributions of six tokens (no ties among the top entries).
P_TE = torch.tensor([[0.40, 0.30, 0.20, 0.10],
                     [0.10, 0.20, 0.30, 0.40],
                     [0.05, 0.60, 0.25, 0.10],
                     [0.30, 0.10, 0.50, 0.10],
                     [0.70, 0.15, 0.10, 0.05],
                     [0.10, 0.05, 0.15, 0.70]])
X_TD = P_TE.log()


def identity_router(name: str, **cfg) -> torch.nn.Module:
    router = build_router(name, E, E, RouterConfig(**cfg))
    with torch.no_grad():
        router.gate.weight.weight.copy_(torch.eye(E))
    return router.eval()


def test_topk_choices_and_renormalised_weights() -> None:
    out = identity_router("topk", k=2).route(X_TD)
    assert out.expert_ids_TK.tolist() == [[0, 1], [3, 2], [1, 2], [2, 0], [0, 1], [3, 2]]
    expected = [[4 / 7, 3 / 7], [4 / 7, 3 / 7], [0.6 / 0.85, 0.25 / 0.85], [5 / 8, 3 / 8],
                [0.7 / 0.85, 0.15 / 0.85], [0.7 / 0.85, 0.15 / 0.85]]
    assert torch.allclose(out.weights_TK, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(out.probs_TE, P_TE, atol=1e-6)
    assert out.num_experts == E and out.top_k == 2 and out.num_tokens == 6
    out3 = identity_router("topk", k=3).route(X_TD[:1])
    assert out3.expert_ids_TK.tolist() == [[0, 1, 2]]
    assert torch.allclose(out3.weights_TK, torch.tensor([[4 / 9, 3 / 9, 2 / 9]]), atol=1e-6)


def test_gshard_is_renormalised_top2_whatever_k() -> None:
    topk = identity_router("topk", k=2).route(X_TD)
    gshard = identity_router("gshard", k=3).route(X_TD)  # moe.k does not apply to gshard
    assert torch.equal(gshard.expert_ids_TK, topk.expert_ids_TK)
    assert torch.allclose(gshard.weights_TK, topk.weights_TK)
    assert torch.allclose(gshard.weights_TK.sum(-1), torch.ones(6))


def test_gshard_balance_loss_counts_first_choices_only() -> None:
    """GShard: E * sum_e (c_e / S) m_e, c_e the tokens whose first choice is e (DeepSpeed's
    top2gating); top-k counts every slot."""
    P_E = P_TE.mean(0)
    first_E = torch.tensor([2, 1, 1, 2]) / 6  # first choices 0, 3, 1, 2, 0, 3
    slots_E = torch.tensor([3, 3, 4, 2]) / 12  # both slots: [0,1] [3,2] [1,2] [2,0] [0,1] [3,2]
    gshard = identity_router("gshard", aux_loss_coef=1.0, z_loss_coef=0.0).route(X_TD)
    topk = identity_router("topk", k=2, aux_loss_coef=1.0, z_loss_coef=0.0).route(X_TD)
    assert gshard.aux_losses["load_balance"].item() == pytest.approx(E * float(first_E @ P_E))
    assert topk.aux_losses["load_balance"].item() == pytest.approx(E * float(slots_E @ P_E))
    assert gshard.stats["tokens_per_expert"].tolist() == [3, 3, 4, 2]  # statistics: every slot


def test_gshard_random_routing_keeps_the_second_expert_with_probability_2_g2() -> None:
    """GShard Sec. 2.2 / Algorithm 1: in training the second expert is dispatched only when
    2 g2 > U(0, 1); a skipped slot is -1 with weight 0 (before capacity), g1 is unchanged.
    Evaluation, and `second_expert_sampling: false`, keep plain top-2."""
    torch.manual_seed(0)
    router = build_router("gshard", 16, E, RouterConfig(second_expert_sampling=True))
    with torch.no_grad():
        router.gate.weight.weight.mul_(5)
    x_TD = torch.randn(20000, 16)
    plain = router.eval().route(x_TD)
    assert bool((plain.expert_ids_TK >= 0).all())
    g2_T = plain.weights_TK[:, 1]
    sampled = router.train().route(x_TD)
    kept_T = sampled.expert_ids_TK[:, 1] >= 0
    assert torch.equal(sampled.expert_ids_TK[:, 0], plain.expert_ids_TK[:, 0])
    assert torch.equal(sampled.expert_ids_TK[kept_T, 1], plain.expert_ids_TK[kept_T, 1])
    assert torch.equal(sampled.weights_TK[:, 0], plain.weights_TK[:, 0])
    assert torch.equal(sampled.weights_TK[:, 1], torch.where(kept_T, g2_T, 0.0))
    for low, high in ((0.0, 0.1), (0.1, 0.3), (0.3, 0.5)):  # kept share ~ mean of 2 g2
        in_bin = (g2_T >= low) & (g2_T < high)
        assert in_bin.sum() > 500
        expect = (2 * g2_T[in_bin]).mean().item()
        assert kept_T[in_bin].float().mean().item() == pytest.approx(expect, abs=0.03)
    counts_E = torch.bincount(sampled.expert_ids_TK[sampled.expert_ids_TK >= 0], minlength=E)
    assert torch.equal(sampled.stats["tokens_per_expert"], counts_E)
    router.cfg = RouterConfig(second_expert_sampling=False)
    assert bool((router.train().route(x_TD).expert_ids_TK >= 0).all())


def test_switch_weight_is_the_raw_top1_probability() -> None:
    out = identity_router("switch", k=2).route(X_TD)
    assert out.expert_ids_TK.flatten().tolist() == [0, 3, 1, 2, 0, 3]
    assert torch.allclose(out.weights_TK.flatten(),
                          torch.tensor([0.4, 0.4, 0.6, 0.5, 0.7, 0.7]), atol=1e-6)
    # topk with k = 1 renormalises to exactly 1 instead.
    assert torch.equal(identity_router("topk", k=1).route(X_TD).weights_TK, torch.ones(6, 1))


def test_top_p_router_minimal_sets_with_padding_slots() -> None:
    out = identity_router("topp", top_p=0.45).route(X_TD)
    # Masses: 0.4 < 0.45 needs a second expert; 0.6, 0.5, 0.7, 0.7 suffice alone.
    assert out.expert_ids_TK.tolist() == [[0, 1], [3, 2], [1, -1], [2, -1], [0, -1], [3, -1]]
    expected = [[0.4, 0.3], [0.4, 0.3], [0.6, 0.0], [0.5, 0.0], [0.7, 0.0], [0.7, 0.0]]
    assert torch.allclose(out.weights_TK, torch.tensor(expected), atol=1e-6)
    assert out.stats["experts_per_token"].item() == pytest.approx(8 / 6)
    assert set(out.aux_losses) == {"load_balance", "z_loss", "entropy"}
    entropy = -(P_TE * P_TE.log()).sum(-1).mean()
    assert out.aux_losses["entropy"].item() == pytest.approx(1e-4 * entropy.item(), rel=1e-5)
    # Assignments 0,1,3,2,1,2,0,3: two per expert, so the balance loss is exactly 1 (x coef).
    assert out.aux_losses["load_balance"].item() == pytest.approx(0.01)


@pytest.mark.parametrize("p, ids", [
    (1e-6, [0]), (0.5, [0]), (0.6, [0, 1]), (0.75, [0, 1]), (0.8, [0, 1, 2]), (1.0, [0, 1, 2, 3]),
])
def test_top_p_select_thresholds(p: float, ids: list[int]) -> None:
    # Exact binary fractions: the cumulative masses are 0.5, 0.75, 0.875, 1 with no rounding;
    # reaching p exactly is enough (Eq. 5 uses >=).
    probs_TE = torch.tensor([[0.125, 0.25, 0.5, 0.125]])
    order = [2, 1, 0, 3]  # experts by decreasing probability (ties: lower id first)
    expert_ids_TK, weights_TK = top_p_select(probs_TE, p)
    assert expert_ids_TK.tolist() == [[order[i] for i in ids]]
    assert weights_TK.tolist() == [[probs_TE[0, order[i]].item() for i in ids]]


def test_top_p_select_ties_and_batch_width() -> None:
    probs_TE = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]])
    expert_ids_TK, weights_TK = top_p_select(probs_TE, 0.5)
    # Ties go to the lower expert id; K is the largest set, the rest is -1 / 0.
    assert expert_ids_TK.tolist() == [[0, 1], [2, -1]]
    assert weights_TK.tolist() == [[0.25, 0.25], [1.0, 0.0]]


def test_aux_losses_weighted_and_padding_excluded() -> None:
    router = identity_router("topk", k=2, aux_loss_coef=0.5, z_loss_coef=0.25)
    pad_BT = torch.tensor([[False, False, False, False, True, True]])
    rctx = RoutingContext.from_batch(1, 6, pad_mask_BT=pad_BT)
    padded = router.route(X_TD, rctx)
    alone = router.route(X_TD[:4])
    for key in ("load_balance", "z_loss"):
        assert padded.aux_losses[key].item() == pytest.approx(alone.aux_losses[key].item())
    # Real tokens: ids 0,1 3,2 1,2 2,0 -> f = [2, 2, 3, 1] / 8; P = column means of rows 0-3.
    P_E = P_TE[:4].mean(0)
    lb = 4 * (torch.tensor([2, 2, 3, 1]) / 8 * P_E).sum().item()
    assert padded.aux_losses["load_balance"].item() == pytest.approx(0.5 * lb, rel=1e-5)
    # Softmax of log-probabilities: logsumexp = log 1 = 0, so the z-loss vanishes.
    assert padded.aux_losses["z_loss"].item() == pytest.approx(0.0, abs=1e-6)
    assert padded.stats["tokens_per_expert"].tolist() == [2, 2, 3, 1]
    no_aux = identity_router("topk", k=2, aux_loss_coef=0.0, z_loss_coef=0.0).route(X_TD)
    assert no_aux.aux_losses == {}


def test_noisy_gating_and_jitter_only_in_training() -> None:
    torch.manual_seed(0)
    for cfg in (dict(noisy_gating=True), dict(jitter_eps=0.5)):
        router = identity_router("topk", k=2, **cfg)
        first, second = router.route(X_TD), router.route(X_TD)
        assert torch.allclose(first.probs_TE, P_TE, atol=1e-6)
        assert torch.equal(first.probs_TE, second.probs_TE)
        router.train()
        noisy = router.route(X_TD)
        assert not torch.allclose(noisy.probs_TE, P_TE, atol=1e-3)
        assert not torch.equal(noisy.probs_TE, router.route(X_TD).probs_TE)
    plain = identity_router("topk", k=2).train()
    assert torch.allclose(plain.route(X_TD).probs_TE, P_TE, atol=1e-6)


def test_jitter_is_drawn_in_float32_for_a_bf16_input() -> None:
    """Near 1 bf16 steps by 2^-8: a bf16 draw in [0.999, 1.001] is the constant 1.0, and one
    in [0.99, 1.01] never exceeds 1.0078 (biased low). Drawn in float32 it jitters every token."""
    from moe_train.moe.gating import LinearGate

    torch.manual_seed(0)
    gate = LinearGate(64, 8, jitter_eps=1e-3).train()
    x_TD = torch.randn(2000, 64).to(torch.bfloat16)
    jittered_TE = gate(x_TD)[1]
    moved_T = (jittered_TE - gate.eval()(x_TD)[1]).abs().amax(-1) > 0
    assert float(moved_T.float().mean()) > 0.99
    scale = LinearGate(1, 1, jitter_eps=1e-2).train()
    with torch.no_grad():
        scale.weight.weight.fill_(1.0)
    u_T = scale(torch.ones(20000, 1, dtype=torch.bfloat16))[1].squeeze(1)
    assert abs(float(u_T.mean()) - 1.0) < 1e-3 and float(u_T.max()) > 1.009


@pytest.mark.parametrize("noisy", [False, True])
def test_gate_logits_are_float32_products_in_a_bf16_model(noisy: bool) -> None:
    """A bf16 model routes on float32 products of its bf16 weights and states, not on
    bf16-rounded logits; gradients come back in bf16."""
    torch.manual_seed(0)
    router = build_router("topk", 64, 8, RouterConfig(k=2, noisy_gating=noisy)).to(torch.bfloat16)
    x_TD = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    want_TE = x_TD.detach().float() @ router.gate.weight.weight.detach().float().T
    clean_TE, logits_TE = router.gate(x_TD)
    assert clean_TE.dtype == torch.float32 and torch.allclose(clean_TE, want_TE, atol=1e-5)
    assert not torch.equal(clean_TE, want_TE.bfloat16().float())  # no bf16 rounding
    router.train()
    router.route(x_TD).weights_TK.sum().backward()
    assert x_TD.grad.dtype == torch.bfloat16 and router.gate.weight.weight.grad is not None


@pytest.mark.parametrize("name", ["topk", "switch", "gshard", "topp", "sentence"])
def test_gradients_reach_the_gate_through_weights_and_aux(name: str) -> None:
    torch.manual_seed(0)
    router = build_router(name, 8, E, RouterConfig(k=2, noisy_gating=True)).train()
    x_TD = torch.randn(6, 8)
    rctx = RoutingContext.from_batch(2, 3)
    out = router.route(x_TD, rctx)
    (out.weights_TK * torch.arange(1.0, out.top_k + 1)).sum().backward()
    grad = router.gate.weight.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert router.gate.noise.weight.grad.abs().sum() > 0
    router.zero_grad()
    out = router.route(x_TD, rctx)
    sum(out.aux_losses.values()).backward()
    assert router.gate.weight.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------- sentence

# Two sentences of three positions: sentence 0 has two real tokens, sentence 1 has one.
SENT_PAD_BT = torch.tensor([[False, False, True], [False, True, True]])
SENT_X_TD = torch.tensor([[2.0, 0, 0, 0], [0, 0, 0, 0], [0, 90, 0, 0],
                          [0, 0, 3, 0], [0, 80, 0, 0], [70, 0, 0, 0]])


def test_sentence_router_pools_real_tokens_and_broadcasts() -> None:
    router = identity_router("sentence", k=1)
    rctx = RoutingContext.from_batch(2, 3, pad_mask_BT=SENT_PAD_BT)
    out = router.route(SENT_X_TD, rctx)
    # Means over real tokens: [1, 0, 0, 0] -> expert 0; [0, 0, 3, 0] -> expert 2 (raw prob).
    w0, w1 = math.e / (math.e + 3), math.e ** 3 / (math.e ** 3 + 3)
    assert out.expert_ids_TK.flatten().tolist() == [0, 0, 0, 2, 2, 2]
    assert torch.allclose(out.weights_TK.flatten(), torch.tensor([w0] * 3 + [w1] * 3))
    # Load balance over the two sentences (f = [1/2, 0, 1/2, 0]), not over their tokens.
    P0 = (w0 + 1 / (math.e ** 3 + 3)) / 2
    P2 = (1 / (math.e + 3) + w1) / 2
    assert out.aux_losses["load_balance"].item() == pytest.approx(0.01 * 4 * (P0 + P2) / 2)
    assert out.stats["tokens_per_expert"].tolist() == [2, 0, 1, 0]
    # Changing the padded positions changes nothing.
    other = SENT_X_TD.clone()
    other[[2, 4, 5]] = torch.randn(3, E) * 100
    again = router.route(other, rctx)
    assert torch.equal(again.expert_ids_TK, out.expert_ids_TK)
    assert torch.equal(again.weights_TK, out.weights_TK)


def test_sentence_router_top2_constant_within_sentence_and_given_repr() -> None:
    torch.manual_seed(0)
    router = build_router("sentence", 8, E, RouterConfig(k=2)).eval()
    x_TD = torch.randn(6, 8)
    rctx = RoutingContext.from_batch(2, 3, pad_mask_BT=SENT_PAD_BT)
    out = router.route(x_TD, rctx)
    ids_BTK = out.expert_ids_TK.view(2, 3, 2)
    assert (ids_BTK == ids_BTK[:, :1]).all()
    assert torch.allclose(out.weights_TK.sum(-1), torch.ones(6))
    # A given sentence representation is used instead of pooling this layer's states.
    repr_BD = sentence_mean(x_TD, rctx.sentence_ids_T, 2, rctx.pad_mask_T)
    given = RoutingContext.from_batch(2, 3, pad_mask_BT=SENT_PAD_BT, sentence_repr_BD=repr_BD)
    same = router.route(torch.randn(6, 8), given)
    assert torch.equal(same.expert_ids_TK, out.expert_ids_TK)
    assert torch.allclose(same.weights_TK, out.weights_TK)
    dec = RoutingContext.from_batch(2, 3, side="decoder")
    with pytest.raises(ConfigError, match="sentence_repr_BD"):
        router.route(x_TD, dec)


def test_sentence_mean_hand_value() -> None:
    rctx = RoutingContext.from_batch(2, 3, pad_mask_BT=SENT_PAD_BT)
    mean_BD = sentence_mean(SENT_X_TD, rctx.sentence_ids_T, 2, rctx.pad_mask_T)
    assert mean_BD.tolist() == [[1.0, 0, 0, 0], [0, 0, 3.0, 0]]


# -------------------------------------------------------------------------------------- task

def test_learned_task_router_routes_by_task_only() -> None:
    router = build_router("task", E, E, RouterConfig(k=2, num_tasks=2, task_source="tgt_lang"))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))
        router.embed.weight.copy_(torch.stack([P_TE[0], P_TE[1]]).log())
    rctx = RoutingContext.from_batch(3, 2, task_ids_B=torch.tensor([0, 1, 0]))
    out = router.route(torch.randn(6, E), rctx)
    assert out.expert_ids_TK.tolist() == [[0, 1]] * 2 + [[3, 2]] * 2 + [[0, 1]] * 2
    assert torch.allclose(out.weights_TK, torch.tensor([[4 / 7, 3 / 7]] * 6), atol=1e-6)
    again = router.route(torch.randn(6, E) * 10, rctx)
    assert torch.equal(again.expert_ids_TK, out.expert_ids_TK)
    # the balance loss counts both slots: experts 0, 1 (tasks 0, two sentences) and 3, 2
    slots_E, P_E = torch.tensor([4, 4, 2, 2]) / 12, (4 * P_TE[0] + 2 * P_TE[1]) / 6
    assert out.aux_losses["load_balance"].item() == pytest.approx(
        router.cfg.aux_loss_coef * E * float(slots_E @ P_E), rel=1e-5)
    assert router.task_source == "tgt_lang" and ROUTERS["topk"].task_source is None
    # Gradients reach the task embedding and the gate through the weights and the aux losses.
    (out.weights_TK[:, 0].sum() + sum(out.aux_losses.values())).backward()
    assert router.embed.weight.grad[:2].abs().sum() > 0
    assert router.gate.weight.grad.abs().sum() > 0


def test_learned_task_router_k1_weights_by_the_raw_probability() -> None:
    """k = 1 as Switch: the raw top-1 probability (0.4), not 1, so the translation loss reaches
    the task gate."""
    router = build_router("task", E, E, RouterConfig(k=1, num_tasks=2, task_source="tgt_lang"))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))
        router.embed.weight.copy_(torch.stack([P_TE[0], P_TE[1]]).log())
    out = router.route(torch.randn(4, E), RoutingContext.from_batch(2, 2,
                                                                    task_ids_B=torch.tensor([0, 1])))
    assert out.expert_ids_TK.view(-1).tolist() == [0, 0, 3, 3]
    assert torch.allclose(out.weights_TK.view(-1), torch.full((4,), 0.4))


def test_fixed_table_task_router() -> None:
    cfg = RouterConfig(k=2, assignment=[[0, 1], [2, 3], [3, 1]])
    router = build_router("task", 8, E, cfg)
    assert list(router.parameters()) == [] and "table_ids_NK" not in router.state_dict()
    rctx = RoutingContext.from_batch(3, 2, task_ids_B=torch.tensor([1, 0, 2]),
                                     pad_mask_BT=torch.tensor([[0, 0], [0, 1], [0, 0]]).bool())
    out = router.route(torch.randn(6, 8), rctx)
    assert out.expert_ids_TK.tolist() == [[2, 3]] * 2 + [[0, 1]] * 2 + [[3, 1]] * 2
    assert torch.equal(out.weights_TK, torch.full((6, 2), 0.5))
    assert out.probs_TE is None and out.aux_losses == {}
    assert out.stats["tokens_per_expert"].tolist() == [1, 3, 2, 4]


def test_task_router_errors() -> None:
    router = build_router("task", 8, E, RouterConfig(num_tasks=2, task_source="domain"))
    with pytest.raises(ConfigError, match=r"^moe\.task_source: .*no task ids .*give --domain\)"):
        router.route(torch.randn(4, 8), RoutingContext.from_batch(2, 2))
    with pytest.raises(ConfigError, match=r"^moe\.num_tasks: .*largest task id \(2\)"):
        router.route(torch.randn(4, 8),
                     RoutingContext.from_batch(2, 2, task_ids_B=torch.tensor([0, 2])))
    with pytest.raises(ConfigError, match=r"^moe\.num_tasks: expected a positive"):
        build_router("task", 8, E, RouterConfig())
    with pytest.raises(ConfigError, match=r"^moe\.assignment\[1\]: expected expert ids below"):
        build_router("task", 8, E, RouterConfig(k=1, assignment=[[0], [4]]))


# ----------------------------------------------------------------------- registry and config

def test_registry_and_k_errors_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError) as err:
        build_router("x", 8, E, RouterConfig())
    assert str(err.value) == ("moe.router: unknown router 'x' "
                              "(known: gated, gshard, gumbel, random, sentence, single, switch, task, thor, "
                                  "topk, topp)")
    for name in ("topk", "sentence", "task"):
        with pytest.raises(ConfigError) as err:
            build_router(name, 8, E, RouterConfig(k=5, num_tasks=3))
        assert str(err.value) == "moe.k: expected at most moe.num_experts (4), got 5"
    with pytest.raises(ConfigError, match=r"^moe\.num_experts: expected at least 2"):
        build_router("gshard", 8, 1, RouterConfig(k=1))
    assert isinstance(build_router("switch", 8, 1, RouterConfig(k=2)), ROUTERS["switch"])


@pytest.mark.parametrize("field, value, message", [
    ("k", 0, "moe.k: expected a positive integer, got 0"),
    ("top_p", 0.0, "moe.top_p: expected a number in (0, 1], got 0.0"),
    ("top_p", 1.5, "moe.top_p: expected a number in (0, 1], got 1.5"),
    ("capacity_factor", -1.0, "moe.capacity_factor: expected a non-negative number"),
    ("jitter_eps", 1.0, "moe.jitter_eps: expected a number in [0, 1)"),
    ("z_loss_coef", -0.1, "moe.z_loss_coef: expected a non-negative number"),
    ("task_source", "lang", "moe.task_source: expected one of lang_pair, tgt_lang, src_lang, domain"),
    ("sentence_pool", "max", "moe.sentence_pool: expected mean, got 'max'"),
    ("assignment", [[0, 1], [2]], "moe.assignment[1]: expected a list of moe.k (2) expert ids"),
    ("assignment", [[1, 1]], "moe.assignment[0]: expected distinct expert ids"),
])
def test_router_config_validation(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        RouterConfig(**{field: value})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ------------------------------------------------------------------------- routing context

def test_routing_context_from_forward() -> None:
    src_pad = torch.tensor([[False, True], [False, False]])
    tgt_pad = torch.tensor([[False, False, True], [False, True, True]])
    repr_BD = torch.randn(2, 4)
    ctx = ForwardContext(src_pad_mask_BS=src_pad, tgt_pad_mask_BT=tgt_pad,
                         src_lang_B=torch.tensor([0, 2]), tgt_lang_B=torch.tensor([1, 0]),
                         domain_ids_B=torch.tensor([4, 3]), task_ids_B=torch.tensor([7, 8]),
                         extras={"num_langs": 3, "sentence_repr_BD": repr_BD})
    enc = RoutingContext.from_forward(ctx, 2, 2, "lang_pair")
    assert enc.pad_mask_T.tolist() == [False, True, False, False]
    assert enc.sentence_ids_T.tolist() == [0, 0, 1, 1] and enc.num_sentences == 2
    assert enc.task_ids_B.tolist() == [0 * 3 + 1, 2 * 3 + 0]
    assert enc.sentence_repr_BD is repr_BD and enc.side == "encoder"
    dec = RoutingContext.from_forward(ctx.for_side("decoder"), 2, 3, "tgt_lang")
    assert dec.pad_mask_T.tolist() == [False, False, True, False, True, True]
    assert dec.side == "decoder" and dec.task_ids_B.tolist() == [1, 0]
    assert RoutingContext.from_forward(ctx, 2, 2, "domain").task_ids_B.tolist() == [4, 3]
    assert RoutingContext.from_forward(ctx, 2, 2, "task_ids").task_ids_B.tolist() == [7, 8]
    assert RoutingContext.from_forward(ctx, 2, 2).task_ids_B is None
    no_langs = ForwardContext(tgt_lang_B=torch.tensor([1, 0]))
    assert RoutingContext.from_forward(no_langs, 2, 1, "lang_pair").task_ids_B is None
    with pytest.raises(ConfigError, match=r"^moe\.task_source: 'lang_pair' needs .*num_langs"):
        RoutingContext.from_forward(ctx.replace(extras={}), 2, 2, "lang_pair")
    with pytest.raises(ConfigError, match=r"^moe\.task_source: expected one of"):
        RoutingContext.from_forward(ctx, 2, 2, "language")


def test_routing_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="weights_TK"):
        Routing(expert_ids_TK=torch.zeros(3, 2, dtype=torch.long), weights_TK=torch.zeros(3, 1),
                probs_TE=None, num_experts=4)
    with pytest.raises(ValueError, match="probs_TE"):
        Routing(expert_ids_TK=torch.zeros(3, 1, dtype=torch.long), weights_TK=torch.zeros(3, 1),
                probs_TE=torch.zeros(3, 5), num_experts=4)


@pytest.mark.parametrize("name,k", [("topk", 1), ("topk", 2), ("switch", 1), ("topk", 3),
                                    ("gshard", 2)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("noisy", [False, True])
def test_topk_gate_equals_composed_ops(name: str, k: int, padded: bool, noisy: bool) -> None:
    """The fused top-k gate (one autograd node, hand-written backward) gives the values of
    softmax -> topk -> renormalise and of moe.losses' definitions, and the same gradients to
    the gate (through the weights, both losses and probs_TE), with and without padding and
    noise."""
    from moe_train.moe import losses

    torch.manual_seed(3)
    T, D, num_experts = 12, 6, 5
    router = build_router(name, D, num_experts,
                          RouterConfig(k=k, aux_loss_coef=0.3, z_loss_coef=0.2,
                                       noisy_gating=noisy,  # gshard: the gate alone
                                       second_expert_sampling=False)).train()
    x_TD = torch.randn(T, D)
    pad_T = (torch.arange(T) % 5 == 4) if padded else None
    rctx = RoutingContext.from_batch(1, T, pad_mask_BT=None if pad_T is None else pad_T[None])
    g_TK, g_TE = torch.randn(T, router.k), torch.randn(T, num_experts)

    def loss(w_TK, probs_TE, aux):
        return (w_TK * g_TK).sum() + (probs_TE * g_TE).sum() + sum(aux.values())

    torch.manual_seed(9)
    out = router.route(x_TD, rctx)
    loss(out.weights_TK, out.probs_TE, out.aux_losses).backward()
    got = [p.grad.clone() for p in router.parameters()]
    router.zero_grad()
    torch.manual_seed(9)  # the same noise draw
    clean_TE, logits_TE = router.gate(x_TD)
    probs_TE = logits_TE.softmax(-1)
    w_TK, ids_TK = probs_TE.topk(router.k, dim=-1)
    if router.renormalize:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    balanced_TK = ids_TK[:, :1] if router.first_choice_balance else ids_TK  # GShard: first only
    aux = {"load_balance": 0.3 * losses.load_balance_loss(probs_TE, balanced_TK, pad_T),
           "z_loss": 0.2 * losses.z_loss(clean_TE, pad_T)}
    loss(w_TK, probs_TE, aux).backward()
    assert torch.equal(out.expert_ids_TK, ids_TK)
    torch.testing.assert_close(out.weights_TK, w_TK)
    torch.testing.assert_close(out.probs_TE, probs_TE)
    for key in aux:
        assert out.aux_losses[key].item() == pytest.approx(aux[key].item(), rel=1e-6)
    for p, want in zip(router.parameters(), got):
        if p.grad is not None:
            torch.testing.assert_close(want, p.grad)
    assert torch.equal(out.stats["tokens_per_expert"],
                       losses.tokens_per_expert(ids_TK, num_experts, pad_T))
    assert out.stats["routing_entropy"].item() == pytest.approx(
        losses.routing_entropy(probs_TE, pad_T).item(), rel=1e-5)


def test_topk_gate_without_aux_losses_and_weights_only() -> None:
    """Coefficients 0: no losses, and the weights' gradient alone matches the composed ops."""
    torch.manual_seed(4)
    router = build_router("topk", 6, 5, RouterConfig(k=2, aux_loss_coef=0.0, z_loss_coef=0.0))
    x_TD = torch.randn(9, 6)
    out = router.route(x_TD)
    assert out.aux_losses == {}
    out.weights_TK.pow(2).sum().backward()
    got = router.gate.weight.weight.grad.clone()
    router.zero_grad()
    w_TK = router.gate(x_TD)[1].softmax(-1).topk(2, dim=-1).values
    (w_TK / w_TK.sum(-1, keepdim=True)).pow(2).sum().backward()
    torch.testing.assert_close(got, router.gate.weight.weight.grad)


def test_sentence_router_with_sgmoe_importance_and_load_losses() -> None:
    """balance_loss cv2 (SGMoE-SL): CV(Importance)^2 + CV(Load)^2 of the real sentences, each
    times aux_loss_coef, in place of the Switch loss; Load trains the noise's scale too."""
    from moe_train.moe import losses

    torch.manual_seed(0)
    cfg = RouterConfig(k=2, noisy_gating=True, balance_loss="cv2", aux_loss_coef=0.1,
                       z_loss_coef=0.0)
    router = build_router("sentence", 6, 4, cfg).train()
    with torch.no_grad():
        router.gate.noise.weight.normal_(0.0, 0.5)
    repr_BD = torch.randn(5, 6)
    pad_BT = torch.tensor([[0, 0], [0, 1], [1, 1], [0, 0], [0, 0]]).bool()  # sentence 2: empty
    rctx = RoutingContext.from_batch(5, 2, pad_mask_BT=pad_BT, sentence_repr_BD=repr_BD)
    x_TD = torch.randn(10, 6)  # not read: the sentences' representation is given
    torch.manual_seed(1)
    out = router.route(x_TD, rctx)
    assert set(out.aux_losses) == {"importance", "load"}
    torch.manual_seed(1)  # the same noise, by hand
    clean_BE, noisy_BE, std_BE = router.gate.scores(repr_BD)
    ids_BK, w_BK = out.expert_ids_TK[::2], out.weights_TK[::2]
    gates_BE = torch.zeros(5, 4).scatter(1, ids_BK, w_BK)
    keep = [0, 1, 3, 4]
    importance = losses.cv_squared(gates_BE[keep].sum(0))
    load = losses.cv_squared(losses.prob_in_top_k(clean_BE, noisy_BE, std_BE, 2)[keep].sum(0))
    assert out.aux_losses["importance"].item() == pytest.approx(0.1 * importance.item(), rel=1e-5)
    assert out.aux_losses["load"].item() == pytest.approx(0.1 * load.item(), rel=1e-5)
    sum(out.aux_losses.values()).backward()
    assert router.gate.weight.weight.grad.abs().sum() > 0
    assert router.gate.noise.weight.grad.abs().sum() > 0


def test_sgmoe_losses_need_noise_and_the_sentence_router() -> None:
    with pytest.raises(ConfigError, match="moe.noisy_gating: expected true with balance_loss cv2"):
        RouterConfig(balance_loss="cv2")
    with pytest.raises(ConfigError, match="moe.balance_loss: expected one of switch, cv2"):
        RouterConfig(balance_loss="cv")
    with pytest.raises(ConfigError, match="built for the sentence router, got router 'topk'"):
        build_router("topk", 6, 4, RouterConfig(balance_loss="cv2", noisy_gating=True))


@pytest.mark.parametrize("name", ["topp", "task", "sentence"])
def test_losses_and_entropy_leave_padding_out(name: str) -> None:
    """The balance loss, the z-loss (and top-p's entropy loss, the entropy statistic) of a padded
    batch equal those of its real tokens alone: padding, or a sentence that is all padding,
    counts nowhere (a padded batch's longer rows would pull harder)."""
    torch.manual_seed(1)
    cfg = RouterConfig(k=2, aux_loss_coef=1.0, z_loss_coef=1.0, entropy_coef=1.0,
                       num_tasks=3, task_source="tgt_lang")
    router = build_router(name, 8, E, cfg).eval()
    pad_BT = torch.tensor([[False, False, True, True], [True, True, True, True],
                           [False, False, False, True]])  # sentence 1: padding only
    x_BTD = torch.randn(3, 4, 8)
    task_B = torch.tensor([0, 1, 2])
    padded = router.route(x_BTD.reshape(12, 8), RoutingContext.from_batch(
        3, 4, pad_mask_BT=pad_BT, task_ids_B=task_B))
    if name == "sentence":  # the real sentences alone, their own padding kept
        keep = [0, 2]
        real = router.route(x_BTD[keep].reshape(8, 8), RoutingContext.from_batch(
            2, 4, pad_mask_BT=pad_BT[keep], task_ids_B=task_B[keep]))
    else:  # the real tokens alone, one per row
        rows = ~pad_BT.reshape(12)
        real = router.route(x_BTD.reshape(12, 8)[rows], RoutingContext.from_batch(
            int(rows.sum()), 1, task_ids_B=task_B.repeat_interleave(4)[rows]))
    assert set(padded.aux_losses) == set(real.aux_losses) >= {"load_balance", "z_loss"}
    for key, value in padded.aux_losses.items():
        assert value.item() == pytest.approx(real.aux_losses[key].item(), rel=1e-5), key
    if "routing_entropy" in real.stats:
        assert padded.stats["routing_entropy"].item() == pytest.approx(
            real.stats["routing_entropy"].item(), rel=1e-5)
