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

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moe_train.config.moe import TASK_SOURCES
from moe_train.errors import ConfigError
from moe_train.models.context import SENTENCE_REPR_KEY, SIDES, ForwardContext, StateCell  # noqa: F401

NUM_LANGS_KEY = "num_langs"
"""`ForwardContext.extras` key of the number of languages (needed by task_source lang_pair)."""
TARGET_TOKENS_KEY = "target_tokens"
"""`ForwardContext.extras` key of a batch's real target tokens (the translation loss's
normaliser)."""


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
    extras: dict[str, Any] = field(default_factory=dict)
    """Model- and batch-provided inputs (`ForwardContext.extras`): per-sentence ``*_B*`` and
    per-position ``*_BT*`` tensors and anything else a router reads by key."""
    offset: int = 0
    """Decoder positions decoded before these tokens (incremental decoding), else 0."""
    state: StateCell | None = None
    """The slot's routing state in the decoder cache while decoding incrementally, else None."""

    def __post_init__(self) -> None:
        if self.side not in SIDES:
            raise ValueError(f"RoutingContext.side: expected one of {', '.join(SIDES)}, "
                             f"got {self.side!r}")

    @classmethod
    def from_batch(cls, B: int, T: int, *, pad_mask_BT: Tensor | None = None,
                   task_ids_B: Tensor | None = None, sentence_repr_BD: Tensor | None = None,
                   side: str = "encoder", task_source: str | None = None,
                   device: torch.device | str | None = None, extras: dict[str, Any] | None = None,
                   offset: int = 0, state: StateCell | None = None) -> RoutingContext:
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
                   sentence_repr_BD=sentence_repr_BD, side=side, task_source=task_source,
                   extras={} if extras is None else extras, offset=offset, state=state)

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
            task_source=task_source, device=device, extras=ctx.extras, offset=ctx.offset,
            state=ctx.state)

    def require(self, key: str, router: str) -> Any:
        """``extras[key]``, or a one-line error naming the router that needs it."""
        if key not in self.extras:
            raise ValueError(f"the {router} router needs {key!r} in ForwardContext.extras "
                             f"(have: {', '.join(sorted(self.extras)) or 'none'})")
        return self.extras[key]


def task_ids_from_context(ctx: ForwardContext, task_source: str | None) -> Tensor | None:
    """Task id of each sentence according to `task_source` (see `RoutingContext.from_forward`)."""
    if task_source is None:
        return None
    if task_source not in TASK_SOURCES:
        raise ConfigError(f"moe.task_source: expected one of {', '.join(TASK_SOURCES)}, "
                          f"got {task_source!r}")
    if task_source == "tgt_lang":
        return ctx.tgt_lang_B
    if task_source == "src_lang":
        return ctx.src_lang_B
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
    return _lang_pairs(ctx.src_lang_B, ctx.tgt_lang_B, int(num_langs))


def tensor_version(t: Tensor) -> int | None:
    """The tensor's in-place version counter; None for an inference tensor (it keeps none)."""
    return None if t.is_inference() else t._version


def unchanged(memo_ref: weakref.ref, memo_version: int | None, t: Tensor) -> bool:
    """Whether a memo of (weak reference, version) still describes `t` unchanged: the memos
    of host copies (`ids_on_host`, a frozen table's served rows) and of `_lang_pairs`."""
    version = tensor_version(t)
    return memo_ref() is t and version is not None and memo_version == version


HOST_IDS_KEPT = 4
"""How many ids tensors `ids_on_host` remembers: a side may route by two sources at once (a
task-routed MoE by target language, gated adapters by domain), whose layers alternate."""
_HOST_IDS: list[tuple[weakref.ref, int | None, list[int]]] = []
"""(tensor, its version, its values) of the last `HOST_IDS_KEPT` tensors `ids_on_host` read,
newest last."""


def ids_on_host(ids_B: Tensor) -> list[int]:
    """``ids_B.tolist()``, read from the device once per tensor: every routed layer of a
    forward and every decode step get the batch's ids tensors (``ForwardContext``'s domain /
    language ids, language pairs by `_lang_pairs`), so the checks of task routers, THOR's
    predictor and gated adapters share one host sync per tensor. Keyed on the tensor's
    identity and version: an in-place change reads again."""
    for ref, version, values in _HOST_IDS:
        if unchanged(ref, version, ids_B):
            return values
    values = ids_B.tolist()
    _HOST_IDS.append((weakref.ref(ids_B), tensor_version(ids_B), values))
    del _HOST_IDS[:-HOST_IDS_KEPT]
    return values


_LANG_PAIRS: tuple[Any, ...] | None = None
"""(src_lang_B, tgt_lang_B as weak references, their versions, num_langs, pair ids) of the
last `_lang_pairs`."""


def _lang_pairs(src_lang_B: Tensor, tgt_lang_B: Tensor, num_langs: int) -> Tensor:
    """src_lang * num_langs + tgt_lang, the same tensor while the inputs are: every layer and
    decode step of a batch then gets one task-id tensor, which `ids_on_host` reads once."""
    global _LANG_PAIRS
    memo = _LANG_PAIRS
    if (memo is not None and memo[3] == num_langs and unchanged(memo[0], memo[2][0], src_lang_B)
            and unchanged(memo[1], memo[2][1], tgt_lang_B)):
        return memo[4]
    pairs_B = src_lang_B.long() * num_langs + tgt_lang_B.long()
    versions = (tensor_version(src_lang_B), tensor_version(tgt_lang_B))
    _LANG_PAIRS = (weakref.ref(src_lang_B), weakref.ref(tgt_lang_B), versions, num_langs, pairs_B)
    return pairs_B


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


@dataclass
class PrefixMeanState:
    """Running sum and count of the real positions decoded so far, per row (see `prefix_mean`)."""

    sum_BD: Tensor
    count_B: Tensor

    def reorder(self, index_B: Tensor) -> None:
        self.sum_BD = self.sum_BD.index_select(0, index_B)
        self.count_B = self.count_B.index_select(0, index_B)


def prefix_mean(x_TD: Tensor, rctx: RoutingContext) -> Tensor:
    """Inclusive causal mean of each position's sentence prefix over its real positions, (T, D).

    Full passes use masked cumulative sums over the B x L layout of the T tokens; during
    incremental decoding (`rctx.state` set) the running sum and count in the slot's cache are
    continued and advanced, so step-by-step decoding gives the same values. Padding adds
    nothing; a position with no real one before it (or itself) gets zeros. Summed in float32.
    """
    B = rctx.num_sentences
    T, D = x_TD.shape
    x32_BLD = x_TD.float().view(B, T // max(B, 1), D)
    keep_BL = (torch.ones(x32_BLD.shape[:2], device=x_TD.device) if rctx.pad_mask_T is None
               else (~rctx.pad_mask_T).view(B, -1).float())
    sums_BLD = (x32_BLD * keep_BL[..., None]).cumsum(1)
    counts_BL = keep_BL.cumsum(1)
    cell = rctx.state
    if cell is not None:
        if cell.value is None:
            cell.value = PrefixMeanState(x32_BLD.new_zeros(B, D), keep_BL.new_zeros(B))
        state = cell.value
        sums_BLD = sums_BLD + state.sum_BD[:, None]
        counts_BL = counts_BL + state.count_B[:, None]
        state.sum_BD, state.count_B = sums_BLD[:, -1].detach(), counts_BL[:, -1]
    return (sums_BLD / counts_BL.clamp_min(1.0)[..., None]).view(T, D).to(x_TD.dtype)


def context_rows(x_TD: Tensor, rctx: RoutingContext) -> tuple[Tensor, Tensor | None]:
    """The context state once per distinct row, and the row of each token: in the encoder
    the masked mean of each sentence (it sees the whole source) and the sentence ids, (B, D)
    and (T,); in the decoder the inclusive causal `prefix_mean`, (T, D), and None. A router
    that maps the context (a gate, a projection) does so on these rows and `expand_rows` the
    result: B rows instead of T in the encoder."""
    if rctx.side == "decoder":
        return prefix_mean(x_TD, rctx), None
    means_BD = sentence_mean(x_TD, rctx.sentence_ids_T, rctx.num_sentences, rctx.pad_mask_T)
    return means_BD, rctx.sentence_ids_T


def expand_rows(rows_NX: Tensor, row_T: Tensor | None) -> Tensor:
    """Per-token values (T, X) from `context_rows`' rows (row_T None: already per token)."""
    return rows_NX if row_T is None else rows_NX.index_select(0, row_T)


def context_mean(x_TD: Tensor, rctx: RoutingContext) -> Tensor:
    """Each token's context state, (T, D) (see `context_rows`)."""
    return expand_rows(*context_rows(x_TD, rctx))
