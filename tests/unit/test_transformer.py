"""Seq2SeqTransformer: incremental decoding, padding invariance, tying, FFN/adapter slots."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe_train.config.schema import ModelConfig
from moe_train.errors import ConfigError
from moe_train.models import (
    ForwardContext,
    Seq2SeqTransformer,
    SinusoidalPositions,
)

PAD, BOS, EOS, V, D = 0, 1, 2, 11, 32


def small_cfg(**overrides) -> ModelConfig:
    kw = dict(d_model=D, n_heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2,
              dropout=0.0, max_positions=64)
    kw.update(overrides)
    return ModelConfig(**kw)


def small_model(seed: int = 0, **overrides) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return Seq2SeqTransformer(small_cfg(**overrides), V, PAD).eval()


# Right-padded sources of lengths 5, 3 and 1, targets (bos + tokens) with right padding.
SRC = torch.tensor([[5, 6, 7, 8, EOS], [9, 4, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD]])
TGT = torch.tensor([[BOS, 3, 4, 5, 6, 7], [BOS, 8, 9, PAD, PAD, PAD], [BOS, 10, 3, 4, PAD, PAD]])


def test_sinusoidal_positions_values() -> None:
    pos = SinusoidalPositions(8, 16)
    table = pos(16)
    assert torch.equal(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    freq1 = 10000.0 ** (-1 / 3)  # half = 4 frequencies: 10000^(-i/3)
    expected3 = [math.sin(3), math.sin(3 * freq1), math.sin(3 * freq1**2), math.sin(3e-4),
                 math.cos(3), math.cos(3 * freq1), math.cos(3 * freq1**2), math.cos(3e-4)]
    assert torch.allclose(table[3], torch.tensor(expected3), atol=1e-6)
    assert torch.equal(pos(2, offset=3), table[3:5])
    with pytest.raises(ConfigError, match="model.max_positions"):
        pos(2, offset=15)


def test_num_parameters_hand_counted() -> None:
    attn = 4 * (D * D + D)
    ffn = D * 64 + 64 + 64 * D + D
    enc_layer = attn + ffn + 2 * 2 * D
    dec_layer = 2 * attn + ffn + 3 * 2 * D
    tied = V * D + 2 * enc_layer + 2 * dec_layer + 2 * 2 * D
    assert small_model().num_parameters() == tied
    assert small_model(tie_embeddings=False).num_parameters() == tied + 2 * V * D


def test_embedding_init() -> None:
    model = small_model()
    weight = model.embed_tokens.weight
    assert torch.equal(weight[PAD], torch.zeros(D))
    assert abs(weight[1:].std().item() - D ** -0.5) < 0.2 * D ** -0.5
    lin = model.encoder_layers[0].ffn.fc1
    bound = math.sqrt(6 / (lin.in_features + lin.out_features))  # xavier-uniform bound
    assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.8 * bound
    assert torch.equal(lin.bias, torch.zeros_like(lin.bias))


def test_tied_weights_are_one_table() -> None:
    model = small_model()
    assert model.decoder_embed is model.embed_tokens
    assert model.output_weight() is model.embed_tokens.weight
    # Token 10 is not in the input: moving its row changes only logit column 10.
    src, tgt = SRC[:2, :3], TGT[:2, :3]
    before = model(src, tgt).logits_BTV
    with torch.no_grad():
        # Not a constant shift: that is orthogonal to the LayerNormed states (zero-mean).
        model.embed_tokens.weight[10] += torch.linspace(-1.0, 1.0, D)
    after = model(src, tgt).logits_BTV
    assert torch.allclose(after[..., :10], before[..., :10], atol=1e-6)
    assert not torch.allclose(after[..., 10], before[..., 10], atol=1e-3)

    untied = small_model(tie_embeddings=False)
    assert untied.decoder_embed is not untied.embed_tokens
    assert untied.output_weight() is untied.output_proj.weight


def test_layer_inputs_are_scaled_embeddings_plus_positions() -> None:
    model = small_model(tie_embeddings=False)
    seen: dict[str, torch.Tensor] = {}
    model.encoder_layers[0].register_forward_hook(
        lambda mod, args, out: seen.__setitem__("enc", args[0]))
    model.decoder_layers[0].register_forward_hook(
        lambda mod, args, out: seen.__setitem__("dec", args[0]))
    table = model.positions(10)
    with torch.no_grad():
        enc = model.encode(SRC)
        expected = model.embed_tokens(SRC) * math.sqrt(D) + table[:5]
        assert torch.allclose(seen["enc"], expected, atol=1e-6)
        cache = model.new_decoder_cache()
        model.decode(TGT[:, :2], enc, cache=cache)
        model.decode(TGT[:, 2:5], enc, cache=cache)  # positions continue at 2
        expected = model.tgt_embed_tokens(TGT[:, 2:5]) * math.sqrt(D) + table[2:5]
        assert torch.allclose(seen["dec"], expected, atol=1e-6)


def test_incremental_decoding_matches_full() -> None:
    model = small_model(seed=1)
    with torch.no_grad():
        enc = model.encode(SRC)
        full, _ = model.decode(TGT, enc)
        for chunks in ([1] * 6, [2, 1, 3]):
            cache = model.new_decoder_cache()
            parts, start = [], 0
            for size in chunks:
                step, _ = model.decode(TGT[:, start:start + size], enc, cache=cache)
                parts.append(step)
                start += size
            assert cache.length == 6
            assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_cache_reorder_matches_reordered_batch() -> None:
    model = small_model(seed=2)
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        enc = model.encode(SRC)
        cache = model.new_decoder_cache()
        model.decode(TGT[:, :3], enc, cache=cache)
        cache.reorder(index)
        step, _ = model.decode(TGT[index, 3:5], enc.index_select(index), cache=cache)
        full, _ = model.decode(TGT[index], model.encode(SRC[index]))
    assert torch.allclose(step, full[:, 3:5], atol=1e-5)


def test_padding_invariance() -> None:
    model = small_model(seed=3)
    with torch.no_grad():
        batch_enc = model.encode(SRC)
        batch_logits = model(SRC, TGT).logits_BTV
        for i, (src_len, tgt_len) in enumerate([(5, 6), (3, 3), (1, 4)]):
            alone_enc = model.encode(SRC[i:i + 1, :src_len])
            assert torch.allclose(alone_enc.states_BSD[0], batch_enc.states_BSD[i, :src_len],
                                  atol=1e-5)
            alone = model(SRC[i:i + 1, :src_len], TGT[i:i + 1, :tgt_len]).logits_BTV
            assert torch.allclose(alone[0], batch_logits[i, :tgt_len], atol=1e-5)


def test_decoder_is_causal_and_encoder_matters() -> None:
    model = small_model(seed=4)
    with torch.no_grad():
        base = model(SRC, TGT).logits_BTV
        tgt2 = TGT.clone()
        tgt2[0, 3] = 9
        changed = model(SRC, tgt2).logits_BTV
        src2 = SRC.clone()
        src2[0, 1] = 3
        other_src = model(src2, TGT).logits_BTV
    assert torch.equal(changed[0, :3], base[0, :3])
    assert not torch.allclose(changed[0, 3:], base[0, 3:], atol=1e-4)
    assert torch.equal(changed[1:], base[1:])
    assert not torch.allclose(other_src[0], base[0], atol=1e-4)
    assert torch.allclose(other_src[1:], base[1:], atol=1e-6)


def test_dropout_only_in_train_mode() -> None:
    model = small_model(dropout=0.3)
    with torch.no_grad():
        assert torch.equal(model(SRC, TGT).logits_BTV, model(SRC, TGT).logits_BTV)
        model.train()
        assert not torch.allclose(model(SRC, TGT).logits_BTV, model(SRC, TGT).logits_BTV)


class FakeFFN(nn.Module):
    """Zero residual branch; records its calls and reports a known aux loss."""

    def __init__(self, side: str, idx: int, calls: list) -> None:
        super().__init__()
        self.side, self.idx, self.calls = side, idx, calls

    def forward(self, x_BTD, ctx):
        self.calls.append((self.side, self.idx, ctx))
        weight = 10.0 if self.side == "encoder" else 1.0
        return torch.zeros_like(x_BTD), {"balance": torch.tensor(weight * (self.idx + 1))}


class ShiftAdapter(nn.Module):
    """Adds a fixed ramp to the layer output (owns the residual) and reports an aux loss.

    (A constant shift would be invisible: the final LayerNorm removes it.)
    """

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift

    def forward(self, x_BTD, ctx):
        ramp_D = torch.linspace(-1.0, 1.0, x_BTD.size(-1))
        return x_BTD + self.shift * ramp_D, {"adapter": torch.tensor(0.5)}


def test_ffn_and_adapter_slots_and_aux_losses() -> None:
    calls: list = []
    seen: list = []

    def ffn_factory(side, idx, cfg):
        seen.append((side, idx, cfg.d_model))
        return FakeFFN(side, idx, calls)

    def adapter_factory(side, idx, cfg, shift=1.0, where=(("encoder", 0), ("decoder", 1))):
        return ShiftAdapter(shift) if (side, idx) in where else None

    torch.manual_seed(5)
    model = Seq2SeqTransformer(small_cfg(), V, PAD, ffn_factory, adapter_factory).eval()
    assert seen == [("encoder", 0, D), ("encoder", 1, D), ("decoder", 0, D), ("decoder", 1, D)]
    assert [layer.adapter is not None for layer in model.encoder_layers] == [True, False]
    assert [layer.adapter is not None for layer in model.decoder_layers] == [False, True]

    ctx = ForwardContext(domain_ids_B=torch.tensor([4, 5, 6]))
    out = model(SRC, TGT, ctx)
    assert set(out.aux_losses) == {"balance", "adapter"}
    assert out.aux_losses["balance"].item() == pytest.approx(10 * (1 + 2) + 1 * (1 + 2))
    assert out.aux_losses["adapter"].item() == pytest.approx(0.5 + 0.5)
    assert [(s, i, c.side) for s, i, c in calls] == [
        ("encoder", 0, "encoder"), ("encoder", 1, "encoder"),
        ("decoder", 0, "decoder"), ("decoder", 1, "decoder")]
    for side, _, c in calls:
        assert torch.equal(c.domain_ids_B, torch.tensor([4, 5, 6]))
        assert torch.equal(c.src_pad_mask_BS, SRC.eq(PAD))
        if side == "decoder":
            assert torch.equal(c.tgt_pad_mask_BT, TGT.eq(PAD))
    assert ctx.side == "encoder" and ctx.src_pad_mask_BS is None  # caller's ctx untouched

    # The adapters are really applied: a zero shift reproduces the adapter-free model, a shift
    # on either side alone changes the logits.
    def build(**kw):
        torch.manual_seed(5)
        return Seq2SeqTransformer(small_cfg(), V, PAD, ffn_factory,
                                  lambda s, i, c: adapter_factory(s, i, c, **kw)).eval()

    plain = build(where=())
    with torch.no_grad():
        ref = plain(SRC, TGT).logits_BTV
        assert torch.allclose(build(shift=0.0)(SRC, TGT).logits_BTV, ref, atol=1e-6)
        for where in ((("encoder", 0),), (("decoder", 1),)):
            shifted = build(where=where)(SRC, TGT).logits_BTV
            assert not torch.allclose(shifted, ref, atol=1e-3)
    assert plain(SRC, TGT).aux_losses.keys() == {"balance"}


def test_dense_model_has_no_aux_and_backprops() -> None:
    model = small_model().train()
    out = model(SRC, TGT)
    assert out.aux_losses == {}
    out.logits_BTV.sum().backward()
    assert model.embed_tokens.weight.grad is not None
    assert model.decoder_layers[1].ffn.fc2.weight.grad.abs().sum() > 0


def test_context_for_side_and_index_select() -> None:
    ctx = ForwardContext(src_pad_mask_BS=torch.tensor([[False, True], [False, False]]),
                         domain_ids_B=torch.tensor([7, 8]), task_ids_B=None,
                         extras={"prior_BE": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
                                 "temperature": torch.tensor([2.0, 3.0]), "name": "x"})
    dec = ctx.for_side("decoder")
    assert dec.side == "decoder" and ctx.side == "encoder"
    assert dec.domain_ids_B is ctx.domain_ids_B
    with pytest.raises(ValueError, match="side"):
        ctx.for_side("middle")

    picked = ctx.index_select(torch.tensor([1, 1, 0]))
    assert torch.equal(picked.domain_ids_B, torch.tensor([8, 8, 7]))
    assert torch.equal(picked.src_pad_mask_BS,
                       torch.tensor([[False, False], [False, False], [False, True]]))
    assert picked.task_ids_B is None
    assert torch.equal(picked.extras["prior_BE"], torch.tensor([[0.0, 1.0], [0.0, 1.0],
                                                                [1.0, 0.0]]))
    assert picked.extras["temperature"] is ctx.extras["temperature"]  # not per-sentence
    assert picked.extras["name"] == "x"
