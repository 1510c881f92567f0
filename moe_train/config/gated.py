"""Gated Adapters settings (seed 004): the ``gated`` section, read when ``adapters.router`` is
``gated`` and by the ``gad`` recipe (`moe-train pipeline gad`: backbone/MIX -> classifier ->
AD -> GAD -> evaluate, with the TAG baselines when ``tag_prepared_dir`` is set). The recipe's
shared settings (workdir, backbone_dir, eval_sentences, eval_beam, seed) are the ``moa``
section's, as for every stage-wise recipe.

One adapter per domain after every layer of ``adapters.sides`` (``adapters.num_experts`` =
the number of domains, ``adapters.dim`` = d/2 for the paper's bottleneck of 2), mixed by a soft
per-layer gate softmax(W_g agg(x) / temperature) (Eq. 3) and distilled from a domain
classifier's probabilities (Eqs. 4-5). Equations and open decisions: ../shared/seed-notes.md
section 2 (OD-G1..G6). Defaults are the reference code's alpha 0.5, beta 2.0, tau 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.moe import _expect

CLASSIFIERS = ("encoder", "tfidf")
"""encoder: the frozen backbone encoder's mean-pooled states plus a linear head, trained
data-parallel; tfidf: TF-IDF over subword n-grams plus logistic regression (scikit-learn)."""
GAD_INITS = ("mix", "ad")
"""mix: GAD starts from the MIX backbone with new adapters and gates (004 Sec. 3.2.2, as AD
does); ad: from the trained AD adapters (gates new), which gives GAD's adapters AD's updates
on top of its own."""
ENCODER_LOSS_NORMS = ("target_tokens", "sentences")
"""How the encoder gates' loss (one row per sentence) is normalised: target_tokens divides its
sum over sentences by the batch's target tokens, as the reference code (which adds it to the
summed translation loss) and seed-notes OD-G4; sentences averages over sentences (about the
mean target length stronger)."""
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
    teacher_as_logits: bool = True
    """Soften the teacher as softmax(p / tau), treating its probabilities as logits (the
    reference code, OD-G2's recommendation); False: softmax(log p / tau), the proper tempered
    distribution (with tau 0.1 that is p^10 renormalised: nearly one-hot)."""
    classifier: str = "encoder"
    """The teacher / inference-time domain classifier of the recipe: encoder or tfidf."""
    classifier_steps: int = 1000
    """Updates of the encoder classifier's linear head."""
    classifier_lr: float = 1e-3
    """Adam learning rate of the encoder classifier's head."""
    classifier_batch_sentences: int = 256
    """Sentences per head update (over all ranks)."""
    tfidf_ngrams: int = 2
    """TF-IDF features are subword n-grams of order 1..tfidf_ngrams."""
    ad_steps: int = 2000
    """Updates of the AD stage (one adapter per domain, oracle routing, base frozen)."""
    gad_steps: int = 2000
    """Updates of the GAD stage (adapters and gates train; see gad_init)."""
    gad_init: str = "mix"
    """Where GAD starts: mix (004: the MIX backbone, adapters and gates new) or ad (the AD
    stage's adapters; gates new)."""
    encoder_loss_norm: str = "target_tokens"
    """Normaliser of the encoder gates' loss: target_tokens (reference code, OD-G4) or
    sentences (see ENCODER_LOSS_NORMS)."""
    lr: float = 5e-4
    """Peak learning rate of the AD, GAD and TAG stages."""
    upsample: bool = True
    """Draw every corpus equally often in AD and GAD (004: every domain up-sampled to the
    largest); False keeps data.temperature."""
    tag_prepared_dir: str = ""
    """The same corpora prepared with data.domain_tags=true: the TAG baseline (MIX fine-tuned
    with a domain tag in the source) and TAG_CLF; '' leaves them out."""
    tag_steps: int = 1000
    """Updates of the TAG stage (every parameter trains, from the MIX backbone)."""
    efficiency_batch: int = 64
    """Sentences per batch of the efficiency table (004 Table 7: 64, greedy)."""
    efficiency_repeats: int = 5
    """Timed passes over the test sentences per system; the table reports the fastest."""

    def __post_init__(self) -> None:
        _expect(self.temperature > 0, "gated.temperature", "a positive number",
                self.temperature)
        _expect(self.gate_loss in GATE_LOSSES, "gated.gate_loss",
                f"one of {', '.join(GATE_LOSSES)}", self.gate_loss)
        _expect(self.alpha >= 0, "gated.alpha", "a non-negative number", self.alpha)
        _expect(self.tau > 0, "gated.tau", "a positive number", self.tau)
        _expect(self.gad_init in GAD_INITS, "gated.gad_init", f"one of {', '.join(GAD_INITS)}",
                self.gad_init)
        _expect(self.encoder_loss_norm in ENCODER_LOSS_NORMS, "gated.encoder_loss_norm",
                f"one of {', '.join(ENCODER_LOSS_NORMS)}", self.encoder_loss_norm)
        _expect(self.classifier in CLASSIFIERS, "gated.classifier",
                f"one of {', '.join(CLASSIFIERS)}", self.classifier)
        for name in ("classifier_steps", "classifier_batch_sentences", "tfidf_ngrams",
                     "ad_steps", "gad_steps", "tag_steps", "efficiency_batch",
                     "efficiency_repeats"):
            _expect(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                    f"gated.{name}", "a positive integer", getattr(self, name))
        for name in ("classifier_lr", "lr"):
            _expect(getattr(self, name) > 0, f"gated.{name}", "a positive number",
                    getattr(self, name))
