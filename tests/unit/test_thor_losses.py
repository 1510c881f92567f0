"""THOR-MoE losses on hand-computed cases (Eqs. 11-13 and the router z-loss), their scaling by
1/num_thor_layers, their absence at coefficient 0, and a tiny THOR model that learns a toy batch.

The router set-up is test_thor_router's (identity gates, D = E = 4, |S^t| = 2). The batch for
the token losses: B = 2 sentences of L = 2 positions, sentence 1's second one padding.
  a  (s0): logits ln(1, 2, 3, 4); over S^t = {0, 1}: q = (1/3, 2/3, 0, 0)
  a2 (s0): logits ln(3, 1, 1, 1); over {0, 1}:      q = (3/4, 1/4, 0, 0)
  b  (s1): logits ln(4, 3, 2, 1); over {2, 3}:      q = (0, 0, 2/3, 1/3)
  pad (s1): logits ln(1, 1, 1, 100) (left out of every loss)
M = 3 real tokens, Q = mean q = (13/36, 11/36, 8/36, 4/36).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import load_config
from moe_train.data.batching import Batch
from moe_train.models.build import build_model, num_thor_layers
from moe_train.models.context import ForwardContext
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_EMB_KEY, TASK_PROBS_KEY, ThorRouter
from moe_train.train.hooks import TaskAccuracy
from tests.unit.test_thor_router import REPR_BD, _rctx, _router, ln

X_TD = torch.stack([ln(1, 2, 3, 4), ln(3, 1, 1, 1), ln(4, 3, 2, 1), ln(1, 1, 1, 100)])
PAD_BL = torch.tensor([[False, False], [False, True]])


pytestmark = pytest.mark.usefixtures("one_thread")


THOR_KEYS = {"thor_task_balance", "thor_token_balance", "thor_topp_entropy", "z_loss"}


def _aux(router: ThorRouter, table_KD: torch.Tensor | None = None) -> dict[str, float]:
    extras = {} if table_KD is None else {TASK_EMB_KEY: table_KD}
    routing = router(X_TD, _rctx(REPR_BD, 2, PAD_BL, **extras))
    return {key: float(value.detach()) for key, value in routing.aux_losses.items()}


@pytest.mark.parametrize("routing, want", [
    # top-1: a -> 1, a2 -> 0, b -> 2: F = (1/3, 1/3, 1/3, 0); sum F Q = (13+11+8)/108 = 8/27;
    # L_bt = |S^t| * 8/27 = 16/27.
    (dict(token_routing="topk", k=1), 16 / 27),
    # top-p .5 takes the same experts (2/3, 3/4, 2/3 >= .5).
    (dict(token_routing="topp", top_p=0.5), 16 / 27),
    # top-2: a, a2 -> {0, 1}, b -> {2, 3}: F = (2/3, 2/3, 1/3, 1/3);
    # sum F Q = (26+22+8+4)/108 = 5/9; L_bt = 10/9.
    (dict(token_routing="topk", k=2), 10 / 9),
])
def test_token_balance_loss(routing: dict, want: float) -> None:
    k, top_p = routing.pop("k", 2), routing.pop("top_p", 0.5)
    aux = _aux(_router(k=k, top_p=top_p, gamma=0.5, loss_scale=0.25, **routing))
    assert set(aux) == {"thor_token_balance"}
    assert abs(aux["thor_token_balance"] - 0.25 * 0.5 * want) < 1e-6


def test_top_p_entropy_loss() -> None:
    """L_topp (Eq. 13), mean over real tokens of the entropy of q:
    H(a) = H(b) = ln 3 - 2/3 ln 2, H(a2) = 2 ln 2 - 3/4 ln 3; mean (5/4 ln 3 + 2/3 ln 2) / 3."""
    want = (5 / 4 * math.log(3) + 2 / 3 * math.log(2)) / 3
    aux = _aux(_router(token_routing="topp", delta=0.5, loss_scale=0.25))
    assert set(aux) == {"thor_topp_entropy"}
    assert abs(aux["thor_topp_entropy"] - 0.25 * 0.5 * want) < 1e-6
    # delta belongs to top-p: the top-k objective (Eq. 14) has no such term
    assert _aux(_router(token_routing="topk", delta=0.5)) == {}


@pytest.mark.parametrize("table, want", [
    # tasks (.4,.3,.2,.1) and (.3,.4,.2,.1): both S = {0, 1}: F = (1, 1, 0, 0),
    # Q = (.35, .35, .2, .1): L_bd = N * .7 = 2.8
    ([ln(.4, .3, .2, .1), ln(.3, .4, .2, .1)], 2.8),
    # (.4,.3,.2,.1) and (.1,.2,.3,.4): F = 1/2 each, Q = 1/4 each: L_bd = 4 * 4 * 1/8 = 2
    ([ln(.4, .3, .2, .1), ln(.1, .2, .3, .4)], 2.0),
])
def test_task_balance_loss(table: list[torch.Tensor], want: float) -> None:
    """L_bd (Eq. 11) over the K task embeddings, independent of the batch's own sentences."""
    table_KD = torch.stack(table).requires_grad_(True)
    router = _router(beta=0.5, loss_scale=0.25).train()
    routing = router(X_TD, _rctx(REPR_BD, 2, PAD_BL, **{TASK_EMB_KEY: table_KD}))
    assert set(routing.aux_losses) == {"thor_task_balance"}
    loss = routing.aux_losses["thor_task_balance"]
    assert abs(float(loss.detach()) - 0.25 * 0.5 * want) < 1e-6
    loss.backward()  # it trains the task embeddings and the task router (uniform F: a
    # constant, sum_e F_e Q_e = |S|/N, so no gradient)
    for grad in (table_KD.grad, router.task_gate.weight.grad):
        assert (grad.abs().sum() > 0) == (want != 2.0), grad
    # evaluation computes the routing only
    assert _aux(router.eval(), table_KD.detach()) == {}


def test_z_loss_is_scaled_too() -> None:
    """z-loss: mean over real tokens of logsumexp(logits)^2 = (2 ln^2 10 + ln^2 6) / 3."""
    aux = _aux(_router(z_loss=0.5, loss_scale=0.25))
    want = (2 * math.log(10) ** 2 + math.log(6) ** 2) / 3
    assert set(aux) == {"z_loss"} and abs(aux["z_loss"] - 0.25 * 0.5 * want) < 1e-5


def test_each_loss_is_absent_at_coefficient_zero() -> None:
    table_KD = torch.stack([ln(.4, .3, .2, .1), ln(.3, .4, .2, .1)])
    names = {"beta": "thor_task_balance", "gamma": "thor_token_balance",
             "delta": "thor_topp_entropy", "z_loss": "z_loss"}
    for off, gone in names.items():
        coefs = {name: (0.0 if name == off else 0.1) for name in names}
        router = _router(token_routing="topp", **coefs).train()
        assert set(_aux(router, table_KD)) == THOR_KEYS - {gone}, off


TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "optim.precision=fp32",
        "moe.num_experts=4", "moe.capacity_factor=0.0", "thor.num_tasks=4",
        "thor.num_candidates=2"]


@pytest.mark.parametrize("layers, want", [
    (["moe.layers=all", "moe.encoder_router=thor", "moe.decoder_router=thor"], 4),
    (["moe.layers=every_other", "moe.encoder_router=thor", "moe.decoder_router=thor"], 2),
    (["moe.layers=all", "moe.encoder_router=topk", "moe.decoder_router=thor"], 2),
])
def test_loss_scale_is_one_over_the_thor_layers(layers: list[str], want: int) -> None:
    cfg = load_config(None, [*TINY, *layers])
    model = build_model(cfg, {"vocab_size": 20, "pad_id": 0})
    routers = [m for m in model.modules() if isinstance(m, ThorRouter)]
    assert num_thor_layers(cfg) == len(routers) == want
    assert all(r.loss_scale == 1.0 / want for r in routers)


# ---------------------------------------------------------------------------------------------
# A tiny THOR model learns a toy batch


V, PAD, BOS, EOS = 40, 0, 1, 2


def _toy_batch() -> Batch:
    """8 sentences, 2 per domain; domain d's sources use tokens 3 + 8d .. 10 + 8d, so the task
    is predictable from the source alone; targets are the source shifted by a domain-dependent
    amount (the same source would translate differently in another domain)."""
    gen = torch.Generator().manual_seed(0)
    domains = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    src = 3 + 8 * domains[:, None] + torch.randint(0, 8, (8, 5), generator=gen)
    tgt = 3 + (src - 3 + 5 * (domains[:, None] + 1)) % 32
    src = torch.cat([src, torch.full((8, 1), EOS)], 1)
    src[6, 3:] = PAD  # ragged
    src[6, 3] = EOS
    tgt_in = torch.cat([torch.full((8, 1), BOS), tgt], 1)
    tgt_out = torch.cat([tgt, torch.full((8, 1), EOS)], 1)
    zeros = torch.zeros(8, dtype=torch.long)
    n_tgt = int(tgt_out.ne(PAD).sum())
    return Batch(src, tgt_in, tgt_out, torch.arange(8), domains, zeros, zeros, zeros,
                 int(src.ne(PAD).sum()), n_tgt, n_tgt)


def test_tiny_thor_model_learns_the_task_and_the_batch() -> None:
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, "moe.layers=all", "moe.encoder_router=thor",
                             "moe.decoder_router=thor", "moe.top_p=0.5", "thor.alpha=1.0"])
    model = build_model(cfg, {"vocab_size": V, "pad_id": PAD}).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = _toy_batch()
    ctx = ForwardContext(domain_ids_B=batch.domain_ids_B)
    hook = TaskAccuracy()
    losses, accuracy = [], []
    for _ in range(30):
        out = model(batch.src_tokens_BS, batch.tgt_in_BT, ctx)
        nll = F.cross_entropy(out.logits_BTV.reshape(-1, V), batch.tgt_out_BT.reshape(-1),
                              ignore_index=PAD)
        assert {"thor_task", *THOR_KEYS} <= set(out.aux_losses)
        loss = nll + sum(out.aux_losses.values())
        right, total = hook.metrics(out, batch)["task_accuracy"]
        losses.append(float(loss.detach()))
        accuracy.append(right / total)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(batch.src_tokens_BS, batch.tgt_in_BT, ForwardContext())  # no gold given
    assert GOLD_TASK_KEY not in out.extras
    predicted = out.extras[TASK_PROBS_KEY].argmax(-1)
    assert predicted.tolist() == batch.domain_ids_B.tolist(), (predicted, accuracy)
    assert accuracy[-1] == 1.0 and accuracy[0] < 1.0, accuracy
    assert losses[-1] < 0.5 * losses[0], losses
