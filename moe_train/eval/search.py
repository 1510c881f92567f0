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

from moe_train.eval.beam import BeamBook, GreedyBook
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


def min_lengths(min_len: int, B: int, device: torch.device) -> Tensor | None:
    """The minimum output length (tokens including eos) per sentence, LongTensor (B,); None
    when there is no minimum."""
    return torch.full((B,), min_len, dtype=torch.long, device=device) if min_len > 0 else None


def _stop(local_done: bool, sync_done: Callable[[bool], bool] | None) -> bool:
    return local_done if sync_done is None else bool(sync_done(local_done))


def _next_log_probs(model: IncrementalSeq2Seq, prev_N1: Tensor, enc: Any,
                    ctx: ForwardContext | None, cache: Any, step: int, max_len_N: Tensor,
                    bos_id: int, eos_id: int, pad_id: int,
                    min_len_N: Tensor | None = None, normalize: bool = True,
                    first_limit: int = 0) -> Tensor:
    """Float32 log-probs (N, V) of the next token; pad (and bos) banned, eos banned before
    `min_len_N` tokens (None: no minimum) and forced at the limit (the limit wins).
    `normalize` False returns the logits with the same bans: enough for an argmax (greedy),
    without the log-softmax over the vocabulary. `first_limit`: no row's limit is below it
    (the search reads it once), so earlier steps skip the forcing without asking the device."""
    logits_N1V, _ = model.decode(prev_N1, enc, ctx, cache)
    lprobs_NV = logits_N1V[:, -1].float()
    if normalize:
        lprobs_NV = torch.log_softmax(lprobs_NV, dim=-1)
    elif lprobs_NV.data_ptr() == logits_N1V.data_ptr():
        lprobs_NV = lprobs_NV.clone()  # the bans below must not write into the model's output
    lprobs_NV[:, pad_id] = -torch.inf
    if bos_id != eos_id:
        lprobs_NV[:, bos_id] = -torch.inf
    at_limit_N = step + 1 >= max_len_N
    if min_len_N is not None:
        ban_N = (step + 1 < min_len_N) & ~at_limit_N
        lprobs_NV[:, eos_id] = torch.where(ban_N, -torch.inf, lprobs_NV[:, eos_id])
    if step + 1 >= first_limit:  # a row may be at its limit (asking would be a host sync)
        eos_NV = torch.full_like(lprobs_NV, -torch.inf)
        eos_NV[:, eos_id] = lprobs_NV[:, eos_id]
        lprobs_NV = torch.where(at_limit_N[:, None], eos_NV, lprobs_NV)
    return lprobs_NV


def first_limit(max_len_B: Tensor) -> int:
    """The smallest length limit of a search's sentences (one host read per search): rows
    leave as they finish, so no live row's limit is ever below it."""
    return int(max_len_B.min()) if max_len_B.numel() else 0


class _LiveRows:
    """The decoding rows still running, and how to drop the others (fairseq's batch pruning).

    A finished sentence's rows leave the batch: the encoder states, the context and the decoder
    cache keep only the live rows, so the remaining steps cost what the live sentences need,
    not what the batch once held. Under `sync_done` (expert parallelism) a rank whose every
    sentence has finished keeps its last rows decoding dummy steps, so it still takes part in
    each step's all-to-all; rows are never dropped to zero.
    """

    def __init__(self, enc: Any, ctx: ForwardContext | None, cache: Any) -> None:
        self.enc, self.ctx, self.cache = enc, ctx, cache

    def keep(self, rows_R: Tensor, cache: bool = True) -> None:
        """Keep only `rows_R` (indices of the current rows), in that order; `cache` False
        leaves the decoder cache to the caller (beam search reorders it once per step)."""
        self.enc = self.enc.index_select(rows_R)
        self.ctx = None if self.ctx is None else self.ctx.index_select(rows_R)
        if cache:
            self.cache.reorder(rows_R)


@torch.no_grad()
def greedy_search(model: IncrementalSeq2Seq, src_tokens_BS: Tensor, bos_id: int, eos_id: int,
                  pad_id: int, max_len_a: float = 1.2, max_len_b: int = 10,
                  ctx: ForwardContext | None = None,
                  sync_done: Callable[[bool], bool] | None = None,
                  min_len: int = 0) -> list[list[int]]:
    """Most likely next token at every step; returns each sentence's tokens without bos/eos.
    Finished sentences leave the batch (`_LiveRows`). `min_len`: eos is banned until that many
    tokens (eos included), e.g. for fixed-length throughput measurements."""
    B = src_tokens_BS.size(0)
    device = src_tokens_BS.device
    max_len_A = max_lengths(model, src_tokens_BS, pad_id, max_len_a, max_len_b).to(device)
    min_len_A = min_lengths(min_len, B, device)
    live = _LiveRows(model.encode(src_tokens_BS, ctx), ctx, model.new_decoder_cache())
    book = GreedyBook(B, max_len_A, min_len_A, eos_id, pad_id, device)
    prev_A1 = torch.full((B, 1), bos_id, dtype=torch.long, device=device)
    lowest = first_limit(max_len_A)
    for step in itertools.count():
        lprobs_AV = _next_log_probs(model, prev_A1, live.enc, live.ctx, live.cache, step,
                                    book.max_len_A, bos_id, eos_id, pad_id, book.min_len_A,
                                    normalize=False, first_limit=lowest)
        next_A, all_done = book.advance(lprobs_AV)
        if _stop(all_done, sync_done):
            break
        prev_A1 = next_A[:, None]  # finished rows feed pad while they stay
        keep_R = book.prune()
        if keep_R is not None:
            live.keep(keep_R)
            prev_A1 = prev_A1.index_select(0, keep_R)
    return book.results()


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
    fairseq rule) or reaches its length limit, and its rows leave the batch (`_LiveRows`).
    Beam 1 is `greedy_search` itself: the rule gives the same search, and exact ties (common in
    bf16 logits) are then broken alike, by the lower token id (topk orders ties arbitrarily).
    """
    if beam < 1:
        raise ValueError(f"beam: expected a positive integer, got {beam}")
    if beam == 1:
        return greedy_search(model, src_tokens_BS, bos_id, eos_id, pad_id, max_len_a, max_len_b,
                             ctx, sync_done, min_len)
    B, K = src_tokens_BS.size(0), beam
    device = src_tokens_BS.device
    max_len_L = max_lengths(model, src_tokens_BS, pad_id, max_len_a, max_len_b).to(device)
    min_len_L = min_lengths(min_len, B, device)

    expand_N = torch.arange(B, device=device).repeat_interleave(K)
    live = _LiveRows(model.encode(src_tokens_BS, ctx).index_select(expand_N),
                     None if ctx is None else ctx.index_select(expand_N),
                     model.new_decoder_cache())
    book = BeamBook(B, K, max_len_L, min_len_L, eos_id, lenpen, device)
    prev_N1 = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)
    lowest = first_limit(max_len_L)
    for step in itertools.count():
        max_len_N, min_len_N = book.limits_N()
        lprobs_NV = _next_log_probs(model, prev_N1, live.enc, live.ctx, live.cache, step,
                                    max_len_N, bos_id, eos_id, pad_id, min_len_N,
                                    first_limit=lowest)
        if _stop(book.advance(lprobs_NV, step), sync_done):
            break
        reorder_N, next_N, rows_R = book.select()
        if rows_R is not None:  # done sentences leave the batch (_LiveRows)
            live.keep(rows_R, cache=False)  # the cache follows reorder_N below
        live.cache.reorder(reorder_N)
        prev_N1 = next_N[:, None]
    return book.results()
