"""`moe-train plan` (eval/plan.py): ZeRO and expert-parallel arithmetic, the activation model's
structure, flag errors, and the big configs' plans (structural facts only, no magic numbers)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.eval.params import count_parameters, human
from moe_train.eval.plan import (
    GIB,
    KERNELS,
    LOSS_BYTES_PER_VOCAB,
    FFNShape,
    LayerShape,
    PlanInputs,
    format_plan,
    layer_bytes,
    model_shape,
    plan_from_args,
    plan_memory,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN_TINY = (CONFIGS / "qwen-moe-tiny-cpu.yaml", [])
SEQ2SEQ_SMALL = (CONFIGS / "debug-cpu.yaml", ["moe.num_experts=8", "model.encoder_layers=4",
                                               "model.decoder_layers=4"])


def _cfg(spec: tuple[Path, list[str]]):
    return load_config(spec[0], spec[1])


def _plan(cfg, **kw):
    base = dict(nodes=2, gpus_per_node=8, gpu_mem_gb=80.0, zero_stage=0, ep=1, micro_batch=4,
                seq_len=128)
    return plan_memory(cfg, PlanInputs(**{**base, **kw}))


@pytest.mark.parametrize("spec", [QWEN_TINY, SEQ2SEQ_SMALL], ids=["qwen", "seq2seq"])
def test_counts_come_from_the_meta_model(spec) -> None:
    cfg = _cfg(spec)
    vocab = cfg.qwen.vocab_size if cfg.decoder_only else cfg.data.vocab_size
    report = count_parameters(cfg, vocab)
    shape = model_shape(cfg)
    assert shape.dense_params + shape.expert_params == report["total"]
    assert shape.expert_params == report["encoder_experts"] + report["decoder_experts"] > 0
    assert sum(d + e for _, d, e in shape.blocks) == report["total"]


@pytest.mark.parametrize("spec", [QWEN_TINY, SEQ2SEQ_SMALL], ids=["qwen", "seq2seq"])
def test_zero_stages_shard_what_deepspeed_shards(spec) -> None:
    cfg = _cfg(spec)
    W, ep = 16, 4
    # ZeRO-3 runs without expert parallelism (the trainer's rule): its experts shard W ways
    plans = [_plan(cfg, zero_stage=z, ep=ep) for z in range(3)] + [_plan(cfg, zero_stage=3, ep=1)]
    Pd, Pe = plans[0]["dense_params"], plans[0]["expert_params"]
    held, shard = Pd + Pe // ep, math.ceil(Pd / W) + math.ceil(Pe / W)
    assert plans[0]["held_params"] == held and plans[0]["shard_params"] == shard
    # bf16: 2 + 2 + 12 bytes per parameter, each part sharded from its stage on
    assert [p["parameters"] for p in plans[:3]] == [2 * held] * 3
    assert [p["gradients"] for p in plans[:2]] == [2 * held] * 2
    assert plans[2]["gradients"] == 2 * shard
    assert plans[0]["optimizer_states"] == 12 * held
    assert {p["optimizer_states"] for p in plans[1:]} == {12 * shard}
    block = plans[3]["gathered_block"]
    assert 0 < block < plans[3]["held_params"]
    assert plans[3]["shard_params"] == shard
    assert plans[3]["parameters"] == plans[3]["gradients"] == 2 * (shard + block)
    assert all(p["activations"] == plans[0]["activations"] for p in plans)
    # model states shrink stage by stage (ZeRO-1/2 add DeepSpeed's fixed gradient bucket on
    # top: test_zero_1_and_2_hold_deepspeeds_gradient_bucket)
    states = [p["parameters"] + p["gradients"] + p["optimizer_states"] for p in plans]
    assert states[:3] == sorted(states[:3], reverse=True) and states[0] > states[3]
    with pytest.raises(ConfigError, match=r"^--ep: expected 1 with --zero 3"):
        _plan(cfg, zero_stage=3, ep=ep)


def test_shards_shrink_with_the_world_size_and_experts_with_ep() -> None:
    cfg = _cfg(QWEN_TINY)
    one, four = (_plan(cfg, nodes=n, zero_stage=1) for n in (1, 4))
    Pd, Pe = one["dense_params"], one["expert_params"]
    assert one["optimizer_states"] == 12 * (math.ceil(Pd / 8) + math.ceil(Pe / 8))
    assert four["optimizer_states"] == 12 * (math.ceil(Pd / 32) + math.ceil(Pe / 32))
    assert four["parameters"] == one["parameters"]  # ZeRO-1 keeps every held parameter
    by_ep = {ep: _plan(cfg, ep=ep) for ep in (1, 2, 8)}
    for ep, plan in by_ep.items():
        assert plan["held_params"] == Pd + Pe // ep
        assert plan["parameters"] == 2 * (Pd + Pe // ep)
    # the experts' ZeRO shard is over the W/ep expert-data-parallel ranks: P_e/W whatever ep
    assert len({_plan(cfg, ep=ep, zero_stage=2)["gradients"] for ep in (1, 2, 8)}) == 1


def test_precision_bytes() -> None:
    cfg = _cfg(QWEN_TINY)
    bf16, fp32 = _plan(cfg, precision="bf16"), _plan(cfg, precision="fp32")
    held = bf16["held_params"]
    assert fp32["parameters"] == 2 * bf16["parameters"] == 4 * held
    assert fp32["optimizer_states"] == 8 * held  # ZeRO-0 fp32: m + v, the master is the param
    assert _plan(cfg, precision="fp32", zero_stage=1)["optimizer_states"] == \
        12 * bf16["shard_params"]  # DeepSpeed's ZeRO optimizers keep an fp32 copy
    assert _plan(cfg, precision="auto")["precision"] == "bf16"
    assert fp32["activations"] > bf16["activations"]


def test_total_adds_the_larger_of_activations_and_the_optimizer_step() -> None:
    cfg = _cfg(QWEN_TINY)
    for kw in ({}, {"micro_batch": 1, "seq_len": 8}, {"zero_stage": 3, "ep": 1},
               {"zero_stage": 2, "ep": 2}):
        p = _plan(cfg, **kw)
        static = p["parameters"] + p["gradients"] + p["optimizer_states"]
        assert p["total"] == static + max(p["activations"] + p["all_to_all"] + p["reduce_bucket"],
                                          p["optimizer_step"])
    tiny = _plan(cfg, micro_batch=1, seq_len=8)
    assert tiny["optimizer_step"] > tiny["activations"]  # a tiny batch: the step's transient


def test_zero_1_and_2_hold_deepspeeds_gradient_bucket() -> None:
    """DeepSpeed's ZeRO-1/2 allocate `reduce_bucket_size` gradient elements (5e8 by default)
    as the backward starts, whatever the model: a 1.9 MB model planned at ZeRO-2 in bf16 on an
    8 GiB GPU needs the bucket's 0.93 GiB. Two with overlap_comm; none at ZeRO 0 and 3."""
    cfg = _cfg(QWEN_TINY)
    for zero, precision, bucket in ((0, "bf16", 0), (3, "bf16", 0), (1, "bf16", 5 * 10**8 * 2),
                                    (2, "bf16", 5 * 10**8 * 2), (2, "fp32", 5 * 10**8 * 4)):
        p = _plan(cfg, zero_stage=zero, precision=precision)
        assert p["reduce_bucket"] == bucket, (zero, precision)
        assert p["total"] >= p["parameters"] + p["gradients"] + p["optimizer_states"] + bucket
    tuned = load_config(QWEN_TINY[0], [
        "deepspeed.zero_optimization.reduce_bucket_size=1e6",
        "deepspeed.zero_optimization.overlap_comm=true"])
    assert _plan(tuned, zero_stage=2)["reduce_bucket"] == 2 * 10**6 * 2
    off = load_config(QWEN_TINY[0], ["deepspeed.zero_optimization.contiguous_gradients=false"])
    assert _plan(off, zero_stage=2)["reduce_bucket"] == 0


def test_top_p_plans_an_upper_bound_and_says_so() -> None:
    topp = load_config(SEQ2SEQ_SMALL[0], [*SEQ2SEQ_SMALL[1], "moe.encoder_router=topp"])
    assert any("upper bound" in note for note in _plan(topp)["notes"])
    assert not any("upper bound" in note for note in _plan(_cfg(SEQ2SEQ_SMALL))["notes"])


def test_all_to_all_buffers_only_with_expert_parallelism() -> None:
    cfg = _cfg(QWEN_TINY)
    assert _plan(cfg, ep=1)["all_to_all"] == 0
    p = _plan(cfg, ep=4)
    tokens, k, D = 4 * 128, cfg.moe.k, cfg.qwen.hidden_size
    assert p["all_to_all"] == 4 * tokens * k * D * 2  # send + receive, dispatch + combine


@pytest.mark.parametrize("spec", [QWEN_TINY, SEQ2SEQ_SMALL], ids=["qwen", "seq2seq"])
def test_activations_scale_and_checkpointing_lowers_them(spec) -> None:
    cfg = _cfg(spec)
    p1, p2 = _plan(cfg, micro_batch=4), _plan(cfg, micro_batch=8)
    assert p2["activations"] == 2 * p1["activations"]
    ckpt = _plan(cfg, micro_batch=4, activation_checkpointing=True)
    assert ckpt["activations"] < p1["activations"]
    vocab = model_shape(cfg).vocab_size
    targets = 64 if cfg.decoder_only else 128  # decoder-only: the LM head sees the targets only
    assert p1["activation_terms"]["loss"] == LOSS_BYTES_PER_VOCAB * vocab * 4 * targets
    if cfg.decoder_only:  # --target-len: by default half of each sequence
        p3 = _plan(cfg, micro_batch=4, target_len=100)
        assert p3["activation_terms"]["loss"] == LOSS_BYTES_PER_VOCAB * vocab * 4 * 100
        assert p3["target_tokens"] == 100 and p1["target_tokens"] == 64
    terms = ckpt["activation_terms"]
    assert ckpt["activations"] == terms["layers"] + terms["other"] + max(
        terms["loss"], terms["recomputed_layer"])


def test_a_gelu_layer_keeps_korthikantis_34_bytes_per_token_and_dim() -> None:
    """Korthikanti et al. 2022: 34*s*b*h bytes per layer in half precision without the score
    terms, which fused attention does not keep: an FFN of 4D with gelu, 1-byte masks."""
    D = 1024
    layer = LayerShape("layernorm", 1.0, False, 0.1, FFNShape("dense", 4 * D, "gelu"))
    assert layer_bytes(layer, D, 2, KERNELS["gpu"]) == (34 * D, 0.0)
    cross = dataclasses.replace(layer, cross=True)
    own, per_src = layer_bytes(cross, D, 2, KERNELS["gpu"])
    assert own == 34 * D + 9 * D and per_src == 4 * D  # + norm, q, o, mask; k, v per source


@pytest.mark.parametrize("kw, flag", [
    ({"ep": 3}, "--ep: expected a divisor of the world size (16), got 3"),
    ({"zero_stage": 4}, "--zero: expected one of 0, 1, 2, 3, got 4"),
    ({"nodes": 0}, "--nodes: expected a positive integer, got 0"),
    ({"gpus_per_node": 0}, "--gpus-per-node:"),
    ({"gpu_mem_gb": 0}, "--gpu-mem:"),
    ({"micro_batch": 0}, "--micro-batch:"),
    ({"seq_len": -1}, "--seq-len:"),
    ({"precision": "int8"}, "--precision:"),
])
def test_bad_inputs_name_the_flag(kw, flag) -> None:
    base = dict(nodes=2, gpus_per_node=8, zero_stage=0, ep=1)
    with pytest.raises(ConfigError) as err:
        PlanInputs(**{**base, **kw})
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)


def test_model_dependent_checks_name_the_flag() -> None:
    cfg = _cfg(QWEN_TINY)  # 8 experts
    with pytest.raises(ConfigError, match=r"^--ep: expected a divisor of the number of "
                                          r"experts \(8\), got 16$"):
        _plan(cfg, ep=16)
    with pytest.raises(ConfigError, match=r"^--seq-len: expected at most the model's 512"):
        _plan(cfg, seq_len=1024)
    dense = load_config(CONFIGS / "debug-cpu.yaml")
    with pytest.raises(ConfigError, match=r"^--ep: expected 1 for a model without experts"):
        _plan(dense, ep=2)


def _args(config: Path, **kw) -> argparse.Namespace:
    values = dict(config=str(config), overrides=[], nodes=1, gpus_per_node=8, gpu_mem=80,
                  zero=None, ep=None, micro_batch=None, seq_len=None,
                  activation_checkpointing=False)
    return argparse.Namespace(**{**values, **kw})


def test_plan_from_args_defaults_come_from_the_config() -> None:
    r = plan_from_args(_args(CONFIGS / "qwen-moe-tiny-cpu.yaml",
                             overrides=["optim.zero_stage=2", "data.max_len=128",
                                        "data.max_tokens=4096", "optim.precision=auto"]))
    assert (r["zero_stage"], r["ep"], r["seq_len"]) == (2, 1, 128)
    assert r["micro_batch"] == 4096 // 128 and r["precision"] == "bf16"
    assert r["config"].endswith("qwen-moe-tiny-cpu.yaml")
    # a model with fewer positions than data.max_len (a small converted one): its positions
    r = plan_from_args(_args(CONFIGS / "qwen-moe-tiny-cpu.yaml",
                             overrides=["qwen.max_position_embeddings=64", "data.max_len=256",
                                        "data.max_tokens=4096"]))
    assert (r["seq_len"], r["micro_batch"]) == (64, 4096 // 64)
    with pytest.raises(ConfigError, match=r"^--seq-len: expected at most the model's 64 "):
        plan_from_args(_args(CONFIGS / "qwen-moe-tiny-cpu.yaml", seq_len=65,
                             overrides=["qwen.max_position_embeddings=64"]))
    with pytest.raises(ConfigError, match=r"^--ep: expected a divisor of the world size \(8\), "
                                          r"got 64 \(the config's moe.ep_size\)"):
        plan_from_args(_args(CONFIGS / "moe128-big.yaml"))
    with pytest.raises(ConfigError, match=r"^--target-len: expected only for a decoder-only"):
        plan_from_args(_args(CONFIGS / "debug-cpu.yaml", target_len=5))


def test_qwen_a27b_on_8_a100_80gb_with_zero3() -> None:
    """Structural facts of the Qwen1.5-MoE-A2.7B plan: 60 experts allow ep 1, 2, 4 on 8 GPUs;
    ZeRO-3 (ep 1) shards every model state 8 ways; unsharded, the states alone (16 B per held
    parameter) overflow the usable 72 GiB."""
    args = dict(gpu_mem=80, micro_batch=1, seq_len=2048)
    r3 = plan_from_args(_args(CONFIGS / "qwen1.5-moe-a2.7b.yaml", zero=3, ep=1, **args))
    total = count_parameters(load_config(CONFIGS / "qwen1.5-moe-a2.7b.yaml"), 151936)["total"]
    assert r3["dense_params"] + r3["expert_params"] == total
    assert r3["shard_params"] == math.ceil(r3["dense_params"] / 8) + \
        math.ceil(r3["expert_params"] / 8)
    assert r3["optimizer_states"] == 12 * r3["shard_params"]
    assert r3["gathered_block"] >= 151936 * 2048  # the embedding / LM head is the largest block
    assert r3["fits"] and r3["total"] <= r3["usable"] == int(0.9 * 80 * GIB)
    r0 = plan_from_args(_args(CONFIGS / "qwen1.5-moe-a2.7b.yaml", zero=0, ep=1, **args))
    assert not r0["fits"]
    assert r0["parameters"] + r0["gradients"] + r0["optimizer_states"] > r0["usable"]
    ckpt = plan_from_args(_args(CONFIGS / "qwen1.5-moe-a2.7b.yaml", zero=3, ep=1,
                                activation_checkpointing=True, **args))
    assert ckpt["activations"] < r3["activations"]
    with pytest.raises(ConfigError, match=r"^--ep: .*number of experts \(60\), got 8"):
        plan_from_args(_args(CONFIGS / "qwen1.5-moe-a2.7b.yaml", zero=2, ep=8, **args))


def test_format_plan_table() -> None:
    r = plan_from_args(_args(CONFIGS / "moe128-big.yaml", ep=8, zero=1, gpu_mem=40))
    text = format_plan(r)
    for row in ("parameters", "gradients", "optimizer state (Adam)", "activations",
                "all-to-all buffers", "optimizer step (transient)", "total", "GiB",
                "headroom", "ZeRO-1", "ep 8", "moe128-big.yaml"):
        assert row in text, row
    assert f"{r['total'] / GIB:.2f}" in text
    assert ("does NOT fit" in text) == (not r["fits"])
    assert format_plan({**r, "fits": True}).count("fits:") == 1
    assert json.loads(json.dumps(r)) == r  # the CLI can print it as a JSON line
    # the model line says what each stage shards: nothing at ZeRO-0, a shard kept at ZeRO-3
    assert "ZeRO-1 shard" in text
    zero0 = format_plan(plan_from_args(_args(CONFIGS / "moe128-big.yaml", ep=8, zero=0,
                                             precision="fp32")))
    assert "not sharded (ZeRO-0)" in zero0 and "shard " not in zero0.split("\n")[2]
    zero3 = plan_from_args(_args(CONFIGS / "qwen1.5-moe-a2.7b.yaml", ep=1, zero=3))
    assert f"of which ZeRO-3 keeps a {human(zero3['shard_params'])} shard" in format_plan(zero3)


def test_plan_refuses_layouts_training_refuses_and_reads_checkpointing_from_the_config() -> None:
    """Expert counts and adapters are checked against --ep as the config checks moe.ep_size,
    and 16-bit at ZeRO 0 with expert parallelism as DeepSpeed's config does."""
    from types import SimpleNamespace

    from moe_train.errors import ConfigError
    from moe_train.eval.plan import plan_from_args

    def args(*overrides, **flags):
        base = dict(config=str(SEQ2SEQ_SMALL[0]), overrides=[*SEQ2SEQ_SMALL[1], *overrides],
                    nodes=1,
                    gpus_per_node=2, gpu_mem=80.0, zero=1, ep=1, micro_batch=2, seq_len=64,
                    activation_checkpointing=False, target_len=None)
        return SimpleNamespace(**{**base, **flags})

    assert plan_from_args(args(ep=2))["ep"] == 2
    with pytest.raises(ConfigError, match=r"^--ep 2 --zero 0 \(bf16\): optim.zero_stage: 0 "):
        plan_from_args(args("optim.precision=bf16", ep=2, zero=0))
    with pytest.raises(ConfigError, match=r"^--ep 2 --zero 1 \(.*\): .*multiple of moe.ep_size"):
        plan_from_args(args("adapters.num_experts=3", "adapters.router=gumbel", "adapters.k=2",
                            ep=2))
    assert plan_from_args(args("model.activation_checkpointing=true"))["activation_checkpointing"]
