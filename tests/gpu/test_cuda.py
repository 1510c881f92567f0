"""GPU checks (skipped without CUDA): bf16 training on the DeepSpeed engine, cached decoding,
the decode-throughput benchmark on the GPU."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, cli_env, debug_overrides, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_training_on_gpu(tiny_prepared, tmp_path):
    proc = run_cli(["train", "--config", str(ROOT / "configs" / "debug-cpu.yaml"),
                    *debug_overrides(tiny_prepared, tmp_path, "optim.precision=auto",
                                     "train.max_steps=60", "train.validate_every=30",
                                     "train.bleu_sentences=10")], cwd=ROOT)
    assert "device cuda" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["step"] == 60 and summary["dev/ppl"] < 300


def test_incremental_decoding_on_gpu():
    from moe_train.config import ModelConfig
    from moe_train.models.transformer import Seq2SeqTransformer

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_heads=4, ffn_dim=128, encoder_layers=2, decoder_layers=2)
    model = Seq2SeqTransformer(cfg, vocab_size=50, pad_id=0).cuda().eval()
    src = torch.randint(4, 50, (3, 7), device="cuda")
    tgt = torch.randint(4, 50, (3, 6), device="cuda")
    with torch.no_grad():
        full = model(src, tgt).logits_BTV
        enc = model.encode(src)
        cache = model.new_decoder_cache()
        steps = [model.decode(tgt[:, t:t + 1], enc, cache=cache)[0] for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_decode_throughput_benchmark_on_gpu(tmp_path):
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"),
                           "--quick", "--device", "cuda", "--out", str(out)], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cuda" and r["provenance"]["machine"]["gpu"]["name"]
    assert r["ep2"] is None  # the EP=2 run uses gloo CPU ranks: not a GPU figure
    for rates in r["decode_sweep"]["tokens_per_s"].values():
        assert min(rates) > 0
    assert min(r["marian"]["greedy"]["sentences_per_s"].values()) > 0


@pytest.mark.parametrize("name", ["token/target", "LP/LP k=3"])
@torch.no_grad()
def test_extracted_sub_network_on_gpu(name):
    """On the GPU the sub-network's task layers run every expert on every token (batched GEMMs,
    no sort, no host sync) and the full model sorts and runs Triton grouped GEMMs: the same
    function, so the same greedy and beam output and logits equal to rounding."""
    from moe_train.eval.extract import extract, load_extracted
    from moe_train.eval.search import beam_search, greedy_search
    from tests.unit.test_extract import BOS, CONFIGS, EOS, MANIFEST, PAD, _inputs, _model

    overrides, task = CONFIGS[name]
    cfg, model = _model(overrides)
    sub = load_extracted(extract(model, cfg, MANIFEST, task), MANIFEST).cuda()
    model = model.cuda()
    src_BS, ctx = _inputs(task)
    src_BS = src_BS.cuda()
    ctx = ctx.replace(**{f: getattr(ctx, f).cuda() for f in ("src_lang_B", "tgt_lang_B",
                                                             "domain_ids_B")})
    kwargs = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=0.0, max_len_b=12, ctx=ctx)
    assert greedy_search(sub, src_BS, **kwargs) == greedy_search(model, src_BS, **kwargs)
    assert beam_search(sub, src_BS, beam=4, **kwargs) == \
        beam_search(model, src_BS, beam=4, **kwargs)
    tgt_BT = torch.randint(3, 40, (src_BS.size(0), 5), device="cuda")
    tgt_BT[:, 0] = BOS
    got = sub.decode(tgt_BT, sub.encode(src_BS, ctx), ctx)[0]
    want = model.decode(tgt_BT, model.encode(src_BS, ctx), ctx)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gad_encoder_gate_probs_on_gpu(tiny_prepared):
    """The GAD evaluate stage's encoder-gate pass on a GPU model: the batches follow the model
    (they come from the CPU shards), and the gates equal the CPU model's."""
    import numpy as np

    from moe_train.config import load_config
    from moe_train.data.shards import ShardedDataset
    from moe_train.models.build import build_model
    from moe_train.stages.gad_eval import encoder_gate_probs

    test = ShardedDataset(tiny_prepared, "test")
    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.ffn_dim=64",
                             "model.encoder_layers=2", "model.decoder_layers=2",
                             f"adapters.num_experts={len(test.manifest['domains'])}",
                             "adapters.router=gated", "adapters.sides=both", "adapters.dim=8"])
    torch.manual_seed(0)
    model = build_model(cfg, test.manifest).eval()
    idx = np.arange(min(len(test), 12))
    cpu = encoder_gate_probs(model, test, idx, 2000)
    gpu = encoder_gate_probs(model.cuda(), test, idx, 2000)
    assert gpu.shape == cpu.shape == (2, len(idx), len(test.manifest["domains"]))
    np.testing.assert_allclose(gpu, cpu, atol=1e-4)


def test_moa_evaluate_scores_the_sentence_router_of_a_model_on_gpu():
    """The evaluate stage feeds the routed model's own sentence gate the pooled features it
    holds as numpy: on the model's device (they stayed on the CPU: a device mismatch after
    every decode had run)."""
    from types import SimpleNamespace

    from moe_train.config import load_config
    from moe_train.models.build import build_model
    from moe_train.stages.evaluate import sentence_router_labels

    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                             "model.encoder_layers=2", "model.decoder_layers=3",
                             "adapters.dim=4", "adapters.num_experts=4",
                             "adapters.router=sentence", "adapters.k=1"])
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": 30, "pad_id": 0}).eval()
    x_ND = torch.randn(6, 16)
    want = sentence_router_labels(SimpleNamespace(model=model, cfg=cfg), x_ND.numpy())
    got = sentence_router_labels(SimpleNamespace(model=model.cuda(), cfg=cfg), x_ND.numpy())
    assert got.tolist() == want.tolist()
