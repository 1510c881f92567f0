"""Router aux losses and statistics (moe/losses.py) against hand-computed values.

Shape legend: T tokens, E experts, K expert slots per token.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_train.moe.losses import (
    cv_squared, entropy_loss, importance_load_losses, load_balance_loss, prob_in_top_k,
    routing_entropy, tokens_per_expert, z_loss)

# Four real tokens (E = 4), top-1 choices 0, 0, 0, 1.
PROBS_TE = torch.tensor([[0.7, 0.1, 0.1, 0.1],
                         [0.5, 0.3, 0.1, 0.1],
                         [0.4, 0.2, 0.2, 0.2],
                         [0.1, 0.6, 0.2, 0.1]])
IDS_TK = torch.tensor([[0], [0], [0], [1]])
# A padded fifth token with extreme values that must not matter.
PAD_PROBS_TE = torch.cat([PROBS_TE, torch.tensor([[0.0, 0.0, 0.0, 1.0]])])
PAD_IDS_TK = torch.cat([IDS_TK, torch.tensor([[3]])])
PAD_MASK_T = torch.tensor([False, False, False, False, True])


def test_tokens_per_expert_ignores_unused_slots_and_padding() -> None:
    ids_TK = torch.tensor([[0, 1], [1, -1], [3, 0], [2, 2]])
    assert tokens_per_expert(ids_TK, 4).tolist() == [2, 2, 2, 1]
    pad_T = torch.tensor([False, False, False, True])
    assert tokens_per_expert(ids_TK, 4, pad_T).tolist() == [2, 2, 0, 1]
    assert tokens_per_expert(ids_TK, 5).tolist() == [2, 2, 2, 1, 0]
    assert tokens_per_expert(torch.empty(0, 2, dtype=torch.long), 3).tolist() == [0, 0, 0]


def test_load_balance_is_one_for_uniform_assignments() -> None:
    # Every expert gets one of the four tokens: f = 1/4 each, so the loss is sum_e P_e = 1.
    ids_TK = torch.tensor([[0], [1], [2], [3]])
    assert load_balance_loss(PROBS_TE, ids_TK).item() == pytest.approx(1.0)
    uniform_TE = torch.full((4, 4), 0.25)
    assert load_balance_loss(uniform_TE, ids_TK).item() == pytest.approx(1.0)
    # Top-2 with every expert used twice is uniform too.
    ids2_TK = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert load_balance_loss(PROBS_TE, ids2_TK).item() == pytest.approx(1.0)


def test_load_balance_skewed_hand_value() -> None:
    # f = [3/4, 1/4, 0, 0]; P = column means = [0.425, 0.3, 0.15, 0.125].
    expected = 4 * (0.75 * 0.425 + 0.25 * 0.3)  # 1.575
    assert load_balance_loss(PROBS_TE, IDS_TK).item() == pytest.approx(expected)
    # Full collapse onto one expert with one-hot probabilities reaches E.
    onehot_TE = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert load_balance_loss(onehot_TE, torch.zeros(4, 1, dtype=torch.long)).item() == \
        pytest.approx(4.0)


def test_load_balance_excludes_padding_and_unused_slots() -> None:
    assert load_balance_loss(PAD_PROBS_TE, PAD_IDS_TK, PAD_MASK_T).item() == \
        pytest.approx(1.575)
    assert load_balance_loss(PAD_PROBS_TE, PAD_IDS_TK).item() != pytest.approx(1.575)
    # Top-p style: slots with id -1 are not assignments. Assignments 0, 1, 2 -> f = 1/3 each.
    ids_TK = torch.tensor([[0, 1], [2, -1]])
    probs_TE = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]])
    expected = 4 * (0.3 + 0.2 + 0.4) / 3
    assert load_balance_loss(probs_TE, ids_TK).item() == pytest.approx(expected)


def test_load_balance_gradient_is_e_f_over_t() -> None:
    probs_TE = PAD_PROBS_TE.clone().requires_grad_()
    load_balance_loss(probs_TE, PAD_IDS_TK, PAD_MASK_T).backward()
    # d/dP[t, e] = E * f_e / T_real for real tokens, 0 for the pad token.
    row = torch.tensor([4 * 0.75 / 4, 4 * 0.25 / 4, 0.0, 0.0])
    assert torch.allclose(probs_TE.grad[:4], row.expand(4, 4))
    assert torch.equal(probs_TE.grad[4], torch.zeros(4))


def test_z_loss_hand_values() -> None:
    logits_TE = torch.tensor([[0.0, 0.0, 0.0, 0.0],
                              [0.0, math.log(2), math.log(3), math.log(4)],
                              [50.0, 0.0, 0.0, 0.0]])
    # logsumexp: log 4, log(1+2+3+4) = log 10; the third row is padding.
    expected = (math.log(4) ** 2 + math.log(10) ** 2) / 2
    pad_T = torch.tensor([False, False, True])
    assert z_loss(logits_TE, pad_T).item() == pytest.approx(expected, rel=1e-6)
    assert z_loss(logits_TE[:2]).item() == pytest.approx(expected, rel=1e-6)


def test_entropy_loss_hand_values_and_finite_gradient() -> None:
    probs_TE = torch.tensor([[0.25, 0.25, 0.25, 0.25],
                             [1.0, 0.0, 0.0, 0.0],
                             [0.5, 0.5, 0.0, 0.0],
                             [0.1, 0.2, 0.3, 0.4]], requires_grad=True)
    pad_T = torch.tensor([False, False, False, True])
    loss = entropy_loss(probs_TE, pad_T)
    assert loss.item() == pytest.approx((math.log(4) + 0.0 + math.log(2)) / 3, rel=1e-6)
    loss.backward()
    assert torch.isfinite(probs_TE.grad).all()
    # d/dP (-P log P) = -(log P + 1), averaged over 3 real tokens; pad row gets none.
    assert probs_TE.grad[0, 0].item() == pytest.approx(-(math.log(0.25) + 1) / 3, rel=1e-5)
    assert torch.equal(probs_TE.grad[3], torch.zeros(4))


def test_routing_entropy_is_detached_entropy() -> None:
    probs_TE = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]], requires_grad=True)
    stat = routing_entropy(probs_TE)
    assert not stat.requires_grad
    expected = (math.log(2) - sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))) / 2
    assert stat.item() == pytest.approx(expected, rel=1e-6)


def test_all_padding_gives_zero_losses_still_on_graph() -> None:
    logits_TE = torch.randn(3, 4, requires_grad=True)
    probs_TE = logits_TE.softmax(-1)
    ids_TK = probs_TE.argmax(-1, keepdim=True)
    pad_T = torch.ones(3, dtype=torch.bool)
    total = (load_balance_loss(probs_TE, ids_TK, pad_T) + z_loss(logits_TE, pad_T)
             + entropy_loss(probs_TE, pad_T))
    assert total.item() == 0.0
    total.backward()
    assert torch.equal(logits_TE.grad, torch.zeros(3, 4))


def test_cv_squared_hand_values() -> None:
    assert cv_squared(torch.tensor([1.0, 3.0])).item() == pytest.approx(0.25)  # var 1, mean 2
    assert cv_squared(torch.tensor([2.0, 2.0, 2.0])).item() == 0.0
    assert cv_squared(torch.tensor([5.0])).item() == 0.0


def test_prob_in_top_k_matches_redrawing_one_experts_noise() -> None:
    """Shazeer et al.'s P(x, i): expert i's noise drawn again, the others' kept as drawn."""
    torch.manual_seed(0)
    clean_NE = torch.tensor([[1.0, 0.5, 0.2, -0.3, 0.8]])
    std_NE = torch.tensor([[0.5, 1.0, 0.7, 0.4, 0.9]])
    noisy_NE = clean_NE + torch.randn(1, 5) * std_NE
    k, draws = 2, 200_000
    got = prob_in_top_k(clean_NE, noisy_NE, std_NE, k)[0]
    for i in range(5):
        redrawn_DE = noisy_NE.repeat(draws, 1)
        redrawn_DE[:, i] = clean_NE[0, i] + torch.randn(draws) * std_NE[0, i]
        in_top = (redrawn_DE.topk(k, dim=-1).indices == i).any(-1).float().mean()
        assert got[i].item() == pytest.approx(in_top.item(), abs=0.005), i
    assert torch.equal(prob_in_top_k(clean_NE, noisy_NE, std_NE, 5), torch.ones(1, 5))


def test_importance_and_load_losses_over_real_rows() -> None:
    gates_NE = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.7, 0.3], [0.9, 0.1, 0.0]])
    clean_NE = torch.tensor([[1.0, 0.5, -1.0], [-1.0, 0.8, 0.2], [2.0, 0.0, -2.0]])
    std_NE = torch.ones(3, 3)
    pad_N = torch.tensor([False, False, True])  # the third row is padding: left out
    importance, load = importance_load_losses(gates_NE, clean_NE, clean_NE, std_NE, 2, pad_N)
    assert importance.item() == pytest.approx(cv_squared(torch.tensor([0.6, 1.1, 0.3])).item())
    expected_E = prob_in_top_k(clean_NE[:2], clean_NE[:2], std_NE[:2], 2).sum(0)
    assert load.item() == pytest.approx(cv_squared(expected_E).item())
