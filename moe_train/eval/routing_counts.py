"""The raw counts `RoutingRecorder` (eval/routing_stats.py) keeps per MoE layer and for the
THOR task predictor: tensors indexed by the manifest's and the predictor's ids, summed over
ranks with one all-reduce of `tensors()`.

Shape legend: E experts, N domains, L languages, P language pairs (L * L), Q task-predictor
classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerCounts:
    """Raw routing counts of one MoE layer, indexed by the manifest's / predictor's ids."""

    expert_domain_EN: Tensor
    """Token slots per (expert, domain id), long."""
    expert_pair_EP: Tensor
    """Token slots per (expert, language pair id src * L + tgt), long."""
    expert_tgt_EL: Tensor
    """Token slots per (expert, target-language id), long."""
    tokens: Tensor
    """Real (non-pad) tokens routed, long scalar."""
    entropy_tokens: Tensor
    """Real tokens whose router gave a distribution (probs_TE), long scalar."""
    entropy_sum: Tensor
    """Summed router entropy (nats) of those tokens, float64 scalar."""
    tokens_domain_N: Tensor
    """Real tokens per domain id, long."""
    tokens_pair_P: Tensor
    """Real tokens per language pair id, long."""
    expert_gold_EQ: Tensor
    """Token slots per (expert, gold task), long; Q = 0 without a task predictor."""
    expert_pred_EQ: Tensor
    """Token slots per (expert, predicted task), long."""
    tokens_gold_Q: Tensor
    """Real tokens per gold task, long."""
    candidate_gold_EQ: Tensor
    """Sentences per (expert in S^t, gold task), long (THOR layers with candidate sets)."""
    candidate_E: Tensor
    """Sentences whose S^t holds the expert, long."""
    candidate_sentences: Tensor
    """Sentences whose S^t was recorded, long scalar."""
    candidate_pairs: Tensor
    """(sentence, candidate) pairs, long scalar."""
    candidate_used: Tensor
    """Of those, the pairs whose candidate received a real token slot, long scalar."""

    @classmethod
    def zeros(cls, num_experts: int, num_domains: int, num_langs: int, num_tasks: int = 0,
              device: torch.device | str | None = None) -> LayerCounts:
        def z(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        E, Q = num_experts, num_tasks
        return cls(z(E, num_domains), z(E, num_langs * num_langs), z(E, num_langs), z(), z(),
                   z(dtype=torch.float64), z(num_domains), z(num_langs * num_langs), z(E, Q),
                   z(E, Q), z(Q), z(E, Q), z(E), z(), z(), z())

    def tensors(self) -> list[Tensor]:
        """The fields in declaration order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def clone(self) -> LayerCounts:
        return LayerCounts(*(t.clone() for t in self.tensors()))


@dataclass
class TaskCounts:
    """Task-predictor counts over the sentences that have a gold task."""

    confusion_QQ: Tensor
    """Sentences per (predicted, gold) task, long."""
    correct_N: Tensor
    """Correctly predicted sentences per domain id, long."""
    sentences_N: Tensor
    """Sentences per domain id, long."""
    correct_P: Tensor
    """Correctly predicted sentences per language pair id, long."""
    sentences_P: Tensor
    """Sentences per language pair id, long."""

    @classmethod
    def zeros(cls, num_tasks: int, num_domains: int, num_langs: int,
              device: torch.device | str | None = None) -> TaskCounts:
        P = num_langs * num_langs
        return cls(*(torch.zeros(shape, dtype=torch.long, device=device) for shape in
                     ((num_tasks, num_tasks), (num_domains,), (num_domains,), (P,), (P,))))

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def clone(self) -> TaskCounts:
        return TaskCounts(*(t.clone() for t in self.tensors()))
