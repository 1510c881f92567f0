"""Teacher forcing for both architectures on the same batches.

Batches are built once for every model (moe_train.data.batching): the source (for a
decoder-only model: its filled prompt, see moe_train.data.prompts) plus eos, the decoder input
bos + target, the labels target + eos. `teacher_forced` returns logits aligned with the labels
either way: an encoder-decoder model reads the batch as it is; a decoder-only model reads the
prompt (left-padded, so every prompt ends in the same column, without its eos) followed by the
target (without bos), and only the last T positions go through the LM head - the prompt is
context, never a label, so the loss falls on target tokens only.

Shape legend: B sentences, S padded source length, P longest prompt, T target columns, L = P +
T - 1 decoder-only input length, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_train.models.context import ForwardContext

PROMPT_MASK_KEY = "prompt_mask_BT"
"""Extras key: True at the real prompt (source segment) positions of a decoder-only call's
(B, T) input; THOR's task predictor pools over them (absent: over every real position)."""


def left_padded_prompts(src_BS: Tensor, pad_id: int, strip_eos: bool = True
                        ) -> tuple[Tensor, Tensor]:
    """(prompt_BP, mask_BP) with each right-padded source moved to the right edge; with
    `strip_eos` the last real token (collate's eos) is dropped."""
    lengths_B = src_BS.ne(pad_id).sum(1) - int(strip_eos)
    P = max(int(lengths_B.max()), 1) if lengths_B.numel() else 1
    col_BP = torch.arange(P, device=src_BS.device)[None] - (P - lengths_B)[:, None]
    mask_BP = col_BP >= 0
    gathered_BP = src_BS.gather(1, col_BP.clamp(0, src_BS.size(1) - 1))
    return torch.where(mask_BP, gathered_BP, torch.full_like(gathered_BP, pad_id)), mask_BP


def lm_inputs(src_BS: Tensor, tgt_in_BT: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids_BL, attention_mask_BL): left-padded prompt, then the target without bos."""
    prompt_BP, mask_BP = left_padded_prompts(src_BS, pad_id)
    target_BT = tgt_in_BT[:, 1:]
    return (torch.cat([prompt_BP, target_BT], 1),
            torch.cat([mask_BP, target_BT.ne(pad_id)], 1).long())


def teacher_forced(model: Any, src_BS: Tensor, tgt_in_BT: Tensor, ctx: ForwardContext,
                   pad_id: int, decoder_only: bool) -> Any:
    """The model's `ModelOutput` with logits (B, T, V) aligned with the batch's labels.
    `model` may be a DeepSpeed engine wrapping the model."""
    if not decoder_only:
        return model(src_BS, tgt_in_BT, ctx)
    input_ids_BL, mask_BL = lm_inputs(src_BS, tgt_in_BT, pad_id)
    ctx = with_prompt_mask(ctx, mask_BL, input_ids_BL.size(1) - (tgt_in_BT.size(1) - 1))
    return model(input_ids_BL, ctx, mask_BL, logits_to_keep=tgt_in_BT.size(1))


def with_prompt_mask(ctx: ForwardContext | None, mask_BL: Tensor, P: int) -> ForwardContext:
    """`ctx` with ``extras[PROMPT_MASK_KEY]``: True at the real positions of the first `P`
    (prompt) columns of the (B, L) input, which THOR's task predictor pools over (OD-1)."""
    prompt_BL = mask_BL.bool().clone()
    prompt_BL[:, P:] = False
    ctx = ctx or ForwardContext()
    return ctx.replace(extras={**ctx.extras, PROMPT_MASK_KEY: prompt_BL})
