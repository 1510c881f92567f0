"""Trim-MoE (seed 003): keep N routed experts per MoE layer of a Qwen2-MoE model.

The experts kept are either given (the same indices in every layer) or the N a calibration
pass uses most: the model reads the calibration text (tokenized with its own tokenizer) and
every MoE layer counts the tokens routed to each expert (`MoELayer.tokens_per_expert_E`); ties
go to the lower index. Kept experts stay in ascending order; each layer's stacked expert
tensors and its router's rows are sliced to them, so the trimmed router is a softmax over the
kept experts only (003's Trim-MoE, which then fine-tunes). The shared expert is kept whole.

Shape legend: E experts, N kept, D hidden size, B lines per batch, T tokens.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.models.hf_qwen2moe import aux_coef_from_hf, aux_coef_to_hf, sparse_layers

_EXPERT = re.compile(r"(hf\.model\.layers\.(\d+)\.mlp\.moe\.)(experts\.w_\w+|router\.gate\.weight"
                     r"\.weight)$")


def parse_experts(text: str, num_experts: int) -> list[int]:
    """`--experts 0,3,5`: distinct indices below num_experts, ascending."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--experts: expected comma-separated expert indices such as 0,3,5, "
                          f"got {text!r}") from None
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_experts for i in ids):
        raise ConfigError(f"--experts: expected distinct indices in 0..{num_experts - 1}, "
                          f"got {text!r}")
    return sorted(ids)


@torch.no_grad()
def expert_usage(model: torch.nn.Module, token_lines: Sequence[Sequence[int]], pad_id: int,
                 max_tokens: int = 4096) -> dict[int, Tensor]:
    """{layer index: tokens routed to each expert (E,)} over the calibration lines."""
    from moe_train.models.hf_qwen2moe import QwenMoEBlock

    blocks = {int(name.split(".")[3]): m for name, m in model.named_modules()
              if isinstance(m, QwenMoEBlock)}
    counts = {i: torch.zeros(b.moe.num_experts, dtype=torch.long) for i, b in blocks.items()}
    order = sorted(range(len(token_lines)), key=lambda i: -len(token_lines[i]))
    model.eval()
    start = 0
    while start < len(order):
        width = max(len(token_lines[order[start]]), 1)
        rows = max(1, max_tokens // width)
        chunk = [token_lines[i] for i in order[start:start + rows]]
        start += rows
        ids_BT = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask_BT = torch.zeros_like(ids_BT)
        for b, line in enumerate(chunk):
            ids_BT[b, :len(line)] = torch.tensor(line, dtype=torch.long)
            mask_BT[b, :len(line)] = 1
        model(ids_BT, None, mask_BT)
        for i, block in blocks.items():
            counts[i] += block.moe.tokens_per_expert_E.cpu()
    return counts


def most_used(counts: Tensor, n: int) -> list[int]:
    """The n experts with the most tokens (ties: lower index first), ascending."""
    order = sorted(range(counts.numel()), key=lambda e: (-int(counts[e]), e))
    return sorted(order[:n])


def trim(state: dict[str, Tensor], cfg: ExperimentConfig, keep: dict[int, list[int]],
         k: int | None = None) -> tuple[dict[str, Tensor], ExperimentConfig]:
    """(state, config) with only `keep[layer]` experts in each MoE layer; top-`k` routing
    (default: the model's k, at most the experts kept)."""
    sizes = {len(ids) for ids in keep.values()}
    if len(sizes) != 1:
        raise ConfigError(f"--trim: every MoE layer must keep the same number of experts, got "
                          f"{sorted(sizes)}")
    n = sizes.pop()
    k = min(cfg.moe.k, n) if k is None else k
    if not 1 <= k <= n:
        raise ConfigError(f"--k: expected 1..{n} (the experts kept), got {k}")
    out = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        out[name] = t if m is None else t.index_select(0, torch.tensor(keep[int(m.group(2))]))
    layers = len(sparse_layers(cfg))  # the same transformers coefficient at the new k
    aux = aux_coef_from_hf(aux_coef_to_hf(cfg.moe.aux_loss_coef, cfg.moe.k, layers), k, layers)
    moe = dataclasses.replace(cfg.moe, num_experts=n, k=k, aux_loss_coef=aux)
    return out, dataclasses.replace(cfg, moe=moe)


def calibration_lines(path: str | Path, tokenizer, limit: int) -> list[list[int]]:
    """Token ids of the non-empty lines of a UTF-8 text file (at most `limit` lines)."""
    from moe_train.data.corpus import read_text_input

    _, lines = read_text_input(str(path))
    encoded = [ids for ids in tokenizer.encode_batch([ln for ln in lines if ln.strip()][:limit])
               if ids]
    if not encoded:
        raise ConfigError(f"--calibration: {path} has no text to route; expected lines of the "
                          "data the trimmed model will serve")
    return encoded
