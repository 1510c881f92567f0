"""What a router decides (`Routing`) and what it may look at besides the tokens (`RoutingContext`).

Routers see the tokens of a batch flattened: position t of the (B*T) rows is token
``t % T`` of sentence ``t // T`` (padding included). Token-level routers need only the hidden
states; sentence- and task-level routers also need which sentence a token belongs to, the
padding mask, the task of each sentence and, optionally, a sentence representation computed
once and shared by every MoE layer (the sentence-level baselines route "all layers with these
scores"). `RoutingContext.from_forward` builds all of that from the Transformer's
`ForwardContext`.

Shape legend: B sentences, T tokens (the flattened B x length positions, padding included),
D model dim, E experts, K expert slots per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_train.config.moe import TASK_SOURCES
from moe_train.errors import ConfigError
from moe_train.models.context import SENTENCE_REPR_KEY, SIDES, ForwardContext  # noqa: F401

NUM_LANGS_KEY = "num_langs"
"""`ForwardContext.extras` key of the number of languages (needed by task_source lang_pair)."""


@dataclass(frozen=True, eq=False)
class Routing:
    """One router decision for T tokens.

    Token t is sent to experts ``expert_ids_TK[t]`` and its expert outputs are summed with
    ``weights_TK[t]``. A slot with expert id -1 is unused (weight 0): routers whose number of
    experts per token varies (top-p) pad with it, and the dispatcher drops such slots.
    """

    expert_ids_TK: Tensor
    """Chosen experts (long), -1 for an unused slot."""
    weights_TK: Tensor
    """Combine weights (0 at unused slots); differentiable w.r.t. the router's parameters."""
    probs_TE: Tensor | None
    """Full router distribution (float32), for statistics and losses; None for fixed tables."""
    num_experts: int
    """E."""
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    """Auxiliary losses already multiplied by their coefficients: add them to the training loss."""
    stats: dict[str, Tensor] = field(default_factory=dict)
    """Detached statistics for logging (routing entropy, tokens per expert, ...)."""
    sentence_expert_ids_BK: Tensor | None = None
    """Sentence- and task-level routers: the experts of each of the B sentences, when token t
    of the T = B*L flattened positions has the slots of sentence t // L (a slot may since have
    become -1: padding). Dispatchers may then order rows by sorting these B*K slots instead of
    the T*K (`kernels.permute.sort_sentence_slots` checks the form). None otherwise."""

    def __post_init__(self) -> None:
        if self.expert_ids_TK.dim() != 2 or self.expert_ids_TK.shape != self.weights_TK.shape:
            raise ValueError(f"Routing: expert_ids_TK {tuple(self.expert_ids_TK.shape)} and "
                             f"weights_TK {tuple(self.weights_TK.shape)} must be equal 2-d shapes")
        if self.probs_TE is not None and self.probs_TE.shape != (
                self.expert_ids_TK.size(0), self.num_experts):
            raise ValueError(f"Routing: probs_TE {tuple(self.probs_TE.shape)} must be "
                             f"({self.expert_ids_TK.size(0)}, {self.num_experts})")

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.expert_ids_TK.size(0)

    @property
    def top_k(self) -> int:
        """K, the number of expert slots per token."""
        return self.expert_ids_TK.size(1)


@dataclass
class RoutingContext:
    """What non-token routers need about the batch; built once per FFN slot call."""

    pad_mask_T: Tensor | None = None
    """True at padding positions (routed like any token but left out of load statistics)."""
    sentence_ids_T: Tensor | None = None
    """Sentence (0 .. B-1) each token belongs to."""
    num_sentences: int = 0
    """B."""
    task_ids_B: Tensor | None = None
    """Task id of each sentence (long), or None when the data has none."""
    sentence_repr_BD: Tensor | None = None
    """Precomputed sentence representation (e.g. mean-pooled encoder states), or None."""
    side: str = "encoder"
    """Stack being run: encoder or decoder."""
    task_source: str | None = None
    """Which field `task_ids_B` was taken from (for error messages), None if not asked for."""

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"RoutingContext.side: expected one of {', '.join(SIDES)}, "
                             f"got {self.side!r}")

    @classmethod
    def from_batch(cls, B: int, T: int, *, pad_mask_BT: Tensor | None = None,
                   task_ids_B: Tensor | None = None, sentence_repr_BD: Tensor | None = None,
                   side: str = "encoder", task_source: str | None = None,
                   device: torch.device | str | None = None) -> RoutingContext:
        """Context for B sentences of T positions each, flattened row-major into B*T tokens."""
        if device is None:
            present = [t for t in (pad_mask_BT, task_ids_B, sentence_repr_BD) if t is not None]
            device = present[0].device if present else None
        if pad_mask_BT is not None and tuple(pad_mask_BT.shape) != (B, T):
            raise ValueError(f"RoutingContext: pad mask of shape {tuple(pad_mask_BT.shape)}, "
                             f"expected ({B}, {T})")
        sentence_ids_T = torch.arange(B, device=device).repeat_interleave(T)
        return cls(pad_mask_T=None if pad_mask_BT is None else pad_mask_BT.reshape(B * T),
                   sentence_ids_T=sentence_ids_T, num_sentences=B, task_ids_B=task_ids_B,
                   sentence_repr_BD=sentence_repr_BD, side=side, task_source=task_source)

    @classmethod
    def from_forward(cls, ctx: ForwardContext, B: int, T: int, task_source: str | None = None,
                     device: torch.device | str | None = None) -> RoutingContext:
        """Build the context from the Transformer's `ForwardContext` for a (B, T) slot input.

        The pad mask is the source mask on the encoder side and the target mask on the decoder
        side. `task_source` picks the task id of a sentence: "lang_pair" (src_lang * num_langs +
        tgt_lang, num_langs from ``ctx.extras["num_langs"]``), "tgt_lang", "domain" or
        "task_ids"; None skips it (token routers). A missing id field gives task_ids_B None (the
        task router then says so); lang_pair with languages but no num_langs is a ConfigError.
        """
        pad_mask_BT = ctx.src_pad_mask_BS if ctx.side == "encoder" else ctx.tgt_pad_mask_BT
        return cls.from_batch(
            B, T, pad_mask_BT=pad_mask_BT, task_ids_B=task_ids_from_context(ctx, task_source),
            sentence_repr_BD=ctx.extras.get(SENTENCE_REPR_KEY), side=ctx.side,
            task_source=task_source, device=device)


def task_ids_from_context(ctx: ForwardContext, task_source: str | None) -> Tensor | None:
    """Task id of each sentence according to `task_source` (see `RoutingContext.from_forward`)."""
    if task_source is None:
        return None
    if task_source not in TASK_SOURCES:
        raise ConfigError(f"moe.task_source: expected one of {', '.join(TASK_SOURCES)}, "
                          f"got {task_source!r}")
    if task_source == "tgt_lang":
        return ctx.tgt_lang_B
    if task_source == "domain":
        return ctx.domain_ids_B
    if task_source == "task_ids":
        return ctx.task_ids_B
    if ctx.src_lang_B is None or ctx.tgt_lang_B is None:
        return None
    num_langs = ctx.extras.get(NUM_LANGS_KEY)
    if num_langs is None:
        raise ConfigError("moe.task_source: 'lang_pair' needs the number of languages in "
                          f"ForwardContext.extras[{NUM_LANGS_KEY!r}], which this batch lacks "
                          "(use task_source tgt_lang, or pass num_langs with the batch)")
    return ctx.src_lang_B.long() * int(num_langs) + ctx.tgt_lang_B.long()


def sentence_mean(x_TD: Tensor, sentence_ids_T: Tensor, num_sentences: int,
                  pad_mask_T: Tensor | None = None) -> Tensor:
    """Mean of the non-pad token states of each sentence, (B, D), summed in float32.

    Eq. 1 of the task-routing paper: (1/S) sum_s x_s over the S real tokens of the sentence.
    A sentence with no real token gets zeros.
    """
    x32_TD = x_TD.float()
    ones_T = torch.ones_like(sentence_ids_T, dtype=torch.float32)
    if pad_mask_T is not None:
        keep_T = ~pad_mask_T
        x32_TD = x32_TD * keep_T[:, None]
        ones_T = ones_T * keep_T
    sums_BD = x32_TD.new_zeros(num_sentences, x_TD.size(1)).index_add(0, sentence_ids_T, x32_TD)
    counts_B = ones_T.new_zeros(num_sentences).index_add(0, sentence_ids_T, ones_T)
    return (sums_BD / counts_B.clamp_min(1.0)[:, None]).to(x_TD.dtype)
