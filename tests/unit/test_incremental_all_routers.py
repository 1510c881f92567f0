"""Incremental decoding (DecoderCache) equals full teacher-forced decoding for every router and
slot kind: token routers (switch, gshard, topk, topp), sentence, task (learned and fixed),
gumbel, the MoA adapters (decoder only and both sides) and the gated adapters (a per-layer
prefix-mean gate kept in the routing state), not only the dense model.

Each model is built from its config by `build_model`, its routed parts randomised so that the
adapters are no identities and sentences go to several experts; fp32, eval mode, dropless. Per position,
the logits of one full `decode` equal those of T single-token cached steps (1e-5), and greedy and
beam search give the same outputs with the cache as with an uncached model that re-decodes the
whole prefix at every step.
"""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.eval.search import beam_search, greedy_search
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext
from moe_train.moe.layer import MoELayer
from moe_train.moe.routing import NUM_LANGS_KEY

V, PAD, BOS, EOS = 40, 0, 1, 2
B, S, T = 4, 7, 6
TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "optim.precision=fp32"]
MOE = ["moe.num_experts=4", "moe.layers=all", "moe.capacity_factor=0.0"]


def _moe(router: str, *extra: str) -> list[str]:
    return [*MOE, f"moe.encoder_router={router}", f"moe.decoder_router={router}", *extra]


VARIANTS = {
    "dense": [],
    "switch": _moe("switch"),
    "gshard": _moe("gshard"),
    "topk k=3": _moe("topk", "moe.k=3"),
    "topp": _moe("topp", "moe.top_p=0.6"),
    "sentence k=1": _moe("sentence", "moe.k=1"),
    "sentence k=2": _moe("sentence", "moe.k=2"),
    "task learned (lang_pair / tgt_lang)": _moe("task", "moe.num_tasks=9", "moe.k=2"),
    "task fixed assignment (domain)": _moe(
        "task", "moe.k=1", "moe.assignment=[[0], [1], [2], [3]]",
        "moe.encoder_task_source=domain", "moe.decoder_task_source=domain"),
    "token encoder, task decoder": [*MOE, "moe.encoder_router=topk", "moe.decoder_router=task",
                                    "moe.num_tasks=9", "moe.k=2"],
    "gumbel moe": _moe("gumbel", "moe.k=2"),
    "adapters single (pre-injected)": ["adapters.num_experts=1", "adapters.dim=4"],
    "adapters gumbel, decoder (MoA)": ["adapters.num_experts=4", "adapters.router=gumbel",
                                       "adapters.k=3", "adapters.dim=4"],
    "adapters gumbel, both sides": ["adapters.num_experts=4", "adapters.router=gumbel",
                                    "adapters.sides=both", "adapters.dim=4"],
    "adapters random (RND control)": ["adapters.num_experts=4", "adapters.router=random",
                                      "adapters.dim=4"],
    "adapters sentence k=2, both sides": ["adapters.num_experts=4", "adapters.router=sentence",
                                          "adapters.k=2", "adapters.sides=both", "adapters.dim=4"],
    "adapters task by domain (ADPT)": ["adapters.num_experts=4", "adapters.router=task",
                                       "adapters.k=1", "adapters.task_source=domain",
                                       "adapters.num_tasks=4", "adapters.sides=both",
                                       "adapters.dim=4"],
    "thor top-2 (mixed, context)": _moe("thor", "moe.num_experts=8", "thor.num_tasks=4",
                                        "thor.num_candidates=4", "thor.token_routing=topk"),
    "thor top-p (argmax, scalar gate)": _moe("thor", "moe.num_experts=8", "thor.num_tasks=4",
                                             "thor.num_candidates=4", "thor.task_repr=argmax",
                                             "thor.context_gate=scalar", "moe.top_p=0.6"),
    "thor top-p infuse, decoder only": [*MOE, "moe.decoder_router=thor", "moe.encoder_router=dense",
                                        "thor.num_tasks=4", "thor.task_repr=infuse"],
    "thor top-p gold, no context": _moe("thor", "thor.num_tasks=4", "thor.num_candidates=3",
                                        "thor.task_repr=gold", "thor.context=false"),
    "gated adapters, both sides (GAD)": ["adapters.num_experts=4", "adapters.router=gated",
                                         "adapters.sides=both", "adapters.dim=8"],
    "gated adapters, decoder, beta 1": ["adapters.num_experts=3", "adapters.router=gated",
                                        "adapters.dim=8", "gated.temperature=1.0"],
    "moe topk + adapters gumbel": [*_moe("topk"), "adapters.num_experts=4",
                                   "adapters.router=gumbel", "adapters.dim=4"],
}


def _model(overrides: list[str]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(load_config(None, [*TINY, *overrides]), {"vocab_size": V, "pad_id": PAD})
    with torch.no_grad():  # adapters start as identities and gates near uniform: make them matter
        for name, p in model.named_parameters():
            if "router" in name and name.endswith("bias"):
                p.zero_()  # a random gate bias tends to send every sentence to one expert
            elif ".adapter." in name or "router" in name or "expert" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch() -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    gen = torch.Generator().manual_seed(1)
    src_BS = torch.randint(3, V, (B, S), generator=gen)
    for b, n in enumerate((S, 5, 3, 6)):  # ragged sources: padding must not leak into routing
        src_BS[b, n - 1] = EOS
        src_BS[b, n:] = PAD
    tgt_BT = torch.randint(3, V, (B, T), generator=gen)
    tgt_BT[:, 0] = BOS
    ctx = ForwardContext(domain_ids_B=torch.tensor([0, 1, 2, 3]), src_lang_B=torch.tensor([0, 1, 2, 0]),
                         tgt_lang_B=torch.tensor([1, 2, 0, 2]), extras={NUM_LANGS_KEY: 3})
    return src_BS, tgt_BT, ctx


class _PrefixCache:
    """The uncached path's 'cache': only the tokens fed so far (reordered like the real one)."""

    def __init__(self) -> None:
        self.tokens_BT: torch.Tensor | None = None

    def reorder(self, index_B: torch.Tensor) -> _PrefixCache:
        self.tokens_BT = self.tokens_BT.index_select(0, index_B)
        return self


class Uncached:
    """The model without incremental state: every step re-decodes the whole prefix in full."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.max_positions = model, model.max_positions

    def encode(self, src_BS, ctx=None):
        return self.model.encode(src_BS, ctx)

    def new_decoder_cache(self) -> _PrefixCache:
        return _PrefixCache()

    def decode(self, tgt_in_BT, enc, ctx=None, cache=None):
        prev = cache.tokens_BT
        cache.tokens_BT = tgt_in_BT if prev is None else torch.cat([prev, tgt_in_BT], dim=1)
        logits_BTV, aux = self.model.decode(cache.tokens_BT, enc, ctx)
        return logits_BTV[:, -tgt_in_BT.size(1):], aux


@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_incremental_equals_full_decoding(name: str) -> None:
    model = _model(VARIANTS[name])
    src_BS, tgt_BT, ctx = _batch()
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    used: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, a, o: used.append(mod.tokens_per_expert_E.clone()))
             for m in moe_layers]
    enc = model.encode(src_BS, ctx)
    full_BTV, _ = model.decode(tgt_BT, enc, ctx)
    for h in hooks:
        h.remove()
    if name != "dense":
        assert moe_layers, "the variant built no routed layer"
        # Routing is exercised: several experts get tokens (one for the single adapter).
        wanted = min(2, moe_layers[0].tokens_per_expert_E.numel())
        assert any(int((u > 0).sum()) >= wanted for u in used), [u.tolist() for u in used]

    cache = model.new_decoder_cache()
    steps = [model.decode(tgt_BT[:, t:t + 1], enc, ctx, cache)[0] for t in range(T)]
    inc_BTV = torch.cat(steps, dim=1)
    assert cache.length == T
    err_T = (inc_BTV - full_BTV).abs().amax(dim=(0, 2))
    assert float(err_T.max()) <= 1e-5, f"{name}: max |incremental - full| per position {err_T.tolist()}"
    # The same holds for the forward pass training uses.
    torch.testing.assert_close(model(src_BS, tgt_BT, ctx).logits_BTV, full_BTV, rtol=0, atol=1e-5)

    # ragged limits (source length + 2): sentences finish at different steps and leave the
    # batch, so every router's decoding state is also pruned, not only reordered
    kwargs = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=1.0, max_len_b=2, ctx=ctx)
    greedy = greedy_search(model, src_BS, **kwargs)
    assert greedy == greedy_search(Uncached(model), src_BS, **kwargs)
    assert any(greedy), "greedy produced only empty outputs: the check would be vacuous"
    for beam in (1, 3):
        cached = beam_search(model, src_BS, beam=beam, lenpen=1.0, **kwargs)
        assert cached == beam_search(Uncached(model), src_BS, beam=beam, lenpen=1.0, **kwargs)
        if beam == 1:
            assert cached == greedy  # fairseq rule: beam 1 is greedy


def test_variants_cover_every_registered_router() -> None:
    from moe_train.moe.registry import ROUTERS

    text = " ".join(" ".join(v) for v in VARIANTS.values())
    for router in ROUTERS:
        assert f"router={router}" in text or router == "single" and "adapters.num_experts=1" in text


@torch.no_grad()
def test_incremental_equals_full_decoding_with_a_capacity_limit() -> None:
    """A capacity limit drops slots while training only: decoding stays dropless, so a token's
    output does not depend on the rest of the batch (B*T tokens teacher-forced, B per step)."""
    model = _model(_moe("switch", "moe.capacity_factor=1.0"))
    src_BS, tgt_BT, ctx = _batch()
    enc = model.encode(src_BS, ctx)
    full_BTV, _ = model.decode(tgt_BT, enc, ctx)
    cache = model.new_decoder_cache()
    inc_BTV = torch.cat([model.decode(tgt_BT[:, t:t + 1], enc, ctx, cache)[0] for t in range(T)], 1)
    torch.testing.assert_close(inc_BTV, full_BTV, rtol=0, atol=1e-5)



THOR_TOPP_CONTEXT = _moe("thor", "moe.num_experts=8", "thor.num_tasks=4", "thor.num_candidates=4",
                         "moe.top_p=0.6")  # top-p, mixed E_p, vector context gate (defaults)


class _Recorder:
    """A search model around `inner` that keeps the last-position logits of every decode step
    (and takes its caches from `new_cache`)."""

    def __init__(self, inner, new_cache=None) -> None:
        self.inner, self.max_positions, self.steps = inner, inner.max_positions, []
        self.new_decoder_cache = new_cache or inner.new_decoder_cache

    def encode(self, src_BS, ctx=None):
        return self.inner.encode(src_BS, ctx)

    def decode(self, tgt_in_BT, enc, ctx=None, cache=None):
        logits_BTV, aux = self.inner.decode(tgt_in_BT, enc, ctx, cache)
        self.steps.append(logits_BTV[:, -1].clone())
        return logits_BTV, aux


@torch.no_grad()
def test_thor_beam_routing_state_follows_parent_swaps(monkeypatch) -> None:
    """THOR top-p with context in the decoder keeps the causal context mean in the cache. Beam
    search reorders it with the KV caches: at some step a hypothesis continues another row's
    prefix (a parent swap) whose running context sum differs from its own, and the cached
    search still gives, step by step, the logits (1e-5) and outputs of re-decoding every prefix
    in full. With the state left unreordered the logits do differ (the check is sensitive)."""
    from moe_train.models.context import StateCell
    from moe_train.moe.routing import PrefixMeanState
    from moe_train.moe.thor_router import ThorRouter

    model = _model(THOR_TOPP_CONTEXT)
    routers = [m.router for m in model.decoder_layers.modules() if isinstance(m, MoELayer)]
    assert routers and all(isinstance(r, ThorRouter) and r.thor.context
                           and r.thor.token_routing == "topp" for r in routers)
    src_BS, _, ctx = _batch()
    swaps: list[tuple[int, int, int]] = []  # (step, row, parent) whose states differ

    def recording_cache():
        cache = model.new_decoder_cache()
        reorder, seen = cache.reorder, []

        def record(index_N: torch.Tensor):
            states = [layer.ffn_state.value for layer in cache.layers]
            sums = [s.sum_BD for s in states if isinstance(s, PrefixMeanState)]
            assert len(sums) == len(routers)  # every decoder THOR layer keeps its state
            for row, parent in enumerate(index_N.tolist()):  # step 0 only fans out beam 0
                if seen and parent != row and any(not torch.equal(s[row], s[parent])
                                                  for s in sums):
                    swaps.append((len(seen), row, parent))
            seen.append(index_N)
            return reorder(index_N)
        cache.reorder = record
        return cache

    kwargs = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=1.0, max_len_b=4, ctx=ctx,
                  beam=4, lenpen=1.0)  # ragged limits: finished sentences leave the batch
    cached, full = _Recorder(model, recording_cache), _Recorder(Uncached(model))
    assert beam_search(cached, src_BS, **kwargs) == beam_search(full, src_BS, **kwargs)
    assert swaps, "no hypothesis changed parent: the beam test would be vacuous"
    rows = [step.shape[0] for step in full.steps]
    assert rows[-1] < rows[0] == B * 4, rows  # pruned, not only reordered
    assert len(cached.steps) == len(full.steps) > 2
    for step, (a, b) in enumerate(zip(cached.steps, full.steps)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {step}")

    # a state that ignores reordering: with equal limits (no pruning, which it would not even
    # fit) its logits drift from the uncached search's
    monkeypatch.setattr(StateCell, "reorder", lambda self, index_B: None)
    fixed = {**kwargs, "max_len_a": 0.0, "max_len_b": T + 4}
    broken, full = _Recorder(model), _Recorder(Uncached(model))
    beam_search(full, src_BS, **fixed)
    beam_search(broken, src_BS, **fixed)
    worst = max((a - b).abs().max().item() for a, b in zip(broken.steps, full.steps))
    assert worst > 1e-3, worst
