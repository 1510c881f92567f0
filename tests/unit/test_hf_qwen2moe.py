"""Qwen2-MoE with our MoE layer (moe_train.models.hf_qwen2moe) against transformers' own."""

from __future__ import annotations

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.models.build import build_model
from moe_train.models.hf_io import hf_to_ours, ours_to_hf
from moe_train.utils.tensor_source import TensorSource
from moe_train.models.hf_qwen2moe import Qwen2MoEForCausalLM, moe_blocks, qwen_hf_config

transformers = pytest.importorskip("transformers")

V = 96


def tiny(*extra: str, renormalize: bool = False, layers: str = "all"):
    """A tiny Qwen2-MoE config: 3 layers, D 32, 8 experts top-2, shared expert 40."""
    return load_config(None, [
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=3", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", "moe.num_experts=8", "moe.k=2",
        "moe.expert_ffn_dim=24", f"moe.layers={layers}", f"moe.renormalize={renormalize}",
        "moe.z_loss_coef=0", *extra])


def ours_and_hf(cfg, seed: int = 0):
    """Our model and transformers' Qwen2MoeForCausalLM holding the same weights."""
    torch.manual_seed(seed)
    ours = build_model(cfg, {"vocab_size": V, "pad_id": 0}).eval()
    hf = transformers.Qwen2MoeForCausalLM(qwen_hf_config(cfg)).eval()
    hf.load_state_dict(ours_to_hf(ours.state_dict(), "test"), strict=True)
    return ours, hf


@pytest.mark.parametrize("renormalize", [False, True])
def test_block_equals_transformers_block_outputs_and_gradients(renormalize: bool) -> None:
    cfg = tiny(renormalize=renormalize)
    ours, hf = ours_and_hf(cfg)
    ours_block = ours.hf.model.layers[1].mlp
    hf_block = hf.model.layers[1].mlp
    assert isinstance(hf_block, transformers.models.qwen2_moe.modeling_qwen2_moe
                      .Qwen2MoeSparseMoeBlock)
    x_BTD = torch.randn(3, 11, 32)
    g_BTD = torch.randn(3, 11, 32)
    results = []
    for call in (lambda x: _call_ours(ours, ours_block, x), hf_block):
        x = x_BTD.clone().requires_grad_(True)
        y = call(x)
        (y * g_BTD).sum().backward()
        results.append((y.detach(), x.grad))
    (y_ours, dx_ours), (y_hf, dx_hf) = results
    torch.testing.assert_close(y_ours, y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_ours, dx_hf, atol=1e-5, rtol=1e-5)
    # Weight gradients, mapped to HF's layout.
    ours_grads = {"hf." + k: v for k, v in _grads(ours).items()}
    mapped = ours_to_hf({k: v for k, v in ours_grads.items() if "layers.1.mlp" in k}, "test")
    hf_grads = {k: v for k, v in _grads(hf).items() if "layers.1.mlp" in k}
    assert set(mapped) == set(hf_grads)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(mapped[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def _call_ours(model: Qwen2MoEForCausalLM, block, x_BTD):
    from moe_train.models.context import ForwardContext

    model.calls.start(ForwardContext(side="decoder"))
    return block(x_BTD)


def _grads(model) -> dict[str, torch.Tensor]:
    prefix = "hf." if isinstance(model, Qwen2MoEForCausalLM) else ""
    return {name[len(prefix):]: p.grad for name, p in model.named_parameters()
            if p.grad is not None}


def test_model_logits_equal_transformers_model() -> None:
    cfg = tiny(layers="1,2")
    ours, hf = ours_and_hf(cfg, seed=1)
    ids_BT = torch.randint(1, V, (2, 9))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[1, 6:] = 0  # right padding
    with torch.no_grad():
        ours_out = ours(ids_BT, attention_mask_BT=mask_BT)
        hf_logits = hf(input_ids=ids_BT, attention_mask=mask_BT).logits
    keep = mask_BT.bool()
    torch.testing.assert_close(ours_out.logits_BTV[keep], hf_logits[keep], atol=1e-5, rtol=1e-5)
    assert set(ours_out.aux_losses) == {"load_balance"}
    assert isinstance(ours.hf.model.layers[0].mlp,
                      transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP)
    assert len(moe_blocks(ours)) == 2


def test_padding_is_never_routed() -> None:
    ours, _ = ours_and_hf(tiny())
    ids_BT = torch.randint(1, V, (2, 6))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[0, 2:] = 0
    with torch.no_grad():
        ours(ids_BT, attention_mask_BT=mask_BT)
    for block in moe_blocks(ours):
        assert int(block.moe.tokens_per_expert_E.sum()) == 2 * int(mask_BT.sum())


@pytest.mark.parametrize("router", ["topp", "switch", "gshard"])
def test_other_routers_train_inside_qwen_blocks(router: str) -> None:
    cfg = tiny(f"moe.decoder_router={router}")
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": V, "pad_id": 0}).train()
    ids_BT = torch.randint(1, V, (2, 8))
    out = model(ids_BT)
    loss = torch.nn.functional.cross_entropy(out.logits_BTV[:, :-1].flatten(0, 1),
                                             ids_BT[:, 1:].flatten())
    (loss + sum(out.aux_losses.values())).backward()
    block = moe_blocks(model)[0]
    assert block.moe.experts.w_gate_EDF.grad is not None
    assert block.moe.router.gate.weight.weight.grad.abs().sum() > 0


def test_per_expert_checkpoint_layout_is_stacked_on_import() -> None:
    cfg = tiny()
    ours, hf = ours_and_hf(cfg, seed=2)
    legacy = {}
    for name, t in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            base = name[:-len("gate_up_proj")]
            for e in range(t.size(0)):
                legacy[f"{base}{e}.gate_proj.weight"] = t[e, :24]
                legacy[f"{base}{e}.up_proj.weight"] = t[e, 24:]
        elif name.endswith("experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(t.size(0)):
                legacy[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            legacy[name] = t
    state = hf_to_ours(TensorSource.from_dict(legacy, "test"), cfg, "test").materialize()
    own = ours.state_dict()
    assert set(state) == set(own)
    for name, t in own.items():
        assert torch.equal(state[name], t), name


def test_malformed_expert_tensors_are_named_before_any_read(tmp_path) -> None:
    """Expert tensors of the wrong rank, or per-expert tensors of unequal shapes, and an index
    naming no tensor: one CheckpointError naming the file or tensor (they were a stack, t() or
    unpacking traceback from deep in the conversion)."""
    import json

    from moe_train.errors import CheckpointError
    from moe_train.models.hf_io import HF_INDEX, hf_weight_files

    cfg = tiny()
    _, hf = ours_and_hf(cfg, seed=3)
    state = hf.state_dict()
    down = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(CheckpointError, match=rf"^src: {down} has shape \(8, 32\); expected "
                                              r"\(E, D, 24\)$"):
        hf_to_ours(TensorSource.from_dict({**state, down: state[down][:, :, 0]}, "src"), cfg,
                   "src")
    legacy = {k: v for k, v in state.items() if not k.startswith("model.layers.0.mlp.experts.")}
    for e in range(8):
        legacy[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.zeros(24, 32)
        legacy[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.zeros(24, 32)
        legacy[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.zeros(32, 24)
    for bad in (torch.zeros(25, 32), torch.zeros(1, 24, 32)):
        broken = {**legacy, "model.layers.0.mlp.experts.2.gate_proj.weight": bad}
        with pytest.raises(CheckpointError, match=r"^src: layer 0 gate_proj has per-expert "
                                                  r"shapes .*expected one 2-D shape"):
            hf_to_ours(TensorSource.from_dict(broken, "src"), cfg, "src")
    (tmp_path / HF_INDEX).write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="no weight_map of tensor names to shard files"):
        hf_weight_files(tmp_path)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="moe.expert_ffn_dim"):
        tiny("moe.expert_ffn_dim=0")
    with pytest.raises(ConfigError, match="qwen.num_key_value_heads"):
        tiny("qwen.num_key_value_heads=3")
    with pytest.raises(ConfigError, match="model.arch"):
        load_config(None, ["model.arch=llama"])
    with pytest.raises(ConfigError, match="qwen.vocab_size"):
        build_model(tiny(), {"vocab_size": V + 1, "pad_id": 0})
    # a row holds a prompt and a target of up to data.max_len each: the budget must hold one
    tiny("data.max_len=100", "data.max_tokens=200")
    with pytest.raises(ConfigError, match=r"data.max_tokens: expected at least 2 x "
                                          r"data.max_len \(200\) with model.arch hf_qwen2_moe"):
        tiny("data.max_len=100", "data.max_tokens=199")


SHARED_ROUTERS = {  # one decision for all of a side's layers, made with random draws
    "sentence_jitter": ["moe.decoder_router=sentence", "moe.k=1"],
    "sentence_noisy": ["moe.decoder_router=sentence", "moe.k=1", "moe.noisy_gating=true",
                       "moe.jitter_eps=0"],
    "gumbel_adapters": ["moe.num_experts=0", "moe.jitter_eps=0", "adapters.num_experts=4",
                        "adapters.router=gumbel", "adapters.dim=8", "adapters.dropout=0.3"],
}


@pytest.mark.parametrize("arch", ["hf_qwen2_moe", "seq2seq", *SHARED_ROUTERS])
def test_activation_checkpointing_gives_the_same_gradients(arch: str) -> None:
    """model.activation_checkpointing recomputes layers in backward: same loss, same gradients
    (dropout and routing noise replayed). A shared sentence-level decision is made once, by
    the first layer: its recomputation must move the generators on as the decision's draws did
    (the dropout after it drew other masks: gradients of another network)."""
    grads = []
    for checkpointing in (False, True):
        if arch != "hf_qwen2_moe":
            cfg = load_config(None, [
                "model.d_model=32", "model.n_heads=4", "model.ffn_dim=48",
                "model.encoder_layers=2", "model.decoder_layers=2", "model.dropout=0.2",
                "moe.num_experts=4", "moe.k=2", "moe.jitter_eps=0.1",
                *SHARED_ROUTERS.get(arch, []),
                f"model.activation_checkpointing={checkpointing}"])
        else:
            cfg = tiny(f"model.activation_checkpointing={checkpointing}", "moe.jitter_eps=0.1")
        torch.manual_seed(0)
        model = build_model(cfg, {"vocab_size": V, "pad_id": 0}).train()
        ids = torch.randint(1, V, (3, 8), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(7)
        if arch != "hf_qwen2_moe":
            from moe_train.models.context import ForwardContext

            out = model(ids, ids, ForwardContext(src_pad_mask_BS=ids.eq(0)))
        else:
            out = model(ids)
        loss = out.logits_BTV.square().mean() + sum(out.aux_losses.values())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_decoder_only_batches_budget_prompt_plus_target(qwen_prepared) -> None:
    """A prompt-templated prepared dir is cut by prompt + target length: every training batch's
    concatenated sequence (what the model reads) stays within data.max_tokens."""
    from moe_train.data.batching import TrainBatchIterator
    from moe_train.data.shards import ShardedDataset
    from moe_train.models.lm_batch import lm_inputs

    prepared, _ = qwen_prepared
    data = ShardedDataset(prepared, "train")
    assert data.concatenated
    pad = int(data.manifest["pad_id"])
    it = iter(TrainBatchIterator(data, 600, pad, data.manifest["bos_id"],
                                 data.manifest["eos_id"], seed=1))
    for _ in range(20):
        (batch,) = next(it)
        ids_BL, _ = lm_inputs(batch.src_tokens_BS, batch.tgt_in_BT, pad)
        lengths_B = batch.src_tokens_BS.ne(pad).sum(1) + batch.tgt_in_BT.ne(pad).sum(1) - 2
        assert int(lengths_B.max()) * len(batch) <= 600 or len(batch) == 1
        assert ids_BL.size(1) >= int(lengths_B.max())


def test_aux_loss_coefficient_means_what_transformers_means() -> None:
    """transformers pools one balance loss over all sparse layers (k at balance); ours is one
    per layer (1 at balance), summed. Its router_aux_loss_coef maps to ours times k / layers,
    so at uniform router probabilities both add the same term to the loss."""
    from moe_train.models.hf_qwen2moe import aux_coef_from_hf, aux_coef_to_hf

    coef_hf = 0.01
    cfg = tiny(f"moe.aux_loss_coef={aux_coef_from_hf(coef_hf, 2, 3)}")
    ours, hf = ours_and_hf(cfg, seed=2)
    assert qwen_hf_config(cfg).router_aux_loss_coef == pytest.approx(coef_hf, rel=1e-9)
    assert aux_coef_to_hf(aux_coef_from_hf(0.001, 4, 24), 4, 24) == 0.001
    with torch.no_grad():
        for block in moe_blocks(ours):
            block.moe.router.gate.weight.weight.zero_()  # uniform router probabilities
    hf.load_state_dict(ours_to_hf(ours.state_dict(), "test"), strict=True)
    ids_BT = torch.randint(1, V, (2, 7))
    ours.train()
    with torch.no_grad():
        balance = float(ours(ids_BT).aux_losses["load_balance"])
        hf_out = hf(input_ids=ids_BT, output_router_logits=True)
    assert balance == pytest.approx(coef_hf * float(hf_out.aux_loss), rel=1e-5)


def test_raw_text_reaches_the_model_as_the_prompt_ids_prepare_stored(qwen_prepared,
                                                                     monkeypatch) -> None:
    """`translate` / `evaluate --src` give a decoder-only model exactly the ids its prepared
    data holds for the same sentence: the source's whitespace collapsed, then the template
    filled and encoded as is (its newlines kept; collapsing the filled prompt turned them into
    spaces, a prompt the model never trained on)."""
    import argparse
    import dataclasses
    import types

    from moe_train.eval import raw_text
    from moe_train.config import load_config
    from moe_train.data.prepare import load_vocab
    from moe_train.data.shards import ShardedDataset
    from moe_train.eval import decode
    from tests.conftest import ROOT

    prepared, tok = qwen_prepared
    test = ShardedDataset(prepared, "test")
    template = test.manifest["data_config"]["prompt_template"]
    assert "\n" in template
    corpus = test.manifest["corpora"][0]
    cfg = load_config(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml",
                      [f"data.prepared_dir={prepared}", f"data.tokenizer={tok}"])
    inf = types.SimpleNamespace(cfg=cfg, manifest=test.manifest, vocab=load_vocab(prepared),
                                model=build_model(cfg, test.manifest))
    fed, real = [], decode.encode_lines

    def spy(*args, **kwargs):
        fed.append(real(*args, **kwargs))
        return fed[-1]

    monkeypatch.setattr(decode, "encode_lines", spy)
    args = argparse.Namespace(src_lang=corpus["src_lang"], tgt_lang=corpus["tgt_lang"],
                              domain=None, long_lines="error")
    lines = [test.raw_src(i) for i in range(2)]
    lines[1] = "  " + lines[1].replace(" ", " \t ", 1) + " "  # as prepare, spaces collapse
    ecfg = dataclasses.replace(cfg.eval, beam=1, max_len_a=0.0, max_len_b=2)
    raw_text.translate_raw(inf, args, "input", lines, ecfg, torch.device("cpu"))
    assert fed == [[test.src(i).tolist() for i in range(2)]]
