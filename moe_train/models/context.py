"""Per-batch side information that travels with the tokens through every layer.

Token-level routers only need the hidden states, but routers that decide per sentence, domain,
language or task (and adapters) need metadata about the batch. `ForwardContext` carries it to
every FFN / adapter slot, so such layers can be added without changing the model's signatures.

Shape legend: B batch (sentences), S source length, T target length.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

SIDES = ("encoder", "decoder")

SENTENCE_REPR_KEY = "sentence_repr_BD"
"""`ForwardContext.extras` key of the sentence representation the model computes once per stack:
the mean-pooled source embeddings while the encoder runs, the mean-pooled encoder output (MoA
Eq. 1) while the decoder runs. Sentence-level routers read it, so every layer they serve
decides from the same input."""


class RoutingState(Protocol):
    """Incremental-decoding state a router keeps per decoder slot (e.g. a running sum and
    count for a causal prefix mean); rows follow the beams."""

    def reorder(self, index_B: Tensor) -> None:
        """Reorder, repeat or drop batch rows in place (beam search)."""


class StateCell:
    """One FFN or adapter slot's place in a decoder cache: empty until the slot's router
    creates its state at the first cached step (`RoutingState`), then reordered with the KV
    caches. A slot whose router keeps no state leaves it empty."""

    def __init__(self) -> None:
        self.value: RoutingState | None = None

    def reorder(self, index_B: Tensor) -> None:
        if self.value is not None:
            self.value.reorder(index_B)


# Extras keys named like tensors whose first dimension is the batch (``prior_BE``, ``ids_B``).
_PER_SENTENCE_KEY = re.compile(r"_B[A-Za-z]*$")


@dataclass
class ForwardContext:
    """Metadata of one batch, given to every FFN and adapter slot as ``ctx``.

    The model fills `src_pad_mask_BS` and `tgt_pad_mask_BT` from the tokens and sets `side`
    before each stack; the caller fills the rest. All per-sentence tensors have the batch as
    their first dimension.
    """

    src_pad_mask_BS: Tensor | None = None
    """True at source padding."""
    tgt_pad_mask_BT: Tensor | None = None
    """True at target padding (of the positions being decoded in this call)."""
    domain_ids_B: Tensor | None = None
    """Domain (corpus) id of each sentence."""
    src_lang_B: Tensor | None = None
    """Source-language id of each sentence."""
    tgt_lang_B: Tensor | None = None
    """Target-language id of each sentence."""
    task_ids_B: Tensor | None = None
    """Task id of each sentence."""
    side: str = "encoder"
    """Which stack is running: encoder or decoder."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Model- and batch-provided inputs for routers (task probabilities, task embedding,
    teacher distributions, ...). A tensor whose key ends in a batch shape suffix (``_B``,
    ``_BE``, ...) is per-sentence and is reordered by `index_select`; everything else is
    passed through."""
    offset: int = 0
    """Decoder positions decoded before this call (incremental decoding), else 0."""
    state: StateCell | None = None
    """The calling slot's routing state in the decoder cache during incremental decoding;
    None in full-sequence passes (routers then compute the same values in one go)."""

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"ForwardContext.side: expected one of {', '.join(SIDES)}, "
                             f"got {self.side!r}")

    def for_side(self, side: str) -> ForwardContext:
        """A copy with `side` set (the tensors are shared, not copied)."""
        return dataclasses.replace(self, side=side)

    def replace(self, **changes: Any) -> ForwardContext:
        """A copy with the given fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def index_select(self, index_B: Tensor) -> ForwardContext:
        """A copy whose per-sentence tensors are reordered / repeated by `index_B`.

        Used by beam search to expand a batch of B sentences to B * beam rows.
        """
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = value.index_select(0, index_B.to(value.device))
        changes["extras"] = {
            key: (value.index_select(0, index_B.to(value.device))
                  if isinstance(value, Tensor) and _PER_SENTENCE_KEY.search(key) else value)
            for key, value in self.extras.items()
        }
        return dataclasses.replace(self, **changes)


def per_sentence(extras: dict[str, Any]) -> dict[str, Any]:
    """The per-sentence tensors of `extras` (keys with a batch shape suffix)."""
    return {key: value for key, value in extras.items()
            if isinstance(value, Tensor) and _PER_SENTENCE_KEY.search(key)}


def mean_pool(x_BTD: Tensor, pad_mask_BT: Tensor | None) -> Tensor:
    """Mean over the non-pad positions of each sentence, (B, D), summed in float32.

    A sentence without any real position gets zeros.
    """
    x32_BTD = x_BTD.float()
    if pad_mask_BT is None:
        return x32_BTD.mean(1).to(x_BTD.dtype)
    keep_BT = (~pad_mask_BT).to(torch.float32)
    sums_BD = torch.einsum("btd,bt->bd", x32_BTD, keep_BT)
    return (sums_BD / keep_BT.sum(1, keepdim=True).clamp_min(1.0)).to(x_BTD.dtype)
