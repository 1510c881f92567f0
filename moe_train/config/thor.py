"""THOR-MoE settings (seed 003): the ``thor`` section, read when a side's router is ``thor``.

Equations and open decisions: ../shared/seed-notes.md section 1. The token router inside the
candidate set takes ``moe.k`` (top-k, Eq. 4) or ``moe.top_p`` (top-p, Eqs. 5-7). Defaults are
the multilingual encoder-decoder coefficients of 003 (alpha 1e-2, beta 5e-2, gamma 5e-2,
delta 1e-4); its multi-domain runs use 1e-2, 1e-2, 1e-2, 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_train.config.moe import _at_most
from moe_train.errors import ConfigError

THOR_TASK_SOURCES = ("domain", "tgt_lang", "src_lang", "lang_pair", "other_lang")
"""What "task" means for the predictor: the domain, the target or source language, the pair,
or the language of the pair that is not `ThorConfig.pivot_lang` (OD-2: the non-English side)."""
TASK_REPRS = ("mixed", "argmax", "gold", "infuse")
"""003 Tables 5-6: E_p from predicted probabilities (mixed), from the argmax task (non-mixed),
from the gold task, or added to the token state with no task-level routing (infuse)."""
TOKEN_SELECTIONS = ("topk", "topp")
CONTEXT_GATES = ("vector", "scalar")
CONTEXT_GATE_INITS = ("open", "xavier")


def _expect(cond: bool, path: str, expected: str, got: object) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


@dataclass
class ThorConfig:
    """Hierarchical task-guided + context-responsive routing; checked on construction."""

    task_source: str = "domain"
    """The task the predictor learns: domain, tgt_lang, src_lang, lang_pair, or other_lang
    (the sentence's language other than `pivot_lang`: 003's multilingual tasks)."""
    pivot_lang: str = "en"
    """The shared language of a multilingual corpus (task_source other_lang)."""
    num_tasks: int = 0
    """K, the predictor's classes; 0 takes it from the prepared data (domains, languages or
    language pairs)."""
    task_repr: str = "mixed"
    """Task representation: mixed (Eq. 9), argmax, gold, or infuse (E_p added to the router
    input, no candidate set)."""
    hierarchy: bool = True
    """Task-level routing: each layer's task router picks the candidate set S^t; False routes
    tokens over all experts (003 Table 4, "w/o hierarchical")."""
    num_candidates: int = 8
    """|S^t|, the candidate experts per sentence and layer (OD-3: 8 of 32, 4 of 8)."""
    token_routing: str = "topp"
    """Token router inside S^t: topk (moe.k, Eq. 4) or topp (moe.top_p, Eqs. 5-7)."""
    context: bool = True
    """Context-responsive routing: router input g*x + (1-g)*H_ctx (decoder: inclusive causal
    mean; encoder: masked source mean)."""
    context_gate: str = "vector"
    """Gate g: vector (W^g 2D x D, as written) or scalar (2D x 1, a cheap ablation)."""
    context_gate_init: str = "xavier"
    """Initial W^g: "xavier" (003 leaves it open; a random gate per token and dimension from
    step 0) or "open" (zeros: every gate starts at sigmoid(context_gate_bias) and the gate
    learns how much context to take)."""
    context_gate_bias: float = 0.0
    """Initial b^g (0: the gate starts around one half; with "open" and 2.0 the router starts
    reading 0.88 x + 0.12 H_ctx)."""
    renormalize: bool = False
    """Divide the combine weights g^t_i * g_j of a token by their sum (OD-4 option)."""
    predictor_layer: int = -1
    """Encoder layer whose input (residual stream) the task predictor max-pools; -1: the first
    encoder THOR layer, or the encoder output when the encoder has none. Decoder-only
    (hf_qwen2_moe): the FFN input of the first MoE layer, pooled over the prompt positions;
    only -1 or that layer's index are accepted (every MoE layer is a THOR layer)."""
    alpha: float = 1e-2
    """Weight of the task-prediction cross-entropy L_tp (Eq. 10)."""
    beta: float = 5e-2
    """Weight of the task-level balance loss L_bd (Eq. 11)."""
    gamma: float = 5e-2
    """Weight of the token-level balance loss L_bt (Eq. 12); replaces moe.aux_loss_coef."""
    delta: float = 1e-4
    """Weight of the top-p entropy loss L_topp (Eq. 13); top-p only."""

    def __post_init__(self) -> None:
        _expect(self.task_source in THOR_TASK_SOURCES, "thor.task_source",
                f"one of {', '.join(THOR_TASK_SOURCES)}", self.task_source)
        _expect(self.task_repr in TASK_REPRS, "thor.task_repr", f"one of {', '.join(TASK_REPRS)}",
                self.task_repr)
        _expect(self.token_routing in TOKEN_SELECTIONS, "thor.token_routing",
                f"one of {', '.join(TOKEN_SELECTIONS)}", self.token_routing)
        _expect(self.hierarchy or self.task_repr != "gold", "thor.task_repr",
                "mixed or argmax when thor.hierarchy is false (no candidate set reads the gold "
                "task's E_p, yet decoding would need every sentence's gold task)", self.task_repr)
        _expect(self.context_gate in CONTEXT_GATES, "thor.context_gate",
                f"one of {', '.join(CONTEXT_GATES)}", self.context_gate)
        _expect(self.context_gate_init in CONTEXT_GATE_INITS, "thor.context_gate_init",
                f"one of {', '.join(CONTEXT_GATE_INITS)}", self.context_gate_init)
        _expect(isinstance(self.pivot_lang, str) and self.pivot_lang != "", "thor.pivot_lang",
                "a language code", self.pivot_lang)
        _expect(self.num_tasks >= 0, "thor.num_tasks", "a non-negative integer (0: from the data)",
                self.num_tasks)
        _expect(self.num_candidates >= 1, "thor.num_candidates", "a positive integer",
                self.num_candidates)
        _at_most("size", self, "thor", "num_tasks")
        _at_most("experts", self, "thor", "num_candidates")
        _expect(self.predictor_layer >= -1, "thor.predictor_layer",
                "an encoder layer index, or -1 (the first encoder THOR layer)",
                self.predictor_layer)
        for name in ("alpha", "beta", "gamma", "delta"):
            _expect(getattr(self, name) >= 0, f"thor.{name}", "a non-negative number",
                    getattr(self, name))

    @property
    def candidate_sets(self) -> bool:
        """Whether each layer restricts tokens to a task-chosen candidate set."""
        return self.hierarchy and self.task_repr != "infuse"
