"""Routing plumbing: the context means (prefix_mean / context_mean) by hand, their incremental
state in the decoder cache (StateCell, continued step by step and reordered with the beams),
per-sentence extras following the beams, and the trainer hooks (train/hooks.py)."""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.data.batching import Batch
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext, StateCell
from moe_train.models.layers import DecoderLayerCache
from moe_train.models.transformer import EncoderOut, ModelOutput
from moe_train.moe.routing import PrefixMeanState, RoutingContext, context_mean, prefix_mean
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_EMB_KEY, TASK_PROBS_KEY, TASK_REPR_KEY
from moe_train.train.hooks import HookList, InitModel, TaskAccuracy, TrainerHooks, hooks_for

# B = 3 decoder rows of L = 3 positions, D = 2, right-padded (the 100s are padding):
#   row 0: (2,0) (0,2) (4,4)      -> prefix means (2,0) (1,1) (2,2)
#   row 1: (1,1) (3,-1) pad       -> (1,1) (2,0) (2,0)   padding adds nothing
#   row 2: pad pad pad            -> zeros (no real position yet: a finished beam row)
X_BLD = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [4.0, 4.0]],
                      [[1.0, 1.0], [3.0, -1.0], [100.0, 100.0]],
                      [[100.0, 100.0], [100.0, 100.0], [100.0, 100.0]]])
PAD_BL = torch.tensor([[False, False, False], [False, False, True], [True, True, True]])
PREFIX_BLD = torch.tensor([[[2.0, 0.0], [1.0, 1.0], [2.0, 2.0]],
                           [[1.0, 1.0], [2.0, 0.0], [2.0, 0.0]],
                           [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])


def _rctx(pad_BL: torch.Tensor, side: str = "decoder", **kw) -> RoutingContext:
    B, L = pad_BL.shape
    return RoutingContext.from_batch(B, L, pad_mask_BT=pad_BL, side=side, **kw)


def test_prefix_mean_by_hand() -> None:
    got = prefix_mean(X_BLD.reshape(9, 2), _rctx(PAD_BL))
    torch.testing.assert_close(got.view(3, 3, 2), PREFIX_BLD, rtol=0, atol=0)
    assert context_mean(X_BLD.reshape(9, 2), _rctx(PAD_BL)).equal(got)  # decoder side


def test_encoder_context_is_the_masked_source_mean() -> None:
    """Every position gets its sentence's mean over real positions: (2,2), (2,0), zeros."""
    got = context_mean(X_BLD.reshape(9, 2), _rctx(PAD_BL, side="encoder")).view(3, 3, 2)
    want = torch.tensor([[2.0, 2.0], [2.0, 0.0], [0.0, 0.0]])[:, None].expand(3, 3, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunks", [(1, 1, 1), (2, 1), (1, 2), (3,)])
def test_incremental_prefix_mean_continues_the_full_cumsum(chunks: tuple[int, ...]) -> None:
    cell, start, outs = StateCell(), 0, []
    assert cell.value is None
    for n in chunks:
        pad = PAD_BL[:, start:start + n]
        rctx = _rctx(pad, offset=start, state=cell)
        outs.append(prefix_mean(X_BLD[:, start:start + n].reshape(-1, 2), rctx).view(3, n, 2))
        start += n
        assert isinstance(cell.value, PrefixMeanState)
    torch.testing.assert_close(torch.cat(outs, 1), PREFIX_BLD, rtol=0, atol=0)
    # the state holds sum and count of the real positions: (6,6)/3, (4,0)/2, 0/0
    torch.testing.assert_close(cell.value.sum_BD, torch.tensor([[6.0, 6.0], [4.0, 0.0], [0, 0]]))
    assert cell.value.count_B.tolist() == [3.0, 2.0, 0.0]


def test_state_follows_reordered_rows() -> None:
    """After two steps the rows are reordered to (1, 0, 0) (beam search: row 0 continues row
    1's hypothesis, rows 1 and 2 both row 0's). Third tokens: (6,6), (-2,4), padding.
      row 0: ((1,1)+(3,-1)+(6,6)) / 3 = (10/3, 2)
      row 1: ((2,0)+(0,2)+(-2,4)) / 3 = (0, 2)
      row 2: ((2,0)+(0,2)) / 2 = (1, 1)"""
    cell = StateCell()
    for t in range(2):
        prefix_mean(X_BLD[:, t], _rctx(PAD_BL[:, t:t + 1], offset=t, state=cell))
    cell.reorder(torch.tensor([1, 0, 0]))
    z_BD = torch.tensor([[6.0, 6.0], [-2.0, 4.0], [100.0, 100.0]])
    pad_B1 = torch.tensor([[False], [False], [True]])
    got = prefix_mean(z_BD, _rctx(pad_B1, offset=2, state=cell))
    torch.testing.assert_close(got, torch.tensor([[10 / 3, 2.0], [0.0, 2.0], [1.0, 1.0]]))


def test_state_cell_and_layer_cache_reorder() -> None:
    cell = StateCell()
    cell.reorder(torch.tensor([0, 0]))  # empty: nothing to reorder
    assert cell.value is None
    cache = DecoderLayerCache()
    cache.ffn_state.value = PrefixMeanState(torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, 2.0]))
    cache.reorder(torch.tensor([1, 1, 0]))  # repeat and reorder, as beam expansion does
    assert cache.ffn_state.value.sum_BD.view(-1).tolist() == [2.0, 2.0, 1.0]
    assert cache.ffn_state.value.count_B.tolist() == [2.0, 2.0, 1.0]
    assert cache.adapter_state.value is None


def _thor_model(*extra: str) -> torch.nn.Module:
    cfg = load_config(None, ["model.d_model=8", "model.n_heads=2", "model.ffn_dim=16",
                             "model.encoder_layers=1", "model.decoder_layers=2",
                             "model.dropout=0.0", "moe.num_experts=4", "moe.layers=every_other",
                             "moe.encoder_router=thor", "moe.decoder_router=thor",
                             "thor.num_tasks=3", "thor.num_candidates=2", *extra])
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": 12, "pad_id": 0}).eval()


@pytest.mark.parametrize("context", [True, False])
@torch.no_grad()
def test_decoder_cache_holds_state_only_for_context_thor_layers(context: bool) -> None:
    """every_other: decoder layer 1 is THOR, layer 0 dense. Only a context router keeps a state;
    it counts the real positions decoded (row 1 fed padding at step 2)."""
    model = _thor_model(f"thor.context={str(context).lower()}")
    src = torch.tensor([[5, 6, 2], [7, 2, 0]])
    enc = model.encode(src, ForwardContext())
    cache = model.new_decoder_cache()
    model.decode(torch.tensor([[1], [1]]), enc, None, cache)
    model.decode(torch.tensor([[4], [0]]), enc, None, cache)
    assert cache.layers[0].ffn_state.value is None  # dense layer 0
    state = cache.layers[1].ffn_state.value
    if context:
        assert isinstance(state, PrefixMeanState) and state.count_B.tolist() == [2.0, 1.0]
    else:
        assert state is None


def test_per_sentence_extras_follow_the_beams() -> None:
    """ForwardContext / EncoderOut.index_select reorder the per-sentence THOR extras (keys with
    a batch suffix) and pass the task-embedding table (K x D, no batch dimension) through."""
    table_KD = torch.arange(6.0).view(3, 2)
    extras = {TASK_PROBS_KEY: torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]),
              TASK_REPR_KEY: torch.tensor([[1.0, 1.0], [2.0, 2.0]]),
              GOLD_TASK_KEY: torch.tensor([0, 1]), TASK_EMB_KEY: table_KD}
    index = torch.tensor([1, 1, 0])
    for moved in (ForwardContext(extras=extras).index_select(index).extras,
                  EncoderOut(torch.zeros(2, 1, 2), torch.zeros(2, 1, dtype=torch.bool),
                             extras=extras).index_select(index).extras):
        assert moved[GOLD_TASK_KEY].tolist() == [1, 1, 0]
        assert moved[TASK_REPR_KEY][:, 0].tolist() == [2.0, 2.0, 1.0]
        assert moved[TASK_PROBS_KEY].argmax(-1).tolist() == [1, 1, 0]
        assert moved[TASK_EMB_KEY] is table_KD


# ---------------------------------------------------------------------------------------------
# Trainer hooks


def _batch(B: int = 3, is_padding: bool = False) -> Batch:
    tok = torch.ones(B, 2, dtype=torch.long)
    ids = torch.zeros(B, dtype=torch.long)
    return Batch(tok, tok, tok, torch.arange(B), ids, ids, ids, ids, 2 * B, 2 * B, 2 * B,
                 is_padding=is_padding)


def _out(extras: dict) -> ModelOutput:
    return ModelOutput(torch.zeros(1, 1, 1), {}, extras)


class _Hook(TrainerHooks):
    def __init__(self, tag: str, calls: list[str], metric_names: tuple[str, ...] = (),
                 extras=None, losses=None, metrics=None) -> None:
        self.tag, self.calls = tag, calls
        self.metric_names = metric_names
        self._extras, self._losses, self._metrics = extras or {}, losses or {}, metrics or {}

    def init_model(self, model):
        self.calls.append(self.tag)

    def batch_extras(self, batch):
        return dict(self._extras)

    def extra_losses(self, out, batch):
        return dict(self._losses)

    def metrics(self, out, batch):
        return dict(self._metrics)


def test_base_hooks_do_nothing() -> None:
    hook, batch = TrainerHooks(), _batch()
    hook.init_model(torch.nn.Linear(1, 1))
    assert hook.batch_extras(batch) == {} and hook.extra_losses(_out({}), batch) == {}
    assert hook.metrics(_out({}), batch) == {} and hook.metric_names == ()


def test_hook_list_merges_in_order() -> None:
    calls: list[str] = []
    one = _Hook("one", calls, ("m1",), extras={"a_B": 1}, losses={"l1": torch.tensor(1.0)},
                metrics={"m1": (1.0, 2.0)})
    two = _Hook("two", calls, ("m2", "m3"), extras={"b": 2}, losses={"l2": torch.tensor(2.0)},
                metrics={"m2": (3.0, 4.0)})
    hooks = HookList([one, two])
    assert hooks.metric_names == ("m1", "m2", "m3")
    hooks.init_model(torch.nn.Linear(1, 1))
    assert calls == ["one", "two"]
    batch, out = _batch(), _out({})
    assert hooks.batch_extras(batch) == {"a_B": 1, "b": 2}
    losses = hooks.extra_losses(out, batch)
    assert {k: float(v) for k, v in losses.items()} == {"l1": 1.0, "l2": 2.0}
    assert hooks.metrics(out, batch) == {"m1": (1.0, 2.0), "m2": (3.0, 4.0)}
    assert HookList([]).batch_extras(batch) == {} and HookList([]).metric_names == ()


@pytest.mark.parametrize("what, method", [("extra", "batch_extras"), ("loss", "extra_losses"),
                                          ("metric", "metrics")])
def test_hook_list_rejects_a_name_given_twice(what: str, method: str) -> None:
    kw = {"batch_extras": "extras", "extra_losses": "losses", "metrics": "metrics"}[method]
    value = {"shared": (1.0, 1.0)}
    hooks = HookList([_Hook("a", [], **{kw: value}), _Hook("b", [], **{kw: {"x": (0.0, 1.0)}}),
                      _Hook("c", [], **{kw: value})])
    args = (_batch(),) if method == "batch_extras" else (_out({}), _batch())
    with pytest.raises(ValueError, match=f"two hooks return {what} 'shared'"):
        getattr(hooks, method)(*args)


def test_init_model_calls_the_function_with_the_model() -> None:
    seen = []
    model = torch.nn.Linear(2, 2)
    InitModel(seen.append).init_model(model)
    assert seen == [model]
    assert InitModel(seen.append).metrics(_out({}), _batch()) == {}


def test_task_accuracy_counts_correct_predictions() -> None:
    hook = TaskAccuracy()
    assert hook.metric_names == ("task_accuracy",)
    probs_BK = torch.tensor([[.7, .2, .1], [.2, .3, .5], [.1, .8, .1], [.4, .5, .1]])
    gold_B = torch.tensor([0, 2, 0, 1])  # argmax 0, 2, 1, 1: three right
    out = _out({TASK_PROBS_KEY: probs_BK, GOLD_TASK_KEY: gold_B})
    assert hook.metrics(out, _batch(4)) == {"task_accuracy": (3.0, 4.0)}
    # nothing to count: no predictor, no gold task, or a filler batch (evaluation lockstep)
    assert hook.metrics(_out({TASK_PROBS_KEY: probs_BK}), _batch(4)) == {}
    assert hook.metrics(_out({GOLD_TASK_KEY: gold_B}), _batch(4)) == {}
    assert hook.metrics(out, _batch(4, is_padding=True)) == {}


def test_hooks_for_adds_task_accuracy_for_thor_only() -> None:
    extra = _Hook("x", [], ("m",))
    thor = load_config(None, ["moe.num_experts=4", "moe.encoder_router=thor",
                              "thor.num_candidates=2"])
    hooks = hooks_for(thor, [extra])
    assert [type(h) for h in hooks.hooks] == [TaskAccuracy, _Hook]
    assert hooks.metric_names == ("task_accuracy", "m")
    plain = hooks_for(load_config(None, ["moe.num_experts=4"]), [extra])
    assert plain.hooks == [extra] and plain.metric_names == ("m",)
