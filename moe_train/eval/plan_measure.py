"""The memory plan checked against real training steps on the CPU (`measure_peak`,
`measured_vs_planned`); benchmarks/plan_check.py and tests/integration/test_plan_measured.py
run `MEASURED_CHECKS`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from moe_train.config.schema import ExperimentConfig
from moe_train.eval.plan import PlanInputs, model_shape, plan_memory
from moe_train.models.build import build_model

MEASURED_CHECKS: dict[str, tuple[str, list[str], int, int]] = {
    "seq2seq": ("configs/debug-cpu.yaml",
                ["model.d_model=256", "model.ffn_dim=1024", "model.encoder_layers=4",
                 "model.decoder_layers=4", "moe.num_experts=8", "data.vocab_size=8000"], 16, 64),
    "qwen": ("configs/qwen-moe-tiny-cpu.yaml",
             ["qwen.hidden_size=256", "qwen.num_hidden_layers=4", "qwen.vocab_size=8000",
              "moe.expert_ffn_dim=256", "moe.num_experts=8",
              "qwen.shared_expert_intermediate_size=512"], 8, 128),
}
"""(config, overrides, micro-batch, sequence length) of the measured-vs-planned checks."""


def measure_peak(cfg: ExperimentConfig, micro_batch: int, seq_len: int, *,
                 activation_checkpointing: bool = False, steps: int = 2, seed: int = 0,
                 target_len: int = 0) -> dict[str, Any]:
    """Peak live tensor bytes of a real fp32 training step on the CPU (one process, ZeRO 0).

    torch.profiler with ``profile_memory=True`` records every allocation and free of the c10
    CPU allocator with its time and size; their running sum from before the model exists is
    the live tensor bytes at every moment (unlike RSS: no freed-but-cached pages, no Python
    objects or libraries). Inside the profiler: the model is built, AdamW (foreach, as on GPUs;
    dense and expert groups, as the trainer) created and `steps` steps run: forward,
    label-smoothed loss (train/loss.py), backward, optimizer step, gradients kept
    (``zero_grad(set_to_none=False)``). The first step creates gradients and Adam's state; the
    experts' `GradBuffers` are held to one buffer (the `.grad`; the CPU path would keep a second
    after the first accumulating step), so the last step is the steady state (a third step
    measures the same bytes). One intra-op thread: same allocations, no oversubscription of a
    shared machine. `activation_checkpointing` builds the model with
    `model.activation_checkpointing` (per-layer recomputation, as training runs it). Random
    tokens in [1, V): no padding. A decoder-only model reads sequences of `seq_len` tokens,
    the last `target_len` of them targets (0: half), as the trainer does (`teacher_forced`:
    logits of the target positions only). Returns peak, static (live when the last step starts),
    working (peak - static), peak_phase, optimizer_working (the optimizer step's own peak above
    static) and parameters.
    """
    from moe_train.eval.plan import target_tokens
    from moe_train.models.context import ForwardContext
    from moe_train.models.lm_batch import teacher_forced
    from moe_train.train.loss import label_smoothed_nll

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, activation_checkpointing=activation_checkpointing))
    vocab = cfg.qwen.vocab_size if cfg.decoder_only else cfg.data.vocab_size
    gen = torch.Generator().manual_seed(seed)
    T = target_tokens(PlanInputs(seq_len=seq_len, target_len=target_len), cfg.decoder_only)
    # decoder-only: the source (its eos is stripped, the prompt's last position predicts the
    # first target): prompt + target without bos is seq_len
    S = seq_len - T + 2 if cfg.decoder_only else seq_len
    src_BS = torch.randint(1, vocab, (micro_batch, S), generator=gen)
    tgt_BT = torch.randint(1, vocab, (micro_batch, T + 1), generator=gen)

    # task labels for task-routed layers (language pair en-de, domain 0, task 0)
    zeros_B = torch.zeros(micro_batch, dtype=torch.long)
    labels = {"domain_ids_B": zeros_B, "src_lang_B": zeros_B, "tgt_lang_B": zeros_B + 1,
              "task_ids_B": zeros_B, "extras": {"num_langs": 2}}

    def loss_of(model: nn.Module) -> torch.Tensor:  # `out` dies here, as in the trainer
        ctx = ForwardContext(src_pad_mask_BS=src_BS.eq(0), **labels)
        out = teacher_forced(model, src_BS, tgt_BT[:, :-1], ctx, 0, cfg.decoder_only)
        loss, _ = label_smoothed_nll(out.logits_BTV, tgt_BT[:, 1:], 0, cfg.optim.label_smoothing)
        return loss / tgt_BT[:, 1:].numel() + sum(out.aux_losses.values())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        events = _profiled_steps(cfg, loss_of, vocab, steps, seed)
    finally:
        torch.set_num_threads(threads)
    span = {name: (t0, t1) for name, t0, t1, _ in events if name.startswith("measured")}
    (start, end), (opt_start, opt_end) = span["measured"], span["measured_optimizer"]
    live, static, peak, peak_at, opt_peak = 0, None, 0, start, 0
    for t, nbytes in sorted((t0, n) for name, t0, _, n in events if name == "[memory]"):
        if static is None and t >= start:
            static = live
        live += nbytes
        if start <= t <= end and live > peak:
            peak, peak_at = live, t
        if opt_start <= t <= opt_end:
            opt_peak = max(opt_peak, live)
    static = live if static is None else static
    phase = ("forward" if peak_at < span["measured_backward"][0] else
             "backward" if peak_at < opt_start else "optimizer")
    shape = model_shape(cfg)
    return {"peak": peak, "static": static, "working": peak - static, "peak_phase": phase,
            "optimizer_working": max(opt_peak - static, 0),
            "parameters": shape.dense_params + shape.expert_params}


def _profiled_steps(cfg: ExperimentConfig, loss_of: Any, vocab: int, steps: int,
                    seed: int) -> list[tuple[str, int, int, int]]:
    """(name, start ns, end ns, bytes) of the profiler's events over building the model and
    `steps` steps, the last marked ``measured``; "[memory]" events allocate (bytes > 0) or
    free (bytes < 0)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from moe_train.parallel.expert_parallel import moe_param_groups

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(seed)
        model = build_model(cfg, {"vocab_size": vocab, "pad_id": 0, "langs": ["en", "de"],
                                  "domains": []})
        for m in model.modules():
            if hasattr(m, "grad_buffers"):
                m.grad_buffers.max_per_name = 1
        model.train()
        groups = moe_param_groups(model, [{"params": list(model.parameters())}], 1)
        optimizer = torch.optim.AdamW(groups, lr=1e-4, foreach=True)
        for i in range(steps):
            tag = "measured" if i == steps - 1 else f"step{i}"
            with record_function(tag):
                loss = loss_of(model)
                with record_function(tag + "_backward"):
                    loss.backward()
                del loss
                with record_function(tag + "_optimizer"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=False)
    return [(e.name(), e.start_ns(), e.end_ns(), e.nbytes() if e.name() == "[memory]" else 0)
            for e in prof.profiler.kineto_results.events()]


def measured_vs_planned(cfg: ExperimentConfig, micro_batch: int, seq_len: int,
                        activation_checkpointing: bool = False, target_len: int = 0
                        ) -> dict[str, Any]:
    """`measure_peak` next to `plan_memory` for the same shape (1 GPU, ZeRO 0, ep 1, fp32, CPU
    kernels), and the relative errors (planned - measured) / measured of the total and of the
    working set (what the step adds to parameters, gradients and optimizer state)."""
    measured = measure_peak(cfg, micro_batch, seq_len, target_len=target_len,
                            activation_checkpointing=activation_checkpointing)
    plan = plan_memory(cfg, PlanInputs(1, 1, 1024.0, 0, 1, micro_batch, seq_len,
                                       activation_checkpointing, "fp32",
                                       target_len=target_len), kernels="cpu")
    static = plan["parameters"] + plan["gradients"] + plan["optimizer_states"]
    working = plan["total"] - static
    return {"measured": measured,
            "planned": {"total": plan["total"], "static": static, "working": working,
                        "optimizer_step": plan["optimizer_step"],
                        "activation_terms": plan["activation_terms"]},
            "relative_error": (plan["total"] - measured["peak"]) / measured["peak"],
            "working_relative_error": (working - measured["working"]) / measured["working"]}


__all__ = ["MEASURED_CHECKS", "measure_peak", "measured_vs_planned"]
