"""Gated Adapters settings (seed 004): the ``gated`` section, read when ``adapters.router`` is
``gated``.

One adapter per domain after every layer of ``adapters.sides`` (``adapters.num_experts`` =
the number of domains, ``adapters.dim`` = d/2 for the paper's bottleneck of 2), mixed by a soft
per-layer gate softmax(W_g agg(x) / temperature) (Eq. 3) and distilled from a domain
classifier's probabilities (Eqs. 4-5). Equations and open decisions: ../shared/seed-notes.md
section 2 (OD-G1..G6). Defaults are the reference code's alpha 0.5, beta 2.0, tau 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.moe import _expect

GATE_LOSSES = ("kl", "ce", "none")
"""kl: distil the teacher's domain distribution (Eq. 4); ce: train the gate as a classifier on
the gold domain (004 Table 9 ablation); none: the translation loss alone."""


@dataclass
class GatedConfig:
    """Soft domain-adapter gate and its distillation; checked on construction."""

    temperature: float = 2.0
    """beta of Eq. 3: gate weights softmax(W_g agg(x) / beta)."""
    gate_loss: str = "kl"
    """kl (Eq. 4), ce on the gold domain (Table 9 ablation) or none."""
    alpha: float = 0.5
    """Weight of the gate loss in L = L_CE + alpha * L_gate (Eq. 5)."""
    tau: float = 0.1
    """Distillation temperature: KL(P_clf,tau || P_g,tau) times tau^2 (Eq. 4)."""
    teacher_as_logits: bool = False
    """Soften the teacher as softmax(p / tau), treating its probabilities as logits (the
    reference code), instead of softmax(log p / tau) (OD-G2)."""

    def __post_init__(self) -> None:
        _expect(self.temperature > 0, "gated.temperature", "a positive number",
                self.temperature)
        _expect(self.gate_loss in GATE_LOSSES, "gated.gate_loss",
                f"one of {', '.join(GATE_LOSSES)}", self.gate_loss)
        _expect(self.alpha >= 0, "gated.alpha", "a non-negative number", self.alpha)
        _expect(self.tau > 0, "gated.tau", "a positive number", self.tau)
