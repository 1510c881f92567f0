"""Token-budget batching: sampling arithmetic, budgets, epochs, rank sharding, resume, eval."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from moe_train.data.batching import (Batch, TrainBatchIterator, build_epoch_plan, collate,
                                     corpus_counts, eval_batches, sampling_probs)
from moe_train.errors import CheckpointError, DataError

PAD, BOS, EOS = 0, 2, 3


class FakeDataset:
    """ShardedDataset look-alike: corpora contiguous, tokens derived from the index."""

    def __init__(self, sizes: list[int], seed: int = 0, max_len: int = 30,
                 long_ones: dict[int, int] | None = None) -> None:
        rng = np.random.default_rng(seed)
        n = sum(sizes)
        self.corpus_sizes = list(sizes)
        self.num_corpora = len(sizes)
        self.corpus_names = [f"c{i}" for i in range(len(sizes))]
        self.corpus_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.src_lengths = rng.integers(1, max_len, n).astype(np.int64)
        self.tgt_lengths = rng.integers(1, max_len, n).astype(np.int64)
        for i, length in (long_ones or {}).items():
            self.src_lengths[i] = length
        self.corpus_ids = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
        self.domain_ids = self.corpus_ids * 10
        self.src_lang_ids = self.corpus_ids + 100
        self.tgt_lang_ids = self.corpus_ids + 200

    def __len__(self) -> int:
        return len(self.src_lengths)

    def src(self, i: int) -> np.ndarray:
        return 10 + (i + np.arange(self.src_lengths[i], dtype=np.int64)) % 50

    def tgt(self, i: int) -> np.ndarray:
        return 60 + (i + np.arange(self.tgt_lengths[i], dtype=np.int64)) % 50


def _epoch_indices(it: TrainBatchIterator) -> list[int]:
    """Every index of the iterator's current epoch (single rank, grad_accum 1)."""
    out: list[int] = []
    for _ in range(it.steps_per_epoch):
        for batch in next(it):
            out.extend(batch.indices_B.tolist())
    return out


# ------------------------------------------------------------------------------ sampling
def test_sampling_probs_t1_is_proportional() -> None:
    np.testing.assert_allclose(sampling_probs([10, 30, 60], 1.0), [0.1, 0.3, 0.6])


def test_sampling_probs_large_t_is_uniform() -> None:
    np.testing.assert_allclose(sampling_probs([1, 1000, 1_000_000], 1e9), [1 / 3] * 3,
                               rtol=1e-6)


def test_sampling_probs_t2_hand_computed() -> None:
    # p = (1/4, 3/4); p^(1/2) = (0.5, 0.8660254); q = those / 1.3660254
    np.testing.assert_allclose(sampling_probs([1, 3], 2.0), [0.3660254, 0.6339746], atol=1e-7)
    # an empty corpus is never drawn
    assert sampling_probs([0, 5, 5], 3.0)[0] == 0.0
    with pytest.raises(ValueError):
        sampling_probs([1, 2], 0.0)


def test_corpus_counts_largest_remainder() -> None:
    # raw = 10 * (0.366, 0.634) = (3.66, 6.34): floors (3, 6), the spare one goes to corpus 0
    assert corpus_counts([1, 3], 2.0, 10).tolist() == [4, 6]
    # three equal corpora, 7 sentences: 2.33 each, the tie goes to the lowest index
    assert corpus_counts([5, 5, 5], 1.0, 7).tolist() == [3, 2, 2]
    sizes = [7, 13, 101, 1, 999]
    assert corpus_counts(sizes, 1.0, sum(sizes)).tolist() == sizes


def test_epoch_counts_exact_and_upsampling_repeats_whole_permutations() -> None:
    ds = FakeDataset([5, 200, 95])
    it = TrainBatchIterator(ds, 200, PAD, BOS, EOS, seed=3, temperature=4.0)
    expected = corpus_counts([5, 200, 95], 4.0, 300)
    assert expected[0] > 10  # the tiny corpus is upsampled several times
    both: list[int] = []
    for epoch in range(2):
        drawn = _epoch_indices(it)
        assert len(drawn) == 300
        per_corpus = Counter(int(ds.corpus_ids[i]) for i in drawn)
        assert [per_corpus[c] for c in range(3)] == expected.tolist()
        both += drawn
        # whole permutations: so far every sentence of the tiny corpus k or k+1 times
        tiny = Counter(i for i in both if i < 5)
        assert len(tiny) == 5 and max(tiny.values()) - min(tiny.values()) <= 1


# ------------------------------------------------------------------------------ batches
def test_collate_pads_and_shifts() -> None:
    ds = FakeDataset([4])
    ds.src_lengths[:] = [2, 3, 1, 1]
    ds.tgt_lengths[:] = [1, 2, 1, 1]
    b = collate(ds, [1, 0], PAD, BOS, EOS)
    # src(1) = 11, 12, 13; src(0) = 10, 11
    assert b.src_tokens_BS.tolist() == [[11, 12, 13, EOS], [10, 11, EOS, PAD]]
    # tgt(1) = 61, 62; tgt(0) = 60
    assert b.tgt_in_BT.tolist() == [[BOS, 61, 62], [BOS, 60, PAD]]
    assert b.tgt_out_BT.tolist() == [[61, 62, EOS], [60, EOS, PAD]]
    assert b.indices_B.tolist() == [1, 0]
    assert (b.n_src_tokens, b.n_tgt_tokens, b.step_tgt_tokens) == (7, 5, 5)
    assert b.src_tokens_BS.dtype == torch.long and not b.is_padding
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.tgt_out_BT, b.tgt_out_BT)


def test_collate_metadata_columns() -> None:
    ds = FakeDataset([3, 2])
    b = collate(ds, [4, 0], PAD, BOS, EOS)
    assert b.corpus_ids_B.tolist() == [1, 0]
    assert b.domain_ids_B.tolist() == [10, 0]
    assert b.src_lang_B.tolist() == [101, 100] and b.tgt_lang_B.tolist() == [201, 200]


def test_every_batch_within_token_budget() -> None:
    ds = FakeDataset([300, 150], long_ones={7: 120})  # sentence 7 alone exceeds the budget
    it = TrainBatchIterator(ds, 100, PAD, BOS, EOS, seed=1)
    seen_long = False
    for _ in range(it.steps_per_epoch):
        (b,) = next(it)
        if 7 in b.indices_B.tolist():
            seen_long = True
            assert len(b) == 1
            continue
        assert b.src_tokens_BS.numel() <= 100 and b.tgt_in_BT.numel() <= 100
        assert b.tgt_out_BT.shape == b.tgt_in_BT.shape
    assert seen_long


def test_decoder_only_rows_the_model_reads_stay_within_the_budget() -> None:
    """A decoder-only model reads each row as the longest prompt (left-padded) plus the
    longest target: costed per sentence, 90% of batches went over the budget."""
    from moe_train.models.lm_batch import lm_inputs

    ds = FakeDataset([300, 200], seed=3)
    ds.concatenated = True
    it = TrainBatchIterator(ds, 160, PAD, BOS, EOS, seed=1)
    for _ in range(it.steps_per_epoch):
        (b,) = next(it)
        assert len(b) == 1 or lm_inputs(b.src_tokens_BS, b.tgt_in_BT, PAD)[0].numel() <= 160
    for b in eval_batches(ds, 160, PAD, BOS, EOS, max_sentences=64):
        assert len(b) == 1 or lm_inputs(b.src_tokens_BS, b.tgt_in_BT, PAD)[0].numel() <= 160


def test_bucket_key_is_the_padded_width_each_sentence_needs() -> None:
    """Encoder-decoder: the longer side plus eos / bos; decoder-only: prompt + target (the
    prompt's eos and the target's bos are not in the row)."""
    from types import SimpleNamespace

    from moe_train.data.batching import bucket_key

    ds = SimpleNamespace(src_lengths=np.array([5, 2]), tgt_lengths=np.array([3, 4]))
    assert bucket_key(ds).tolist() == [6, 5]
    assert bucket_key(SimpleNamespace(**vars(ds), concatenated=True)).tolist() == [8, 6]


def test_decoder_only_rows_fill_the_budget_exactly() -> None:
    """Three prompts of 3 and targets of 3: rows of 6 tokens, all three in a budget of 18
    (costed one wider, they were cut 2 + 1)."""
    from moe_train.models.lm_batch import lm_inputs

    ds = FakeDataset([3])
    ds.concatenated = True
    ds.src_lengths[:] = 3
    ds.tgt_lengths[:] = 3
    (batch,) = list(eval_batches(ds, 18, PAD, BOS, EOS))
    ids_BL = lm_inputs(batch.src_tokens_BS, batch.tgt_in_BT, PAD)[0]
    assert len(batch) == 3 and tuple(ids_BL.shape) == (3, 6)


def test_t1_each_sentence_once_per_epoch_new_order_each_epoch() -> None:
    ds = FakeDataset([120, 40, 77])
    it = TrainBatchIterator(ds, 150, PAD, BOS, EOS, seed=5)
    first = _epoch_indices(it)
    second = _epoch_indices(it)
    assert sorted(first) == list(range(len(ds))) == sorted(second)
    assert first != second
    assert it.epoch == 1


def test_batches_come_in_shuffled_order_not_by_length() -> None:
    """Batches are cut from length-sorted sentences, then shuffled: an epoch that ran them
    shortest first (every epoch alike) would still cover the data and keep the budget."""
    ds = FakeDataset([300], seed=3)
    widths = []
    for epoch in (0, 1):
        plan = build_epoch_plan(ds, np.asarray([300]), 200, seed=7, epoch=epoch)
        widths.append([int(ds.src_lengths[plan.batch(j)].max()) for j in range(plan.num_batches)])
    for w in widths:
        assert len(w) > 10 and w != sorted(w) and w != sorted(w, reverse=True)
    assert widths[0] != widths[1]  # a new batch order each epoch


def test_same_seed_same_order_other_seed_differs() -> None:
    ds = FakeDataset([100, 60])

    def first_steps(seed: int) -> list[list[int]]:
        it = TrainBatchIterator(ds, 120, PAD, BOS, EOS, seed=seed)
        return [b.indices_B.tolist() for _ in range(5) for b in next(it)]

    assert first_steps(9) == first_steps(9)
    assert first_steps(9) != first_steps(10)


# ------------------------------------------------------------------------------ sharding
def test_two_ranks_split_the_one_rank_group() -> None:
    ds = FakeDataset([200, 100], seed=2)
    kw = dict(max_tokens=90, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=4, temperature=2.0)
    single = TrainBatchIterator(ds, grad_accum=4, **kw)
    ranks = [TrainBatchIterator(ds, dp_rank=r, dp_world=2, grad_accum=2, **kw) for r in (0, 1)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch == ranks[1].steps_per_epoch
    for _ in range(single.steps_per_epoch + 2):  # into the second epoch
        group = next(single)
        parts = [next(r) for r in ranks]
        assert len(group) == 4 and all(len(p) == 2 for p in parts)
        # rank r takes micro-batches r, r + 2 of the group
        assert [b.indices_B.tolist() for b in parts[0]] == \
            [group[0].indices_B.tolist(), group[2].indices_B.tolist()]
        assert [b.indices_B.tolist() for b in parts[1]] == \
            [group[1].indices_B.tolist(), group[3].indices_B.tolist()]
        total = sum(b.n_tgt_tokens for b in group)
        assert {b.step_tgt_tokens for p in parts for b in p} == {total}
        assert {b.step_tgt_tokens for b in group} == {total}
        assert sorted(i for p in parts for b in p for i in b.indices_B.tolist()) == \
            sorted(i for b in group for i in b.indices_B.tolist())


def test_ranks_disjoint_at_t1() -> None:
    ds = FakeDataset([150, 150], seed=6)
    ranks = [TrainBatchIterator(ds, 80, PAD, BOS, EOS, seed=1, dp_rank=r, dp_world=2)
             for r in (0, 1)]
    for _ in range(ranks[0].steps_per_epoch):
        (b0,), (b1,) = next(ranks[0]), next(ranks[1])
        assert not set(b0.indices_B.tolist()) & set(b1.indices_B.tolist())
        assert b0.step_tgt_tokens == b1.step_tgt_tokens == b0.n_tgt_tokens + b1.n_tgt_tokens


def test_too_little_data_for_one_step_is_a_data_error() -> None:
    ds = FakeDataset([3])
    it = TrainBatchIterator(ds, 10_000, PAD, BOS, EOS, seed=0, dp_world=2, dp_rank=1)
    with pytest.raises(DataError, match="fewer than one step"):
        next(it)


# ------------------------------------------------------------------------------ resume
def _steps(it: TrainBatchIterator, n: int) -> list[list[list[int]]]:
    return [[b.indices_B.tolist() + [b.step_tgt_tokens] for b in next(it)] for _ in range(n)]


def test_resume_continues_with_the_next_step_across_epochs() -> None:
    ds = FakeDataset([60, 30], seed=8)
    kw = dict(max_tokens=200, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=11, temperature=2.0,
              grad_accum=2)
    reference = TrainBatchIterator(ds, **kw)
    assert 3 <= reference.steps_per_epoch <= 6  # so 7 + 8 steps cross epoch boundaries
    expected = _steps(reference, 15)
    first = TrainBatchIterator(ds, **kw)
    assert _steps(first, 7) == expected[:7]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] >= 1 and state["seed"] == 11
    resumed = TrainBatchIterator(ds, **kw)
    resumed.load_state_dict(state)
    assert _steps(resumed, 8) == expected[7:]
    assert resumed.epoch == reference.epoch


def test_resume_with_other_grad_accum_keeps_the_micro_batch_position() -> None:
    ds = FakeDataset([80], seed=1)
    kw = dict(max_tokens=120, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=2)
    flat = [step[0][:-1] for step in _steps(TrainBatchIterator(ds, **kw), 6)]
    first = TrainBatchIterator(ds, grad_accum=3, **kw)
    assert [b.indices_B.tolist() for b in next(first)] == flat[:3]
    resumed = TrainBatchIterator(ds, grad_accum=1, **kw)
    resumed.load_state_dict(first.state_dict())
    assert [b.indices_B.tolist() for b in next(resumed)] == [flat[3]]


def test_resume_from_a_checkpoint_without_the_micro_batch_position() -> None:
    """Checkpoints written before `micro_batch_in_epoch` existed hold only the step: the
    position is step x (grad_accum x dp ranks) micro-batches, not step."""
    ds = FakeDataset([80], seed=1)
    kw = dict(max_tokens=120, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=2, grad_accum=2)
    reference = TrainBatchIterator(ds, **kw)
    expected = _steps(reference, 3)
    first = TrainBatchIterator(ds, **kw)
    _steps(first, 1)
    old = {k: v for k, v in first.state_dict().items() if k != "micro_batch_in_epoch"}
    resumed = TrainBatchIterator(ds, **kw)
    resumed.load_state_dict(old)
    assert _steps(resumed, 2) == expected[1:]


def test_resume_rejects_another_data_order() -> None:
    ds = FakeDataset([50])
    state = TrainBatchIterator(ds, 100, PAD, BOS, EOS, seed=1).state_dict()
    other = TrainBatchIterator(ds, 100, PAD, BOS, EOS, seed=2)
    with pytest.raises(CheckpointError, match="seed"):
        other.load_state_dict(state)


# ------------------------------------------------------------------------------ evaluation
def test_eval_batches_cover_once_with_equal_counts_on_three_ranks() -> None:
    ds = FakeDataset([37, 20], seed=4)
    per_rank = [eval_batches(ds, 70, PAD, BOS, EOS, dp_rank=r, dp_world=3) for r in range(3)]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1
    real = [i for batches in per_rank for b in batches if not b.is_padding
            for i in b.indices_B.tolist()]
    assert sorted(real) == list(range(len(ds)))
    n_real = sum(not b.is_padding for batches in per_rank for b in batches)
    assert n_real % 3 != 0  # the uneven case: some rank got a filler
    fillers = [b for batches in per_rank for b in batches if b.is_padding]
    assert len(fillers) == 3 - n_real % 3
    for b in (b for batches in per_rank for b in batches):
        assert b.step_tgt_tokens == b.n_tgt_tokens
        assert len(b) == 1 or b.src_tokens_BS.numel() <= 70


def test_eval_batches_deterministic_sorted_and_capped() -> None:
    ds = FakeDataset([50], seed=3)
    a = eval_batches(ds, 10_000, PAD, BOS, EOS, max_sentences=8)
    b = eval_batches(ds, 10_000, PAD, BOS, EOS, max_sentences=8)
    assert [x.indices_B.tolist() for x in a] == [x.indices_B.tolist() for x in b]
    assert max(len(x) for x in a) == 8 and sum(len(x) for x in a) == 50
    widths = [max(int(ds.src_lengths[i]), int(ds.tgt_lengths[i])) for x in a
              for i in x.indices_B.tolist()]
    assert widths == sorted(widths)


def test_eval_batches_subset_and_rank_without_batches() -> None:
    ds = FakeDataset([30], seed=5)
    per_rank = [eval_batches(ds, 10_000, PAD, BOS, EOS, dp_rank=r, dp_world=3,
                             indices=[4, 9, 2]) for r in range(3)]
    assert [len(b) for b in per_rank] == [1, 1, 1]
    (only,) = per_rank[0]
    assert sorted(only.indices_B.tolist()) == [2, 4, 9] and not only.is_padding
    for r in (1, 2):
        (filler,) = per_rank[r]
        assert filler.is_padding and torch.equal(filler.src_tokens_BS, only.src_tokens_BS)
    assert eval_batches(ds, 100, PAD, BOS, EOS, indices=[]) == []


def test_trailing_incomplete_group_is_dropped() -> None:
    ds = FakeDataset([90], seed=13)
    kw = dict(max_tokens=100, pad_id=PAD, bos_id=BOS, eos_id=EOS, seed=3)
    flat = TrainBatchIterator(ds, **kw)
    n_batches = flat.steps_per_epoch
    epoch0 = [step[0][:-1] for step in _steps(flat, n_batches)]
    epoch1 = [step[0][:-1] for step in _steps(flat, 3)]
    assert n_batches % 3 != 0
    grouped = TrainBatchIterator(ds, grad_accum=3, **kw)
    assert grouped.steps_per_epoch == n_batches // 3
    seen = [b.indices_B.tolist() for _ in range(n_batches // 3) for b in next(grouped)]
    assert seen == epoch0[:len(seen)]
    assert [b.indices_B.tolist() for b in next(grouped)] == epoch1 and grouped.epoch == 1


def test_plan_for_250k_sentences_is_exact() -> None:
    """(Its speed is not timed here: speed targets live in benchmarks, and a timed unit test
    fails on a loaded machine.)"""
    ds = FakeDataset([120_000, 80_000, 50_000], seed=0, max_len=80)
    counts = corpus_counts(ds.corpus_sizes, 1.0, len(ds))
    plan = build_epoch_plan(ds, counts, 4096, seed=1, epoch=0)
    assert np.array_equal(np.sort(plan.order), np.arange(len(ds)))
    width = np.maximum(ds.src_lengths, ds.tgt_lengths)[plan.order] + 1
    starts = plan.bounds[:-1]
    assert np.all(np.diff(plan.bounds) * np.maximum.reduceat(width, starts) <= 4096)
    assert plan.tgt_tokens.sum() == (ds.tgt_lengths + 1).sum()
