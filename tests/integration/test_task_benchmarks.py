"""benchmarks/decode_throughput.py and benchmarks/multilingual.py at --quick sizes: the records
hold what their docstrings promise, every figure measured (positive, consistent), with
provenance; multilingual.py scores an external --test-dir and skips cleanly without data."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, SHARED_DATA, cli_env


def _bench(script: str, *args: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_decode_throughput_quick(tmp_path) -> None:
    out = tmp_path / "d.json"
    _bench("decode_throughput.py", "--quick", "--out", str(out), cwd=tmp_path)
    r = json.loads(out.read_text())
    assert r["provenance"]["git"]["commit"] and r["provenance"]["command"]
    models = ("token_moe", "task_moe", "task_extracted", "dense_active")
    sweep = r["decode_sweep"]
    for name in models:
        rates = sweep["tokens_per_s"][name]
        assert len(rates) == len(sweep["batch_sizes"]) and min(rates) > 0
        assert sweep["peak"][name]["tokens_per_s"] == max(rates)
        split = r["encoder_decoder_split"]["models"][name]
        assert 0 < split["encoder_share"] < 1
    p = r["params"]
    # Equal training parameters for the two MoE models; the sub-network is smaller, its
    # decoder as small as the dense model of equal active parameters (same FFN width 2F).
    assert abs(p["token_moe"]["total"] - p["task_moe"]["total"]) < 0.01 * p["task_moe"]["total"]
    assert p["task_extracted"]["total"] < p["task_moe"]["total"]
    assert abs(p["task_extracted"]["decoder"] - p["dense_active"]["decoder"]) \
        < 0.01 * p["dense_active"]["decoder"]
    train = r["training"]["ratio_vs_dense_active"]
    assert set(train) == {"token_moe", "task_moe"} and min(train.values()) > 0
    marian = r["marian"]
    if "skipped" not in marian:
        for key in ("greedy", "beam5"):
            assert min(marian[key]["sentences_per_s"].values()) > 0
    ep = r["ep2"]
    assert 0 < ep["all_to_all_share"] < 1 and ep["ranks"][0]["calls"] > 0
    acc = r["acceptance"]
    peak = sweep["peak"]
    assert acc["extracted_over_token_moe_peak"] == round(
        peak["task_extracted"]["tokens_per_s"] / peak["token_moe"]["tokens_per_s"], 3)


def test_decode_throughput_sweep_only(tmp_path) -> None:
    """--experts / --batches reshape the sweep; --sweep-only records no training, MarianMT or
    EP figures (nothing it did not measure); a bad --batches is one line and status 2."""
    out = tmp_path / "d.json"
    _bench("decode_throughput.py", "--quick", "--sweep-only", "--experts", "6",
           "--batches", "3,1", "--out", str(out), cwd=tmp_path)
    r = json.loads(out.read_text())
    assert r["sizes"]["E"] == 6 and r["decode_sweep"]["batch_sizes"] == [1, 3]
    assert r["training"] is None and r["marian"] is None and r["ep2"] is None
    assert set(r["acceptance"]["holds"]) == {"extracted_peak_at_least_2x_token_moe"}
    bad_args = [(["--batches", "8,x"], "error: --batches"),
                (["--experts", "5"], "error: --experts: expected at least 2 (top-2 "
                                     "routing), and even (the EP=2 run")]
    if not torch.cuda.is_available():
        bad_args.append((["--device", "cuda"], "error: benchmarks/decode_throughput.py: "
                                               "--device cuda: expected a CUDA GPU"))
    for args, needle in bad_args:
        bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"),
                              "--quick", *args], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert bad.stderr.startswith(needle) and args[1] in bad.stderr


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared OPUS data absent")
@pytest.mark.benchmark_smoke
def test_multilingual_quick(tmp_path) -> None:
    ext = tmp_path / "ext" / "EMEA"  # an external test set: 5 de-en pairs of one domain
    ext.mkdir(parents=True)
    for lang in ("de", "en"):
        lines = (SHARED_DATA / "EMEA" / f"EMEA.de-en.train.{lang}").read_text().splitlines()
        (ext / f"EMEA.de-en.test.{lang}").write_text("\n".join(lines[-5:]) + "\n")
    out = tmp_path / "m.json"
    _bench("multilingual.py", "--quick", "--variants", "dense,token-target", "--minutes", "1",
           "--work", str(tmp_path / "w"), "--out", str(out), "--test-dir", str(tmp_path / "ext"),
           cwd=tmp_path)
    r = json.loads(out.read_text())
    assert r["directions"] == ["de-en", "en-de", "en-fr", "fr-en"]
    dense, task = r["variants"]["dense"], r["variants"]["token-target"]
    for v in (dense, task):
        assert set(v["test"]["pairs"]) == set(r["directions"]) and v["steps"] == 4
        assert v["test"]["en_xx_bleu"] is not None and v["test"]["xx_en_bleu"] is not None
        ext_scores = v["test_dir"]
        # de-en test files score both directions of the pair; en-fr / fr-en have none
        assert list(ext_scores["pairs"]) == ["de-en", "en-de"]
        assert ext_scores["all"]["sentences"] == 10 and len(ext_scores["skipped"]) == 2
    assert "extraction" in task and "extraction" not in dense
    assert task["extraction"]["extracted"]["total"] < task["extraction"]["full"]["total"]
    assert task["params"]["total"] > dense["params"]["total"]


def test_multilingual_skips_without_data(tmp_path) -> None:
    proc = _bench("multilingual.py", "--data", str(tmp_path / "none"), cwd=tmp_path)
    assert proc.stdout.startswith("skipped:")
