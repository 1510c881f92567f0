"""Gated Adapters (seed 004): a dense, soft mixture over per-domain adapters, one gate per layer.

`GatedRouter` ("gated") weighs all E adapters of its layer with g = softmax(W_g agg(x) / beta)
(Eq. 3): agg is the masked mean of the layer's adapter input over the source in the encoder
(one gate per sentence) and the inclusive causal prefix mean in the decoder (one gate per
target position; while decoding incrementally the running sum and count live in the slot's
routing state, reordered with the beams). Every token goes to every adapter, so the layer uses
a `DenseDispatcher` (no sort) and the adapters run as one batched GEMM per projection.

The gate is trained by distillation from a domain classifier: with the teacher's per-sentence
distribution in ``ForwardContext.extras[TEACHER_PROBS_KEY]`` (a trainer hook puts it there),
each gate adds alpha * tau^2 * KL(P_clf,tau || P_g,tau) (Eqs. 4-5), P_g,tau = softmax(W_g agg /
tau), summed over gates; or alpha * CE(W_g agg, gold domain) (gate_loss ce). Normalisation,
as the reference code (which adds the gate losses to the summed translation loss) and seed-notes
OD-G4: a decoder gate's loss is its mean over the real target positions, an encoder gate's (one
row per sentence) its sum over sentences divided by the batch's real target tokens
(``extras[TARGET_TOKENS_KEY]``); ``gated.encoder_loss_norm: sentences`` averages the encoder's
over sentences instead (about the mean target length stronger). Evaluation and inference have
no gate loss; training without the teacher's probabilities is refused (the gates would train
on translation alone while the config says kl).

Shape legend: T tokens (flattened B x length), B sentences, D model dim, E adapters (domains).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_train.config.gated import GatedConfig
from moe_train.config.moe import RouterConfig
from moe_train.errors import ConfigError
from moe_train.moe import losses
from moe_train.moe.gating import Router, _require_sentences, _sentence_pad_mask, linear_fp32
from moe_train.moe.routing import (TARGET_TOKENS_KEY, Routing, RoutingContext, context_rows,
                                    expand_rows, ids_on_host)

TEACHER_PROBS_KEY = "teacher_probs_BE"
"""Extras key of the domain classifier's distribution over the E domains, per sentence."""


def check_gold_domains(gold_B: Tensor, num_experts: int) -> None:
    """ConfigError when a gold domain id has no adapter (id >= E), checked on the ids' host
    copy (`ids_on_host`): every gated layer of a forward gets the batch's one tensor, which
    is read from the device once."""
    ids = ids_on_host(gold_B)
    if ids and max(ids) >= num_experts:
        raise ConfigError(f"adapters.num_experts: domain id {max(ids)} has no adapter "
                          f"(expected one adapter per domain, got {num_experts})")


class GatedRouter(Router):
    """Soft per-layer domain gate over all E adapters (see the module docstring)."""

    name = "gated"
    soft = True

    def __init__(self, d_model: int, num_experts: int, cfg: RouterConfig,
                 gated: GatedConfig | None = None) -> None:
        super().__init__(num_experts)
        self.cfg, self.gated = cfg, gated or GatedConfig()
        self.k = num_experts
        self.gate = nn.Linear(d_model, num_experts, bias=False)  # W_g, no bias (Eq. 3)
        if self.gated.gate_loss == "ce":
            self.task_source = "domain"  # the gold domain reaches RoutingContext.task_ids_B

    def gate_logits(self, x_TD: Tensor, rctx: RoutingContext) -> tuple[Tensor, Tensor]:
        """(W_g agg(x) of every token (T, E), and of the rows the gate loss averages over:
        sentences (B, E) in the encoder, tokens in the decoder), float32."""
        agg_ND, row_T = context_rows(x_TD, rctx)  # encoder: one gate per sentence, B rows
        logits_NE = linear_fp32(agg_ND, self.gate)
        return expand_rows(logits_NE, row_T), logits_NE

    def forward(self, x_TD: Tensor, rctx: RoutingContext | None = None) -> Routing:
        rctx = _require_sentences(rctx, self.name)
        logits_TE, rows_NE = self.gate_logits(x_TD, rctx)
        probs_TE = (logits_TE / self.gated.temperature).softmax(-1)
        T, E = probs_TE.shape
        ids_TE = torch.arange(E, device=x_TD.device).expand(T, E)
        aux = self.gate_loss(rows_NE, rctx) if self.training else {}
        with torch.no_grad():  # every real token reaches every adapter
            real = (torch.tensor(T, device=x_TD.device) if rctx.pad_mask_T is None
                    else (~rctx.pad_mask_T).sum())  # no host sync
            stats = {"tokens_per_expert": real.long().expand(E)}
            if self.training:  # logged per training step; not worth a pass per decoding step
                stats["routing_entropy"] = losses.routing_entropy(probs_TE, rctx.pad_mask_T)
        return Routing(expert_ids_TK=ids_TE, weights_TK=probs_TE.to(x_TD.dtype),
                       probs_TE=probs_TE, num_experts=E, aux_losses=aux, stats=stats)

    def gate_loss(self, logits_NE: Tensor, rctx: RoutingContext) -> dict[str, Tensor]:
        """alpha * (tau^2 KL to the teacher | CE on the gold domain), over real rows."""
        g = self.gated
        if g.gate_loss == "none" or g.alpha == 0:
            return {}
        per_sentence = rctx.side == "encoder"
        pad_N = _sentence_pad_mask(rctx) if per_sentence else rctx.pad_mask_T
        if g.gate_loss == "ce":
            if rctx.task_ids_B is None:
                raise ConfigError("gated.gate_loss: ce needs the gold domain of every sentence, "
                                  "which this batch lacks")
            check_gold_domains(rctx.task_ids_B, self.num_experts)
            gold_N = rctx.task_ids_B.long()
            if not per_sentence:
                gold_N = gold_N.index_select(0, rctx.sentence_ids_T)
            ce_N = F.cross_entropy(logits_NE, gold_N, reduction="none")
            return {"gad_gate_ce": g.alpha * self._normalised(ce_N, pad_N, rctx)}
        teacher_BE = rctx.extras.get(TEACHER_PROBS_KEY)
        if teacher_BE is None:
            raise ConfigError("gated.gate_loss: kl distils the domain classifier's "
                              "probabilities, which this training batch lacks; train GAD with "
                              "`moe-train pipeline gad`, or set gated.gate_loss to ce or none")
        if teacher_BE.shape != (rctx.num_sentences, self.num_experts):
            raise ConfigError(f"gated: teacher probabilities of shape {tuple(teacher_BE.shape)}"
                              f", expected ({rctx.num_sentences}, {self.num_experts}): one "
                              "probability per domain adapter (adapters.num_experts)")
        if not per_sentence:
            teacher_BE = teacher_BE.index_select(0, rctx.sentence_ids_T)
        kl_N = losses.distillation_kl(logits_NE, teacher_BE, g.tau, g.teacher_as_logits)
        return {"gad_gate_kd": g.alpha * g.tau ** 2 * self._normalised(kl_N, pad_N, rctx)}

    def _normalised(self, loss_N: Tensor, pad_N: Tensor | None, rctx: RoutingContext) -> Tensor:
        """A gate loss over its real rows: the mean over target positions (decoder); over
        sentences, their sum per real target token of the batch (encoder, target_tokens) or
        their mean (sentences)."""
        if rctx.side != "encoder" or self.gated.encoder_loss_norm == "sentences":
            return losses.masked_mean(loss_N, pad_N)
        tokens = rctx.extras.get(TARGET_TOKENS_KEY)
        if tokens is None:
            raise ConfigError("gated.encoder_loss_norm: target_tokens needs the batch's target "
                              "token count, which this forward lacks; use sentences")
        keep_N = 1.0 if pad_N is None else (~pad_N).to(torch.float32)
        return (loss_N.float() * keep_N).sum() / max(int(tokens), 1)

