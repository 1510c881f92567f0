"""Schedule, loss and DeepSpeed-config arithmetic on hand-computed cases."""

import math

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.train.ds_config import build_deepspeed_config
from moe_train.train.loss import label_smoothed_nll, per_token_bits
from moe_train.train.schedule import inverse_sqrt_factor, inverse_sqrt_scheduler


def test_inverse_sqrt_schedule_values():
    assert inverse_sqrt_factor(1, 4000) == pytest.approx(1 / 4000)
    assert inverse_sqrt_factor(2000, 4000) == pytest.approx(0.5)
    assert inverse_sqrt_factor(4000, 4000) == pytest.approx(1.0)
    assert inverse_sqrt_factor(16000, 4000) == pytest.approx(0.5)
    # Noam: d^-0.5 * min(step^-0.5, step * warmup^-1.5), normalised to its peak
    d, w = 512, 4000
    noam = lambda s: d ** -0.5 * min(s ** -0.5, s * w ** -1.5)  # noqa: E731
    for s in (10, 3999, 4000, 12345):
        assert inverse_sqrt_factor(s, w) == pytest.approx(noam(s) / noam(w))


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=7e-4)
    sched = inverse_sqrt_scheduler(opt, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([7e-4 * f for f in (0.25, 0.5, 0.75, 1.0, math.sqrt(4 / 5),
                                                   math.sqrt(4 / 6))])


def test_label_smoothed_loss_hand_computed():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]]))
    target = torch.tensor([[0, 2]])
    loss, nll = label_smoothed_nll(logits, target, pad_id=99, epsilon=0.0)
    assert nll.item() == pytest.approx(-math.log(0.5) - math.log(0.7))
    assert loss.item() == pytest.approx(nll.item())
    eps = 0.3
    loss, nll = label_smoothed_nll(logits, target, pad_id=99, epsilon=eps)
    smooth = -(math.log(0.5) + 2 * math.log(0.25)) / 3 - (math.log(0.1) + math.log(0.2)
                                                         + math.log(0.7)) / 3
    assert loss.item() == pytest.approx((1 - eps) * nll.item() + eps * smooth)


def test_label_smoothed_loss_ignores_padding():
    logits = torch.randn(2, 3, 5)
    target = torch.tensor([[1, 2, 0], [3, 0, 0]])
    loss, nll = label_smoothed_nll(logits, target, pad_id=0, epsilon=0.1)
    keep = [(0, 0), (0, 1), (1, 0)]
    lp = torch.log_softmax(logits, -1)
    assert nll.item() == pytest.approx(sum(-lp[b, t, target[b, t]].item() for b, t in keep),
                                       rel=1e-6)
    smooth = sum(-lp[b, t].mean().item() for b, t in keep)  # padded positions smooth nothing
    assert loss.item() == pytest.approx(0.9 * nll.item() + 0.1 * smooth, rel=1e-6)


def test_bf16_logits_give_the_float32_loss() -> None:
    """The log-softmax runs in float32 whatever the logits' dtype (bf16 training): a bf16 one
    rounds a 32k-way loss by several units."""
    torch.manual_seed(0)
    logits = torch.randn(4, 16, 32000) * 3
    target = torch.randint(1, 32000, (4, 16))
    want = label_smoothed_nll(logits, target, pad_id=0, epsilon=0.1)
    got = label_smoothed_nll(logits.bfloat16(), target, pad_id=0, epsilon=0.1)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        # only the logits' own bf16 rounding remains (about 1e-3 relative), not the softmax's
        assert abs(g.item() - w.item()) <= 2e-3 * w.item()


def test_per_token_bits_and_a_perplexity_past_the_float_range() -> None:
    """Sums in nats -> bits per token; 2^nll past 1024 bits is inf, not an OverflowError that
    stopped a diverging run inside its log line."""
    ln2 = math.log(2)
    assert per_token_bits(6 * ln2, 4 * ln2, 2, "dev/") == {"dev/loss": 3.0, "dev/nll": 2.0,
                                                          "dev/ppl": 4.0}
    huge = per_token_bits(1.0, 5000.0 * ln2, 1.0, "train/")
    assert huge["train/nll"] == pytest.approx(5000.0) and huge["train/ppl"] == math.inf
    assert math.isnan(per_token_bits(math.nan, math.nan, 1.0, "")["ppl"])


def test_deepspeed_config_mapping():
    cfg = load_config(overrides=["optim.zero_stage=2", "optim.grad_accum=4", "optim.clip_norm=0.5",
                                 "deepspeed.zero_optimization.reduce_bucket_size=1000"])
    ds = build_deepspeed_config(cfg, world_size=8, device=torch.device("cpu"))
    assert ds["train_batch_size"] == 32
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    bf16 = build_deepspeed_config(load_config(overrides=["optim.precision=bf16"]), 1,
                                  torch.device("cpu"))
    assert bf16["bf16"]["enabled"] is True
    with pytest.raises(ConfigError, match="optim.precision: fp16 needs a GPU"):
        build_deepspeed_config(load_config(overrides=["optim.precision=fp16"]), 1,
                               torch.device("cpu"))
    # 16-bit at ZeRO 0 keeps fp32 masters in rank 0's file: experts split over ranks would
    # resume as rank 0's
    ep = ["moe.num_experts=4", "moe.ep_size=2", "optim.precision=bf16"]
    with pytest.raises(ConfigError, match=r"^optim.zero_stage: 0 with bf16 and moe.ep_size 2 "):
        build_deepspeed_config(load_config(overrides=ep), 2, torch.device("cpu"))
    for fine in ("optim.zero_stage=1", "optim.precision=fp32"):
        build_deepspeed_config(load_config(overrides=[*ep, fine]), 2, torch.device("cpu"))


@pytest.mark.parametrize("precision, zero, accum, error", [
    ("bf16", 2, "fp32", None), ("bf16", 3, "float32", None), ("bf16", 0, "bf16", None),
    ("fp32", 0, "fp32", None),
    ("bf16", 0, "fp32", "fp32 sums of bf16 gradients need optim.zero_stage 2 or 3 .* 0$"),
    ("bf16", 1, "fp32", "fp32 sums of bf16 gradients need optim.zero_stage 2 or 3 .* 1$"),
    ("fp32", 2, "bf16", r"bf16 below the model's fp32 \(optim.precision\); expected fp32$"),
    ("bf16", 2, "fp64", "expected one of fp32, .*, got 'fp64'$"),
    # DeepSpeed's inference config takes "bfloat", its training config does not (a traceback)
    ("bf16", 2, "bfloat", "expected one of .*, got 'bfloat'$"),
    ("bf16", 2, "torch.float32", None),
    ("bf16", 2, None, None),
])
def test_grad_accum_dtype_only_where_deepspeed_and_we_run_it(precision, zero, accum, error):
    """DeepSpeed raises NotImplementedError (a traceback) for fp32 sums at ZeRO 0 and swaps
    in its BF16_Optimizer at ZeRO 1: both are one config line before it starts."""
    if accum is None:  # a scalar where DeepSpeed reads a section: one line, no traceback
        cfg = load_config(overrides=["deepspeed.data_types=fp32"])
        with pytest.raises(ConfigError, match="^deepspeed.data_types: expected a mapping"):
            build_deepspeed_config(cfg, 1, torch.device("cpu"))
        return
    cfg = load_config(overrides=[f"optim.precision={precision}", f"optim.zero_stage={zero}",
                                 f"deepspeed.data_types.grad_accum_dtype={accum}"])
    if error is None:
        ds = build_deepspeed_config(cfg, 1, torch.device("cpu"))
        assert ds["data_types"] == {"grad_accum_dtype": accum}
        return
    with pytest.raises(ConfigError, match="^deepspeed.data_types.grad_accum_dtype: " + error):
        build_deepspeed_config(cfg, 1, torch.device("cpu"))


@pytest.mark.parametrize("key", ["param_dtype", "buffer_dtype"])
def test_every_data_types_name_is_one_deepspeed_reads(key):
    """DeepSpeed reads param_dtype and buffer_dtype with its DtypeEnum: a typo was its
    ValueError from the standard library's enum, a traceback."""
    cfg = load_config(overrides=["optim.precision=bf16", f"deepspeed.data_types.{key}=bf_16"])
    with pytest.raises(ConfigError, match=f"^deepspeed.data_types.{key}: expected one of "
                                          r".*, got 'bf_16'$"):
        build_deepspeed_config(cfg, 1, torch.device("cpu"))
    cfg = load_config(overrides=["optim.precision=bf16", f"deepspeed.data_types.{key}=bf16"])
    assert build_deepspeed_config(cfg, 1, torch.device("cpu"))["data_types"] == {key: "bf16"}


def test_no_weight_decay_on_stacked_expert_and_adapter_biases_and_norms():
    """Stacked per expert, biases and norm affines are 2-D: they must still skip decay."""
    from moe_train.models.build import build_model
    from moe_train.train.param_groups import param_groups

    def split(*overrides: str) -> tuple[set[str], set[str]]:
        cfg = load_config(None, ["model.encoder_layers=1", "model.decoder_layers=1",
                                 "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64",
                                 *overrides])
        model = build_model(cfg, {"vocab_size": 40, "pad_id": 0})
        groups = {g["name"]: g for g in param_groups(model, 0.1)}
        assert groups["decay"]["weight_decay"] == 0.1
        assert groups["no_decay"]["weight_decay"] == 0.0
        names = {id(p): n.rsplit(".", 1)[-1] for n, p in model.named_parameters()}
        return ({names[id(p)] for p in groups["decay"]["params"]},
                {names[id(p)] for p in groups["no_decay"]["params"]})

    decay, no_decay = split("moe.num_experts=4", "moe.layers=all")
    assert {"b1_EF", "b2_ED"} <= no_decay and {"w1_EDF", "w2_EFD"} <= decay
    decay, no_decay = split("adapters.num_experts=2", "adapters.dim=8", "adapters.router=sentence",
                            "adapters.k=1")
    assert {"ln_weight_ED", "ln_bias_ED", "b_down_ER", "b_up_ED"} <= no_decay
    assert {"w_down_EDR", "w_up_ERD"} <= decay
