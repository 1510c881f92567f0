"""Gated Adapters (seed 004) on hand-computed cases: the soft gate (Eq. 3) and its temperature,
the encoder's masked source mean and the decoder's inclusive prefix mean, the batched adapters
against a per-domain loop, the layer output sum_e g_e A_e(x), and the gate losses (Eqs. 4-5).

The gate is set to the identity (D = E = 4), so W_g agg(x) = agg(x) and every expected value
below follows from the inputs by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_train.config import GatedConfig, RouterConfig, load_config
from moe_train.errors import ConfigError
from moe_train.models.context import StateCell
from moe_train.moe import losses
from moe_train.moe.adapters import AdapterExperts, AdapterSlot
from moe_train.moe.dispatcher import DenseDispatcher
from moe_train.moe.gated_router import TEACHER_PROBS_KEY, GatedRouter
from moe_train.moe.layer import MoELayer
from moe_train.moe.routing import TARGET_TOKENS_KEY, RoutingContext

D = E = 4
TOKENS = {TARGET_TOKENS_KEY: 10}  # the batch's real target tokens: the encoder loss normaliser
# Sentence 0: three real tokens; sentence 1: one real token, then padding (50s).
X_TD = torch.tensor([[4.0, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 8],
                     [2.0, 2, 2, 2], [50.0, 50, 50, 50], [50.0, 50, 50, 50]])
PAD_BL = torch.tensor([[False, False, False], [False, True, True]])


pytestmark = pytest.mark.usefixtures("one_thread")


def _router(**gated: object) -> GatedRouter:
    router = GatedRouter(D, E, RouterConfig(), GatedConfig(**gated))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(E))
    return router.eval()


def _rctx(side: str = "encoder", task_ids_B: torch.Tensor | None = None,
          **extras: torch.Tensor) -> RoutingContext:
    """Two sentences of three positions (PAD_BL), extras by key."""
    return RoutingContext.from_batch(2, 3, pad_mask_BT=PAD_BL, side=side, extras=extras,
                                     task_ids_B=task_ids_B)


def test_encoder_gate_is_one_softmax_of_the_masked_source_mean_per_sentence() -> None:
    """Sentence 0: mean (4/3, 4/3, 0, 8/3); sentence 1: (2, 2, 2, 2) (padding left out), so
    its gate is uniform. Weights sum to 1, every token of a sentence has its sentence's gate,
    and all four adapters are used by every token, in expert order."""
    routing = _router()(X_TD, _rctx())
    mean0 = torch.tensor([4 / 3, 4 / 3, 0, 8 / 3])
    want0 = (mean0 / 2.0).softmax(-1)  # beta = 2
    for t in range(3):
        torch.testing.assert_close(routing.weights_TK[t], want0)
    torch.testing.assert_close(routing.weights_TK[3], torch.full((4,), 0.25))
    torch.testing.assert_close(routing.weights_TK.sum(-1), torch.ones(6))
    assert torch.equal(routing.expert_ids_TK, torch.arange(4).expand(6, 4))
    assert routing.aux_losses == {}
    assert routing.stats["tokens_per_expert"].tolist() == [4, 4, 4, 4]  # the real tokens
    assert "routing_entropy" not in routing.stats  # logged for training steps only
    train_stats = _router(gate_loss="none").train()(X_TD, _rctx()).stats
    assert train_stats["tokens_per_expert"].tolist() == [4, 4, 4, 4]
    assert 0 < train_stats["routing_entropy"] < math.log(4)


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0, 8.0])
def test_gate_follows_the_temperature(beta: float) -> None:
    """softmax(agg / beta): a higher temperature flattens the gate (lower max weight)."""
    w = _router(temperature=beta)(X_TD, _rctx()).weights_TK[0]
    agg = torch.tensor([4 / 3, 4 / 3, 0, 8 / 3])
    torch.testing.assert_close(w, torch.softmax(agg / beta, -1))
    e = math.exp
    assert abs(w[3].item() - e(8 / 3 / beta) / (2 * e(4 / 3 / beta) + 1 + e(8 / 3 / beta))) < 1e-6


def test_decoder_gate_at_position_t_is_the_mean_over_1_to_t() -> None:
    """Sentence 0 prefix means: (4,0,0,0), (2,2,0,0), (4/3,4/3,0,8/3); sentence 1: (2,2,2,2)."""
    routing = _router(temperature=1.0)(X_TD, _rctx("decoder"))
    means = [[4, 0, 0, 0], [2, 2, 0, 0], [4 / 3, 4 / 3, 0, 8 / 3], [2, 2, 2, 2]]
    torch.testing.assert_close(routing.weights_TK[:4], torch.tensor(means).softmax(-1))


def test_incremental_decoder_gate_continues_the_running_mean() -> None:
    """Three single-position steps with the slot's state cell give the full pass's gates."""
    router = _router()
    full = router(X_TD[:3], RoutingContext.from_batch(1, 3, side="decoder")).weights_TK
    cell = StateCell()
    steps = [router(X_TD[t:t + 1], RoutingContext.from_batch(1, 1, side="decoder", offset=t,
                                                             state=cell)).weights_TK
             for t in range(3)]
    torch.testing.assert_close(torch.cat(steps), full)


def test_batched_adapters_equal_a_per_domain_loop_and_the_grouped_path() -> None:
    torch.manual_seed(0)
    experts = AdapterExperts(3, 8, 5)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)
    x_TD = torch.randn(7, 8)
    y_ETD = experts(x_TD, None)
    assert y_ETD.shape == (3, 7, 8)
    for e in range(3):  # A_e(x) = up(relu(down(LN_e(x)))) with adapter e's own LayerNorm
        z = F.layer_norm(x_TD, (8,), experts.ln_weight_ED[e], experts.ln_bias_ED[e])
        h = torch.relu(z @ experts.w_down_EDR[e] + experts.b_down_ER[e])
        torch.testing.assert_close(y_ETD[e], h @ experts.w_up_ERD[e] + experts.b_up_ED[e])
    grouped = experts(x_TD.repeat(3, 1), torch.full((3,), 7))
    torch.testing.assert_close(y_ETD.reshape(21, 8), grouped)
    # Gradients agree with the grouped-GEMM path too.
    w_ETD = torch.randn(3, 7, 8)
    g1 = torch.autograd.grad((experts(x_TD, None) * w_ETD).sum(), list(experts.parameters()))
    g2 = torch.autograd.grad((experts(x_TD.repeat(3, 1), torch.full((3,), 7)).view(3, 7, 8)
                              * w_ETD).sum(), list(experts.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_gated_slot_output_is_x_plus_the_gate_weighted_adapters() -> None:
    """o = x + sum_e g_e A_e(x) at real tokens; padding passes unchanged."""
    torch.manual_seed(1)
    experts = AdapterExperts(E, D, 3)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)
    router = _router()
    slot = AdapterSlot(MoELayer(router, DenseDispatcher(E), experts, dropout=0.0)).eval()
    from moe_train.models.context import ForwardContext

    ctx = ForwardContext(src_pad_mask_BS=PAD_BL)
    out_BLD, aux = slot(X_TD.view(2, 3, D), ctx)
    g_TE = router(X_TD, _rctx()).weights_TK
    want_TD = X_TD + torch.einsum("te,etd->td", g_TE, experts(X_TD, None))
    torch.testing.assert_close(out_BLD.view(6, D)[:4], want_TD[:4])
    torch.testing.assert_close(out_BLD.view(6, D)[4:], X_TD[4:])
    assert aux == {}


def test_dense_dispatcher_needs_one_slot_per_expert() -> None:
    routing = _router()(X_TD, _rctx())
    with pytest.raises(ValueError, match="one per expert"):
        DenseDispatcher(5).dispatch(X_TD, routing)


TEACHER_BE = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> float:
    p_t = torch.softmax(teacher_logits / tau, -1)
    return float((p_t * (p_t.log() - torch.log_softmax(student_logits / tau, -1))).sum())


@pytest.mark.parametrize("as_logits", [False, True])
def test_kd_loss_encoder_is_alpha_tau2_kl_per_sentence(as_logits: bool) -> None:
    """Encoder rows are sentences: KL(teacher_tau || softmax(agg / tau)) summed over the two
    real sentences per real target token of the batch (the reference code, OD-G4), or averaged
    over sentences (encoder_loss_norm sentences); the teacher softened from log p or from p."""
    router = _router(alpha=0.5, tau=0.5, teacher_as_logits=as_logits).train()
    routing = router(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE}, **TOKENS))
    aggs = [torch.tensor([4 / 3, 4 / 3, 0, 8 / 3]), torch.full((4,), 2.0)]
    t_logits = TEACHER_BE if as_logits else TEACHER_BE.log()
    kl_sum = _kl(aggs[0], t_logits[0], 0.5) + _kl(aggs[1], t_logits[1], 0.5)
    want = 0.5 * 0.5 ** 2 * kl_sum / 10
    assert abs(routing.aux_losses["gad_gate_kd"].item() - want) < 1e-6
    per_sentence = _router(alpha=0.5, tau=0.5, teacher_as_logits=as_logits,
                           encoder_loss_norm="sentences").train()
    assert abs(per_sentence(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE})).aux_losses[
        "gad_gate_kd"].item() - 0.5 * 0.5 ** 2 * kl_sum / 2) < 1e-6
    # The gate temperature beta does not enter the distillation (it is W_g agg / tau).
    other = _router(alpha=0.5, tau=0.5, teacher_as_logits=as_logits, temperature=7.0).train()
    assert abs(other(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE}, **TOKENS)).aux_losses[
        "gad_gate_kd"].item() - want) < 1e-6
    with pytest.raises(ConfigError, match="encoder_loss_norm"):  # no token count given
        router(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE}))


def test_kd_loss_decoder_averages_every_real_target_position() -> None:
    """Decoder rows are positions: the four real ones, each against its sentence's teacher."""
    router = _router(alpha=1.0, tau=1.0, teacher_as_logits=False).train()
    routing = router(X_TD, _rctx("decoder", **{TEACHER_PROBS_KEY: TEACHER_BE}))
    means = [[4, 0, 0, 0], [2, 2, 0, 0], [4 / 3, 4 / 3, 0, 8 / 3], [2, 2, 2, 2]]
    teachers = [0, 0, 0, 1]
    want = sum(_kl(torch.tensor(m), TEACHER_BE[s].log(), 1.0)
               for m, s in zip(means, teachers)) / 4
    assert abs(routing.aux_losses["gad_gate_kd"].item() - want) < 1e-6


def test_kd_loss_is_zero_when_the_gate_matches_the_teacher() -> None:
    router = _router(tau=1.0, teacher_as_logits=False).train()
    teacher = torch.stack([torch.tensor([4 / 3, 4 / 3, 0, 8 / 3]).softmax(-1),
                           torch.full((4,), 0.25)])
    loss = router(X_TD, _rctx(**{TEACHER_PROBS_KEY: teacher}, **TOKENS)).aux_losses["gad_gate_kd"]
    assert abs(loss.item()) < 1e-6
    assert losses.distillation_kl(torch.zeros(1, 4), torch.full((1, 4), 0.25), 0.1).item() == \
        pytest.approx(0.0, abs=1e-6)


def test_ce_gate_loss_on_the_gold_domain() -> None:
    """gate_loss ce (004 Table 9): alpha * CE(W_g agg, gold) over real rows, normalised as the
    KL is (encoder: per target token); needs the gold."""
    router = _router(gate_loss="ce", alpha=0.5).train()
    assert router.task_source == "domain"
    gold = torch.tensor([3, 1])
    routing = router(X_TD, _rctx(task_ids_B=gold, **TOKENS))
    aggs = torch.stack([torch.tensor([4 / 3, 4 / 3, 0, 8 / 3]), torch.full((4,), 2.0)])
    want = 0.5 * F.cross_entropy(aggs, gold, reduction="sum").item() / 10
    assert abs(routing.aux_losses["gad_gate_ce"].item() - want) < 1e-6
    with pytest.raises(ConfigError, match="gold domain"):
        router(X_TD, _rctx(**TOKENS))
    with pytest.raises(ConfigError, match="adapters.num_experts: domain id 4"):
        router(X_TD, _rctx(task_ids_B=torch.tensor([4, 0]), **TOKENS))


def test_no_gate_loss_in_eval_or_when_off_and_no_kl_training_without_teacher() -> None:
    """Training gates with kl but no teacher (`moe-train train` of a gated config, outside the
    gad recipe) is refused: they would learn from translation alone."""
    with pytest.raises(ConfigError, match="pipeline gad"):
        _router().train()(X_TD, _rctx(**TOKENS))
    assert _router()(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE})).aux_losses == {}  # eval
    for off in ({"gate_loss": "none"}, {"alpha": 0.0}):
        routing = _router(**off).train()(X_TD, _rctx(**{TEACHER_PROBS_KEY: TEACHER_BE}))
        assert routing.aux_losses == {}


def test_teacher_of_the_wrong_width_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="adapters.num_experts"):
        _router().train()(X_TD, _rctx(**{TEACHER_PROBS_KEY: torch.ones(2, 3) / 3}))


def test_config_checks() -> None:
    for bad, field in (({"temperature": 0.0}, "gated.temperature"),
                       ({"gate_loss": "mse"}, "gated.gate_loss"),
                       ({"alpha": -1.0}, "gated.alpha"), ({"tau": 0.0}, "gated.tau"),
                       ({"gad_init": "tag"}, "gated.gad_init"),
                       ({"encoder_loss_norm": "tokens"}, "gated.encoder_loss_norm")):
        with pytest.raises(ConfigError, match=field):
            GatedConfig(**bad)
    with pytest.raises(ConfigError, match="moe.ep_size"):
        load_config(None, ["adapters.num_experts=2", "adapters.router=gated", "moe.ep_size=2",
                           "moe.num_experts=2"])


def test_build_gives_one_gate_per_layer_on_both_sides() -> None:
    """GAD: an adapter slot after every encoder and decoder layer, each with its own gate
    (no sharing) and the dense dispatcher; parameters as 004 counts them (E x D per gate)."""
    from moe_train.models.build import build_model

    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                             "model.encoder_layers=2", "model.decoder_layers=3",
                             "adapters.num_experts=5", "adapters.router=gated",
                             "adapters.sides=both", "adapters.dim=8"])
    model = build_model(cfg, {"vocab_size": 30, "pad_id": 0})
    slots = [m for m in model.modules() if isinstance(m, AdapterSlot)]
    assert len(slots) == 5
    routers = {id(s.moe.router) for s in slots}
    assert len(routers) == 5
    assert all(isinstance(s.moe.dispatcher, DenseDispatcher) for s in slots)
    assert all(s.moe.router.gate.weight.shape == (5, 16) and s.moe.router.gate.bias is None
               for s in slots)


def _train_batch(indices: list[int], split: str = "train", is_padding: bool = False):
    from moe_train.data.batching import Batch

    B = len(indices)
    tok, ids = torch.ones(B, 2, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    return Batch(tok, tok, tok, torch.tensor(indices), ids, ids, ids, ids, 2 * B, 2 * B, 2 * B,
                 is_padding=is_padding, split=split)


def test_teacher_probs_hook_looks_up_training_rows_only(tmp_path) -> None:
    """The hook hands each training batch its sentences' teacher rows (by dataset index);
    dev/test and filler batches get none; a bad file is one DataError naming it."""
    import numpy as np

    from moe_train.errors import DataError
    from moe_train.train.hooks import TeacherProbs

    probs = np.array([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]], dtype=np.float32)
    path = tmp_path / "teacher.npy"
    np.save(path, probs)
    hook = TeacherProbs.from_file(path, num_sentences=3, num_domains=2)
    got = hook.batch_extras(_train_batch([2, 0]))[TEACHER_PROBS_KEY]
    torch.testing.assert_close(got, torch.tensor([[0.5, 0.5], [0.7, 0.3]]))
    assert hook.batch_extras(_train_batch([2, 0], split="dev")) == {}
    assert hook.batch_extras(_train_batch([2, 0], is_padding=True)) == {}
    for bad, needle in ((probs[:2], "one row per training sentence"),
                        (probs * 2, "sum to 1"), (probs[:, :1], "one column per domain")):
        np.save(path, bad)
        with pytest.raises(DataError, match=needle):
            TeacherProbs.from_file(path, num_sentences=3, num_domains=2)
    path.write_bytes(b"not numpy")
    with pytest.raises(DataError, match=str(path)):
        TeacherProbs.from_file(path, num_sentences=3, num_domains=2)


def test_batches_name_their_split(tmp_path) -> None:
    from moe_train.data.batching import collate

    class Split:
        split = "dev"
        domain_ids = src_lang_ids = tgt_lang_ids = corpus_ids = [0, 0]

        def src(self, i):
            return [5, 6]

        def tgt(self, i):
            return [7]

    assert collate(Split(), [1, 0], pad_id=0, bos_id=1, eos_id=2).split == "dev"
