"""THOR router (seed 003) on hand-computed cases: candidate sets S^t, top-k / top-p inside them,
combined weights g^t_e * g_e, the task-representation variants and the context gate.

Every gate is set to the identity (D = E = 4), so the token logits are the router input and the
task logits are E_p. Inputs are logs of probabilities, so each softmax gives back the numbers
written in the comments, and every expectation below is derived by hand from them.

Sentence 0: task probs (.4, .3, .2, .1) -> S^t = {0, 1}, g^t = (4/7, 3/7, 0, 0).
Sentence 1: task probs (.1, .2, .3, .4) -> S^t = {3, 2}, g^t = (0, 0, 3/7, 4/7).
Token a (sentence 0): logits ln(1, 2, 3, 4). Unrestricted it prefers experts 3 and 2; over
  S^t = {0, 1} its distribution is (1/3, 2/3, 0, 0).
Token b (sentence 1): logits ln(4, 3, 2, 1); over S^t = {2, 3}: (0, 0, 2/3, 1/3).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.config import RouterConfig, ThorConfig
from moe_train.errors import ConfigError
from moe_train.models.context import ForwardContext
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.routing import Routing, RoutingContext
from moe_train.moe.thor_router import (
    GOLD_TASK_KEY,
    TASK_EMB_KEY,
    TASK_PROBS_KEY,
    TASK_REPR_KEY,
    TaskPredictor,
    ThorRouter,
)

E = D = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def ln(*p: float) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float32).log()


REPR_BD = torch.stack([ln(.4, .3, .2, .1), ln(.1, .2, .3, .4)])
X_TD = torch.stack([ln(1, 2, 3, 4), ln(4, 3, 2, 1)])  # token a, token b (one per sentence)


def _router(*, k: int = 2, top_p: float = 0.5, loss_scale: float = 1.0, z_loss: float = 0.0,
            **thor: object) -> ThorRouter:
    """A THOR router with identity gates, no context and no losses unless asked."""
    settings = dict(num_tasks=2, num_candidates=2, context=False, beta=0.0, gamma=0.0, delta=0.0)
    settings.update(thor)
    router = ThorRouter(D, E, RouterConfig(k=k, top_p=top_p, z_loss_coef=z_loss),
                        ThorConfig(**settings), loss_scale)
    with torch.no_grad():
        router.gate.weight.weight.copy_(torch.eye(E))
        if router.task_gate is not None:
            router.task_gate.weight.copy_(torch.eye(E))
    return router.eval()


def _rctx(repr_BD: torch.Tensor, L: int, pad_BL: torch.Tensor | None = None,
          side: str = "encoder", **extras: torch.Tensor) -> RoutingContext:
    return RoutingContext.from_batch(repr_BD.size(0), L, pad_mask_BT=pad_BL, side=side,
                                     extras={TASK_REPR_KEY: repr_BD, **extras})


def dense(routing: Routing) -> torch.Tensor:
    """(T, E) combine weight of every expert (0 where it has no slot); no expert twice."""
    ids_TK, w_TK = routing.expert_ids_TK, routing.weights_TK
    out_TE = torch.zeros(ids_TK.size(0), routing.num_experts)
    for t in range(ids_TK.size(0)):
        used = [int(i) for i in ids_TK[t] if i >= 0]
        assert len(used) == len(set(used)), ids_TK[t]
        for i, w in zip(ids_TK[t].tolist(), w_TK[t].tolist()):
            if i < 0:
                assert w == 0.0, (ids_TK[t], w_TK[t])
            else:
                out_TE[t, i] += w
    return out_TE


def slots(routing: Routing) -> list[set[int]]:
    return [{int(i) for i in row if i >= 0} for row in routing.expert_ids_TK]


S_T = [{0, 1}, {2, 3}]  # the candidate sets of tokens a and b


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 1-3: candidate sets, token routing inside them, combined weights


def test_candidate_sets_and_task_weights() -> None:
    router = _router()
    probs_BE, cand_BC, g_BE = router.candidate_sets(REPR_BD)
    _close(probs_BE, [[.4, .3, .2, .1], [.1, .2, .3, .4]])
    assert [set(c.tolist()) for c in cand_BC] == S_T
    _close(g_BE, [[4 / 7, 3 / 7, 0, 0], [0, 0, 3 / 7, 4 / 7]])  # OD-4: renormalised over S^t


@pytest.mark.parametrize("case, want", [
    # top-1: a -> expert 1 (g = 1, g^t = 3/7); b -> expert 2 (3/7).
    (dict(token_routing="topk", k=1), [[0, 3 / 7, 0, 0], [0, 0, 3 / 7, 0]]),
    # top-2 (Eq. 4, g renormalised over the two, here all of S^t): a: 1/3 * 4/7, 2/3 * 3/7.
    (dict(token_routing="topk", k=2), [[4 / 21, 2 / 7, 0, 0], [0, 0, 2 / 7, 4 / 21]]),
    # renormalise: (4/21, 6/21) / (10/21) = (.4, .6).
    (dict(token_routing="topk", k=2, renormalize=True), [[.4, .6, 0, 0], [0, 0, .6, .4]]),
    # top-p .5 (Eq. 6, raw prob): a keeps only expert 1 (2/3 >= .5): 2/3 * 3/7 = 2/7.
    (dict(token_routing="topp", top_p=0.5), [[0, 2 / 7, 0, 0], [0, 0, 2 / 7, 0]]),
    # top-p .7: 2/3 < .7, so the second candidate joins: 1/3 * 4/7 = 4/21.
    (dict(token_routing="topp", top_p=0.7), [[4 / 21, 2 / 7, 0, 0], [0, 0, 2 / 7, 4 / 21]]),
    # top-p 1.0: all of S^t and nothing else, though experts 2, 3 (resp. 0, 1) hold
    # most of the unrestricted mass.
    (dict(token_routing="topp", top_p=1.0), [[4 / 21, 2 / 7, 0, 0], [0, 0, 2 / 7, 4 / 21]]),
    (dict(token_routing="topp", top_p=0.5, renormalize=True), [[0, 1, 0, 0], [0, 0, 1, 0]]),
])
def test_token_routing_inside_the_candidate_set(case: dict, want: list[list[float]]) -> None:
    k, top_p = case.pop("k", 2), case.pop("top_p", 0.5)
    routing = _router(k=k, top_p=top_p, **case)(X_TD, _rctx(REPR_BD, 1))
    _close(dense(routing), want)
    assert all(s <= cand for s, cand in zip(slots(routing), S_T))
    # the token distribution is the candidate-renormalised one (zero outside S^t)
    _close(routing.probs_TE, [[1 / 3, 2 / 3, 0, 0], [0, 0, 2 / 3, 1 / 3]])


def test_without_candidate_sets_the_same_tokens_leave_s_t() -> None:
    """Control: with hierarchy off, top-p .5 of token a takes experts 3 and 2 (.4 + .3), with
    their raw probabilities, so the restriction above is what keeps them out."""
    routing = _router(token_routing="topp", top_p=0.5, hierarchy=False)(X_TD, _rctx(REPR_BD, 1))
    _close(dense(routing), [[0, 0, .3, .4], [.4, .3, 0, 0]])


def test_top_p_takes_the_minimal_set_inside_s_t() -> None:
    """|S^t| = 3: S^t = {0, 1, 2}, g^t = (4/9, 3/9, 2/9, 0). Token logits ln(3, 2, 1, 1000): the
    unrestricted distribution is almost all expert 3; inside S^t it is (1/2, 1/3, 1/6, 0)."""
    x_TD = ln(3, 2, 1, 1000)[None]
    repr_BD = REPR_BD[:1]
    for p, want in [(0.4, [2 / 9, 0, 0, 0]),                  # 1/2 >= .4
                    (0.6, [2 / 9, 1 / 9, 0, 0]),              # 1/2 < .6 <= 5/6
                    (0.9, [2 / 9, 1 / 9, 1 / 27, 0]),         # 5/6 < .9: all of S^t
                    (1.0, [2 / 9, 1 / 9, 1 / 27, 0])]:
        routing = _router(token_routing="topp", top_p=p, num_candidates=3)(x_TD, _rctx(repr_BD, 1))
        _close(dense(routing), [want])
    # Unrestricted, top-p .4 would take expert 3 alone.
    free = _router(token_routing="topp", top_p=0.4, hierarchy=False)(x_TD, _rctx(repr_BD, 1))
    assert slots(free) == [{3}]


def test_zero_probability_edges_never_leave_s_t() -> None:
    # Token logits (0, -200, 50, 50) in sentence 0 (S^t = {0, 1}): inside S^t the distribution
    # is exactly (1, 0, 0, 0) (exp(-200) underflows in float32).
    x_TD = torch.tensor([[0.0, -200.0, 50.0, 50.0]])
    rctx = _rctx(REPR_BD[:1], 1)
    # top-2: expert 1 keeps its slot inside S^t, with weight 0; expert 0 gets g^t = 4/7.
    routing = _router(token_routing="topk", k=2)(x_TD, rctx)
    assert slots(routing) == [{0, 1}]
    _close(dense(routing), [[4 / 7, 0, 0, 0]])
    # k = 3 > |S^t|: the third slot is unused (-1), not expert 2 or 3 (highest logits).
    routing = _router(token_routing="topk", k=3)(x_TD, rctx)
    assert slots(routing) == [{0, 1}] and (routing.expert_ids_TK == -1).sum() == 1
    _close(dense(routing), [[4 / 7, 0, 0, 0]])
    # top-p 1.0: the mass before expert 1 is already 1, so it is not taken.
    routing = _router(token_routing="topp", top_p=1.0)(x_TD, rctx)
    assert slots(routing) == [{0}]
    _close(dense(routing), [[4 / 7, 0, 0, 0]])
    # A candidate whose task weight underflows to 0 (task logits (0, -200, -200, -200): S^t =
    # {0, 1} by the lower-id tie rule, g^t = (1, 0, 0, 0)) could only get weight 0: the token
    # goes to expert 0 with weight 1 and nothing outside S^t gets a slot, whatever x prefers.
    repr_BD = torch.tensor([[0.0, -200.0, -200.0, -200.0]])
    x_TD = torch.tensor([[0.0, 10.0, 20.0, 30.0]])
    for case in (dict(token_routing="topk", k=2), dict(token_routing="topp", top_p=1.0)):
        k, top_p = case.pop("k", 2), case.pop("top_p", 0.5)
        routing = _router(k=k, top_p=top_p, **case)(x_TD, _rctx(repr_BD, 1))
        assert slots(routing)[0] <= {0, 1}
        _close(dense(routing), [[1, 0, 0, 0]])
        assert torch.isfinite(routing.weights_TK).all() and torch.isfinite(routing.probs_TE).all()


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 1.0])
def test_random_tokens_minimal_set_and_weights(p: float) -> None:
    """E = 8, |S^t| = 3, 6 sentences x 25 tokens of random logits: against a float64 reference
    of the definitions, every token takes the fewest candidates whose (candidate-renormalised)
    mass reaches p, nothing outside S^t, with weight g^t_e * q_e."""
    E8, C, B, L = 8, 3, 6, 25
    gen = torch.Generator().manual_seed(0)
    router = ThorRouter(E8, E8, RouterConfig(k=2, top_p=p, z_loss_coef=0.0),
                        ThorConfig(num_tasks=2, num_candidates=C, context=False, beta=0.0,
                                   gamma=0.0, delta=0.0, token_routing="topp")).eval()
    with torch.no_grad():
        router.gate.weight.weight.copy_(torch.eye(E8))
        router.task_gate.weight.copy_(torch.eye(E8))
    repr_BD = torch.randn(B, E8, generator=gen) * 2
    x_TD = torch.randn(B * L, E8, generator=gen) * 2
    routing = router(x_TD, _rctx(repr_BD, L))
    w_TE = dense(routing)
    task64_BE = repr_BD.double().softmax(-1)
    for t in range(B * L):
        b = t // L
        cand = set(task64_BE[b].topk(C).indices.tolist())
        gt = {e: float(task64_BE[b, e] / task64_BE[b, sorted(cand)].sum()) for e in cand}
        logits = x_TD[t].double()
        q = {e: float(v) for e, v in zip(sorted(cand), logits[sorted(cand)].softmax(-1))}
        chosen = {e for e in range(E8) if w_TE[t, e] > 0} | slots(routing)[t]
        assert chosen <= cand, (t, chosen, cand)
        mass = sorted(q.values(), reverse=True)
        n = len(chosen)
        assert sum(mass[:n]) >= p - 1e-6 and sum(mass[:n - 1]) < p + 1e-6, (t, p, mass, n)
        assert chosen == set(sorted(q, key=q.get, reverse=True)[:n])
        for e in chosen:
            assert abs(w_TE[t, e] - gt[e] * q[e]) < 1e-5


def test_top_p_one_is_guarded_against_float_mass_below_one() -> None:
    """At p = 1.0 a float32 cumulative sum that ends just below 1 would also take the
    zero-probability experts outside S^t (the edge the router guards): on random tokens this
    happens for plain top-p over the restricted distribution, and never for the router."""
    from moe_train.moe.gating import top_p_select

    E8, C, T = 8, 3, 400
    gen = torch.Generator().manual_seed(1)
    router = ThorRouter(E8, E8, RouterConfig(top_p=1.0, z_loss_coef=0.0),
                        ThorConfig(num_candidates=C, context=False, beta=0.0, gamma=0.0,
                                   delta=0.0)).eval()
    with torch.no_grad():
        router.gate.weight.weight.copy_(torch.eye(E8))
        router.task_gate.weight.copy_(torch.eye(E8))
    repr_BD = torch.randn(1, E8, generator=gen)
    x_TD = torch.randn(T, E8, generator=gen) * 3
    routing = router(x_TD, _rctx(repr_BD, T))
    cand = set(repr_BD[0].topk(C).indices.tolist())
    assert all(s <= cand for s in slots(routing))
    unguarded, _ = top_p_select(routing.probs_TE, 1.0)
    leaks = sum(bool({int(i) for i in row if i >= 0} - cand) for row in unguarded)
    assert leaks > 0, "the edge case did not occur: the guard is not exercised"


def test_routing_statistics() -> None:
    """Tokens a, b plus a padding position each (L = 2). Top-p .5: one expert per real token
    (experts 1 and 2); top-p .7: two. Each expert is a candidate of one sentence; candidate
    usage = used (sentence, candidate) pairs / 4."""
    x_TD = torch.stack([X_TD[0], torch.zeros(E), X_TD[1], torch.zeros(E)])
    pad_BL = torch.tensor([[False, True], [False, True]])
    for p, per_token, counts, usage in [(0.5, 1.0, [0, 1, 1, 0], 0.5),
                                        (0.7, 2.0, [1, 1, 1, 1], 1.0)]:
        stats = _router(token_routing="topp", top_p=p)(x_TD, _rctx(REPR_BD, 2, pad_BL)).stats
        assert float(stats["experts_per_token"]) == per_token
        assert stats["tokens_per_expert"].tolist() == counts
        assert stats["candidates_per_expert"].tolist() == [1, 1, 1, 1]
        assert float(stats["candidate_usage"]) == usage
    # a sentence of padding only (a filler row) is no real sentence
    pad_BL = torch.tensor([[False, True], [True, True]])
    stats = _router(token_routing="topp", top_p=0.5)(x_TD, _rctx(REPR_BD, 2, pad_BL)).stats
    assert stats["candidates_per_expert"].tolist() == [1, 1, 0, 0]
    assert float(stats["candidate_usage"]) == 0.5 and float(stats["experts_per_token"]) == 1.0


# ---------------------------------------------------------------------------------------------
# 5: task representations (TaskPredictor) and infuse


def _predictor(task_repr: str = "mixed", alpha: float = 0.5) -> TaskPredictor:
    """D = K = 2, W^p = identity (P^t = softmax of the max-pool), EMB1 = ((1, 2), (3, 4))."""
    pred = TaskPredictor(2, 2, ThorConfig(num_tasks=2, task_repr=task_repr, alpha=alpha))
    with torch.no_grad():
        pred.proj.weight.copy_(torch.eye(2))
        pred.task_embed_KD.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    return pred


# Sentence 0 max-pools to (ln 3, 0): P^t = (3/4, 1/4). Sentence 1's real positions max-pool to
# (0, ln 2): P^t = (1/3, 2/3); its padding position holds 100s, which must not win the max.
X_BSD = torch.tensor([[[math.log(3), -1.0], [0.0, 0.0], [-2.0, -5.0]],
                      [[0.0, -3.0], [-1.0, math.log(2)], [100.0, 100.0]]])
PAD_BS = torch.tensor([[False, False, False], [False, False, True]])


def _pctx(gold: list[int] | None) -> ForwardContext:
    return ForwardContext(src_pad_mask_BS=PAD_BS,
                          domain_ids_B=None if gold is None else torch.tensor(gold))


@pytest.mark.parametrize("task_repr, gold, want", [
    # 3/4 (1,2) + 1/4 (3,4); 1/3 (1,2) + 2/3 (3,4)
    ("mixed", [0, 0], [[1.5, 2.5], [7 / 3, 10 / 3]]),
    ("infuse", [0, 0], [[1.5, 2.5], [7 / 3, 10 / 3]]),  # infuse uses the mixed E_p
    ("argmax", [0, 0], [[1.0, 2.0], [3.0, 4.0]]),  # argmax P^t: tasks 0 and 1
    ("gold", [1, 0], [[3.0, 4.0], [1.0, 2.0]]),  # the gold rows, whatever P^t says
    ("mixed", None, [[1.5, 2.5], [7 / 3, 10 / 3]]),  # inference: no gold needed
])
def test_task_representations(task_repr: str, gold: list[int] | None,
                              want: list[list[float]]) -> None:
    extras, aux = _predictor(task_repr)(X_BSD, _pctx(gold))
    _close(extras[TASK_PROBS_KEY], [[3 / 4, 1 / 4], [1 / 3, 2 / 3]])
    _close(extras[TASK_REPR_KEY], want)
    assert extras[TASK_EMB_KEY].shape == (2, 2)
    if gold is None:
        assert GOLD_TASK_KEY not in extras and aux == {}
    else:
        assert extras[GOLD_TASK_KEY].tolist() == gold


def test_gold_representation_without_gold_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="gold.*domain"):
        _predictor("gold")(X_BSD, _pctx(None))


def test_task_prediction_loss_is_alpha_times_cross_entropy() -> None:
    """L_tp (Eq. 10), gold (0, 0): mean(-ln 3/4, -ln 1/3) = (ln 4/3 + ln 3) / 2 = ln 2."""
    _, aux = _predictor(alpha=0.5)(X_BSD, _pctx([0, 0]))
    assert set(aux) == {"thor_task"}
    assert abs(aux["thor_task"].detach().item() - 0.5 * math.log(2)) < 1e-6
    _, aux = _predictor(alpha=0.0)(X_BSD, _pctx([0, 0]))
    assert aux == {}


def test_out_of_range_gold_task_is_an_error() -> None:
    with pytest.raises(ConfigError, match="num_tasks"):
        _predictor()(X_BSD, _pctx([0, 2]))


def test_infuse_routes_from_x_plus_e_p_over_all_experts() -> None:
    """infuse: no task router, router input x + E_p. x = ln(1,1,1,1) and E_p = ln(.1,.2,.3,.4)
    give logits ln(.1,.2,.3,.4): top-p .95 needs all four experts (.4+.3+.2 = .9 < .95), each
    with its raw probability; sentence 1 (E_p = ln(.4,.3,.2,.1)) the mirror image."""
    router = _router(token_routing="topp", top_p=0.95, task_repr="infuse")
    assert router.task_gate is None and not router.candidates
    x_TD = torch.zeros(2, E)
    repr_BD = torch.stack([ln(.1, .2, .3, .4), ln(.4, .3, .2, .1)])
    rctx = _rctx(repr_BD, 1)
    torch.testing.assert_close(router.router_input(x_TD, rctx)[0], x_TD + repr_BD)
    routing = router(x_TD, rctx)
    assert slots(routing) == [{0, 1, 2, 3}, {0, 1, 2, 3}]
    _close(dense(routing), [[.1, .2, .3, .4], [.4, .3, .2, .1]])
    # top-p .5 picks from all experts: 3 and 2 for sentence 0 (outside any task "S^t").
    routing = _router(token_routing="topp", top_p=0.5, task_repr="infuse")(x_TD, rctx)
    assert slots(routing) == [{2, 3}, {0, 1}]


def test_router_without_sentence_ids_or_task_repr_says_what_it_needs() -> None:
    router = _router()
    with pytest.raises(ValueError, match="RoutingContext"):
        router(X_TD, None)
    with pytest.raises(ValueError, match=TASK_REPR_KEY):
        router(X_TD, RoutingContext.from_batch(2, 1))


# ---------------------------------------------------------------------------------------------
# 6: context gate


# Encoder, B = 2, L = 3; sentence 1's last position is padding (100s, left out of the mean).
# Both sentences have the masked source mean H_ctx = (1, 1, 1, 1).
XC_TD = torch.tensor([[3.0, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 3],
                      [2.0, 2, 0, 0], [0, 0, 2, 2], [100.0, 100, 100, 100]])
PADC_BL = torch.tensor([[False, False, False], [False, False, True]])


def _context_router(gate: str, **thor: object) -> ThorRouter:
    return _router(context=True, context_gate=gate, **thor)


def test_vector_context_gate_on_the_encoder() -> None:
    """W^g = 0, b^g = (0, ln 3, -ln 3, 0): g = (1/2, 3/4, 1/4, 1/2) for every token. Token 0:
    g*(3,0,0,0) + (1-g)*(1,1,1,1) = (2, 1/4, 3/4, 1/2)."""
    router = _context_router("vector")
    assert router.context_gate.weight.shape == (D, 2 * D)
    with torch.no_grad():
        router.context_gate.weight.zero_()
        router.context_gate.bias.copy_(torch.tensor([0.0, math.log(3), -math.log(3), 0.0]))
    h_TD, _ = router.router_input(XC_TD, _rctx(REPR_BD, 3, PADC_BL))
    g = torch.tensor([.5, .75, .25, .5])
    torch.testing.assert_close(h_TD[0], torch.tensor([2.0, .25, .75, .5]))
    torch.testing.assert_close(h_TD[:5], g * XC_TD[:5] + (1 - g) * torch.ones(4))


def test_scalar_context_gate_reads_x_and_h_ctx() -> None:
    """W^g (2D -> 1) reads x_0 + H_ctx_3 (weight 1 at columns 0 and D+3), b^g = -4. Token 0:
    3 + 1 - 4 = 0, g = 1/2: (3,0,0,0)/2 + (1,1,1,1)/2 = (2, 1/2, 1/2, 1/2). Token 3: 2 + 1 - 4
    = -1, g = sigmoid(-1) on every dimension."""
    router = _context_router("scalar")
    assert router.context_gate.weight.shape == (1, 2 * D)
    with torch.no_grad():
        router.context_gate.weight.zero_()
        router.context_gate.weight[0, 0] = 1.0
        router.context_gate.weight[0, D + 3] = 1.0
        router.context_gate.bias.fill_(-4.0)
    h_TD, _ = router.router_input(XC_TD, _rctx(REPR_BD, 3, PADC_BL))
    torch.testing.assert_close(h_TD[0], torch.tensor([2.0, .5, .5, .5]))
    s = 1 / (1 + math.e)
    torch.testing.assert_close(h_TD[3], s * XC_TD[3] + (1 - s) * torch.ones(4))


@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_context_gate_initialisation(gate: str) -> None:
    """"xavier" (default, b^g = 0): a random gate around one half; "open" with b^g = 2: W^g = 0
    and every token's g is sigmoid(2) on every dimension, so the router reads 0.88 x +
    0.12 H_ctx; the mean gate over real tokens is a routing statistic."""
    torch.manual_seed(0)
    xavier = _context_router(gate)
    assert xavier.context_gate.weight.abs().sum() > 0
    assert torch.equal(xavier.context_gate.bias, torch.zeros_like(xavier.context_gate.bias))
    router = _context_router(gate, context_gate_init="open", context_gate_bias=2.0)
    assert torch.equal(router.context_gate.weight, torch.zeros_like(router.context_gate.weight))
    rctx = _rctx(REPR_BD, 3, PADC_BL)
    h_TD, g_TX = router.router_input(XC_TD, rctx)
    s = 1 / (1 + math.exp(-2.0))
    torch.testing.assert_close(g_TX, torch.full_like(g_TX, s))
    torch.testing.assert_close(h_TD[:3], s * XC_TD[:3] + (1 - s) * torch.ones(4))
    torch.testing.assert_close(router(XC_TD, rctx).stats["context_gate_mean"], torch.tensor(s))
    assert "context_gate_mean" not in _router()(X_TD, _rctx(REPR_BD, 1)).stats


def test_context_gate_init_is_checked() -> None:
    with pytest.raises(ConfigError, match="thor.context_gate_init"):
        ThorConfig(context_gate_init="zeros")


def test_gold_representation_needs_the_hierarchy() -> None:
    """Without candidate sets nothing reads E_p, yet gold would need each test sentence's task."""
    with pytest.raises(ConfigError, match="thor.task_repr: expected mixed or argmax when "
                                          "thor.hierarchy is false"):
        ThorConfig(task_repr="gold", hierarchy=False)
    ThorConfig(task_repr="argmax", hierarchy=False)  # harmless: the same routing as mixed


def test_decoder_context_is_the_inclusive_causal_prefix_mean() -> None:
    """Decoder, b^g = 0 (g = 1/2). Sentence 0: x = (4,0,0,0), (0,4,0,0), (0,0,0,8); prefix
    means (4,0,0,0), (2,2,0,0), (4/3,4/3,0,8/3); router inputs (4,0,0,0), (1,3,0,0),
    (2/3,2/3,0,16/3). Sentence 1: (2,2,2,2), padding (50s), padding: H_ctx stays (2,2,2,2)."""
    router = _context_router("vector")
    with torch.no_grad():
        router.context_gate.weight.zero_()
        router.context_gate.bias.zero_()
    x_TD = torch.tensor([[4.0, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 8],
                         [2.0, 2, 2, 2], [50.0, 50, 50, 50], [50.0, 50, 50, 50]])
    pad_BL = torch.tensor([[False, False, False], [False, True, True]])
    h_TD, _ = router.router_input(x_TD, _rctx(REPR_BD, 3, pad_BL, side="decoder"))
    want = [[4, 0, 0, 0], [1, 3, 0, 0], [2 / 3, 2 / 3, 0, 16 / 3], [2, 2, 2, 2]]
    _close(h_TD[:4], want)
    _close(h_TD[4:], [[26, 26, 26, 26]] * 2)  # padding's own input: (50 + 2) / 2 (never routed)


def test_experts_receive_x_not_the_context_fused_input() -> None:
    """An MoE layer over a context THOR router whose gate leans on H_ctx (g ~ 0.12): every
    expert row is an unfused token state, and the output is sum_k w_k * e_k(x)."""
    torch.manual_seed(0)
    router = _context_router("vector", token_routing="topp", top_p=0.9)
    with torch.no_grad():
        router.context_gate.bias.fill_(-2.0)
    experts = Experts(E, D, 8)
    layer = MoELayer(router, LocalDispatcher(E), experts).eval()
    seen: list[torch.Tensor] = []
    experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    x_BLD = torch.randn(2, 3, D)
    ctx = ForwardContext(src_pad_mask_BS=PADC_BL, extras={TASK_REPR_KEY: REPR_BD})
    y_BLD, _ = layer(x_BLD, ctx)
    x_TD = x_BLD.reshape(6, D)
    rctx = _rctx(REPR_BD, 3, PADC_BL)
    fused_TD, _ = router.router_input(x_TD, rctx)
    assert (fused_TD - x_TD).abs().max() > 0.1  # the check below can tell them apart
    routing = router(x_TD, rctx)
    real = [t for t in range(6) if not PADC_BL.view(-1)[t]]
    n_slots = sum(len(slots(routing)[t]) for t in real)
    assert seen[0].shape == (n_slots, D)
    for row in seen[0]:
        assert (x_TD - row).abs().amax(-1).min() == 0.0
    for t in range(6):
        want = torch.zeros(D)
        if t in real:
            for e, w in zip(routing.expert_ids_TK[t].tolist(), routing.weights_TK[t].tolist()):
                if e >= 0:
                    counts = torch.zeros(E, dtype=torch.long)
                    counts[e] = 1
                    want += w * experts(x_TD[t:t + 1], counts)[0]
        torch.testing.assert_close(y_BLD.reshape(6, D)[t], want, rtol=0, atol=1e-6)


def test_other_lang_task_is_the_non_pivot_side_of_each_pair() -> None:
    """OD-2: with task_source other_lang the gold task is the language that is not the pivot
    (En->XX and XX->En of one language share a task); build takes the pivot id from the data."""
    from moe_train.config import load_config

    from moe_train.models.build import build_model
    from moe_train.models.context import ForwardContext

    overrides = ["model.d_model=8", "model.n_heads=2", "model.ffn_dim=16", "model.encoder_layers=2",
                 "model.decoder_layers=2", "moe.num_experts=4", "moe.encoder_router=thor",
                 "moe.decoder_router=thor", "thor.num_candidates=2", "thor.task_source=other_lang"]
    manifest = {"vocab_size": 20, "pad_id": 0, "domains": ["d"], "langs": ["de", "en", "fr"]}
    model = build_model(load_config(None, overrides), manifest)
    predictor = next(m for m in model.modules() if isinstance(m, TaskPredictor))
    assert (predictor.num_tasks, predictor.pivot_lang_id) == (3, 1)
    ctx = ForwardContext(src_lang_B=torch.tensor([1, 0, 1, 2]), tgt_lang_B=torch.tensor([0, 1, 2, 1]))
    assert predictor.gold_tasks(ctx).tolist() == [0, 0, 2, 2]  # en-de, de-en, en-fr, fr-en
    with pytest.raises(ConfigError, match="thor.pivot_lang: expected one of the data's languages"):
        build_model(load_config(None, [*overrides, "thor.pivot_lang=xx"]), manifest)
