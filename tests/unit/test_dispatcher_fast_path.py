"""Sentence-level dispatch fast path: sorting B*K sentence slots gives the token path's rows.

Shape legend: B sentences, L positions per sentence, T = B*L tokens, K slots, E experts,
N routed rows, D model dim.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from moe_train.config import RouterConfig
from moe_train.kernels.permute import sort_sentence_slots, sort_slots
from moe_train.models.context import ForwardContext
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import Experts
from moe_train.moe.layer import MoELayer
from moe_train.moe.registry import build_router
from moe_train.moe.routing import Routing

E = 5
permute_module = importlib.import_module("moe_train.kernels.permute")  # the package re-exports
# a function of the same name


def sentence_ids(B: int, L: int, K: int, seed: int, pad_from: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BK, ids_TK): K distinct experts per sentence, broadcast to its L tokens; positions
    at or past pad_from[b] are padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    ids_BK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    ids_TK = ids_BK.repeat_interleave(L, dim=0)
    for b, start in enumerate(pad_from or []):
        ids_TK[b * L + start:(b + 1) * L] = -1
    return ids_BK, ids_TK


@pytest.mark.parametrize("B,L,K,pad_from", [
    (1, 4, 1, None), (3, 4, 2, [4, 2, 1]), (4, 1, 2, [1, 0, 1, 1]), (6, 3, 1, [3, 3, 0, 1, 2, 3]),
    (2, 5, 3, [5, 0]),
])
def test_sentence_sort_equals_token_sort(B, L, K, pad_from):
    ids_BK, ids_TK = sentence_ids(B, L, K, seed=B * 10 + L, pad_from=pad_from)
    fast = sort_sentence_slots(ids_TK, ids_BK, E)
    assert fast is not None
    row_map, counts = sort_slots(ids_TK, E)
    assert torch.equal(fast[0], row_map) and torch.equal(fast[1], counts)


def test_hand_computed_sentence_order():
    """Sentences (L=2) choose [2, 0], [0, 1], [2, 1]; sentence 1's second token is padding.
    Expert 0: sentence 0 slot 1 (flat slots 1, 3), sentence 1 slot 0 (slot 4); expert 1:
    sentence 1 slot 1 (5), sentence 2 slot 1 (9, 11); expert 2: sentences 0 and 2, slot 0."""
    ids_BK = torch.tensor([[2, 0], [0, 1], [2, 1]])
    ids_TK = ids_BK.repeat_interleave(2, dim=0)
    ids_TK[3] = -1
    row_map, counts = sort_sentence_slots(ids_TK, ids_BK, 3)
    assert row_map.tolist() == [1, 3, 4, 5, 9, 11, 0, 2, 8, 10]
    assert counts.tolist() == [3, 3, 4]


def test_other_forms_fall_back_to_the_token_sort():
    ids_BK, ids_TK = sentence_ids(3, 4, 2, seed=1)
    changed = ids_TK.clone()
    changed[5, 1] = (changed[5, 1] + 1) % E  # one token leaves its sentence's experts
    assert sort_sentence_slots(changed, ids_BK, E) is None
    assert sort_sentence_slots(ids_TK[:-1], ids_BK, E) is None  # T not a multiple of B
    assert sort_sentence_slots(ids_TK, ids_BK[:, :1], E) is None  # K differs
    repeated_BK = torch.tensor([[1, 1], [0, 2], [3, 4]])  # a sentence names an expert twice
    assert sort_sentence_slots(repeated_BK.repeat_interleave(4, 0), repeated_BK, E) is None


class TokenPathDispatcher(LocalDispatcher):
    """The reference: LocalDispatcher with the sentence fast path switched off."""

    def dispatch(self, x_TD, routing, drop=True):
        return super().dispatch(x_TD, dataclasses.replace(routing, sentence_expert_ids_BK=None),
                                drop)


def _layer_pair(router_name: str, k: int, **cfg) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    D = 8
    rcfg = RouterConfig(k=k, **cfg)
    router, experts = build_router(router_name, D, E, rcfg), Experts(E, D, 16)
    fast = MoELayer(router, LocalDispatcher(E), experts)
    slow = MoELayer(router, TokenPathDispatcher(E), experts)
    return fast, slow


@pytest.mark.parametrize("router_name,k,cfg", [
    ("sentence", 1, {}), ("sentence", 2, {}),
    ("task", 2, {"num_tasks": 3, "task_source": "task_ids"}),
    ("task", 2, {"assignment": [[0, 3], [4, 1], [2, 0]], "task_source": "task_ids"}),
])
def test_layer_fast_path_equals_token_path(router_name, k, cfg, monkeypatch):
    """Outputs, aux losses and every gradient are equal with and without the fast path, with
    padding; and the fast path is taken (the token sort is not called)."""
    fast, slow = _layer_pair(router_name, k, **cfg)
    pad = torch.tensor([[False, False, False, True], [False, True, True, True],
                        [False, False, False, False]])
    ctx = ForwardContext(src_pad_mask_BS=pad, side="encoder", task_ids_B=torch.tensor([2, 0, 1]))
    x = torch.randn(3, 4, 8)
    seen = {}
    fast.router.register_forward_hook(lambda m, i, out: seen.update(routing=out))
    results = []
    token_sorts = []
    monkeypatch.setattr(permute_module, "sort_slots",
                        lambda *a, **kw: token_sorts.append(1) or sort_slots(*a, **kw))
    for layer in (fast, slow):
        calls = len(token_sorts)
        layer.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_(True)
        y, aux = layer(x_leaf, ctx)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().add(sum(aux.values(), 0.0)) \
            .backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        results.append((y, x_leaf.grad, grads, layer.tokens_per_expert_E.clone()))
        assert len(token_sorts) - calls == (0 if layer is fast else 1)
    routing: Routing = seen["routing"]
    assert routing.sentence_expert_ids_BK is not None
    ids_TK = routing.expert_ids_TK.masked_fill(pad.reshape(-1, 1), -1)
    assert sort_sentence_slots(ids_TK, routing.sentence_expert_ids_BK, E) is not None
    (y0, dx0, g0, c0), (y1, dx1, g1, c1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(c0, c1)
    assert g0.keys() == g1.keys() and len(g0) >= 4
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_capacity_takes_the_token_path():
    """With a capacity factor slots are dropped token by token: the fast path does not apply
    and the result is the token path's, drops included."""
    ids_BK, ids_TK = sentence_ids(4, 6, 1, seed=3)
    ids_BK[:] = 2  # every sentence to expert 2: capacity ceil(24 / 5) = 5 keeps 5 of 24
    ids_TK[:] = 2
    routing = Routing(expert_ids_TK=ids_TK, weights_TK=torch.ones(24, 1), probs_TE=None,
                      num_experts=E, sentence_expert_ids_BK=ids_BK)
    x = torch.randn(24, 3)
    disp = LocalDispatcher(E, capacity_factor=1.0)
    x_ND, counts, meta = disp.dispatch(x, routing)
    ref_ND, _, ref_meta = TokenPathDispatcher(E, 1.0).dispatch(x, routing)
    assert counts.tolist() == [0, 0, 5, 0, 0] and int(meta.dropped) == 19
    assert torch.equal(x_ND, ref_ND) and torch.equal(meta.row_map_N, ref_meta.row_map_N)
    assert torch.equal(x_ND, x[:5])
