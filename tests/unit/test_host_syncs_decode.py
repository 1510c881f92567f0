"""Host-device syncs of decoding and of the task / THOR routers, counted on CPU
(tests/sync_points.py): a search reads the device once per step (whether all rows are done;
beam search also copies the hypotheses on a step where some finish); the task ids are read
once per batch for every task-routed layer and decode step, the served rows of a frozen table
once per table; THOR's statistics read nothing.

Only the syncs of the code under test are counted (`MINE`): the dispatch kernels keep their
own (one per MoE layer call). Each path runs once to warm up, then on a new batch (new id
tensors, as from the data loader). The counts before these fixes are in each test's docstring.
"""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.eval.extract import extract, load_extracted
from moe_train.eval.search import _next_log_probs, beam_search, greedy_search
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext
from moe_train.moe.layer import MoELayer
from moe_train.moe.routing import NUM_LANGS_KEY
from tests.sync_points import SyncPoints

V, PAD, BOS, EOS = 40, 0, 1, 2
B, S, T = 4, 7, 6
STEPS = 6
"""Decoder steps of every search here: min_len = max_len, so no sentence finishes early."""
MANIFEST = {"vocab_size": V, "pad_id": PAD, "langs": ["de", "en", "fr"],
            "domains": ["it", "law", "med", "news"]}
TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "optim.precision=fp32",
        "moe.num_experts=4", "moe.layers=all", "moe.capacity_factor=0.0"]
TASK = ["moe.encoder_router=task", "moe.decoder_router=task", "moe.num_tasks=9", "moe.k=2"]
"""Learned task routers on all four layers: language pair (encoder), target language."""
THOR = ["moe.encoder_router=thor", "moe.decoder_router=thor", "moe.num_experts=8",
        "thor.num_tasks=4", "thor.num_candidates=4", "thor.token_routing=topk"]
MINE = ("moe_train/moe/sentence_router.py", "moe_train/moe/routing.py",
        "moe_train/moe/thor_router.py", "moe_train/eval/search.py", "moe_train/eval/beam.py")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(overrides: list[str]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(load_config(None, [*TINY, *overrides]), MANIFEST)
    with torch.no_grad():  # spread the gates so that sentences use several experts
        for name, p in model.named_parameters():
            if "router" in name or "expert" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def _batch(seed: int, lang_pair: tuple[int, int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """A new batch: ragged sources, targets and new id tensors (`lang_pair`: all one pair)."""
    gen = torch.Generator().manual_seed(seed)
    src_BS = torch.randint(3, V, (B, S), generator=gen)
    for b, n in enumerate((S, 5, 3, 6)):
        src_BS[b, n - 1] = EOS
        src_BS[b, n:] = PAD
    tgt_BT = torch.randint(3, V, (B, T), generator=gen)
    tgt_BT[:, 0] = BOS
    src_B, tgt_B = (torch.tensor([0, 1, 2, 0]), torch.tensor([1, 2, 0, 2])) if lang_pair is None \
        else (torch.full((B,), lang_pair[0]), torch.full((B,), lang_pair[1]))
    ctx = ForwardContext(domain_ids_B=torch.tensor([0, 1, 2, 3]), src_lang_B=src_B,
                         tgt_lang_B=tgt_B, extras={NUM_LANGS_KEY: 3})
    return src_BS, tgt_BT, ctx


def _mine(s: SyncPoints, *files: str) -> int:
    """Syncs counted in `files` (default: every file under test)."""
    files = files or MINE
    return sum(n for (where, _), n in s.counts.items() if where.rsplit(":", 1)[0] in files)


def _forward(model: torch.nn.Module, seeds: tuple[int, int]) -> SyncPoints:
    """A warm-up training forward on one batch, then the syncs of one on a new batch."""
    for seed in seeds:
        src_BS, tgt_BT, ctx = _batch(seed)
        with SyncPoints() as s:
            model(src_BS, tgt_BT, ctx)
    return s


def _decode(model: torch.nn.Module, beam: int, seed: int, **batch) -> SyncPoints:
    """One warm-up search, then the syncs of a search of STEPS steps on a new batch."""
    for measure in (False, True):
        src_BS, _, ctx = _batch(seed + measure, **batch)
        kwargs = dict(max_len_a=0.0, max_len_b=STEPS, min_len=STEPS, ctx=ctx)
        with SyncPoints() as s:
            if beam == 1:
                out = greedy_search(model, src_BS, BOS, EOS, PAD, **kwargs)
            else:
                out = beam_search(model, src_BS, BOS, EOS, PAD, beam=beam, **kwargs)
        assert [len(tokens) for tokens in out] == [STEPS - 1] * B  # the limit's eos stripped
    return s


def test_task_routed_training_forward_reads_the_task_ids_once_per_side() -> None:
    """Before: int(min) and int(max) in each of the 4 layers, 8; after: one read of each
    side's ids (language pairs, target languages), 2."""
    s = _forward(_model(TASK).train(), seeds=(0, 1))
    assert _mine(s) <= 2, s.where()


def test_task_routed_decoding_reads_the_task_ids_once() -> None:
    """Greedy and beam 3, STEPS steps. Before: 2 per task-routed layer call (2 encoder + 2 x
    STEPS decoder calls: 28) plus search.py's limit check per step (6); after: 2 in all, and
    the search's smallest limit (1)."""
    model = _model(TASK)
    for beam in (1, 3):
        s = _decode(model, beam, seed=10)
        assert _mine(s, "moe_train/moe/sentence_router.py", "moe_train/moe/routing.py",
                     "moe_train/eval/search.py") <= 3, s.where()


def test_frozen_task_table_checks_cost_nothing_per_decode_step() -> None:
    """An extracted language-pair model (frozen tables on all 4 layers), greedy. Before: 3 per
    layer call (range and served checks: 42); after: one read of the pair ids that both
    sides share (the served rows were read once per table, while warming up)."""
    cfg = load_config(None, [*TINY, *TASK, "moe.encoder_task_source=lang_pair",
                             "moe.decoder_task_source=lang_pair"])
    torch.manual_seed(0)
    model = build_model(cfg, MANIFEST).eval()
    sub = load_extracted(extract(model, cfg, MANIFEST, "de-en"), MANIFEST)
    s = _decode(sub, 1, seed=20, lang_pair=(0, 1))
    assert _mine(s, "moe_train/moe/sentence_router.py", "moe_train/moe/routing.py") <= 1, \
        s.where()


@pytest.mark.parametrize("beam", [1, 3])
def test_search_reads_the_device_once_per_step(beam: int) -> None:
    """search.py: before, bool(at_limit.any()) per step (6); after, the smallest limit read
    once per search (1). beam.py: greedy keeps its
    done check per step plus the final copy of the tokens (6 + 2 before and after); beam
    before: any() and int(sum) per step plus the hypotheses finished at the last step
    (nonzero + 3 copies: 16), after: one read per step and one copy of them (7)."""
    s = _decode(_model(TASK), beam, seed=30)
    assert _mine(s, "moe_train/eval/search.py") == 1, s.where()
    assert _mine(s, "moe_train/eval/beam.py") <= STEPS + (2 if beam == 1 else 1), s.where()


def test_thor_statistics_and_task_check_read_nothing_per_layer() -> None:
    """THOR on all 4 layers. Training forward: before, bool-mask indexing, bincount, bool-mask
    indexing per layer plus the predictor's id check (13); after, the id check (1). Greedy
    decode: before 3 per layer call (42) + 1 + search.py's 6; after the id check and the
    search's smallest limit (2)."""
    model = _model(THOR).train()
    s = _forward(model, seeds=(40, 41))
    assert _mine(s) <= 1, s.where()
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    assert {"candidate_usage", "experts_per_token"} <= set(layer.scalar_stats)  # still logged
    s = _decode(model.eval(), 1, seed=42)
    assert _mine(s, "moe_train/moe/sentence_router.py", "moe_train/moe/thor_router.py",
                 "moe_train/moe/routing.py", "moe_train/eval/search.py") <= 2, s.where()


def test_eos_forced_at_the_limit_without_asking_the_device() -> None:
    """_next_log_probs (greedy, beam and LM search): rows at their limit keep only eos, the
    others are untouched; no sync (before: one per call)."""

    class Given:
        def decode(self, *_):
            return logits_N1V.clone(), {}

    logits_N1V = torch.randn(3, 1, 7)
    with SyncPoints() as s:
        out_NV = _next_log_probs(Given(), None, None, None, None, 4, torch.tensor([5, 9, 5]),
                                 BOS, EOS, PAD)
    assert s.total() == 0, s.where()
    ref_NV = torch.log_softmax(logits_N1V[:, 0], -1)
    ref_NV[:, [PAD, BOS]] = -torch.inf
    assert torch.equal(out_NV[1], ref_NV[1])
    for row in (0, 2):
        assert out_NV[row, EOS] == ref_NV[row, EOS] and out_NV[row].isinf().sum() == 6
