"""MoE layer and local dispatcher against per-token references; capacity; model integration."""

import pytest
import torch

from moe_train.config import RouterConfig, load_config
from moe_train.errors import ConfigError
from moe_train.models.build import build_model, moe_layers
from moe_train.models.context import ForwardContext
from moe_train.moe.dispatcher import DenseDispatcher, LocalDispatcher, apply_capacity
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router
from moe_train.moe.routing import Routing


def _routing(ids, weights, E):
    ids = torch.tensor(ids)
    return Routing(expert_ids_TK=ids, weights_TK=torch.tensor(weights, dtype=torch.float32),
                   probs_TE=None, num_experts=E)


def _reference(x_TD, experts: Experts, ids_TK, weights_TK):
    """y[t] = sum_k w[t,k] * FFN_{e(t,k)}(x[t]), one token at a time."""
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        for k in range(ids_TK.size(1)):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            h = torch.relu(x_TD[t] @ experts.w1_EDF[e] + experts.b1_EF[e])
            out[t] += weights_TK[t, k] * (h @ experts.w2_EFD[e] + experts.b2_ED[e])
    return out


@pytest.mark.parametrize("ids", [
    [[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]],        # spread
    [[0, -1], [0, -1], [0, -1], [0, -1], [0, -1]],   # everything to one expert, k=1 slots
    [[2, 1], [-1, -1], [1, 2], [2, 1], [1, 2]],      # empty experts and a fully dropped token
])
def test_local_dispatch_combine_equals_reference(ids):
    torch.manual_seed(0)
    E, D = 4, 8
    experts = Experts(E, D, 16)
    x = torch.randn(5, D)
    w = torch.rand(5, 2)
    routing = _routing(ids, w.tolist(), E)
    disp = LocalDispatcher(E)
    x_ND, counts_E, meta = disp.dispatch(x, routing)
    assert int(counts_E.sum()) == sum(e >= 0 for row in ids for e in row)
    assert int(meta.dropped) == 0
    y = disp.combine(experts(x_ND, counts_E), meta)
    torch.testing.assert_close(y, _reference(x, experts, routing.expert_ids_TK, w),
                               atol=1e-5, rtol=1e-5)


def test_capacity_drops_overflow_in_token_order():
    ids = torch.tensor([[0], [0], [0], [0], [1], [0], [2], [0]])
    kept, dropped = apply_capacity(ids, num_experts=4, capacity_factor=1.0)  # capacity 2
    assert kept.view(-1).tolist() == [0, 0, -1, -1, 1, -1, 2, -1]
    assert int(dropped) == 4
    kept, dropped = apply_capacity(ids, num_experts=4, capacity_factor=4.0)  # capacity 8
    assert torch.equal(kept, ids) and int(dropped) == 0


def test_capacity_counts_routed_slots_only():
    """Unused slots (-1: top-p's short rows, padding) take no capacity: 4 routed of 8 slots."""
    ids = torch.tensor([[0, -1], [0, -1], [0, -1], [1, -1]])
    kept, dropped = apply_capacity(ids, num_experts=2, capacity_factor=1.0)  # ceil(4 / 2) = 2
    assert kept.tolist() == [[0, -1], [0, -1], [-1, -1], [1, -1]] and int(dropped) == 1


def test_capacity_serves_every_first_choice_before_any_second():
    """GShard's order: token 2 and 3 keep their first expert, which the second choices of
    tokens 0 and 1 would have taken in plain token order."""
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    kept, dropped = apply_capacity(ids, num_experts=2, capacity_factor=0.5)  # capacity 2
    assert kept.tolist() == [[0, -1], [0, -1], [1, -1], [1, -1]] and int(dropped) == 4
    kept, _ = apply_capacity(ids, num_experts=2, capacity_factor=0.75)  # capacity 3
    assert kept.tolist() == [[0, 1], [0, -1], [1, 0], [1, -1]]


def test_dropless_never_drops_under_total_imbalance():
    torch.manual_seed(0)
    E, D, T = 8, 6, 64
    routing = _routing([[3]] * T, [[1.0]] * T, E)
    x_ND, counts_E, meta = LocalDispatcher(E).dispatch(torch.randn(T, D), routing)
    assert counts_E.tolist() == [0, 0, 0, T, 0, 0, 0, 0] and int(meta.dropped) == 0
    capped = LocalDispatcher(E, capacity_factor=1.0)
    _, counts_E, meta = capped.dispatch(torch.randn(T, D), routing)
    assert counts_E.tolist()[3] == T // E and int(meta.dropped) == T - T // E


def test_capacity_limit_applies_while_training_only():
    """Training drops the overflow; evaluation (and so decoding) is dropless and equals the
    per-token reference."""
    torch.manual_seed(0)
    E, D, T = 4, 8, 32
    router = build_router("switch", D, E, RouterConfig(k=1))
    with torch.no_grad():
        router.gate.weight.weight.zero_()
        router.gate.weight.weight[2] = 1.0  # every token (all features > 0) prefers expert 2
    layer = MoELayer(router, LocalDispatcher(E, capacity_factor=1.0), Experts(E, D, 16))
    x = torch.randn(1, T, D).abs()
    ctx = ForwardContext(side="encoder")
    layer.train()
    layer(x, ctx)
    assert int(layer.dropped_slots) == T - T // E
    y, _ = layer.eval()(x, ctx)
    assert int(layer.dropped_slots) == 0
    routing = router.route(x.reshape(T, D))
    ref = _reference(x.reshape(T, D), layer.experts, routing.expert_ids_TK, routing.weights_TK)
    torch.testing.assert_close(y.reshape(T, D), ref, atol=1e-5, rtol=1e-5)


def test_moe_layer_skips_padding_and_matches_reference():
    torch.manual_seed(0)
    E, D = 4, 8
    router = build_router("topk", D, E, RouterConfig(k=2))
    layer = MoELayer(router, LocalDispatcher(E), Experts(E, D, 16)).eval()
    x = torch.randn(2, 3, D)
    pad = torch.tensor([[False, False, True], [False, False, False]])
    y, aux = layer(x, ForwardContext(src_pad_mask_BS=pad, side="encoder"))
    assert set(aux) == {"load_balance", "z_loss"}
    assert torch.all(y[0, 2] == 0)  # padding is not routed
    assert int(layer.tokens_per_expert_E.sum()) == 5 * 2
    routing = router.route(x.reshape(6, D))
    ref = _reference(x.reshape(6, D), layer.experts, routing.expert_ids_TK, routing.weights_TK)
    torch.testing.assert_close(y.reshape(6, D)[[0, 1, 3, 4, 5]], ref[[0, 1, 3, 4, 5]],
                               atol=1e-5, rtol=1e-5)


def test_the_layers_dropout_runs_in_training_only():
    """MoELayer's output dropout (model.dropout): evaluation and decoding stay deterministic."""
    torch.manual_seed(0)
    E, D = 4, 8
    layer = MoELayer(build_router("topk", D, E, RouterConfig(k=2)), LocalDispatcher(E),
                     Experts(E, D, 16), dropout=0.5)
    x, ctx = torch.randn(2, 5, D), ForwardContext(side="encoder")
    layer.eval()
    assert torch.equal(layer(x, ctx)[0], layer(x, ctx)[0])
    layer.train()
    assert not torch.equal(layer(x, ctx)[0], layer(x, ctx)[0])


def test_model_places_moe_layers_from_config():
    cfg = load_config(overrides=[
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=4",
        "model.decoder_layers=2", "moe.num_experts=4", "moe.decoder_router=task", "moe.k=1",
        "moe.decoder_task_source=tgt_lang", "moe.num_tasks=3"])
    model = build_model(cfg, {"vocab_size": 40, "pad_id": 0})
    names = [n for n, _ in moe_layers(model)]
    assert names == ["encoder_layers.1.ffn", "encoder_layers.3.ffn", "decoder_layers.1.ffn"]
    src = torch.randint(4, 40, (3, 5))
    tgt = torch.randint(4, 40, (3, 4))
    ctx = ForwardContext(tgt_lang_B=torch.tensor([0, 1, 2]))
    out = model(src, tgt, ctx)
    (out.logits_BTV.sum() + sum(out.aux_losses.values())).backward()
    dec = dict(moe_layers(model))["decoder_layers.1.ffn"]
    # the task gate learns through the combine weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in dec.router.parameters())
    with pytest.raises(ConfigError, match="moe.layers: layer 7 does not exist"):
        build_model(load_config(overrides=["moe.num_experts=2", "moe.layers=1,7"]),
                    {"vocab_size": 40, "pad_id": 0})


@pytest.mark.parametrize("override, message", [
    (["moe.num_experts=6", "moe.ep_size=4"], "moe.num_experts: expected a multiple of moe.ep_size"),
    (["moe.num_experts=4", "moe.k=5"], "moe.k: expected at most moe.num_experts (4), got 5"),
    (["moe.num_experts=4", "moe.encoder_router=hash"], "moe.encoder_router: expected dense or one of gated, gshard"),
    (["moe.layers=odd"], "moe.layers: expected every_other, all, or a comma list"),
])
def test_bad_moe_configs_fail_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        cfg = load_config(overrides=override)
        build_model(cfg, {"vocab_size": 40, "pad_id": 0})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ep_size_must_divide_world_size():
    from moe_train.parallel.expert_parallel import setup_expert_parallel
    from moe_train.parallel.runtime import ParallelRuntime

    with pytest.raises(ConfigError, match=r"moe.ep_size: expected a divisor of the world size "
                                          r"\(4\), got 3"):
        setup_expert_parallel(ParallelRuntime(world_size=4), 3)


@pytest.mark.parametrize("override, message", [
    (["moe.decoder_task_source=task_ids"], "moe.decoder_task_source: task_ids, but the prepared "
                                           "data carries no task ids"),
    (["moe.decoder_task_source=lang_pair", "moe.num_tasks=2"],
     "moe.num_tasks: expected at least 9 (tasks by lang_pair"),
])
def test_task_routing_needs_task_ids_in_the_data(override, message):
    from moe_train.parallel.expert_parallel import check_moe_against_data

    cfg = load_config(overrides=["moe.num_experts=4", "moe.decoder_router=task", "moe.k=1",
                                 "moe.num_tasks=3", *override])
    manifest = {"langs": ["de", "en", "fr"], "domains": ["a", "b"]}
    with pytest.raises(ConfigError) as err:
        check_moe_against_data(cfg, manifest)
    assert message in str(err.value) and "\n" not in str(err.value)
    check_moe_against_data(load_config(overrides=["moe.num_experts=4", "moe.decoder_router=task",
                                                  "moe.k=1", "moe.num_tasks=3"]), manifest)


@pytest.mark.parametrize("ids", [
    [[0, 1], [1, 0], [1, 0], [0, 1], [1, 0]],        # each token uses both experts, any order
    [[1, 0], [-1, -1], [0, 1], [1, 0], [-1, -1]],    # and padding
])
def test_dense_dispatch_equals_local_dispatch_bit_for_bit(ids):
    """Where every token uses all E experts, `DenseDispatcher` (no sort) computes the numbers
    `LocalDispatcher` does, bit for bit on CPU, and the same gradients."""
    torch.manual_seed(0)
    E, D = 2, 8
    experts = Experts(E, D, 16)
    x = torch.randn(5, D)
    routing = _routing(ids, torch.rand(5, 2).tolist(), E)
    out = {}
    for disp in (LocalDispatcher(E), DenseDispatcher(E)):
        experts.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        x_ND, counts_E, meta = disp.dispatch(x_in, routing)
        y = disp.combine(experts(x_ND, counts_E), meta)
        y.square().sum().backward()
        out[type(disp).__name__] = (y.detach(), x_in.grad, experts.w1_EDF.grad.clone(),
                                    experts.b2_ED.grad.clone())
    local, dense = out["LocalDispatcher"], out["DenseDispatcher"]
    assert torch.equal(dense[0], local[0])
    pad = torch.tensor([row[0] < 0 for row in ids])
    assert torch.all(dense[0][pad] == 0)
    for got, want in zip(dense[1:], local[1:]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_builder_gives_task_layers_keeping_k_experts_the_dense_dispatcher():
    """A task-routed side with k = E (an extracted sub-network) runs without a sort; token
    routers and task sides with more experts keep the local dispatcher."""
    cfg = load_config(None, ["model.d_model=16", "model.ffn_dim=32", "model.n_heads=2",
                             "model.encoder_layers=1", "model.decoder_layers=1",
                             "moe.num_experts=4", "moe.decoder_num_experts=2", "moe.k=2",
                             "moe.layers=all", "moe.decoder_router=task",
                             "moe.decoder_task_source=tgt_lang"])
    model = build_model(cfg, {"vocab_size": 30, "pad_id": 0, "langs": ["de", "en"],
                              "domains": ["news"]})
    kinds = {name.split("_layers.")[0]: type(layer.dispatcher) for name, layer in moe_layers(model)}
    assert kinds == {"encoder": LocalDispatcher, "decoder": DenseDispatcher}


@pytest.mark.parametrize("factor, routed, experts, capacity", [
    (1.1, 100, 2, 55), (1.1, 50, 5, 11), (1.1, 90, 3, 33), (1.25, 10, 4, 4), (1.0, 7, 2, 4)])
def test_capacity_is_the_ceiling_of_the_exact_product(factor, routed, experts, capacity):
    """ceil(c * routed / E) of the exact value: 1.1 * 100 / 2 is 55, though floating point
    makes it 55.000000000000007 (56 slots before)."""
    ids = torch.zeros(routed, 1, dtype=torch.long)  # every slot to expert 0
    kept, dropped = apply_capacity(ids, num_experts=experts, capacity_factor=factor)
    assert int((kept >= 0).sum()) == capacity and int(dropped) == routed - capacity


def test_entropy_is_logged_only_for_routers_with_probabilities():
    """A fixed task table has no distribution: no entropy statistic (it was logged as 0)."""
    E, D = 4, 8
    x, ctx = torch.randn(2, 3, D), ForwardContext(side="encoder", task_ids_B=torch.tensor([0, 1]))
    topk = MoELayer(build_router("topk", D, E, RouterConfig(k=2)), LocalDispatcher(E),
                    Experts(E, D, 16))
    topk(x, ctx)
    assert float(topk.scalar_stats["routing_entropy"]) > 0
    table = build_router("task", D, E, RouterConfig(k=1, task_source="task_ids",
                                                    assignment=[[0], [3]]))
    fixed = MoELayer(table, LocalDispatcher(E), Experts(E, D, 16))
    fixed(x, ctx)
    assert "routing_entropy" not in fixed.scalar_stats
    assert fixed.tokens_per_expert_E.tolist() == [3, 0, 0, 3]
