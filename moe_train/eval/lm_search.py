"""Greedy and beam search over a decoder-only model with transformers' KV cache.

Works with any model called like `Qwen2MoEForCausalLM`: ``model(input_ids_BT, ctx,
attention_mask_BT=..., past_key_values=..., use_cache=True)`` returning an output with
``logits_BTV`` and the cache in ``extras["past_key_values"]`` (a transformers ``Cache``: rows
are selected with ``batch_select_indices``, else ``reorder_cache``); the prefill also passes
``logits_to_keep=1`` (the last position's logits only). The caller sets train/eval mode;
search leaves it.

Prompts are LEFT-padded (mask 0 at the padding), so every prompt ends in the last column and
its continuation starts right after it. One prefill call runs over the prompts; its last
position gives the first token's distribution, then each step feeds the new token with the
attention mask extended by one column (the mask always covers the cached and the new
positions; the model derives positions from it, so left padding shifts nothing). Beam search
prefills the B prompts once and repeats the cache rows K times.

Lengths: as in moe_train.eval.search, a sentence may produce at most
``max_len = floor(max_len_a * src_len + max_len_b)`` tokens (at least 1) counting the final
eos, which is forced at that limit. The prompt holds template tokens (instruction, language
tags) besides the source sentence, so the source length is given per sentence as
``src_len_B``; without it, the prompt's real token count is used. ``max_new_B`` gives the limits
directly instead. The limit is also capped so that prompt + output fit the model's
``max_positions`` (when it has one). Pad is never produced; ``min_len`` bans eos before that
many tokens (eos included).

Finished sentences leave the batch (search.py's `_LiveRows`): the KV cache, the attention mask,
the `ForwardContext` (``ctx.index_select``, so per-sentence routing inputs such as
``ctx.tgt_lang_B`` follow) and the per-row state keep only the live rows. ``sync_done`` is
search.py's: under expert parallelism a rank that has finished keeps decoding dummy steps (its
finished rows feed pad, masked out) so every rank calls the model equally often; rows never
drop to zero.

Shape legend: B sentences, P prompt length, T positions so far, K beam, N = B * K decoding rows
(A live greedy rows, L live sentences), V vocabulary, C candidates per step (2K).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch import Tensor

from moe_train.eval.beam import BeamBook, GreedyBook
from moe_train.eval.search import (_LiveRows, _next_log_probs, _stop, first_limit,
                                   min_lengths)
from moe_train.models.context import ForwardContext
from moe_train.models.lm_batch import with_prompt_mask


class _GivenLogits:
    """Stands in for search.py's ``model.decode`` so `_next_log_probs` applies its bans
    (pad, min_len, eos forced at the limit) to logits this module already computed."""

    def __init__(self, logits_N1V: Tensor) -> None:
        self.logits_N1V = logits_N1V

    def decode(self, *_: Any) -> tuple[Tensor, dict[str, Tensor]]:
        return self.logits_N1V, {}


def _constrained(logits_N1V: Tensor, ctx: ForwardContext | None, step: int, max_len_N: Tensor,
                 eos_id: int, pad_id: int, min_len_N: Tensor | None,
                 normalize: bool, lowest: int) -> Tensor:
    # bos_id = eos_id: no bos to ban (the prompt ends where the output begins).
    return _next_log_probs(_GivenLogits(logits_N1V), None, None, ctx, None, step, max_len_N,
                           eos_id, eos_id, pad_id, min_len_N, normalize=normalize,
                           first_limit=lowest)


class _Mask:
    """The attention mask (N, T) of the cached positions, as `_LiveRows`'s ``enc``."""

    def __init__(self, mask_NT: Tensor) -> None:
        self.mask_NT = mask_NT

    def index_select(self, rows_R: Tensor) -> _Mask:
        return _Mask(self.mask_NT.index_select(0, rows_R))

    def extend(self, new_N: Tensor) -> None:
        self.mask_NT = torch.cat([self.mask_NT, new_N.to(self.mask_NT.dtype)[:, None]], dim=1)


class _KVCache:
    """transformers' cache behind the ``reorder(rows)`` `_LiveRows` calls, with the model's
    routing state (`new_routing_state`, e.g. THOR's E_p and context sums), reordered alike."""

    def __init__(self, cache: Any, routing_state: Any = None) -> None:
        self.cache, self.routing_state = cache, routing_state

    def reorder(self, rows_R: Tensor) -> None:
        select = getattr(self.cache, "batch_select_indices", None)
        if select is not None:
            select(rows_R)
        else:
            self.cache.reorder_cache(rows_R)
        if self.routing_state is not None:
            self.routing_state.reorder(rows_R)

    def kwargs(self) -> dict[str, Any]:
        """The model call's routing-state argument (none for models without one)."""
        return {} if self.routing_state is None else {"routing_state": self.routing_state}


def lm_max_lengths(model: Any, prompt_mask_BP: Tensor, max_len_a: float, max_len_b: float,
                   src_len_B: Tensor | None = None,
                   max_new_B: Tensor | None = None) -> Tensor:
    """Per-sentence output length limit (tokens including eos), LongTensor (B,): `max_new_B`
    if given, else floor(max_len_a * src_len_B + max_len_b) (src_len_B: the prompts' real
    token counts when None); at least 1, and at most the positions the prompt leaves free plus
    one: the last output (eos) is predicted, never fed, so P prompt tokens in L positions leave
    room for L - P + 1 outputs (as training fits prompt + target in L)."""
    prompt_len_B = prompt_mask_BP.ne(0).sum(dim=1)
    if max_new_B is not None:
        max_len_B = torch.as_tensor(max_new_B, device=prompt_mask_BP.device).long()
    else:
        src_B = prompt_len_B if src_len_B is None else torch.as_tensor(src_len_B)
        src_B = src_B.to(prompt_mask_BP.device).double()
        max_len_B = (max_len_a * src_B + max_len_b).floor().long()
    max_len_B = max_len_B.clamp(min=1)
    limit = getattr(model, "max_positions", None)
    if limit is not None:
        max_len_B = torch.minimum(max_len_B, (limit - prompt_len_B + 1).clamp(min=1))
    return max_len_B


def _prefill(model: Any, prompt_BP: Tensor, prompt_mask_BP: Tensor | None,
             ctx: ForwardContext | None) -> tuple[Tensor, Tensor, ForwardContext | None, _KVCache]:
    """One call over the prompts: (mask (B, P), last logits (B, 1, V), ctx, cache). A model
    with ``new_routing_state`` gets a fresh state, passed on every call; the prefill's context
    marks the prompt positions (``extras[PROMPT_MASK_KEY]``: THOR's task predictor pools
    over them, then keeps E_p fixed in that state for the sentence)."""
    mask_BP = (torch.ones_like(prompt_BP) if prompt_mask_BP is None
               else prompt_mask_BP.to(prompt_BP.device).long())
    if bool(mask_BP[:, -1].eq(0).any()):
        raise ValueError("lm search: prompts must be left-padded (every mask row ends in 1)")
    if ctx is not None:  # the model fills the padding of each call from the attention mask
        ctx = ctx.replace(tgt_pad_mask_BT=None)
    new_state = getattr(model, "new_routing_state", None)
    cache = _KVCache(None, None if new_state is None else new_state())
    prefill_ctx = with_prompt_mask(ctx, mask_BP, mask_BP.size(1))
    out = model(prompt_BP, prefill_ctx, attention_mask_BT=mask_BP, use_cache=True,
                logits_to_keep=1, **cache.kwargs())
    cache.cache = out.extras["past_key_values"]
    return mask_BP, out.logits_BTV[:, -1:], ctx, cache


def _step(model: Any, prev_N: Tensor, live: _LiveRows, real_N: Tensor) -> Tensor:
    """Feed one token per row (real_N False: a pad, masked out); the next logits (N, 1, V)."""
    live.enc.extend(real_N)
    out = model(prev_N[:, None], live.ctx, attention_mask_BT=live.enc.mask_NT,
                past_key_values=live.cache.cache, use_cache=True, **live.cache.kwargs())
    live.cache.cache = out.extras["past_key_values"]
    return out.logits_BTV[:, -1:]


@torch.no_grad()
def lm_greedy_search(model: Any, prompt_BP: Tensor, prompt_mask_BP: Tensor | None, eos_id: int,
                     pad_id: int, max_len_a: float = 1.2, max_len_b: int = 10,
                     src_len_B: Tensor | None = None, ctx: ForwardContext | None = None,
                     sync_done: Callable[[bool], bool] | None = None, min_len: int = 0,
                     max_new_B: Tensor | None = None) -> list[list[int]]:
    """Most likely next token at every step; returns each sentence's continuation without
    the prompt and eos. Lengths, `min_len`, `sync_done`: see the module docstring."""
    B = prompt_BP.size(0)
    device = prompt_BP.device
    mask_BP, logits_A1V, ctx, cache = _prefill(model, prompt_BP, prompt_mask_BP, ctx)
    max_len_A = lm_max_lengths(model, mask_BP, max_len_a, max_len_b, src_len_B, max_new_B)
    min_len_A = min_lengths(min_len, B, device)
    live = _LiveRows(_Mask(mask_BP), ctx, cache)
    book = GreedyBook(B, max_len_A, min_len_A, eos_id, pad_id, device)
    prev_A: Tensor | None = None  # the prefill gave step 0's logits
    lowest = first_limit(max_len_A)
    for step in itertools.count():
        if prev_A is not None:
            logits_A1V = _step(model, prev_A, live, ~book.finished_A)
        lprobs_AV = _constrained(logits_A1V, live.ctx, step, book.max_len_A, eos_id, pad_id,
                                 book.min_len_A, normalize=False, lowest=lowest)
        next_A, all_done = book.advance(lprobs_AV)
        if _stop(all_done, sync_done):
            break
        prev_A = next_A  # finished rows feed pad (masked) while they stay
        keep_R = book.prune()
        if keep_R is not None:
            live.keep(keep_R)
            prev_A = prev_A.index_select(0, keep_R)
    return book.results()


@torch.no_grad()
def lm_beam_search(model: Any, prompt_BP: Tensor, prompt_mask_BP: Tensor | None, eos_id: int,
                   pad_id: int, beam: int = 5, lenpen: float = 1.0, max_len_a: float = 1.2,
                   max_len_b: int = 10, src_len_B: Tensor | None = None,
                   ctx: ForwardContext | None = None,
                   sync_done: Callable[[bool], bool] | None = None, min_len: int = 0,
                   max_new_B: Tensor | None = None) -> list[list[int]]:
    """Batched beam search with search.py's `beam_search` rule; returns each sentence's best
    continuation without the prompt and eos.

    Each step takes the top 2K of the K x V extensions per sentence. Eos extensions ranked in the
    top K become finished hypotheses (scored sum(log p) / len**lenpen, len counting eos); the K
    best non-eos extensions stay live. A sentence stops once it has K finished hypotheses or
    reaches its length limit, and its rows leave the batch. Beam 1 is `lm_greedy_search`
    itself (ties broken alike, as in `beam_search`).
    """
    if beam < 1:
        raise ValueError(f"beam: expected a positive integer, got {beam}")
    if beam == 1:
        return lm_greedy_search(model, prompt_BP, prompt_mask_BP, eos_id, pad_id, max_len_a,
                                max_len_b, src_len_B, ctx, sync_done, min_len, max_new_B)
    B, K = prompt_BP.size(0), beam
    device = prompt_BP.device
    mask_BP, logits_B1V, ctx, cache = _prefill(model, prompt_BP, prompt_mask_BP, ctx)
    max_len_L = lm_max_lengths(model, mask_BP, max_len_a, max_len_b, src_len_B, max_new_B)
    min_len_L = min_lengths(min_len, B, device)

    expand_N = torch.arange(B, device=device).repeat_interleave(K)
    live = _LiveRows(_Mask(mask_BP), ctx, cache)
    live.keep(expand_N)  # one prefill per sentence, its rows repeated for the K beams
    logits_N1V = logits_B1V.index_select(0, expand_N)
    book = BeamBook(B, K, max_len_L, min_len_L, eos_id, lenpen, device)
    prev_N: Tensor | None = None  # the prefill gave step 0's logits
    lowest = first_limit(max_len_L)
    for step in itertools.count():
        if prev_N is not None:
            logits_N1V = _step(model, prev_N, live, torch.ones_like(prev_N, dtype=torch.bool))
        max_len_N, min_len_N = book.limits_N()
        lprobs_NV = _constrained(logits_N1V, live.ctx, step, max_len_N, eos_id, pad_id,
                                 min_len_N, normalize=True, lowest=lowest)
        if _stop(book.advance(lprobs_NV, step), sync_done):
            break
        reorder_N, next_N, rows_R = book.select()
        if rows_R is not None:
            # done sentences leave: the context follows the kept sentences (equal over a
            # sentence's beams), the mask and the cache follow reorder_N
            live.ctx = None if live.ctx is None else live.ctx.index_select(rows_R)
        live.enc = live.enc.index_select(reorder_N)
        live.cache.reorder(reorder_N)
        prev_N = next_N
    return book.results()


__all__ = ["lm_beam_search", "lm_greedy_search", "lm_max_lengths"]
