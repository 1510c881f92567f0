"""A small MoE Transformer with ep_size=2 on two ranks: it lowers its loss, resumes, and its
checkpoint loads at EP=1 (trainer resume and standalone inference) with the same outputs as at
EP=2 (computed by a script under `deepspeed --num_gpus 2`)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli_runner import Ranks
from tests.conftest import ROOT, cli_env, debug_overrides

DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
WORKER = str(Path(__file__).with_name("ep_outputs_worker.py"))
CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
MOE = ["moe.num_experts=4", "moe.k=2", "moe.capacity_factor=0", "data.max_tokens=400",
       "train.bleu_sentences=10", "train.log_every=5", "checkpoint.keep_last=0",
       "optim.lr=3e-3", "optim.warmup_steps=20"]


def _deepspeed(args, tmp_path):
    from moe_train.parallel.runtime import free_port

    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()),
                           *args], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def _train(args: list[str], log: Path) -> str:
    """`moe_train train ARGS` on two ranks of one job (as the deepspeed launcher starts them)."""
    return Ranks(["train", *args], ROOT, cli_env(), log).finish(timeout=400)


def _losses(log: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"\| step +\d+ \| loss ([\d.]+)", log)]


@pytest.mark.skipif(shutil.which(DEEPSPEED) is None and not Path(DEEPSPEED).exists(),
                    reason="deepspeed launcher not installed")
def test_ep2_trains_resumes_and_loads_at_ep1(tiny_prepared, tmp_path):
    work = tmp_path / "w"
    common = debug_overrides(tiny_prepared, work, *MOE, "moe.ep_size=2")
    log = _train(["--config", CONFIG, *common, "train.max_steps=40", "checkpoint.save_every=20",
                  "train.validate_every=20"], tmp_path / "train.log")
    assert "world 2 (env, gloo)" in log
    from moe_train.config import load_config
    from moe_train.eval.params import count_parameters
    from moe_train.data.prepare import load_manifest

    manifest = load_manifest(tiny_prepared)
    whole = count_parameters(load_config(CONFIG, common), manifest["vocab_size"], manifest)
    # the start-up line counts the whole model, not one rank's half of the experts
    assert f"| model {whole['total'] / 1e6:.2f}M parameters |" in log, log[:3000]
    losses = _losses(log)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    step40 = work / "ckpt" / "step_00000040"
    assert all((step40 / f"experts_ep{r}of2.index.json").is_file() for r in (0, 1))

    log = _train(["--config", CONFIG, "--resume", *common, "train.max_steps=50",
                  "checkpoint.save_every=50", "train.validate_every=0"], tmp_path / "resume.log")
    assert "resume from step 40" in log
    assert (work / "ckpt" / "latest").read_text().strip() == "step_00000050"

    # the same checkpoint at EP=2 (two ranks) and at EP=1 (one process) gives the same outputs
    ep2_out, ep1_out = tmp_path / "ep2.pt", tmp_path / "ep1.pt"
    _deepspeed(["--no_local_rank", WORKER, CONFIG, str(ep2_out), *common], tmp_path)
    env = cli_env()
    ep1 = debug_overrides(tiny_prepared, work, *MOE, "moe.ep_size=1")
    proc = subprocess.run([sys.executable, WORKER, CONFIG, str(ep1_out), *ep1], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = torch.load(ep2_out), torch.load(ep1_out)
    assert a["step"] == b["step"] == 50
    torch.testing.assert_close(a["logits"], b["logits"], atol=1e-5, rtol=1e-5)

    from moe_train.models.context import ForwardContext
    from moe_train.train.export import load_for_inference

    for path in (work / "ckpt", work / "ckpt" / "export"):
        inf = load_for_inference(path)
        with torch.no_grad():
            logits = inf.model(a["src"], a["tgt_in"],
                               ForwardContext(src_pad_mask_BS=a["src"].eq(0))).logits_BTV
        torch.testing.assert_close(logits, a["logits"], atol=1e-5, rtol=1e-5)
    summary = json.loads((work / "ckpt" / "step_00000050" / "meta.json").read_text())
    assert summary["world_size"] == 2
