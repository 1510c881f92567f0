"""Greedy and beam search over an encoder-decoder model with an incremental-decoding cache.

Works with any model exposing ``encode(src, ctx) -> enc`` (with ``enc.index_select``),
``new_decoder_cache()`` (with ``cache.reorder``) and ``decode(tokens, enc, ctx, cache) ->
(logits, aux)``, e.g. `Seq2SeqTransformer`. The caller sets train/eval mode; search leaves it.

Lengths: a sentence with L real source tokens may produce at most
``max_len = floor(max_len_a * L + max_len_b)`` tokens (at least 1, at most the model's
``max_positions``) counting the final eos, which is forced at that limit.

Under expert parallelism every rank must call `decode` equally often: pass ``sync_done``, a
function that gets whether this rank has finished and returns whether all ranks have (an
all-reduce living in moe_train/parallel/); a finished rank then keeps decoding dummy steps.

Shape legend: B sentences, K beam, N = B * K decoding rows, S source length, V vocabulary,
C candidates kept per step (2K), F hypotheses finished in one step.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from moe_train.models.context import ForwardContext


class IncrementalSeq2Seq(Protocol):
    """The model interface search needs."""

    def encode(self, src_tokens_BS: Tensor, ctx: ForwardContext | None = None) -> Any: ...

    def new_decoder_cache(self) -> Any: ...

    def decode(self, tgt_in_BT: Tensor, enc: Any, ctx: ForwardContext | None = None,
               cache: Any = None) -> tuple[Tensor, dict[str, Tensor]]: ...


def max_lengths(model: Any, src_tokens_BS: Tensor, pad_id: int, max_len_a: float,
                max_len_b: float) -> Tensor:
    """Per-sentence output length limit (tokens including eos), LongTensor (B,)."""
    src_len_B = src_tokens_BS.ne(pad_id).sum(dim=1).double()
    max_len_B = (max_len_a * src_len_B + max_len_b).floor().long().clamp(min=1)
    limit = getattr(model, "max_positions", None)
    return max_len_B.clamp(max=limit) if limit is not None else max_len_B


def _stop(local_done: bool, sync_done: Callable[[bool], bool] | None) -> bool:
    return local_done if sync_done is None else bool(sync_done(local_done))


def _next_log_probs(model: IncrementalSeq2Seq, prev_N1: Tensor, enc: Any,
                    ctx: ForwardContext | None, cache: Any, step: int, max_len_N: Tensor,
                    bos_id: int, eos_id: int, pad_id: int, min_len: int = 0) -> Tensor:
    """Float32 log-probs (N, V) of the next token; pad (and bos) banned, eos banned before
    `min_len` tokens and forced at the limit (the limit wins)."""
    logits_N1V, _ = model.decode(prev_N1, enc, ctx, cache)
    lprobs_NV = torch.log_softmax(logits_N1V[:, -1].float(), dim=-1)
    lprobs_NV[:, pad_id] = -torch.inf
    if bos_id != eos_id:
        lprobs_NV[:, bos_id] = -torch.inf
    at_limit_N = step + 1 >= max_len_N
    if step + 1 < min_len:
        lprobs_NV[:, eos_id] = torch.where(at_limit_N, lprobs_NV[:, eos_id], -torch.inf)
    if bool(at_limit_N.any()):
        eos_NV = torch.full_like(lprobs_NV, -torch.inf)
        eos_NV[:, eos_id] = lprobs_NV[:, eos_id]
        lprobs_NV = torch.where(at_limit_N[:, None], eos_NV, lprobs_NV)
    return lprobs_NV


@torch.no_grad()
def greedy_search(model: IncrementalSeq2Seq, src_tokens_BS: Tensor, bos_id: int, eos_id: int,
                  pad_id: int, max_len_a: float = 1.2, max_len_b: int = 10,
                  ctx: ForwardContext | None = None,
                  sync_done: Callable[[bool], bool] | None = None,
                  min_len: int = 0) -> list[list[int]]:
    """Most likely next token at every step; returns each sentence's tokens without bos/eos.
    `min_len`: eos is banned until that many tokens (eos included), e.g. for fixed-length
    throughput measurements."""
    B = src_tokens_BS.size(0)
    device = src_tokens_BS.device
    max_len_B = max_lengths(model, src_tokens_BS, pad_id, max_len_a, max_len_b).to(device)
    enc = model.encode(src_tokens_BS, ctx)
    cache = model.new_decoder_cache()
    prev_B1 = torch.full((B, 1), bos_id, dtype=torch.long, device=device)
    finished_B = torch.zeros(B, dtype=torch.bool, device=device)
    steps: list[Tensor] = []
    for step in itertools.count():
        lprobs_BV = _next_log_probs(model, prev_B1, enc, ctx, cache, step, max_len_B,
                                    bos_id, eos_id, pad_id, min_len)
        next_B = lprobs_BV.argmax(dim=-1)
        next_B = torch.where(finished_B, torch.full_like(next_B, pad_id), next_B)
        steps.append(next_B)
        finished_B |= next_B.eq(eos_id)  # the length limit forces eos, so this ends the loop
        if _stop(bool(finished_B.all()), sync_done):
            break
        prev_B1 = next_B[:, None]  # finished rows feed pad
    out_BT = torch.stack(steps, dim=1).tolist()
    return [_strip(row, eos_id) for row in out_BT]


def _strip(tokens: list[int], eos_id: int) -> list[int]:
    return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


@torch.no_grad()
def beam_search(model: IncrementalSeq2Seq, src_tokens_BS: Tensor, bos_id: int, eos_id: int,
                pad_id: int, beam: int = 5, lenpen: float = 1.0, max_len_a: float = 1.2,
                max_len_b: int = 10, ctx: ForwardContext | None = None,
                sync_done: Callable[[bool], bool] | None = None,
                min_len: int = 0) -> list[list[int]]:
    """Batched beam search; returns each sentence's best hypothesis without bos/eos
    (`min_len` as in `greedy_search`).

    Each step takes the top 2K of the K x V extensions per sentence. Eos extensions ranked in the
    top K become finished hypotheses (scored sum(log p) / len**lenpen, len counting eos); the K
    best non-eos extensions stay live. A sentence stops once it has K finished hypotheses (the
    fairseq rule, so beam 1 is greedy) or reaches its length limit.
    """
    if beam < 1:
        raise ValueError(f"beam: expected a positive integer, got {beam}")
    B, K = src_tokens_BS.size(0), beam
    N = B * K
    device = src_tokens_BS.device
    max_len_B = max_lengths(model, src_tokens_BS, pad_id, max_len_a, max_len_b).to(device)
    max_len_N = max_len_B.repeat_interleave(K)

    expand_N = torch.arange(B, device=device).repeat_interleave(K)
    enc = model.encode(src_tokens_BS, ctx).index_select(expand_N)
    ctx_N = None if ctx is None else ctx.index_select(expand_N)
    cache = model.new_decoder_cache()

    # Only beam 0 is live at the start; the others are -inf so they never win a slot.
    scores_BK = torch.full((B, K), -torch.inf, device=device)
    scores_BK[:, 0] = 0.0
    tokens_NT = torch.empty((N, 0), dtype=torch.long, device=device)
    prev_N1 = torch.full((N, 1), bos_id, dtype=torch.long, device=device)
    row_base_B1 = torch.arange(B, device=device)[:, None] * K
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done_B = torch.zeros(B, dtype=torch.bool, device=device)

    for step in itertools.count():
        lprobs_NV = _next_log_probs(model, prev_N1, enc, ctx_N, cache, step, max_len_N,
                                    bos_id, eos_id, pad_id, min_len)
        V = lprobs_NV.size(-1)
        cand_BX = (scores_BK[:, :, None] + lprobs_NV.view(B, K, V)).view(B, K * V)
        top_scores_BC, top_idx_BC = cand_BX.topk(min(2 * K, K * V), dim=1)
        top_beam_BC = top_idx_BC // V
        top_tok_BC = top_idx_BC % V
        is_eos_BC = top_tok_BC.eq(eos_id)

        final_BK = is_eos_BC[:, :K] & top_scores_BC[:, :K].isfinite() & ~done_B[:, None]
        if bool(final_BK.any()):  # one host transfer per step, not per hypothesis
            b_F, c_F = final_BK.nonzero(as_tuple=True)
            hyps = tokens_NT.index_select(0, b_F * K + top_beam_BC[b_F, c_F]).tolist()
            scores = (top_scores_BC[b_F, c_F].double() / (step + 1) ** lenpen).tolist()
            for b, score, hyp in zip(b_F.tolist(), scores, hyps):
                finished[b].append((score, hyp))
        n_finished_B = torch.tensor([len(f) for f in finished], device=device)
        done_B |= n_finished_B.ge(K) | max_len_B.le(step + 1)
        if _stop(bool(done_B.all()), sync_done):
            break

        # Live: the first K non-eos candidates, in score order (there are at most K eos ones).
        C = top_idx_BC.size(1)
        rank_BC = torch.arange(C, device=device)[None] + is_eos_BC.long() * C
        live_BK = rank_BC.topk(K, dim=1, largest=False).indices
        scores_BK = top_scores_BC.gather(1, live_BK)
        reorder_N = (row_base_B1 + top_beam_BC.gather(1, live_BK)).view(N)
        next_N = top_tok_BC.gather(1, live_BK).view(N)
        tokens_NT = torch.cat([tokens_NT.index_select(0, reorder_N), next_N[:, None]], dim=1)
        cache.reorder(reorder_N)
        prev_N1 = next_N[:, None]

    results = []
    for b in range(B):
        if finished[b]:
            results.append(max(finished[b], key=lambda item: item[0])[1])
        else:  # unreachable with a finite model: the limit forces eos on every live beam
            results.append(_strip(tokens_NT[b * K].tolist(), eos_id))
    return results
