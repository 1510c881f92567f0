"""Per-GPU memory plan of a training run (`moe-train plan`): will it fit, and what takes the room.

`plan_memory(cfg, PlanInputs(...))` gives the bytes one GPU holds, by part. Counts come from the
model built on the meta device (`eval.params.count_model`): P_d dense parameters (attention,
dense FFNs, norms, routers, embeddings) and P_e expert parameters (every `StackedExperts`
tensor). W = nodes x GPUs per node ranks; a rank holds every dense parameter and E/ep experts
of each MoE layer. ZeRO shards dense tensors over the W data-parallel ranks and expert tensors
over the W/ep ranks of their expert-data-parallel group: a shard is P_d/W + P_e/W parameters.

Model states (ZeRO paper, Rajbhandari et al. 2020, Sec. 3.1: 2 + 2 + 12 B per parameter):
- parameters: 2 B (bf16/fp16) or 4 B (fp32) per held parameter (P_d + P_e/ep); ZeRO-3 holds its
  shard plus one gathered block in full (the largest layer's dense parameters and local
  experts, or the embedding / LM head).
- gradients: the parameters' dtype; sharded from ZeRO-2 (ZeRO-3 adds one gathered block's).
- optimizer state (AdamW): fp32 master + m + v = 12 B under mixed precision; in fp32 8 B at
  ZeRO-0 (the master is the parameter), 12 B from ZeRO-1 (DeepSpeed's ZeRO optimizers keep an
  fp32 copy of their shard whatever the dtype); sharded from ZeRO-1.
- optimizer step (transient; never alive with the activations): torch's foreach AdamW (the
  trainer's) allocates sqrt(v) for one parameter group at a time, 4 B per parameter; DeepSpeed
  adds that group's fp32 gradient, 4 B (ZeRO-1/2: the group's shard; ZeRO-3: per sub-group of
  at most 1e9; ZeRO-0 with mixed precision converts every held gradient at once). A group is
  at most the larger of the dense and the expert parameters (the trainer splits the two).

Activations: what autograd keeps for the backward, per token: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1: s*b*h*(34 +
5*a*s/h) B per layer in half precision) term by term for our modules. Attention is fused (SDPA
flash / memory-efficient: no s x s scores, so no 5*a*s/h term). a = 2 (bf16/fp16) or 4 (fp32)
B, m = dropout-mask bytes (CUDA: 1), D model dim, H / H_kv heads, F inner dims, E experts, k
experts per token (the router's k; top-p: its bound):
- norm: LayerNorm input + output 2aD; HF's RMSNorm (fp32 math) fp32 input + normalised +
  output (4 + 2a)D.
- self-attention: norm + q, o 2aD + k, v 2aD H_kv/H + residual dropout mask mD (the 34's
  "QKV input, Q, K, V, output-projection input, mask").
- cross-attention (seq2seq decoder): norm + q, o 2aD + mask mD per target token, k, v 2aD per
  *source* token in every decoder layer.
- dense FFN: norm + hidden (relu aF: its output, read by its backward and fc2's; gelu 2aF;
  SwiGLU 4aF: gate, up, silu(gate), product) + mask mD (+ (a + m)F with activation dropout).
- MoE FFN: norm + router (fp32 probabilities 4E; ids, weights, row map 24 B per slot) + per
  slot: dispatched row aD, expert hidden rows (relu aF, gelu 2aF, SwiGLU 4aF), expert output aD
  (read by the combine's weight gradient) + shared SwiGLU expert 4aF_s + aD + mask mD.
- adapter slot (MoA, ADPT, Gated Adapters; inner dim R): see `_adapter_bytes` (per slot 5aD +
  aR; Gated Adapters run all E adapters on every token, 2aD + aR each).
- per stack: embedding dropout mask mD and the final norm (the encoder's output, read by every
  cross-attention, is kept once).
- loss: 12 B per vocabulary entry per target token: the fp32 log-softmax kept for backward
  (train/loss.py upcasts) and, at the start of the backward, the fp32 gradients of the
  smoothing mean and of the nll gather. That moment is the peak: every activation is still
  alive (the layers' gradient temporaries come later, as activations are freed).
- activation checkpointing (per layer): each layer keeps its input aD; the peak adds the larger
  of the loss term and one recomputed layer plus the gradient at its output aD.

All-to-all (ep > 1): one MoE layer's dispatch send and receive buffers, tokens x k x D x a each,
and the same two for the combine: 4 x tokens x k x D x a.
Gradient bucket (ZeRO-1/2): DeepSpeed's `reduce_bucket_size` elements (default 5e8: 0.93 GiB in
bf16), allocated as the backward starts whatever the model's size (`reduce_bucket_bytes`).

Total = parameters + gradients + optimizer state + max(activations + all-to-all + bucket,
optimizer step); it fits within (1 - headroom) of the GPU's memory. The 10% headroom covers the
CUDA context, allocator fragmentation and what is not modelled (ZeRO-3's prefetch and reduce
buckets, O(H) bytes per token, THOR's task predictor). Top-p and THOR routers plan their
bound on experts per token (all E, or |S^t|): an upper bound, which the report notes.

`eval.plan_measure.measure_peak` checks the model against real steps on the CPU;
`kernels="cpu"` plans with what the CPU kernels keep (masks in the activation dtype, SwiGLU
experts gate and up only, gelu experts their input only). benchmarks/plan_check.py: within
0.3% of the measured peak in ten fp32 CPU cases (benchmarks/results/plan_check_cpu.json). The
GPU-only terms (bool masks, the grouped GEMMs' rows, bf16 with fp32 norms and loss) follow the
code; no GPU measured them.
Shape legend: B sequences, S / T source / target tokens.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from moe_train.config.moe import _expect
from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError
from moe_train.eval.params import _need_num_tasks, count_model, experts_per_token, human
from moe_train.models.build import shape_model
from moe_train.moe.dispatcher import DenseDispatcher
from moe_train.moe.experts import Experts, StackedExperts, SwiGLUExperts
from moe_train.moe.layer import MoELayer

GIB = 2**30
MAX_GPU_MEM_GB = 2**20
"""Largest --gpu-mem (GiB, a pebibyte) taken: beyond it the byte counts are not real."""
HEADROOM = 0.10
"""Share of GPU memory left for the CUDA context, fragmentation and what is not modelled."""
ZERO3_SUB_GROUP = 10**9
"""DeepSpeed's default zero_optimization.sub_group_size: ZeRO-3 steps this many at a time."""
LOSS_BYTES_PER_VOCAB = 12
"""fp32 log-probs + the two fp32 gradients alive at the start of the backward (4 + 4 + 4)."""


@dataclass
class PlanInputs:
    """What `moe-train plan` asks about: the cluster, the sharding and one micro-batch."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    """Memory of one GPU in GiB (an A100-80GB has 80 GiB)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (1: optimizer state, 2: + gradients, 3: + parameters)."""
    ep: int = 1
    """Expert-parallel degree; must divide the world size and every MoE layer's experts."""
    micro_batch: int = 16
    """Sequences per GPU in one micro-batch (seq2seq: sentence pairs)."""
    seq_len: int = 256
    """Tokens per sequence (seq2seq: source and target length each)."""
    activation_checkpointing: bool = False
    precision: str = "bf16"
    """bf16, fp16 or fp32; auto means bf16 (the plan is for GPUs)."""
    headroom: float = HEADROOM
    target_len: int = 0
    """Decoder-only: the tokens of each sequence that are targets, the only positions the LM
    head and the loss see (the trainer keeps their logits alone); 0: half of seq_len, a prompt
    as long as its target. Seq2seq: every target token (seq_len)."""

    def __post_init__(self) -> None:
        if self.precision == "auto":
            self.precision = "bf16"
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                            ("--ep", self.ep), ("--micro-batch", self.micro_batch),
                            ("--seq-len", self.seq_len)):
            _expect(isinstance(value, int) and value >= 1, flag, "a positive integer", value)
        _expect(isinstance(self.gpu_mem_gb, (int, float)) and math.isfinite(self.gpu_mem_gb)
                and 0 < self.gpu_mem_gb <= MAX_GPU_MEM_GB, "--gpu-mem",
                f"a positive, finite number of GiB, at most {MAX_GPU_MEM_GB} (no GPU has more)",
                self.gpu_mem_gb)
        _expect(self.zero_stage in (0, 1, 2, 3), "--zero", "one of 0, 1, 2, 3", self.zero_stage)
        _expect(self.precision in ("bf16", "fp16", "fp32"), "--precision",
              "one of bf16, fp16, fp32, auto", self.precision)
        _expect(0 <= self.headroom < 1, "--headroom", "a fraction in [0, 1)", self.headroom)
        _expect(isinstance(self.target_len, int) and 0 <= self.target_len <= self.seq_len,
                "--target-len", f"at most --seq-len ({self.seq_len}), 0 for half of it",
                self.target_len)
        _expect(self.world_size % self.ep == 0, "--ep",
              f"a divisor of the world size ({self.world_size})", self.ep)
        _expect(self.zero_stage != 3 or self.ep == 1, "--ep",
              "1 with --zero 3 (expert parallelism runs with ZeRO 0-2)", self.ep)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Kernels:
    """What the kernels keep for backward where the GPU and CPU paths differ."""

    name: str
    mask_bytes: int
    """Bytes per dropout-mask element (CUDA: bool); 0: the activation dtype's size (CPU)."""
    swiglu_expert_rows: int
    """F-wide rows per slot: GPU grouped GEMMs 4 (gate, up, silu, product), CPU 2 (gate, up)."""
    gelu_expert_rows: int
    """F-wide rows per slot: GPU 2 (gelu input and output), CPU 1 (input; recomputed)."""


KERNELS = {"gpu": Kernels("gpu", 1, 4, 2), "cpu": Kernels("cpu", 0, 2, 1)}


@dataclass(frozen=True)
class FFNShape:
    """One layer's FFN slot, dense or moe, with the sizes its activations depend on."""

    kind: str
    ffn_dim: int
    act: str
    """relu, gelu or swiglu (the dense FFN's, or the experts')."""
    act_dropout: float = 0.0
    num_experts: int = 0
    k: int = 0
    shared_dim: int = 0
    """Inner dim of the shared SwiGLU expert (0: none)."""
    exact: bool = True
    """False where k is the router's bound (top-p, THOR's top-p): the plan is an upper bound."""


@dataclass(frozen=True)
class AdapterShape:
    """A layer's adapter slot (MoA, ADPT, Gated Adapters): E adapters of inner dim R, k per
    token (grouped rows), or all of them on every token (`dense`: Gated Adapters)."""

    num_experts: int
    k: int
    dim: int
    dense: bool
    act_dropout: float = 0.0


@dataclass(frozen=True)
class LayerShape:
    """One Transformer layer as the activation model sees it."""

    norm: str
    """layernorm or rmsnorm."""
    kv_ratio: float
    """H_kv / H (1 without grouped-query attention)."""
    cross: bool
    dropout: float
    """Residual dropout after attention and FFN (seq2seq: model.dropout)."""
    ffn: FFNShape
    adapter: AdapterShape | None = None


@dataclass(frozen=True)
class ModelShape:
    """Everything the plan reads from the model built on the meta device."""

    arch: str
    d_model: int
    vocab_size: int
    max_positions: int
    dense_params: int
    expert_params: int
    layers: tuple[LayerShape, ...]
    blocks: tuple[tuple[str, int, int], ...]
    """(name, dense parameters, expert parameters) of each layer, embedding and LM head."""
    experts_per_side: tuple[int, ...]
    """Experts per MoE layer of each side that has MoE layers."""
    embed_dropout: float


def _block_of(name: str) -> str:
    """The layer (``encoder_layers.3``, ``hf.model.layers.5``) or module a parameter is in."""
    match = re.match(r"(.*?layers\.\d+)\.", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def _ffn_shape(ffn: nn.Module, default_act: str) -> FFNShape:
    """FFNShape of a seq2seq FFN slot, a Qwen MoE block or HF's dense Qwen MLP."""
    moe = getattr(ffn, "moe", ffn)  # QwenMoEBlock wraps the MoELayer
    if isinstance(moe, MoELayer):
        experts, dim, act, act_dropout = moe.experts, 0, "relu", 0.0
        if isinstance(experts, SwiGLUExperts):
            dim, act = experts.w_gate_EDF.shape[2], "swiglu"
        elif isinstance(experts, Experts):
            dim, act = experts.w1_EDF.shape[2], experts.activation_name
            act_dropout = experts.activation_dropout
        k, exact, _ = experts_per_token(moe.router, moe.num_experts)
        shared = moe.shared_expert
        return FFNShape("moe", dim, act, act_dropout, moe.num_experts, k,
                        0 if shared is None else shared.gate_proj.out_features, exact)
    if hasattr(ffn, "gate_proj"):  # HF Qwen2MoeMLP: SwiGLU
        return FFNShape("dense", ffn.gate_proj.out_features, "swiglu")
    return FFNShape("dense", ffn.fc1.out_features, default_act, ffn.activation_dropout.p)


def _adapter_shape(slot: nn.Module | None) -> AdapterShape | None:
    if slot is None:
        return None
    moe = slot.moe
    k, _, _ = experts_per_token(moe.router, moe.num_experts)
    return AdapterShape(moe.num_experts, k, moe.experts.w_down_EDR.shape[2],
                        isinstance(moe.dispatcher, DenseDispatcher),
                        moe.experts.activation_dropout)


def _layer_shapes(model: nn.Module, cfg: ExperimentConfig) -> tuple[LayerShape, ...]:
    if cfg.decoder_only:
        ratio = cfg.qwen.num_key_value_heads / cfg.qwen.num_attention_heads
        return tuple(LayerShape("rmsnorm", ratio, False, 0.0, _ffn_shape(layer.mlp, "swiglu"))
                     for layer in model.hf.model.layers)
    m = cfg.model
    return tuple(LayerShape("layernorm", 1.0, side == "decoder", m.dropout,
                            _ffn_shape(layer.ffn, m.activation), _adapter_shape(layer.adapter))
                 for side in ("encoder", "decoder") for layer in getattr(model, f"{side}_layers"))


@functools.lru_cache(maxsize=8)
def _model_shape(cfg_json: str) -> ModelShape:
    from moe_train.config.loader import config_from_dict

    cfg = config_from_dict(json.loads(cfg_json))
    _need_num_tasks(cfg, "plan")  # as `count_parameters` builds it: no data, task counts from cfg
    vocab = cfg.qwen.vocab_size if cfg.decoder_only else cfg.data.vocab_size
    model = shape_model(cfg, {"langs": [cfg.thor.pivot_lang], "vocab_size": vocab, "pad_id": 0})
    counts = count_model(model)
    expert_ids = {id(p) for m in model.modules() if isinstance(m, StackedExperts)
                  for p in m.parameters()}
    blocks: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        blocks.setdefault(_block_of(name), [0, 0])[id(p) in expert_ids] += p.numel()
    experts = counts["encoder_experts"] + counts["decoder_experts"]
    sides = tuple(n for n in (counts["encoder_num_experts"], counts["decoder_num_experts"]) if n)
    if cfg.decoder_only:
        d_model, max_pos, dropout = cfg.qwen.hidden_size, cfg.qwen.max_position_embeddings, 0.0
    else:  # THOR's [CLS] takes one source position
        d_model, max_pos = cfg.model.d_model, cfg.model.max_positions - int(cfg.uses_thor)
        dropout = cfg.model.dropout
    return ModelShape(cfg.model.arch, d_model, vocab, max_pos, counts["total"] - experts,
                      experts, _layer_shapes(model, cfg),
                      tuple((n, d, e) for n, (d, e) in blocks.items()), sides, dropout)


def model_shape(cfg: ExperimentConfig) -> ModelShape:
    """The model's counts and layer shapes (built on the meta device once per config)."""
    return _model_shape(json.dumps(cfg.to_dict(), sort_keys=True))


def _norm_bytes(norm: str, a: int) -> int:
    """Per model-dim element: LayerNorm input + output; RMSNorm fp32 input + two more."""
    return 2 * a if norm == "layernorm" else 4 + 2 * a


def _ffn_bytes(ffn: FFNShape, d: int, a: int, m: int, kern: Kernels) -> float:
    """Bytes per token an FFN slot keeps, its norm and residual mask excluded."""
    rows = {"relu": 1, "gelu": 2, "swiglu": 4}[ffn.act]
    if ffn.kind == "dense":
        return (rows * a + (a + m) * (ffn.act_dropout > 0)) * ffn.ffn_dim
    if ffn.act != "relu":
        rows = kern.swiglu_expert_rows if ffn.act == "swiglu" else kern.gelu_expert_rows
    slot = 2 * a * d + (rows * a + (a + m) * (ffn.act_dropout > 0)) * ffn.ffn_dim + 24
    shared = (4 * a * ffn.shared_dim + a * d) if ffn.shared_dim else 0
    return 4 * ffn.num_experts + ffn.k * slot + shared


def _adapter_bytes(ad: AdapterShape, d: int, a: int, m: int) -> float:
    """Bytes per token an adapter slot keeps. Every adapter on every token (dense): the
    LayerNorm's input and normalised rows 2aD (+ 8 B statistics) and the combine's sum aD, then
    per adapter its affine output aD, hidden aR (+ dropout) and output aD, and 16 B of gate
    weights, probabilities and indices. Grouped (k per token): the router's fp32 probabilities
    4E, then per slot the dispatched row, normalised row, gathered LayerNorm weight, affine
    output and adapter output (5aD), hidden aR (+ dropout) and 80 B of statistics, ids, weights
    and row maps (measured on the CPU path)."""
    hidden = (a + (a + m) * (ad.act_dropout > 0)) * ad.dim
    if ad.dense:
        return 3 * a * d + 8 + ad.num_experts * (2 * a * d + hidden + 16)
    return 4 * ad.num_experts + ad.k * (5 * a * d + hidden + 80)


def layer_bytes(layer: LayerShape, d: int, a: int, kern: Kernels) -> tuple[float, float]:
    """(bytes per token of the layer's stream, bytes per source token) kept for backward."""
    m = kern.mask_bytes or a
    mask = m * d if layer.dropout > 0 else 0
    norm = _norm_bytes(layer.norm, a) * d
    attn = norm + 2 * a * d + 2 * a * d * layer.kv_ratio + mask
    per_src = 0.0
    if layer.cross:
        attn += norm + 2 * a * d + mask
        per_src = 2 * a * d
    adapter = 0.0 if layer.adapter is None else _adapter_bytes(layer.adapter, d, a, m)
    return attn + norm + _ffn_bytes(layer.ffn, d, a, m, kern) + mask + adapter, per_src


def target_tokens(inputs: PlanInputs, decoder_only: bool) -> int:
    """Target tokens per sequence: what the LM head and the loss see."""
    if not decoder_only:
        return inputs.seq_len
    return inputs.target_len or max(inputs.seq_len // 2, 1)


def activation_bytes(shape: ModelShape, inputs: PlanInputs, kern: Kernels) -> dict[str, float]:
    """Activation bytes of one micro-batch: layers (or, checkpointed, their inputs),
    recomputed_layer, loss, other (embeddings, final norms) and total."""
    a = 4 if inputs.precision == "fp32" else 2
    d, tokens = shape.d_model, inputs.micro_batch * inputs.seq_len  # seq2seq: S = T
    per_layer = [sum(layer_bytes(layer, d, a, kern)) * tokens for layer in shape.layers]
    qwen = shape.arch == "hf_qwen2_moe"
    mask = (kern.mask_bytes or a) * (shape.embed_dropout > 0)
    other = (1 if qwen else 2) * tokens * d * (_norm_bytes("rmsnorm" if qwen else "layernorm",
                                                           a) + mask)
    loss = LOSS_BYTES_PER_VOCAB * shape.vocab_size * inputs.micro_batch * target_tokens(
        inputs, qwen)
    if inputs.activation_checkpointing:
        kept = a * d * tokens * len(shape.layers)
        recomputed = max(per_layer, default=0) + a * d * tokens  # + its output's gradient
        return {"layers": kept, "recomputed_layer": recomputed, "loss": loss, "other": other,
                "total": kept + other + max(loss, recomputed)}
    return {"layers": sum(per_layer), "recomputed_layer": 0, "loss": loss, "other": other,
            "total": sum(per_layer) + other + loss}


def reduce_bucket_bytes(cfg: ExperimentConfig, zero: int, precision: str) -> int:
    """ZeRO-1/2's gradient reduction bucket: DeepSpeed allocates `reduce_bucket_size` elements
    (default 5e8) in the gradient dtype (fp32 with data_types.grad_accum_dtype fp32) when the
    backward starts, two with `overlap_comm`, whatever the model's size: alive with the
    activations. None without `contiguous_gradients`, and none at ZeRO 0 and 3."""
    zo = cfg.deepspeed.get("zero_optimization") or {}
    if zero not in (1, 2) or not zo.get("contiguous_gradients", True):
        return 0
    accum = (cfg.deepspeed.get("data_types") or {}).get("grad_accum_dtype")
    dtype_bytes = 4 if precision == "fp32" or accum in ("fp32", "float32") else 2
    buffers = 2 if zo.get("overlap_comm", False) else 1
    return buffers * int(float(zo.get("reduce_bucket_size", 5e8))) * dtype_bytes


def _step_bytes(zero: int, mixed: bool, held: tuple[int, int], shard: tuple[int, int]) -> int:
    """The optimizer step's transient: foreach sqrt(v) of the largest group, plus DeepSpeed's
    fp32 gradients of that group (ZeRO 1-3) or of all held parameters (ZeRO-0, mixed)."""
    if zero == 0:
        return 4 * max(held) + (4 * sum(held) if mixed else 0)
    return 8 * (max(shard) if zero < 3 else min(max(shard), ZERO3_SUB_GROUP))


def plan_memory(cfg: ExperimentConfig, inputs: PlanInputs, *, kernels: str = "gpu"
                ) -> dict[str, Any]:
    """Per-GPU bytes by part, the total and whether it fits (see the module docstring).

    Keys (bytes unless said): parameters, gradients, optimizer_states, activations, all_to_all,
    optimizer_step (transient), total, gpu_mem, usable (less the headroom), fits;
    activation_terms; the counts used: dense_params, expert_params, held_params (per GPU
    before ZeRO-3), shard_params (ZeRO shard per GPU), gathered_block (ZeRO-3),
    tokens_per_gpu, experts_per_token; the inputs, world_size and notes.
    """
    shape = model_shape(cfg)
    W, ep, zero = inputs.world_size, inputs.ep, inputs.zero_stage
    bad = [e for e in shape.experts_per_side if e % ep]
    _expect(not bad, "--ep", f"a divisor of the number of experts ({bad[0] if bad else 0})", ep)
    _expect(bool(shape.experts_per_side) or ep == 1, "--ep", "1 for a model without experts", ep)
    _expect(inputs.seq_len <= shape.max_positions, "--seq-len",
          f"at most the model's {shape.max_positions} positions", inputs.seq_len)
    mixed = inputs.precision != "fp32"
    pb = 2 if mixed else 4
    Pd, Pe = shape.dense_params, shape.expert_params
    held, shard = Pd + Pe // ep, math.ceil(Pd / W) + math.ceil(Pe / W)
    block = max((d + e // ep for _, d, e in shape.blocks), default=0) if zero == 3 else 0
    params = pb * ((shard if zero == 3 else held) + block)
    grads = pb * ((shard if zero >= 2 else held) + block)
    optim = (12 if mixed or zero >= 1 else 8) * (shard if zero >= 1 else held)
    step = _step_bytes(zero, mixed, (Pd, Pe // ep), (math.ceil(Pd / W), math.ceil(Pe / W)))
    act = activation_bytes(shape, inputs, KERNELS[kernels])
    tokens = inputs.micro_batch * inputs.seq_len
    k = max((layer.ffn.k for layer in shape.layers), default=0)
    a2a = 4 * tokens * k * shape.d_model * pb if ep > 1 else 0
    bucket = reduce_bucket_bytes(cfg, zero, inputs.precision)
    total = params + grads + optim + max(act["total"] + a2a + bucket, step)
    gpu_mem = int(inputs.gpu_mem_gb * GIB)
    usable = int(gpu_mem * (1 - inputs.headroom))
    notes = []
    if kernels != "gpu":
        notes.append(f"activations as the {kernels} kernels keep them")
    if ep > 1 and not k:
        notes.append("the adapter layers' all-to-all buffers are not modelled")
    if not all(layer.ffn.exact for layer in shape.layers):
        notes.append("top-p / THOR routing: activations (and all-to-all buffers) planned for "
                     "the most experts a token may take, an upper bound")
    return {
        "arch": shape.arch, **asdict(inputs), "world_size": W, "kernels": kernels,
        "parameters": params, "gradients": grads, "optimizer_states": optim,
        "activations": int(act["total"]), "all_to_all": a2a, "reduce_bucket": bucket,
        "optimizer_step": step,
        "total": int(total), "gpu_mem": gpu_mem, "usable": usable, "fits": total <= usable,
        "activation_terms": {key: int(v) for key, v in act.items() if key != "total"},
        "dense_params": Pd, "expert_params": Pe, "held_params": held, "shard_params": shard,
        "gathered_block": block, "tokens_per_gpu": tokens, "experts_per_token": k,
        "target_tokens": target_tokens(inputs, shape.arch == "hf_qwen2_moe"), "notes": notes,
    }


def format_plan(report: dict[str, Any]) -> str:
    """A readable table of a `plan_memory` report (GiB), the verdict and the headroom note."""
    r, zero, ep = report, report["zero_stage"], report["ep"]
    ckpt = r["activation_checkpointing"]
    lines = [f"plan: {r['config']}"] if r.get("config") else []
    lines.append(f"{r['nodes']} node(s) x {r['gpus_per_node']} GPUs ({r['gpu_mem_gb']:g} GiB "
                 f"each) | ZeRO-{zero} | ep {ep} | {r['precision']} | micro-batch "
                 f"{r['micro_batch']} x {r['seq_len']} tokens"
                 + (f" ({r['target_tokens']} target)" if r["arch"] == "hf_qwen2_moe" else "")
                 + " | activation checkpointing "
                 f"{'on' if ckpt else 'off'}")
    lines.append(f"model: {human(r['dense_params'] + r['expert_params'])} parameters "
                 f"({human(r['dense_params'])} dense, {human(r['expert_params'])} in experts); "
                 f"per GPU {human(r['held_params'])} (dense + 1/{ep} of the experts)"
                 + {0: ", not sharded (ZeRO-0)",
                    3: f", of which ZeRO-3 keeps a {human(r['shard_params'])} shard (and "
                       "gathers one block at a time)"}.get(
                     zero, f", ZeRO-{zero} shard {human(r['shard_params'])}"))
    block = f" + gathered block {human(r['gathered_block'])}" if r["gathered_block"] else ""
    t = {key: value / GIB for key, value in r["activation_terms"].items()}
    act = (f"layer inputs {t['layers']:.2f} + max(loss {t['loss']:.2f}, one layer "
           f"{t['recomputed_layer']:.2f})" if ckpt else
           f"layers {t['layers']:.2f} + loss {t['loss']:.2f}")
    master = "fp32 master + m + v" if r["precision"] != "fp32" or zero else "m + v"
    rows = [("parameters", r["parameters"], ("shard" if zero == 3 else "held") + block),
            ("gradients", r["gradients"], ("shard" if zero >= 2 else "held") + block),
            ("optimizer state (Adam)", r["optimizer_states"],
             f"{'shard' if zero else 'held'}, {master}"),
            ("activations", r["activations"], act),
            ("all-to-all buffers", r["all_to_all"],
             "one MoE layer, dispatch + combine" if r["all_to_all"] else
             "none (ep 1)" if ep == 1 else "not modelled (adapter layers)"),
            ("gradient bucket", r["reduce_bucket"],
             "DeepSpeed's reduce_bucket_size, during the backward" if r["reduce_bucket"] else
             f"none (ZeRO-{zero})" if zero in (0, 3) else "none (contiguous_gradients off)"),
            ("optimizer step (transient)", r["optimizer_step"],
             "in the total only where above activations + all-to-all + bucket")]
    lines.append(f"{'per GPU':<30}{'GiB':>6}")
    lines += [f"  {name:<28}{value / GIB:6.2f}   {note}" for name, value, note in rows]
    lines.append(f"  {'total':<28}{r['total'] / GIB:6.2f}")
    lines.append(f"{'fits' if r['fits'] else 'does NOT fit'}: {r['total'] / GIB:.2f} GiB of "
                 f"{r['usable'] / GIB:.2f} GiB usable ({r['gpu_mem'] / GIB:g} GiB less "
                 f"{r['headroom']:.0%} headroom for the CUDA context, fragmentation and what "
                 "is not modelled)")
    return "\n".join(lines + [f"note: {n}" for n in r["notes"]])


def inputs_from_args(args: Any, cfg: ExperimentConfig) -> PlanInputs:
    """PlanInputs from argparse attributes (nodes, gpus_per_node, gpu_mem, zero, ep,
    micro_batch, seq_len, activation_checkpointing; precision optional). One left None takes
    the config's value: optim.zero_stage, moe.ep_size, optim.precision, and the data section's
    token budget (seq_len data.max_len, at most the model's positions; micro_batch
    data.max_tokens // seq_len)."""
    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    if getattr(args, "target_len", None) and not cfg.decoder_only:
        raise ConfigError("--target-len: expected only for a decoder-only model (a seq2seq "
                          "model's targets are --seq-len tokens each)")
    seq_len = get("seq_len", min(cfg.data.max_len, model_shape(cfg).max_positions))
    nodes, gpus, ep = get("nodes", 1), get("gpus_per_node", 8), get("ep", cfg.moe.ep_size)
    world = nodes * gpus if isinstance(nodes, int) and isinstance(gpus, int) else 0
    if getattr(args, "ep", None) is None and world >= 1 and world % ep:
        raise ConfigError(f"--ep: expected a divisor of the world size ({world}), got {ep} "
                          "(the config's moe.ep_size); pass --ep")
    return PlanInputs(nodes=nodes, gpus_per_node=gpus, gpu_mem_gb=get("gpu_mem", 80.0),
                      zero_stage=get("zero", cfg.optim.zero_stage), ep=ep,
                      micro_batch=get("micro_batch", max(cfg.data.max_tokens // seq_len, 1)),
                      seq_len=seq_len,
                      activation_checkpointing=bool(getattr(args, "activation_checkpointing",
                                                            False))
                      or cfg.model.activation_checkpointing,
                      precision=get("precision", cfg.optim.precision),
                      target_len=get("target_len", 0))


def plan_from_args(args: Any) -> dict[str, Any]:
    """`moe-train plan`: load ``args.config`` with ``args.overrides``, plan (`inputs_from_args`)
    and name the config in the report; print it with `format_plan`."""
    from moe_train.config import load_config
    from moe_train.train.ds_config import check_layout

    overrides = list(getattr(args, "overrides", None) or [])
    cfg = load_config(args.config, overrides)
    inputs = inputs_from_args(args, cfg)
    # the planned layout is one training accepts: the config validated with it (adapters and
    # expert counts against the EP degree), and DeepSpeed's own combination rules
    layout = {"moe.ep_size": inputs.ep, "optim.zero_stage": inputs.zero_stage}
    report = plan_memory(cfg, inputs)  # its own checks first: they name the flag
    try:
        load_config(args.config, [*overrides, *(f"{k}={v}" for k, v in layout.items())])
        check_layout(inputs.precision, inputs.zero_stage, inputs.ep)
    except ConfigError as exc:
        flags = f"--ep {inputs.ep} --zero {inputs.zero_stage} ({inputs.precision})"
        raise ConfigError(f"{flags}: {exc}") from None
    return {**report, "config": str(args.config)}


__all__ = ["HEADROOM", "KERNELS", "ModelShape", "PlanInputs", "activation_bytes", "format_plan",
           "inputs_from_args", "model_shape", "plan_from_args", "plan_memory"]
