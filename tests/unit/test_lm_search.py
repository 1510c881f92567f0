"""Decoder-only greedy / beam search (moe_train.eval.lm_search) on a tiny random Qwen2-MoE:
against naive full-recomputation references, padding- and pruning-invariance, limits, sync."""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext

pytest.importorskip("transformers")

from moe_train.eval.lm_search import (  # noqa: E402
    lm_beam_search, lm_greedy_search, lm_max_lengths)

V, PAD = 96, 0
EOS = 33  # an attractor of the seeded model below: sentences end after different lengths
LONG = 20  # a generous limit (tokens including eos)


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, [
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=2", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", "qwen.tie_word_embeddings=false",
        "moe.num_experts=8", "moe.k=2", "moe.expert_ffn_dim=24", "moe.z_loss_coef=0"])
    torch.manual_seed(0)
    m = build_model(cfg, {"vocab_size": V, "pad_id": PAD}).eval()
    with torch.no_grad():  # large logits: outputs depend on the prompt, near-ties are rare
        m.hf.lm_head.weight.mul_(10)
        m.hf.model.embed_tokens.weight.mul_(10)
    return m


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in lengths]


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r)
        mask[i, P - len(r):] = 1
    return ids, mask


def greedy(model, rows, **kw):
    ids, mask = left_pad(rows)
    kw.setdefault("max_new_B", torch.full((len(rows),), LONG))
    return lm_greedy_search(model, ids, mask, EOS, PAD, **kw)


def beam(model, rows, K, **kw):
    ids, mask = left_pad(rows)
    kw.setdefault("max_new_B", torch.full((len(rows),), LONG))
    return lm_beam_search(model, ids, mask, EOS, PAD, beam=K, **kw)


def constrained_lprobs(model, seqs: list[list[int]], made: int, max_len: int,
                       min_len: int) -> torch.Tensor:
    """Log-probs (rows, V) of the next token, the whole sequences rerun without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits_BTV[:, -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    lp[:, PAD] = -torch.inf
    if made + 1 < min_len and made + 1 < max_len:
        lp[:, EOS] = -torch.inf
    if made + 1 >= max_len:
        forced = torch.full_like(lp, -torch.inf)
        forced[:, EOS] = lp[:, EOS]
        lp = forced
    return lp


def naive_greedy(model, prompt: list[int], max_len: int = LONG, min_len: int = 0) -> list[int]:
    out: list[int] = []
    while True:
        tok = int(constrained_lprobs(model, [prompt + out], len(out), max_len,
                                     min_len)[0].argmax())
        if tok == EOS:
            return out
        out.append(tok)


def naive_beam(model, prompt: list[int], K: int, lenpen: float = 1.0,
               max_len: int = LONG) -> list[int]:
    """The fairseq rule on one sentence: top 2K of K x V, eos in the top K finishes."""
    scores = torch.full((K,), -torch.inf)
    scores[0] = 0.0
    beams: list[list[int]] = [[] for _ in range(K)]
    finished: list[tuple[float, list[int]]] = []
    for step in range(max_len):
        lp = constrained_lprobs(model, [prompt + b for b in beams], step, max_len, 0)
        top_s, top_i = (scores[:, None] + lp).view(-1).topk(2 * K)
        cands = [(float(s), int(i) // V, int(i) % V) for s, i in zip(top_s, top_i)]
        for s, b, tok in cands[:K]:
            if tok == EOS and s > -float("inf"):
                finished.append((s / (step + 1) ** lenpen, beams[b]))
        if len(finished) >= K or step + 1 >= max_len:
            break
        keep = [c for c in cands if c[2] != EOS][:K]
        beams = [beams[b] + [tok] for _, b, tok in keep]
        scores = torch.tensor([s for s, _, _ in keep])
    return max(finished, key=lambda item: item[0])[1]


class Recorder:
    """Calls the model, recording each call's rows and ctx.tgt_lang_B; with `lang_bias`, the
    logits favour a token given by the last input token and tgt_lang (a stand-in for a task
    router reading the context: a row given another row's language decodes differently)."""

    def __init__(self, model, lang_bias: float = 0.0) -> None:
        self.model, self.lang_bias = model, lang_bias
        self.max_positions = model.max_positions
        self.rows: list[int] = []
        self.langs: list[list[int] | None] = []

    def __call__(self, ids_BT, ctx=None, **kw):
        self.rows.append(ids_BT.size(0))
        lang_B = None if ctx is None else ctx.tgt_lang_B
        self.langs.append(None if lang_B is None else lang_B.tolist())
        out = self.model(ids_BT, ctx, **kw)
        if lang_B is not None:
            assert lang_B.size(0) == ids_BT.size(0)
            if self.lang_bias:
                tok_B = 40 + (ids_BT[:, -1] + 7 * lang_B) % 40
                out.logits_BTV[torch.arange(ids_BT.size(0)), -1, tok_B] += self.lang_bias
        return out


MIXED = [7, 3, 12, 5, 9]  # prompt lengths


def test_incremental_greedy_equals_full_recomputation(model) -> None:
    rows = prompts(0, MIXED)
    expected = [naive_greedy(model, r) for r in rows]
    assert len({len(e) for e in expected}) > 2  # sentences end at different steps
    assert greedy(model, rows) == expected


def test_left_padding_changes_nothing(model) -> None:
    short, mid, long_ = prompts(1, [2, 6, 13])
    alone = greedy(model, [mid])[0]
    assert greedy(model, [long_, mid, short])[1] == alone
    assert greedy(model, [short, mid])[1] == alone
    assert beam(model, [long_, mid, short], 3)[1] == beam(model, [mid], 3)[0]


def test_beam_one_is_greedy(model) -> None:
    rows = prompts(2, MIXED)
    assert beam(model, rows, 1) == greedy(model, rows)


@pytest.mark.parametrize("K,lenpen", [(2, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_equals_naive_beam(model, K: int, lenpen: float) -> None:
    rows = prompts(3, [6, 11, 4])
    expected = [naive_beam(model, r, K, lenpen) for r in rows]
    assert beam(model, rows, K, lenpen=lenpen) == expected


def test_beam_differs_from_greedy_somewhere(model) -> None:
    """Guards the tests above: with this model beam search is not just greedy."""
    rows = prompts(3, [6, 11, 4, 8, 5, 9])
    assert beam(model, rows, 4) != greedy(model, rows)


def test_length_limits_min_len_and_forced_eos(model) -> None:
    rows = prompts(4, [5, 8, 3])
    ids, mask = left_pad(rows)
    src_len = torch.tensor([2, 6, 1])  # the sentence inside each prompt, not the template
    limit = (0.5 * src_len + 2).floor().long()  # 3, 5, 2 tokens with eos
    assert lm_max_lengths(model, mask, 0.5, 2, src_len).tolist() == limit.tolist()
    for search in (lambda **kw: lm_greedy_search(model, ids, mask, EOS, PAD, **kw),
                   lambda **kw: lm_beam_search(model, ids, mask, EOS, PAD, beam=3, **kw)):
        outs = search(max_len_a=0.5, max_len_b=2, src_len_B=src_len)
        assert all(len(o) <= n - 1 for o, n in zip(outs, limit.tolist()))
        # eos that the model never prefers: every sentence runs to its limit, eos forced there
        free = lm_greedy_search(model, ids, mask, 1, PAD, max_len_a=0.5, max_len_b=2,
                                src_len_B=src_len)
        assert [len(o) for o in free] == (limit - 1).tolist()
        assert all(EOS not in o and PAD not in o for o in outs)
        # min_len: eos banned before 12 tokens (with eos), the limit wins over it
        outs = search(max_new_B=torch.tensor([15, 15, 10]), min_len=12)
        assert len(outs[0]) >= 11 and len(outs[1]) >= 11 and len(outs[2]) == 9
    assert greedy(model, rows, max_new_B=torch.tensor([15, 15, 10]), min_len=12) == [
        naive_greedy(model, r, n, 12) for r, n in zip(rows, [15, 15, 10])]
    # The model's positions cap the limit: 64 positions, a 60-token prompt leaves 4 to feed
    # and room for a fifth output, the eos, which is never fed.
    assert lm_max_lengths(model, torch.ones(1, 60), 1.0, 50).tolist() == [5]
    # and the model takes the last of them: positions 60..63 fed, eos predicted at 63
    for search in (greedy, lambda m, r, **kw: beam(m, r, 2, **kw)):
        out = search(model, prompts(9, [60]), min_len=5)  # eos banned before the cap
        assert [len(o) for o in out] == [4]
    # Default source length: the prompts' real tokens.
    assert lm_max_lengths(model, mask, 1.0, 1).tolist() == [6, 9, 4]


@pytest.mark.parametrize("K", [1, 3])
def test_pruned_batch_equals_sentences_alone_with_context(model, K: int) -> None:
    rows = prompts(5, MIXED)
    langs = [0, 3, 1, 2, 4]

    def run(sel: list[int]):
        rec = Recorder(model, lang_bias=1.5)
        ids, mask = left_pad([rows[i] for i in sel])
        ctx = ForwardContext(tgt_lang_B=torch.tensor([langs[i] for i in sel]))
        out = lm_beam_search(rec, ids, mask, EOS, PAD, beam=K, ctx=ctx,
                             max_new_B=torch.full((len(sel),), LONG))
        return out, rec

    together, rec = run(list(range(len(rows))))
    alone = [run([i])[0][0] for i in range(len(rows))]
    assert together == alone
    plain = beam(model, rows, K)
    assert together != plain  # the outputs do depend on the context
    assert len({len(o) for o in together}) > 2
    assert min(rec.rows) < len(rows) * K  # sentences did leave the batch
    # The context followed the rows: each call's languages are those of the sentences still
    # decoding (the sentences of each length are known from the outputs).
    steps = [len(o) + 1 for o in together]
    for s, call in enumerate(rec.langs[1:], start=1):
        if K == 1:
            live = [lang for lang, n in zip(langs, steps) if n > s]
            assert sorted(call) == sorted(live)
        else:  # beams of a sentence stay together
            assert call == [lang for lang in call[::K] for _ in range(K)]


def test_model_sees_fewer_rows_after_sentences_finish(model) -> None:
    rows = prompts(0, MIXED)
    rec = Recorder(model)
    ids, mask = left_pad(rows)
    outs = lm_greedy_search(rec, ids, mask, EOS, PAD, max_new_B=torch.full((5,), LONG))
    lengths = sorted(len(o) + 1 for o in outs)  # steps each sentence took, with eos
    assert rec.rows[0] == len(rows)  # the prefill
    assert len(rec.rows) == max(lengths)  # one prefill + one call per later step
    # After step s (1-based), the sentences with length > s remain.
    assert rec.rows[1:] == [sum(n > s for n in lengths) for s in range(1, max(lengths))]
    rec = Recorder(model)
    lm_beam_search(rec, ids, mask, EOS, PAD, beam=3, max_new_B=torch.full((5,), LONG))
    assert rec.rows[0] == 5 and rec.rows[1] <= 15
    assert rec.rows == sorted(rec.rows[:1]) + sorted(rec.rows[1:], reverse=True)
    assert rec.rows[-1] < 15 and all(r % 3 == 0 for r in rec.rows[1:])


@pytest.mark.parametrize("K", [1, 3])
def test_sync_done_keeps_decoding_with_rows(model, K: int) -> None:
    rows = prompts(0, MIXED)
    ids, mask = left_pad(rows)
    kw = dict(beam=K, max_new_B=torch.full((5,), LONG))
    plain = Recorder(model)
    expected = lm_beam_search(plain, ids, mask, EOS, PAD, **kw)

    extra = [3]
    calls: list[bool] = []

    def sync_done(local_done: bool) -> bool:  # another rank finishes 3 steps later
        calls.append(local_done)
        if local_done and extra[0] > 0:
            extra[0] -= 1
            return False
        return local_done

    rec = Recorder(model)
    assert lm_beam_search(rec, ids, mask, EOS, PAD, sync_done=sync_done, **kw) == expected
    assert len(rec.rows) == len(plain.rows) + 3
    assert rec.rows[:len(plain.rows)] == plain.rows
    assert all(r >= 1 for r in rec.rows) and rec.rows[-3:] == [plain.rows[-1]] * 3
    assert calls[-4:] == [True] * 4
    if K == 1:  # greedy too
        extra[0] = 3
        rec = Recorder(model)
        assert lm_greedy_search(rec, ids, mask, EOS, PAD, sync_done=sync_done,
                                max_new_B=kw["max_new_B"]) == expected
        assert len(rec.rows) == len(plain.rows) + 3 and min(rec.rows) >= 1


def test_prompts_must_be_left_padded(model) -> None:
    ids, mask = left_pad(prompts(0, [3, 5]))
    with pytest.raises(ValueError, match="left-padded"):
        lm_greedy_search(model, ids, mask.flip(1), EOS, PAD)


def test_the_cache_goes_by_the_name_this_transformers_takes(model, monkeypatch) -> None:
    """transformers 5.2x renamed forward's past_key_values to cache; the old name warns on every
    call and is to be removed, so the search passes the one the installed version takes."""
    import inspect

    takes = set(inspect.signature(model.hf.forward).parameters)
    rows = prompts(4, [5, 3])
    expected = greedy(model, rows)
    seen: list[set[str]] = []
    forward = model.hf.forward
    monkeypatch.setattr(model.hf, "forward", lambda *a, **kw: seen.append(set(kw)) or
                        forward(*a, **kw))
    assert greedy(model, rows) == expected
    assert len(seen) > 1 and all(kw <= takes for kw in seen), (seen, takes)
