"""Greedy and beam search: hand-built distributions, exhaustive search, beam 1 == greedy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_train.config.schema import ModelConfig
from moe_train.eval.search import beam_search, greedy_search, max_lengths
from moe_train.models import ForwardContext, Seq2SeqTransformer

PAD, BOS, EOS, A, B_, C = 0, 1, 2, 3, 4, 5


class _Enc:
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def index_select(self, index):
        return _Enc(len(index))


class _Cache:
    """Remembers every token fed so far, so reordering mistakes change the prefixes seen."""

    def __init__(self) -> None:
        self.tokens = None

    def reorder(self, index):
        self.tokens = self.tokens.index_select(0, index)
        return self


class TableModel:
    """Fake model: the next-token distribution is looked up by the prefix generated so far."""

    max_positions = 64

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]],
                 default: dict[int, float], vocab: int = 5) -> None:
        self.table, self.default, self.vocab = table, default, vocab
        self.ctx_seen: list = []

    def encode(self, src_tokens_BS, ctx=None):
        return _Enc(src_tokens_BS.size(0))

    def new_decoder_cache(self):
        return _Cache()

    def decode(self, tgt_in_BT, enc, ctx=None, cache=None):
        assert cache is not None and tgt_in_BT.size(0) == enc.rows
        cache.tokens = tgt_in_BT if cache.tokens is None else torch.cat(
            [cache.tokens, tgt_in_BT], dim=1)
        self.ctx_seen.append(ctx)
        logits = torch.full((tgt_in_BT.size(0), self.vocab), -30.0)
        for row, prefix in enumerate(cache.tokens.tolist()):
            assert prefix[0] == BOS
            for token, p in self.table.get(tuple(prefix[1:]), self.default).items():
                logits[row, token] = math.log(p)
        return logits[:, None, :], {}


def test_max_lengths_per_sentence() -> None:
    src = torch.tensor([[5, 6, 7, 8, 2], [5, 2, 0, 0, 0]])
    assert max_lengths(None, src, PAD, 1.2, 10).tolist() == [16, 12]  # floor(1.2*5+10), 1.2*2+10
    assert max_lengths(None, src, PAD, 0.0, 0).tolist() == [1, 1]  # at least eos
    assert max_lengths(TableModel({}, {}), src, PAD, 100.0, 0).tolist() == [64, 64]


# Hand-built distribution; vocabulary: pad, bos, eos, a, b.
LENPEN_TABLE = {
    (): {EOS: 0.5, A: 0.4, B_: 0.1},
    (A,): {EOS: 0.12, A: 0.08, B_: 0.8},
    (B_,): {EOS: 0.2, A: 0.5, B_: 0.3},
}
LENPEN_DEFAULT = {EOS: 0.9, A: 0.05, B_: 0.05}


@pytest.mark.parametrize("lenpen, expected", [
    # [] scores log .5 = -0.693; [a b] scores log(.4*.8*.9) = -1.245, divided by 3**lenpen:
    (0.0, []),        # -0.693 > -1.245
    (1.0, [A, B_]),   # -1.245 / 3 = -0.415 > -0.693
])
def test_beam_search_length_penalty_hand_computed(lenpen: float, expected: list[int]) -> None:
    model = TableModel(LENPEN_TABLE, LENPEN_DEFAULT)
    src = torch.tensor([[5, 6, EOS]])
    out = beam_search(model, src, BOS, EOS, PAD, beam=3, lenpen=lenpen, max_len_a=0,
                      max_len_b=4)
    assert out == [expected]
    assert greedy_search(model, src, BOS, EOS, PAD, max_len_a=0, max_len_b=4) == [[]]


def test_beam_beats_greedy_hand_computed() -> None:
    table = {(): {A: 0.45, B_: 0.40, EOS: 0.15}, (A,): {A: 0.35, B_: 0.33, EOS: 0.32},
             (B_,): {EOS: 0.9, A: 0.05, B_: 0.05}}
    model = TableModel(table, {EOS: 0.9, A: 0.05, B_: 0.05})
    src = torch.tensor([[5, EOS], [6, EOS]])
    # Greedy: a (.45), a (.35), eos (.9): p = .14175.  Best overall: b eos, p = .36.
    assert greedy_search(model, src, BOS, EOS, PAD) == [[A, A], [A, A]]
    for lenpen in (0.0, 1.0):
        assert beam_search(model, src, BOS, EOS, PAD, beam=2, lenpen=lenpen) == [[B_], [B_]]


def test_beam_search_follows_reordered_hypotheses() -> None:
    # Step 1 ranks b a (.36) above a b (.25): the two live beams swap rows, and only the right
    # prefixes (b a), (a b) make eos likely; the wrong ones fall back to the default row.
    table = {(): {A: 0.5, B_: 0.4, EOS: 0.1}, (A,): {B_: 0.5, A: 0.3, EOS: 0.2},
             (B_,): {A: 0.9, B_: 0.05, EOS: 0.05}, (B_, A): {EOS: 0.9, A: 0.05, B_: 0.05},
             (A, B_): {EOS: 0.9, A: 0.05, B_: 0.05}}
    model = TableModel(table, {EOS: 0.01, A: 0.5, B_: 0.49})
    src = torch.tensor([[5, EOS]])
    # Finished: b a eos (.324) and a b eos (.225); greedy takes a, b, eos.
    assert beam_search(model, src, BOS, EOS, PAD, beam=2, lenpen=0.0) == [[B_, A]]
    assert greedy_search(model, src, BOS, EOS, PAD) == [[A, B_]]


def test_eos_forced_at_length_limit() -> None:
    # eos is nearly impossible, so every hypothesis runs to its sentence's limit.
    model = TableModel({}, {A: 0.7, B_: 0.3 - 1e-6, EOS: 1e-6})
    src = torch.tensor([[5, 5, EOS], [5, EOS, PAD]])  # limits (max_len_a=1): 3 and 2 tokens
    assert greedy_search(model, src, BOS, EOS, PAD, max_len_a=1, max_len_b=0) == [[A, A], [A]]
    # With beam 3 the first-step eos (ranked 3rd) is finished too, so [] competes.
    # Length penalty 1: (k log .7 + log 1e-6) / (k + 1) grows with k, the longest wins.
    out = beam_search(model, src, BOS, EOS, PAD, beam=3, lenpen=1.0, max_len_a=1, max_len_b=0)
    assert out == [[A, A], [A]]
    # No length penalty: [] (p = 1e-6) beats [a] (p = .7e-6) and [a a] (p = .49e-6).
    out = beam_search(model, src, BOS, EOS, PAD, beam=3, lenpen=0.0, max_len_a=1, max_len_b=0)
    assert out == [[], []]
    # Beam 2 never ranks that eos in its top 2, so [] is never finished (fairseq rule).
    out = beam_search(model, src, BOS, EOS, PAD, beam=2, lenpen=0.0, max_len_a=1, max_len_b=0)
    assert out == [[A, A], [A]]


def test_sync_done_keeps_decoding_until_all_ranks_finish() -> None:
    model = TableModel(LENPEN_TABLE, LENPEN_DEFAULT)
    src = torch.tensor([[5, 6, EOS]])
    for search, kw in ((greedy_search, {}), (beam_search, {"beam": 3, "lenpen": 1.0})):
        alone = search(model, src, BOS, EOS, PAD, **kw)
        local_calls = len(model.ctx_seen)
        model.ctx_seen.clear()
        flags: list[bool] = []

        def sync_done(done: bool) -> bool:  # another rank needs 7 steps
            flags.append(done)
            return len(flags) >= 7

        assert search(model, src, BOS, EOS, PAD, sync_done=sync_done, **kw) == alone
        assert len(model.ctx_seen) == 7 and local_calls < 7
        assert flags[local_calls - 1:] == [True] * (8 - local_calls)
        assert not any(flags[:local_calls - 1])
        model.ctx_seen.clear()


def test_context_is_expanded_to_beams() -> None:
    model = TableModel(LENPEN_TABLE, LENPEN_DEFAULT)
    ctx = ForwardContext(domain_ids_B=torch.tensor([7, 9]))
    beam_search(model, torch.tensor([[5, EOS], [6, EOS]]), BOS, EOS, PAD, beam=3, ctx=ctx)
    assert model.ctx_seen and all(
        torch.equal(c.domain_ids_B, torch.tensor([7, 7, 7, 9, 9, 9])) for c in model.ctx_seen)


def small_model(seed: int, vocab: int = 11, tie: bool = True) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2,
                      dropout=0.0, max_positions=64, tie_embeddings=tie)
    return Seq2SeqTransformer(cfg, vocab, PAD).eval()


SRC = torch.tensor([[5, 6, 7, 8, EOS], [9, 4, EOS, PAD, PAD], [3, EOS, PAD, PAD, PAD]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(seed: int) -> None:
    model = small_model(seed)
    greedy = greedy_search(model, SRC, BOS, EOS, PAD, max_len_a=1.2, max_len_b=4)
    assert greedy == beam_search(model, SRC, BOS, EOS, PAD, beam=1, lenpen=1.0, max_len_a=1.2,
                                 max_len_b=4)
    assert [len(g) for g in greedy] != [0, 0, 0]


def test_beam_one_breaks_exact_ties_as_greedy_does() -> None:
    """Equal logits (common in bf16) go to the lower token id in both searches; topk alone
    orders ties arbitrarily."""
    model = TableModel({}, {A: 0.3, B_: 0.3, C: 0.3, EOS: 0.1}, vocab=6)
    greedy = greedy_search(model, SRC, BOS, EOS, PAD, max_len_a=0.0, max_len_b=3)
    assert greedy == [[A, A]] * 3  # the third token is the forced eos
    assert beam_search(model, SRC, BOS, EOS, PAD, beam=1, max_len_a=0.0, max_len_b=3) == greedy


def test_batched_search_equals_one_sentence_at_a_time() -> None:
    model = small_model(3)
    batched = beam_search(model, SRC, BOS, EOS, PAD, beam=4, max_len_a=1.0, max_len_b=3)
    greedy = greedy_search(model, SRC, BOS, EOS, PAD, max_len_a=1.0, max_len_b=3)
    for i, length in enumerate([5, 3, 2]):
        alone = SRC[i:i + 1, :length]
        assert beam_search(model, alone, BOS, EOS, PAD, beam=4, max_len_a=1.0,
                           max_len_b=3) == [batched[i]]
        assert greedy_search(model, alone, BOS, EOS, PAD, max_len_a=1.0,
                             max_len_b=3) == [greedy[i]]


def _exhaustive_best(model: Seq2SeqTransformer, src_1S: torch.Tensor, words: list[int],
                     max_len: int, lenpen: float) -> list[int]:
    """Score every word sequence (+ eos) up to `max_len` tokens with a teacher-forced pass."""
    best, best_score = None, -math.inf
    for n in range(max_len):
        for seq in itertools.product(words, repeat=n):
            hyp = list(seq) + [EOS]
            tgt_in = torch.tensor([[BOS] + hyp[:-1]])
            lprobs = torch.log_softmax(model(src_1S, tgt_in).logits_BTV[0].float(), dim=-1)
            logp = sum(lprobs[t, tok].item() for t, tok in enumerate(hyp))
            score = logp / len(hyp) ** lenpen
            if score > best_score:
                best, best_score = list(seq), score
    return best


@pytest.mark.parametrize("seed", [1, 3])
def test_beam_search_equals_exhaustive_search(seed: int) -> None:
    # Vocabulary pad, bos, eos, a, b, c; 4 tokens at most: 1 + 3 + 9 + 27 hypotheses and at
    # most 9 * 4 = 36 finite candidates before the forced-eos step, so beam 36 keeps every
    # hypothesis alive and must be exact.
    # Untied: a random tied model mostly repeats its input token, a weaker check.
    model = small_model(seed, vocab=6, tie=False)
    src = torch.tensor([[A, B_, C, EOS], [C, EOS, PAD, PAD]])
    lengths = [4, 2]
    longest = 0
    with torch.no_grad():
        for lenpen in (0.0, 1.0, 2.0):
            out = beam_search(model, src, BOS, EOS, PAD, beam=36, lenpen=lenpen, max_len_a=0,
                              max_len_b=4)
            for i, length in enumerate(lengths):
                expected = _exhaustive_best(model, src[i:i + 1, :length], [A, B_, C], 4, lenpen)
                assert out[i] == expected
                longest = max(longest, len(expected))
    assert longest == 3  # the length penalty reaches the deepest level


@pytest.mark.parametrize("training", [True, False])
def test_search_keeps_model_mode(training: bool) -> None:
    model = small_model(6).train(training)
    greedy_search(model, SRC, BOS, EOS, PAD, max_len_b=2)
    beam_search(model, SRC, BOS, EOS, PAD, beam=2, max_len_b=2)
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_min_len_bans_eos_until_then_but_the_limit_wins() -> None:
    # eos is the likeliest token at every step: without min_len every output is empty.
    model = TableModel({}, {EOS: 0.6, A: 0.3, B_: 0.1})
    src = torch.tensor([[5, 5, 5, EOS], [5, EOS, PAD, PAD]])  # limits (max_len_a=1): 4 and 2
    kwargs = dict(max_len_a=1, max_len_b=0)
    assert greedy_search(model, src, BOS, EOS, PAD, **kwargs) == [[], []]
    # min_len 3 (eos included): two tokens, then eos; the second sentence's limit (2) wins.
    assert greedy_search(model, src, BOS, EOS, PAD, min_len=3, **kwargs) == [[A, A], [A]]
    for beam in (1, 3):
        out = beam_search(model, src, BOS, EOS, PAD, beam=beam, min_len=3, **kwargs)
        assert [len(h) for h in out] == [2, 1], out


class _SentenceEnc(_Enc):
    """Encoder output that remembers which sentence each row is (source token 10 + i)."""

    def __init__(self, sid_B: torch.Tensor) -> None:
        super().__init__(len(sid_B))
        self.sid_B = sid_B

    def index_select(self, index):
        return _SentenceEnc(self.sid_B.index_select(0, index))


class _PerSentence(TableModel):
    """TableModel whose first step depends on the sentence, recording the rows of each step."""

    def __init__(self, first: dict[int, dict[int, float]], *args) -> None:
        super().__init__(*args)
        self.first, self.rows = first, []

    def encode(self, src_tokens_BS, ctx=None):
        return _SentenceEnc(src_tokens_BS[:, 0] - 10)

    def decode(self, tgt_in_BT, enc, ctx=None, cache=None):
        self.rows.append(tgt_in_BT.size(0))
        logits, aux = super().decode(tgt_in_BT, enc, ctx, cache)
        if cache.tokens.size(1) == 1:
            for row, sid in enumerate(enc.sid_B.tolist()):
                logits[row, 0] = -30.0
                for token, p in self.first[sid].items():
                    logits[row, 0, token] = math.log(p)
        return logits, aux


@pytest.mark.parametrize("beam", [1, 2])
def test_finished_sentences_leave_the_batch(beam: int) -> None:
    """A done sentence's rows leave the batch (fairseq's pruning): later steps decode fewer
    rows, and every sentence's output equals decoding it alone."""
    # Sentences 0 and 2 end after one token (a or c); sentence 1 goes on with b b b b.
    first = {0: {A: 0.9, C: 0.1}, 1: {B_: 0.9, C: 0.1}, 2: {A: 0.8, C: 0.2}}
    table = {(A,): {EOS: 1.0}, (C,): {EOS: 1.0}, (B_,): {B_: 0.99, EOS: 0.01},
             (B_, B_): {B_: 0.99, EOS: 0.01}, (B_, B_, B_): {B_: 0.99, EOS: 0.01},
             (B_, B_, B_, B_): {EOS: 1.0}}
    src = torch.tensor([[10, EOS], [11, EOS], [12, EOS]])
    kw = dict(max_len_a=0, max_len_b=8)

    def run(model, src_BS):
        if beam == 1:
            return greedy_search(model, src_BS, BOS, EOS, PAD, **kw)
        return beam_search(model, src_BS, BOS, EOS, PAD, beam=beam, **kw)

    model = _PerSentence(first, table, {EOS: 1.0}, 6)
    out = run(model, src)
    assert out[0] == out[2] == [A]
    if beam == 1:
        assert out[1] == [B_, B_, B_, B_] and model.rows == [3, 3, 1, 1, 1], model.rows
    else:  # sentences 0 and 2 are done after step 1 (both beams finished), 1 goes on
        assert model.rows[:3] == [6, 6, 2] and set(model.rows[2:]) == {2}, model.rows
    alone = [run(_PerSentence({0: first[i]}, table, {EOS: 1.0}, 6), src[i:i + 1] - i)[0]
             for i in range(3)]
    assert alone == out
