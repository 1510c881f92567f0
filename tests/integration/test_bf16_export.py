"""A bf16 run exports its fp32 master weights, not the module's bf16 rounding of them, and a
step directory read directly gives the same (CPU, DeepSpeed bf16 at ZeRO 0 and 1). Before, ZeRO 0 exported the rounding of everything and ZeRO 1
the rounding of the dense weights beside the experts' masters; decoded, such an export
differed from the masters in 2 of 32 greedy outputs."""

import pytest
import torch

from moe_train.train.checkpoint import consolidated_state_dict, read_dense_state
from moe_train.train.export import load_export_weights
from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def _rounded(t: torch.Tensor) -> float:
    """The share of `t`'s values a bf16 tensor can hold exactly."""
    return float((t == t.bfloat16().float()).float().mean())


@pytest.mark.parametrize("zero", [0, 1])
def test_a_bf16_run_exports_its_fp32_masters(tiny_prepared, tmp_path, zero) -> None:
    overrides = debug_overrides(
        tiny_prepared, tmp_path, "optim.precision=bf16", f"optim.zero_stage={zero}",
        "train.max_steps=6", "train.validate_every=0", "checkpoint.save_every=1000",
        "moe.num_experts=4", "moe.k=2", "moe.layers=every_other", "moe.encoder_router=topk",
        "moe.decoder_router=topk", "data.max_tokens=400", "train.log_every=3")
    proc = run_cli(["train", "--config", CONFIG, *overrides], cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    exported = load_export_weights(tmp_path / "ckpt" / "export")
    weights = {k: t for k, t in exported.items() if t.is_floating_point() and t.dim() == 2}
    experts = [k for k in weights if ".experts." in k]
    assert experts and len(weights) > len(experts)
    for name, t in weights.items():  # a bf16 rounding would hold every value exactly
        assert _rounded(t) < 0.5, (name, _rounded(t))
    # the checkpoint's per-parameter masters are what was exported (at ZeRO 0 values only:
    # DeepSpeed's own files hold the moments there)
    src, _ = read_dense_state(tmp_path / "ckpt" / "step_00000006")
    dense = [k for k in weights if k not in experts]
    for name in dense:
        assert torch.equal(weights[name], src.get(f"param/{name}")), name
    assert any(k.startswith("exp_avg/") for k in src.names()) == (zero == 1)
    # read directly, the step directory gives what the export holds
    step = consolidated_state_dict(tmp_path / "ckpt" / "step_00000006")
    for name, t in exported.items():
        assert torch.equal(step[name], t), name


def test_a_tied_hf_model_reads_its_fp32_output_table_from_a_step_dir(qwen_prepared, tmp_path):
    """Qwen2-MoE with tied embeddings, bf16 at ZeRO 1: the dense store holds the shared table
    once (named_parameters drops the alias), so a step directory read directly gave
    `lm_head.weight` as the module's bf16 value; the store now records the alias."""
    prepared, tok = qwen_prepared
    overrides = [f"data.prepared_dir={prepared}", f"data.tokenizer={tok}",
                 f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"logging.tensorboard_dir={tmp_path / 'tb'}",
                 "qwen.tie_word_embeddings=true", "optim.precision=bf16", "optim.zero_stage=1",
                 "train.max_steps=4", "train.validate_every=0", "checkpoint.save_every=1000",
                 "data.max_tokens=800", "optim.lr=5e-3", "optim.warmup_steps=2"]
    config = str(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml")
    proc = run_cli(["train", "--config", config, *overrides], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    exported = load_export_weights(tmp_path / "ckpt" / "export")
    step = consolidated_state_dict(tmp_path / "ckpt" / "step_00000004")
    embed = next(k for k in step if k.endswith("embed_tokens.weight"))
    head = next(k for k in step if k.endswith("lm_head.weight"))
    assert _rounded(step[head]) < 0.5, _rounded(step[head])
    assert torch.equal(step[head], step[embed])
    for name, t in exported.items():
        assert torch.equal(step[name], t), name
