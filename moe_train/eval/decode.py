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
from moe_train.data.corpus import collapse_spaces
from moe_train.data.vocab import Vocab
from moe_train.errors import DataError
from moe_train.eval.lm_search import lm_beam_search, lm_greedy_search
from moe_train.eval.search import beam_search, greedy_search
from moe_train.models.lm_batch import left_padded_prompts
from moe_train.parallel.zero3 import is_partitioned
from moe_train.models.context import ForwardContext
from moe_train.moe.routing import NUM_LANGS_KEY, TARGET_TOKENS_KEY
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
    languages lets task routers number language pairs; the real target tokens normalise
    sentence-level gate losses as the translation loss is)."""
    extras: dict = {TARGET_TOKENS_KEY: batch.n_tgt_tokens}
    if num_langs is not None:
        extras[NUM_LANGS_KEY] = num_langs
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
    if getattr(model, "decoder_only", False):
        # The source is the filled prompt + eos: left-pad it without the eos. The length limit
        # counts the prompt's tokens (template included) as the source length.
        prompt_BP, mask_BP = left_padded_prompts(src_BS, vocab.pad_id)
        kw = dict(eos_id=vocab.eos_id, pad_id=vocab.pad_id, max_len_a=ecfg.max_len_a,
                  max_len_b=ecfg.max_len_b, ctx=ctx, sync_done=sync_done)
        if beam <= 1:
            return lm_greedy_search(model, prompt_BP, mask_BP, **kw)
        return lm_beam_search(model, prompt_BP, mask_BP, beam=beam, lenpen=ecfg.lenpen, **kw)
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
    check_dataset_lengths(dataset, max_source_tokens(model),
                          None if indices is None else np.asarray(indices, dtype=np.int64),
                          positions_field(model))
    was_training = model.training
    model.eval()
    batches = eval_batches(dataset, max_tokens, vocab.pad_id, vocab.bos_id, vocab.eos_id,
                           dp_rank=rt.dp_rank, dp_world=rt.dp_world,
                           max_sentences=ecfg.max_sentences,
                           indices=None if indices is None else np.asarray(indices, dtype=np.int64))
    local: dict[int, str] = {}
    # Expert parallelism and ZeRO-3 make every forward collective: ranks decode in lockstep.
    lockstep = rt.ep_size > 1 or (rt.world_size > 1 and is_partitioned(model))
    sync_done = (lambda done: all_ranks_true(rt, done)) if lockstep else None
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


LONG_LINES = ("error", "truncate")
"""What `encode_lines` does with a line longer than the model takes: refuse the whole input
(nothing is translated) or cut the line to the limit and warn."""


def max_source_tokens(model: torch.nn.Module) -> int | None:
    """Most source tokens (end-of-sentence and tags included) the model's positions
    cover; None when the model has no limit."""
    limit = getattr(model, "max_source_tokens", None)
    return limit if limit is not None else getattr(model, "max_positions", None)


def positions_field(model: torch.nn.Module) -> str:
    """The config field that sets the model's position limit (for messages)."""
    return getattr(model, "positions_field", "model.max_positions")


def encode_lines(vocab: Vocab, lines: Sequence[str], limit: int | None, source: str = "input",
                 prefix_ids: Sequence[int] = (), long_lines: str = "error",
                 warn: Callable[[str], None] | None = None,
                 field: str = "model.max_positions", prompts: bool = False) -> list[list[int]]:
    """Encode raw lines (spaces collapsed as in prepared data, `collapse_spaces`; after the tag
    ids `prefix_ids`, end-of-sentence not included) and check them against `limit`
    (model.max_positions) before anything is translated. `prompts`: the lines are a
    decoder-only model's filled prompts, encoded as they are (their sources were collapsed
    before filling, as `prepare` does; the template's own newlines stay).

    A line that does not fit is a DataError naming ``source:line`` and the limit, unless
    `long_lines` is ``truncate``: then its tokens are cut to fit and `warn` hears about it.
    """
    if long_lines not in LONG_LINES:
        raise ValueError(f"long_lines: expected one of {', '.join(LONG_LINES)}, got {long_lines!r}")
    encoded = vocab.encode_batch(list(lines) if prompts else
                                 [collapse_spaces(line) for line in lines])
    if prefix_ids:
        encoded = [[*prefix_ids, *ids] for ids in encoded]
    if limit is None:
        return encoded
    room = limit - 1  # the end-of-sentence token takes one position
    for line_no, ids in enumerate(encoded, start=1):
        if len(ids) <= room:
            continue
        where = (f"{source}:{line_no}: {len(ids) + 1} source tokens (end-of-sentence "
                 f"included), more than the model's {field}={limit}")
        if long_lines == "error":
            raise DataError(f"{where}; nothing was translated (shorten or split the line, or "
                            "pass --long-lines truncate)")
        del ids[room:]
        if warn is not None:
            warn(f"{where}; translating its first {room} tokens only")
    return encoded


def check_dataset_lengths(dataset: Any, limit: int | None, indices: np.ndarray | None,
                          field: str = "model.max_positions") -> None:
    """Refuse a prepared split with a source longer than the model's positions (before any
    sentence is decoded), naming the split, the sentence and the limit."""
    if limit is None:
        return
    lengths = dataset.src_lengths if indices is None else dataset.src_lengths[indices]
    if len(lengths) and int(lengths.max()) + 1 > limit:  # + 1: the end-of-sentence token
        i = int(np.argmax(lengths))
        index = i if indices is None else int(indices[i])
        raise DataError(f"{dataset.prepared_dir}/{dataset.split}: sentence {index} (0-based) "
                        f"has {int(lengths[i]) + 1} source tokens (end-of-sentence included), "
                        f"more than the model's {field}={limit}; prepare the data with a "
                        f"smaller data.max_len or train with a larger {field}")


@torch.no_grad()
def translate_lines(model: torch.nn.Module, vocab: Vocab, lines: Sequence[str],
                    ecfg: EvalConfig, device: torch.device, prefix_ids: Sequence[int] = (),
                    beam: int | None = None, labels: RawTextLabels | None = None,
                    source: str = "input", long_lines: str = "error",
                    warn: Callable[[str], None] | None = None,
                    prompts: bool = False) -> list[str]:
    """Translate raw text lines (single process), longest first for tight batches.

    `labels` gives every line the same language / domain ids, which task routers (by language
    pair, target language or domain) need. Every line is encoded and checked against the
    model's positions before the first is translated (see `encode_lines`; `prompts`: the
    lines are filled prompts)."""
    model.eval()
    encoded = encode_lines(vocab, lines, max_source_tokens(model), source, prefix_ids,
                           long_lines, warn, positions_field(model), prompts=prompts)
    # a blank line translates to a blank line (the model never saw an empty source), and so
    # does one the tokenizer keeps nothing of (a zero-width space, a stray BOM)
    order = sorted((i for i, line in enumerate(lines)
                    if line.strip() and len(encoded[i]) > len(prefix_ids)),
                   key=lambda i: -len(encoded[i]))
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
