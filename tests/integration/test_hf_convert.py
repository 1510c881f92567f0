"""`moe-train convert` both ways on a tiny random Qwen2-MoE saved by transformers: our model of
the converted directory gives transformers' logits, the round trip HF -> ours -> HF gives
identical tensors and logits, and bad directories are one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from moe_train.models.hf_io import load_qwen
from tests.conftest import ROOT, run_cli

transformers = pytest.importorskip("transformers")


def _tiny_hf(path, norm_topk_prob: bool, mlp_only_layers: list[int], **special_ids):
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only_layers,
        tie_word_embeddings=False, **(special_ids or {"eos_token_id": 2}))
    torch.manual_seed(3)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-initialises the router: give it something to route by
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return model


@pytest.mark.parametrize("norm_topk_prob,dense_layers,special_ids", [
    (False, [], {"eos_token_id": 2}),
    (True, [0], {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None})])
def test_convert_round_trip(tmp_path, norm_topk_prob: bool, dense_layers: list[int],
                            special_ids: dict) -> None:
    hf_dir, ours_dir, back_dir = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    hf_model = _tiny_hf(hf_dir, norm_topk_prob, dense_layers, **special_ids)
    proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(ours_dir)], cwd=tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["parameters"] == sum(p.numel() for p in hf_model.parameters())
    assert (ours_dir / "tokenizer_config.json").is_file()

    ids_BT = torch.randint(3, 120, (3, 10), generator=torch.Generator().manual_seed(0))
    ours, cfg, _ = load_qwen(ours_dir)
    assert cfg.moe.renormalize is norm_topk_prob and cfg.moe.k == 2
    with torch.no_grad():
        want = hf_model(input_ids=ids_BT).logits
        torch.testing.assert_close(ours(ids_BT).logits_BTV, want, atol=1e-5, rtol=1e-5)

    run_cli(["convert", "--to-hf", str(ours_dir), "--out", str(back_dir)], cwd=tmp_path)
    back = transformers.Qwen2MoeForCausalLM.from_pretrained(back_dir).eval()
    written = json.loads((back_dir / "config.json").read_text())
    assert written["architectures"] == ["Qwen2MoeForCausalLM"]
    given = json.loads((hf_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # as they were, lists too
        assert written.get(key) == given.get(key), key
    original = hf_model.state_dict()
    assert set(back.state_dict()) == set(original)
    for name, t in back.state_dict().items():
        assert torch.equal(t, original[name]), name
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids_BT).logits, want)
    from safetensors import safe_open

    with safe_open(str(back_dir / "model.safetensors"), "pt") as f, \
            safe_open(str(hf_dir / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())  # transformers' own saved layout

    # A stacked file (transformers' module layout) reads back to the same weights.
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((back_dir / "config.json").read_text())
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in back.state_dict().items()},
              str(stacked / "model.safetensors"))
    run_cli(["convert", "--from-hf", str(stacked), "--out", str(tmp_path / "ours2")],
            cwd=tmp_path)
    again, _, _ = load_qwen(tmp_path / "ours2")
    for name, t in again.state_dict().items():
        assert torch.equal(t, ours.state_dict()[name]), name


def test_to_hf_shards_and_casts_as_save_pretrained(tmp_path) -> None:
    """--max-shard-size splits the weights into numbered shards with transformers' index (a
    tensor above the size alone in its shard), --dtype casts them and names the dtype in
    config.json; transformers loads both, and --from-hf reads the shards back exactly."""
    from safetensors import safe_open

    hf_model = _tiny_hf(tmp_path / "hf", False, [])
    original = hf_model.state_dict()
    run_cli(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")],
            cwd=tmp_path)
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        out = tmp_path / dtype
        proc = run_cli(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(out),
                        "--dtype", dtype, "--max-shard-size", "20KB"], cwd=tmp_path)
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert summary["files"] == files and len(files) > 3 and summary["dtype"] == dtype
        assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        assert not (out / "model.safetensors").exists()
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            assert set(index["weight_map"]) == set(f.keys())  # transformers' saved layout
        sizes = []
        for name in files:
            with safe_open(str(out / name), "pt") as f:
                tensors = [f.get_tensor(k) for k in f.keys()]
            assert all(t.dtype == torch_dtype for t in tensors)
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
            assert sizes[-1] <= 20_000 or len(tensors) == 1, (name, sizes[-1])
        assert index["metadata"]["total_size"] == sum(sizes)
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        back = transformers.Qwen2MoeForCausalLM.from_pretrained(out).eval()
        for name, t in back.state_dict().items():
            assert t.dtype == torch_dtype and torch.equal(t, original[name].to(torch_dtype)), name
    run_cli(["convert", "--from-hf", str(tmp_path / "float32"), "--out", str(tmp_path / "again")],
            cwd=tmp_path)
    again, _, _ = load_qwen(tmp_path / "again")
    ours, _, _ = load_qwen(tmp_path / "ours")
    for name, t in again.state_dict().items():
        assert torch.equal(t, ours.state_dict()[name]), name
    for args, needle in ((["--to-hf", str(tmp_path / "ours"), "--max-shard-size", "5XB"],
                          "--max-shard-size: expected a whole number of bytes such as 5GB"),
                         (["--from-hf", str(tmp_path / "hf"), "--dtype", "bfloat16"],
                          "--dtype and --max-shard-size go with --to-hf")):
        proc = run_cli(["convert", *args, "--out", str(tmp_path / "bad")], cwd=tmp_path,
                       check=False)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_convert_bad_directories_are_one_line_errors(tmp_path) -> None:
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = run_cli(["convert", "--from-hf", str(bad), "--out", str(tmp_path / "o")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model_type" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    (bad / "config.json").write_text("{not json")
    proc = run_cli(["convert", "--from-hf", str(bad), "--out", str(tmp_path / "o")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "config.json" in proc.stderr
    proc = run_cli(["convert", "--to-hf", str(bad), "--out", str(tmp_path / "o")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_params_of_the_qwen_configs_match_seed_003() -> None:
    """003: Qwen1.5-MoE-A2.7B 14.3B total / 2.7B active; Trim-MoE 3.52B / 2.27B (2%)."""
    for name, total, active in (("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9),
                                ("qwen1.5-moe-trim8", 3.52e9, 2.27e9)):
        proc = run_cli(["params", "--config", str(ROOT / "configs" / f"{name}.yaml")],
                       cwd=ROOT)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert abs(report["total"] / total - 1) < 0.02, (name, report["total"])
        assert abs(report["active_all"] / active - 1) < 0.02, (name, report["active_all"])


def test_trim_moe_explicit_and_calibrated(tmp_path) -> None:
    """--trim N keeps N experts per layer: explicit indices give transformers' model built with
    the same sliced weights; --calibration keeps each layer's N most used experts, counted
    independently from transformers' own router on the same tokens."""
    from moe_train.data.hf_tokenizer import HFTokenizer, train_bpe_tokenizer

    hf_dir = tmp_path / "hf"
    texts = [f"the {w} of case {i} was {v}" for i, (w, v) in enumerate(
        [("court", "heard"), ("patient", "treated"), ("server", "restarted")] * 30)]
    train_bpe_tokenizer(texts, hf_dir, 300)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(hf_dir)

    # explicit experts: the same as transformers with the sliced weights
    keep = [1, 2, 4, 5]
    out = tmp_path / "trim-explicit"
    summary = json.loads(run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(out),
                                  "--trim", "4", "--experts", "5,1,4,2", "--k", "2"],
                                 cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert summary["kept_experts"] == {"0": keep, "1": keep}
    ours, trimmed_cfg, _ = load_qwen(out)
    assert trimmed_cfg.moe.num_experts == 4 and trimmed_cfg.moe.k == 2
    small = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **{**cfg.to_dict(), "num_experts": 4})).eval()
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(("mlp.gate.weight", "experts.gate_up_proj", "experts.down_proj")):
            t = t[keep]
        state[name] = t
    small.load_state_dict(state, strict=True)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits_BTV, small(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    run_cli(["convert", "--to-hf", str(out), "--out", str(tmp_path / "trim-hf")], cwd=tmp_path)
    assert transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "trim-hf") \
        .config.num_experts == 4

    # calibrated: the N experts transformers' router picks most often on the same text
    calib = tmp_path / "calib.txt"
    calib.write_text("".join(t + "\n" for t in texts[:40]))
    out = tmp_path / "trim-calib"
    summary = json.loads(run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(out),
                                  "--trim", "3", "--calibration", str(calib)],
                                 cwd=tmp_path).stdout.strip().splitlines()[-1])
    tok = HFTokenizer(hf_dir)
    counts = {0: torch.zeros(6, dtype=torch.long), 1: torch.zeros(6, dtype=torch.long)}
    with torch.no_grad():
        for ids in tok.encode_batch(texts[:40]):
            router_logits = model(input_ids=torch.tensor([ids]),
                                  output_router_logits=True).router_logits
            for layer, logits in enumerate(router_logits):
                top = logits.softmax(-1).topk(2, dim=-1).indices.flatten()
                counts[layer] += torch.bincount(top, minlength=6)
    for layer, c in counts.items():
        want = sorted(sorted(range(6), key=lambda e: (-int(c[e]), e))[:3])
        assert summary["kept_experts"][str(layer)] == want, (layer, c.tolist())
    assert load_qwen(out)[1].moe.num_experts == 3
    # convert.json: the source, how the experts were chosen (the counts behind the choice),
    # and where and by what command it ran
    report = json.loads((out / "convert.json").read_text())
    assert report["from"] == str(hf_dir.resolve())
    trim = report["trim"]
    assert (trim["to"], trim["experts"], trim["calibration"]) == (3, None, str(calib.resolve()))
    assert {layer: c for layer, c in trim["expert_use"].items()} == {
        str(layer): c.tolist() for layer, c in counts.items()}
    prov = report["provenance"]
    assert "--calibration" in prov["command"] and {"git", "machine", "libraries"} <= set(prov)

    # errors: one line, exit 2
    for extra in (["--trim", "7", "--experts", "0"], ["--trim", "2"],
                  ["--trim", "2", "--experts", "0,9"], ["--trim", "2", "--experts", "0,1",
                                                        "--k", "3"]):
        proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "x"),
                        *extra], cwd=tmp_path, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_to_hf_refuses_a_router_transformers_lacks_and_tied_counts_once(tmp_path) -> None:
    """transformers' Qwen2-MoE routes top-k: another router would convert into another model;
    a tied head is one tensor, counted once."""
    hf_dir, ours_dir = tmp_path / "hf", tmp_path / "ours"
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, eos_token_id=2, tie_word_embeddings=True)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    model.save_pretrained(hf_dir)
    proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(ours_dir)], cwd=tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())  # tied: once
    # tied, but the weights lack the embedding it is tied to: one line, not a KeyError
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    weights.pop("model.embed_tokens.weight")
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "x")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "embed_tokens" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    config = json.loads((ours_dir / "config.json").read_text())
    config["moe"]["decoder_router"] = "switch"
    (ours_dir / "config.json").write_text(json.dumps(config))
    proc = run_cli(["convert", "--to-hf", str(ours_dir), "--out", str(tmp_path / "back")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "moe.decoder_router is 'switch'; expected 'topk'" in proc.stderr
    assert not (tmp_path / "back").exists()


def test_from_hf_skips_rotary_buffers_and_refuses_a_tied_head_that_differs(tmp_path) -> None:
    """Older files hold `rotary_emb.inv_freq` buffers (computed from the config; transformers
    ignores them) and tied models may store their head too: equal to the embedding it converts
    to transformers' logits; different, transformers' versions disagree on which wins, so it
    is refused in one line."""
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    model.save_pretrained(hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")], cwd=tmp_path)
    ours, _, _ = load_qwen(tmp_path / "ours")
    ids_BT = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids_BT).logits_BTV, model(input_ids=ids_BT).logits,
                                   atol=1e-5, rtol=1e-5)
    # no tokenizer.json to count expert use with: the error names the option that needs it
    (tmp_path / "calib.txt").write_text("some text\n")
    proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "x"), "--trim",
                    "2", "--calibration", str(tmp_path / "calib.txt")], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "tokenizer.json: missing; --calibration" in proc.stderr

    weights["lm_head.weight"] = weights["lm_head.weight"] + 1.0
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "x")],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "lm_head.weight differs from model.embed_tokens.weight" in proc.stderr
    assert not (tmp_path / "x").exists()
