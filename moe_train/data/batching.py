"""Token-budget batching: temperature sampling over corpora, length bucketing, rank sharding.

Tensor legend: B sentences in a micro-batch, S padded source length (tokens + eos), T padded
target length (bos + tokens, or tokens + eos).

An epoch's plan (which sentences are drawn, how they are cut into micro-batches, in which order
the micro-batches come) is a pure function of ``(seed, epoch)``, so every data-parallel rank
computes the same global list without communicating and a checkpoint only has to store the
position ``(epoch, micro-batch)`` to resume exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from moe_train.errors import CheckpointError, DataError

_SALT_TIES, _SALT_ORDER = 1, 2  # independent random streams of one (seed, epoch)


class ParallelDataset(Protocol):
    """What batching needs from a dataset (see `moe_train.data.shards.ShardedDataset`)."""

    src_lengths: np.ndarray
    tgt_lengths: np.ndarray
    corpus_ids: np.ndarray
    domain_ids: np.ndarray
    src_lang_ids: np.ndarray
    tgt_lang_ids: np.ndarray
    corpus_sizes: list[int]
    corpus_offsets: np.ndarray

    def __len__(self) -> int: ...
    def src(self, i: int) -> np.ndarray: ...
    def tgt(self, i: int) -> np.ndarray: ...


# ---------------------------------------------------------------------------------------- Batch
@dataclass
class Batch:
    """One padded micro-batch; the source ends with eos, targets are shifted by one."""

    src_tokens_BS: torch.Tensor
    """Source ids + eos, right-padded with pad_id."""
    tgt_in_BT: torch.Tensor
    """bos + target ids (decoder input), right-padded."""
    tgt_out_BT: torch.Tensor
    """target ids + eos (labels), right-padded."""
    indices_B: torch.Tensor
    """Global dataset index of each row."""
    domain_ids_B: torch.Tensor
    src_lang_B: torch.Tensor
    tgt_lang_B: torch.Tensor
    corpus_ids_B: torch.Tensor
    n_src_tokens: int
    """Non-pad source tokens (incl. eos)."""
    n_tgt_tokens: int
    """Non-pad target tokens (incl. eos)."""
    step_tgt_tokens: int
    """Target tokens of the whole optimizer step over all micro-batches and ranks (the loss
    normaliser); equals n_tgt_tokens for evaluation batches."""
    is_padding: bool = False
    """A filler batch (evaluation only) that keeps ranks in lockstep; its outputs are ignored."""
    split: str = ""
    """The dataset split the rows come from (train, dev, test; "" when the dataset names
    none): `indices_B` index that split."""

    def __len__(self) -> int:
        return int(self.src_tokens_BS.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor moved to `device`."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def _pack_rows(rows: list[np.ndarray], lengths_B: np.ndarray, width: int, col: int,
               pad_id: int) -> np.ndarray:
    """[B, width] array of pad_id with row b's tokens written from column `col` on."""
    out_BW = np.full((len(rows), width), pad_id, dtype=np.int64)
    if lengths_B.sum() > 0:
        mask_BL = np.arange(width - col) < lengths_B[:, None]
        out_BW[:, col:][mask_BL] = np.concatenate(rows)
    return out_BW


def collate(dataset: ParallelDataset, indices: Sequence[int] | np.ndarray, pad_id: int,
            bos_id: int, eos_id: int) -> Batch:
    """Pad the sentences `indices` of `dataset` into a Batch (step_tgt_tokens = n_tgt_tokens)."""
    idx_B = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(idx_B) == 0:
        raise ValueError("collate: no sentences")
    src_rows = [np.asarray(dataset.src(int(i)), dtype=np.int64) for i in idx_B]
    tgt_rows = [np.asarray(dataset.tgt(int(i)), dtype=np.int64) for i in idx_B]
    src_len_B = np.fromiter((len(r) for r in src_rows), dtype=np.int64, count=len(idx_B))
    tgt_len_B = np.fromiter((len(r) for r in tgt_rows), dtype=np.int64, count=len(idx_B))
    rows_B = np.arange(len(idx_B))

    src_BS = _pack_rows(src_rows, src_len_B, int(src_len_B.max()) + 1, 0, pad_id)
    src_BS[rows_B, src_len_B] = eos_id
    width_T = int(tgt_len_B.max()) + 1
    tgt_in_BT = _pack_rows(tgt_rows, tgt_len_B, width_T, 1, pad_id)
    tgt_in_BT[:, 0] = bos_id
    tgt_out_BT = _pack_rows(tgt_rows, tgt_len_B, width_T, 0, pad_id)
    tgt_out_BT[rows_B, tgt_len_B] = eos_id

    n_tgt = int(tgt_len_B.sum()) + len(idx_B)

    def meta(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, dtype=np.int64)[idx_B])

    return Batch(src_tokens_BS=torch.from_numpy(src_BS), tgt_in_BT=torch.from_numpy(tgt_in_BT),
                 tgt_out_BT=torch.from_numpy(tgt_out_BT), indices_B=torch.from_numpy(idx_B.copy()),
                 domain_ids_B=meta(dataset.domain_ids), src_lang_B=meta(dataset.src_lang_ids),
                 tgt_lang_B=meta(dataset.tgt_lang_ids), corpus_ids_B=meta(dataset.corpus_ids),
                 n_src_tokens=int(src_len_B.sum()) + len(idx_B), n_tgt_tokens=n_tgt,
                 step_tgt_tokens=n_tgt, split=str(getattr(dataset, "split", "")))


# ------------------------------------------------------------------------------------- sampling
def sampling_probs(sizes: Sequence[int] | np.ndarray, temperature: float) -> np.ndarray:
    """q_i = p_i^(1/T) / sum_j p_j^(1/T) with p_i = n_i / sum n (T=1: proportional)."""
    sizes_C = np.asarray(sizes, dtype=np.float64)
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be positive, got {temperature}")
    if sizes_C.ndim != 1 or np.any(sizes_C < 0) or sizes_C.sum() <= 0:
        raise ValueError(f"corpus sizes must be non-negative with a positive sum, got {sizes}")
    p_C = sizes_C / sizes_C.sum()
    # In log space so that a large T gives exactly uniform weights instead of underflow.
    with np.errstate(divide="ignore"):
        logq_C = np.log(p_C) / temperature
    q_C = np.exp(logq_C - logq_C.max())
    return q_C / q_C.sum()


def corpus_counts(sizes: Sequence[int] | np.ndarray, temperature: float,
                  epoch_size: int) -> np.ndarray:
    """Sentences per corpus in one epoch: round(epoch_size * q_i), largest remainder, exact sum."""
    q_C = sampling_probs(sizes, temperature)
    raw_C = epoch_size * q_C
    counts_C = np.floor(raw_C).astype(np.int64)
    short = int(epoch_size - counts_C.sum())
    if short > 0:  # ties go to the lower corpus index (stable sort)
        counts_C[np.argsort(-(raw_C - counts_C), kind="stable")[:short]] += 1
    return counts_C


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k % (1 << 63) for k in key])


def _corpus_draw(seed: int, corpus: int, size: int, start: int, count: int) -> np.ndarray:
    """Positions [start, start+count) of corpus `corpus`'s endless stream of permutations.

    Permutation k of the stream is seeded by (seed, corpus, k): a corpus drawn more often than
    its size repeats whole permutations, one drawn less often sees every sentence once before
    any repeats (epochs continue the stream).
    """
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    first, last = start // size, (start + count - 1) // size
    stream = np.concatenate([_rng(seed, corpus, k).permutation(size)
                             for k in range(first, last + 1)])
    offset = start - first * size
    return stream[offset:offset + count]


def bucket_key(dataset: ParallelDataset) -> np.ndarray:
    """Padded width each sentence needs: max(src_len + 1, tgt_len + 1) (eos / bos included);
    for a decoder-only model's data (``dataset.concatenated``) the prompt and the target form
    one sequence, src_len + tgt_len (`lm_inputs` drops the prompt's eos and the target's
    bos)."""
    src = np.asarray(dataset.src_lengths, dtype=np.int64)
    tgt = np.asarray(dataset.tgt_lengths, dtype=np.int64)
    if getattr(dataset, "concatenated", False):
        return src + tgt
    return np.maximum(src, tgt) + 1


def cut_batches(keys_sorted: np.ndarray, max_tokens: int,
                max_sentences: int | None = None,
                lm_parts: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Batch boundaries (n_batches + 1 offsets) of ascending `keys_sorted`.

    Greedy: each batch is the longest run with size * width <= max_tokens (and at most
    `max_sentences`); a sentence longer than max_tokens forms a batch of its own. The width
    is the run's largest key; with `lm_parts` (prompt and target lengths in the same order, a
    decoder-only model's data) it is the longest prompt plus the longest target, the row the
    model reads (prompts left-padded to the longest, targets right-padded; `lm_inputs`).
    """
    keys = np.asarray(keys_sorted, dtype=np.int64)
    bounds = [0]
    start, n = 0, len(keys)
    while start < n:
        cap = max(1, max_tokens // int(keys[start]))
        if max_sentences is not None:
            cap = min(cap, max_sentences)
        stop = min(n, start + cap)
        if lm_parts is None:
            widths = keys[start:stop]
        else:
            prompt, target = (np.maximum.accumulate(np.asarray(a[start:stop], dtype=np.int64))
                              for a in lm_parts)
            widths = prompt + target
        # Cost (e - start) * width grows with e, so the feasible ends form a prefix.
        fits = int(np.count_nonzero(np.arange(1, stop - start + 1) * widths <= max_tokens))
        start += max(1, fits)
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def _lm_parts(dataset: ParallelDataset, idx_N: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """(prompt, target) lengths of the sentences `idx_N` of a decoder-only model's data (for
    `cut_batches`); None for an encoder-decoder's."""
    if not getattr(dataset, "concatenated", False):
        return None
    return (np.asarray(dataset.src_lengths, dtype=np.int64)[idx_N],
            np.asarray(dataset.tgt_lengths, dtype=np.int64)[idx_N])


@dataclass(frozen=True)
class EpochPlan:
    """The global micro-batch list of one epoch: batch j is order[bounds[j]:bounds[j+1]]."""

    order: np.ndarray
    bounds: np.ndarray
    tgt_tokens: np.ndarray
    """Target tokens (incl. eos) of each micro-batch."""

    @property
    def num_batches(self) -> int:
        return len(self.bounds) - 1

    def batch(self, j: int) -> np.ndarray:
        return self.order[self.bounds[j]:self.bounds[j + 1]]


def build_epoch_plan(dataset: ParallelDataset, counts_C: np.ndarray, max_tokens: int, seed: int,
                     epoch: int) -> EpochPlan:
    """Sample `counts_C` sentences per corpus, bucket by length, cut and shuffle the batches."""
    sizes = [int(s) for s in dataset.corpus_sizes]
    offsets = np.asarray(dataset.corpus_offsets, dtype=np.int64)
    sample_N = np.concatenate(
        [offsets[c] + _corpus_draw(seed, c, sizes[c], epoch * int(counts_C[c]), int(counts_C[c]))
         for c in range(len(sizes))] + [np.zeros(0, dtype=np.int64)])
    keys_N = bucket_key(dataset)[sample_N]
    ties_N = _rng(seed, epoch, _SALT_TIES).random(len(sample_N))
    by_len = np.lexsort((ties_N, keys_N))
    sample_N, keys_N = sample_N[by_len], keys_N[by_len]
    bounds = cut_batches(keys_N, max_tokens, lm_parts=_lm_parts(dataset, sample_N))

    n_batches = len(bounds) - 1
    perm = _rng(seed, epoch, _SALT_ORDER).permutation(n_batches)
    sizes_J = np.diff(bounds)
    new_pos_J = np.empty(n_batches, dtype=np.int64)
    new_pos_J[perm] = np.arange(n_batches)
    regroup = np.argsort(np.repeat(new_pos_J, sizes_J), kind="stable")
    order = sample_N[regroup]
    new_bounds = np.concatenate([[0], np.cumsum(sizes_J[perm])]).astype(np.int64)
    tgt_N = np.asarray(dataset.tgt_lengths, dtype=np.int64)[order] + 1
    tgt_tokens = np.add.reduceat(tgt_N, new_bounds[:-1]) if n_batches else np.zeros(0, np.int64)
    return EpochPlan(order=order, bounds=new_bounds, tgt_tokens=tgt_tokens.astype(np.int64))


# ------------------------------------------------------------------------------------- training
class TrainBatchIterator:
    """Endless iterator over optimizer steps; `next()` gives this rank's `grad_accum` batches.

    A step consumes a group of dp_world * grad_accum consecutive micro-batches of the epoch's
    global list; rank r takes micro-batches r, r + dp_world, ... of the group. A trailing
    incomplete group is dropped.
    """

    def __init__(self, dataset: ParallelDataset, max_tokens: int, pad_id: int, bos_id: int,
                 eos_id: int, seed: int, temperature: float = 1.0, dp_rank: int = 0,
                 dp_world: int = 1, grad_accum: int = 1, epoch_size: int | None = None) -> None:
        if not 0 <= dp_rank < dp_world or grad_accum < 1 or max_tokens < 1:
            raise ValueError(f"bad batching arguments: dp_rank={dp_rank} dp_world={dp_world} "
                             f"grad_accum={grad_accum} max_tokens={max_tokens}")
        if len(dataset) == 0:
            raise DataError("training data: no sentence pairs (check data.pairs / data.domains "
                            "and the prepared data)")
        self.dataset = dataset
        self.max_tokens, self.seed, self.temperature = max_tokens, seed, temperature
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.dp_rank, self.dp_world, self.grad_accum = dp_rank, dp_world, grad_accum
        self.epoch_size = len(dataset) if epoch_size is None else int(epoch_size)
        if self.epoch_size < 1:
            raise ValueError(f"epoch_size must be positive, got {epoch_size}")
        self.counts_C = corpus_counts(dataset.corpus_sizes, temperature, self.epoch_size)
        self._epoch = 0
        self._step_in_epoch = 0
        self._cursor = 0  # micro-batches of the current epoch consumed (by all ranks)
        self._plan: EpochPlan | None = None
        self._plan_epoch = -1

    @property
    def group_size(self) -> int:
        """Micro-batches one optimizer step consumes over all ranks."""
        return self.dp_world * self.grad_accum

    @property
    def epoch(self) -> int:
        """The epoch the next step is (normally) drawn from, counting from 0."""
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch (epochs can differ slightly when T != 1)."""
        return self._current_plan().num_batches // self.group_size

    def _current_plan(self) -> EpochPlan:
        if self._plan_epoch != self._epoch:
            self._plan = build_epoch_plan(self.dataset, self.counts_C, self.max_tokens,
                                          self.seed, self._epoch)
            self._plan_epoch = self._epoch
        assert self._plan is not None
        return self._plan

    def __iter__(self) -> "TrainBatchIterator":
        return self

    def __next__(self) -> list[Batch]:
        plan = self._current_plan()
        group = self.group_size
        while self._cursor + group > plan.num_batches:
            if self._cursor == 0:
                raise DataError(
                    f"training data: epoch {self._epoch} has only {plan.num_batches} "
                    f"micro-batches at data.max_tokens={self.max_tokens}, fewer than one step "
                    f"needs (dp_world {self.dp_world} x grad_accum {self.grad_accum}); "
                    "lower data.max_tokens or optim.grad_accum, or add data")
            self._epoch, self._cursor, self._step_in_epoch = self._epoch + 1, 0, 0
            plan = self._current_plan()
        start = self._cursor
        step_tokens = int(plan.tgt_tokens[start:start + group].sum())
        batches = []
        for j in range(start + self.dp_rank, start + group, self.dp_world):
            batch = collate(self.dataset, plan.batch(j), self.pad_id, self.bos_id, self.eos_id)
            batch.step_tgt_tokens = step_tokens
            batches.append(batch)
        self._cursor += group
        self._step_in_epoch += 1
        return batches

    # Fields that fix the data order: a resumed run must match them.
    _ORDER_FIELDS = ("seed", "temperature", "max_tokens", "epoch_size", "num_sentences")

    def state_dict(self) -> dict[str, Any]:
        """Position and identity of the data order (identical on every rank; JSON-serialisable)."""
        return {"epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                "micro_batch_in_epoch": self._cursor, "seed": self.seed,
                "temperature": self.temperature, "max_tokens": self.max_tokens,
                "epoch_size": self.epoch_size, "num_sentences": len(self.dataset),
                "dp_world": self.dp_world, "grad_accum": self.grad_accum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the step at which `state` was taken.

        The position is kept in micro-batches, so a different dp_world or grad_accum resumes
        without skipping or repeating data.
        """
        current = self.state_dict()
        for key in self._ORDER_FIELDS:
            if key in state and state[key] != current[key]:
                raise CheckpointError(
                    f"data state: {key} is {state[key]!r} in the checkpoint but "
                    f"{current[key]!r} now; the data order cannot be resumed")
        self._epoch = int(state["epoch"])
        self._step_in_epoch = int(state["step_in_epoch"])
        self._cursor = int(state.get("micro_batch_in_epoch",
                                     self._step_in_epoch * self.group_size))


# ----------------------------------------------------------------------------------- evaluation
def eval_batches(dataset: ParallelDataset, max_tokens: int, pad_id: int, bos_id: int,
                 eos_id: int, dp_rank: int = 0, dp_world: int = 1,
                 max_sentences: int | None = None,
                 indices: Sequence[int] | np.ndarray | None = None) -> list[Batch]:
    """This rank's evaluation batches: each sentence exactly once over all ranks, no sampling.

    Sentences are sorted by length (ties by index) and cut under the token budget; batch j goes
    to rank j % dp_world. Every rank gets the same number of batches: a rank that runs out
    repeats its first batch (or global batch 0) flagged ``is_padding=True``.
    """
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"bad dp_rank={dp_rank} for dp_world={dp_world}")
    idx_N = (np.arange(len(dataset), dtype=np.int64) if indices is None
             else np.asarray(indices, dtype=np.int64).reshape(-1))
    if len(idx_N) == 0:
        return []
    keys_N = bucket_key(dataset)[idx_N]
    by_len = np.lexsort((idx_N, keys_N))
    idx_N, keys_N = idx_N[by_len], keys_N[by_len]
    bounds = cut_batches(keys_N, max_tokens, max_sentences, _lm_parts(dataset, idx_N))
    n_batches = len(bounds) - 1
    per_rank = -(-n_batches // dp_world)
    mine = list(range(dp_rank, n_batches, dp_world))
    out = [collate(dataset, idx_N[bounds[j]:bounds[j + 1]], pad_id, bos_id, eos_id)
           for j in mine]
    if len(out) < per_rank:
        filler_j = mine[0] if mine else 0
        filler = collate(dataset, idx_N[bounds[filler_j]:bounds[filler_j + 1]], pad_id, bos_id,
                         eos_id)
        filler.is_padding = True
        out.extend(dataclasses.replace(filler) for _ in range(per_rank - len(out)))
    return out
