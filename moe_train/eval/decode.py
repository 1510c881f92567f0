"""Batched translation of prepared-data sentences or raw text lines, sharded over ranks.

Every rank runs the same number of search calls (filler batches are decoded and discarded), so
collectives inside the model (expert parallelism) stay in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Callable, Sequence

import numpy as np
import torch

from moe_train.config.schema import EvalConfig
from moe_train.data.batching import Batch, eval_batches
from moe_train.data.vocab import Vocab
from moe_train.eval.search import beam_search, greedy_search
from moe_train.models.context import ForwardContext
from moe_train.moe.routing import NUM_LANGS_KEY
from moe_train.parallel.collectives import all_gather_object, all_ranks_true
from moe_train.parallel.runtime import ParallelRuntime


@dataclass(frozen=True)
class RawTextLabels:
    """Ids shared by every line of a raw-text input (None: unknown), and the number of
    languages (for language-pair task ids)."""

    src_lang: int | None = None
    tgt_lang: int | None = None
    domain: int | None = None
    num_langs: int | None = None

    def context(self, src_BS: torch.Tensor, pad_id: int) -> ForwardContext:
        """The ForwardContext of a batch of such lines."""
        B = src_BS.size(0)

        def ids(value: int | None) -> torch.Tensor | None:
            return None if value is None else torch.full((B,), value, dtype=torch.long,
                                                         device=src_BS.device)

        extras = {} if self.num_langs is None else {NUM_LANGS_KEY: self.num_langs}
        return ForwardContext(src_pad_mask_BS=src_BS.eq(pad_id), src_lang_B=ids(self.src_lang),
                              tgt_lang_B=ids(self.tgt_lang), domain_ids_B=ids(self.domain),
                              extras=extras)


def batch_context(batch: Batch, pad_id: int, num_langs: int | None = None) -> ForwardContext:
    """The routing context of a batch (padding mask, domain and language ids; the number of
    languages lets task routers number language pairs)."""
    extras = {} if num_langs is None else {NUM_LANGS_KEY: num_langs}
    return ForwardContext(src_pad_mask_BS=batch.src_tokens_BS.eq(pad_id),
                          domain_ids_B=batch.domain_ids_B, src_lang_B=batch.src_lang_B,
                          tgt_lang_B=batch.tgt_lang_B, extras=extras)


def search(model: torch.nn.Module, src_BS: torch.Tensor, ctx: ForwardContext, vocab: Vocab,
           ecfg: EvalConfig, beam: int | None = None,
           sync_done: Callable[[bool], bool] | None = None) -> list[list[int]]:
    """Beam search (beam > 1) or greedy search on one batch.

    `sync_done` (expert parallelism) makes every rank take the same number of decoder steps.
    """
    beam = ecfg.beam if beam is None else beam
    kw = dict(bos_id=vocab.bos_id, eos_id=vocab.eos_id, pad_id=vocab.pad_id,
              max_len_a=ecfg.max_len_a, max_len_b=ecfg.max_len_b, ctx=ctx, sync_done=sync_done)
    if beam <= 1:
        return greedy_search(model, src_BS, **kw)
    return beam_search(model, src_BS, beam=beam, lenpen=ecfg.lenpen, **kw)


@torch.no_grad()
def translate_dataset(model: torch.nn.Module, dataset: Any, vocab: Vocab, rt: ParallelRuntime,
                      ecfg: EvalConfig, max_tokens: int, indices: Sequence[int] | None = None,
                      beam: int | None = None) -> dict[int, str]:
    """Translate dataset sentences (all, or `indices`); every rank returns {index: text}."""
    was_training = model.training
    model.eval()
    batches = eval_batches(dataset, max_tokens, vocab.pad_id, vocab.bos_id, vocab.eos_id,
                           dp_rank=rt.dp_rank, dp_world=rt.dp_world,
                           max_sentences=ecfg.max_sentences,
                           indices=None if indices is None else np.asarray(indices))
    local: dict[int, str] = {}
    sync_done = (lambda done: all_ranks_true(rt, done)) if rt.ep_size > 1 else None
    for batch in batches:
        batch = batch.to(rt.device)
        ctx = batch_context(batch, vocab.pad_id, len(dataset.manifest["langs"]))
        hyps = search(model, batch.src_tokens_BS, ctx, vocab, ecfg, beam, sync_done)
        if not batch.is_padding:
            for idx, ids in zip(batch.indices_B.tolist(), hyps):
                local[idx] = vocab.decode(ids)
    model.train(was_training)
    merged: dict[int, str] = {}
    for part in all_gather_object(rt, local):
        merged.update(part)
    return merged


@torch.no_grad()
def translate_lines(model: torch.nn.Module, vocab: Vocab, lines: Sequence[str],
                    ecfg: EvalConfig, device: torch.device, lang_tag_id: int | None = None,
                    beam: int | None = None, labels: RawTextLabels | None = None) -> list[str]:
    """Translate raw text lines (single process), longest first for tight batches.

    `labels` gives every line the same language / domain ids, which task routers (by language
    pair, target language or domain) need."""
    model.eval()
    encoded = vocab.encode_batch(list(lines))
    if lang_tag_id is not None:
        encoded = [[lang_tag_id] + ids for ids in encoded]
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    out: list[str] = [""] * len(encoded)
    for start in range(0, len(order), ecfg.max_sentences):
        chunk = order[start:start + ecfg.max_sentences]
        width = max(1, max(len(encoded[i]) + 1 for i in chunk))
        src_BS = torch.full((len(chunk), width), vocab.pad_id, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids = encoded[i] + [vocab.eos_id]
            src_BS[row, :len(ids)] = torch.tensor(ids)
        src_BS = src_BS.to(device)
        ctx = (labels or RawTextLabels()).context(src_BS, vocab.pad_id)
        for i, ids in zip(chunk, search(model, src_BS, ctx, vocab, ecfg, beam)):
            out[i] = vocab.decode(ids)
    return out
