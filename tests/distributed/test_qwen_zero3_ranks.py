"""A tiny Qwen2-MoE trains with ZeRO-3 on two CPU gloo ranks of one launched job: the loss falls; SIGKILLed right after a step and resumed, it ends equal to an uninterrupted run;
its export converts to a directory transformers loads, with our logits."""

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from moe_train.train.checkpoint import consolidated_state_dict, latest_tag
from tests.cli_runner import Ranks
from tests.conftest import ROOT, cli_env, run_cli

CONFIG = str(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml")
STEPS = 8
COMMON = ["optim.zero_stage=3", "data.max_tokens=700", "train.validate_every=0",
          "train.bleu_sentences=4", "train.log_every=1", f"train.max_steps={STEPS}",
          "checkpoint.save_every=2", "checkpoint.keep_last=0", "eval.beam=1",
          "optim.warmup_steps=4", "optim.lr=5e-3"]


def _start(data: tuple[Path, Path], work: Path, *extra: str) -> Ranks:
    prepared, tok = data
    log = work.with_name(work.name + f"-{time.monotonic_ns()}.log")
    work.mkdir(parents=True, exist_ok=True)
    return Ranks(["train", "--config", CONFIG, f"data.prepared_dir={prepared}",
                  f"data.tokenizer={tok}", f"checkpoint.dir={work / 'ckpt'}",
                  f"logging.tensorboard_dir={work / 'tb'}", *COMMON, *extra], ROOT, cli_env(), log)


def _finish(ranks: Ranks, expect_ok: bool = True) -> str:
    return ranks.finish(expect_ok, timeout=500)


def _losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"\| step\s+(\d+) \| loss ([\d.]+)", text)}


@pytest.fixture(scope="module")
def full_run(qwen_prepared, tmp_path_factory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("qwen-z3") / "full"
    return work, _finish(_start(qwen_prepared, work))


def test_zero3_training_loss_falls_and_export_loads_in_transformers(full_run, tmp_path):
    work, text = full_run
    assert "zero 3" in text and "world 2" in text
    losses = _losses(text)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5, losses
    export = work / "ckpt" / "export"
    # streamed under ZeRO-3: a tensor store written one gathered parameter at a time
    assert (export / "model.index.json").is_file() and not (export / "model.safetensors").exists()
    hf_dir = tmp_path / "hf"
    summary = json.loads(run_cli(["convert", "--to-hf", str(export), "--out", str(hf_dir)],
                                 cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert summary["tokenizer"] == ["tokenizer.json", "tokenizer_config.json"]
    transformers = pytest.importorskip("transformers")
    from moe_train.models.hf_io import load_qwen

    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(hf_dir).eval()
    ours, _, _ = load_qwen(export)
    ids = torch.randint(1, 390, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits_BTV, hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    # the export equals the last checkpoint's (gathered) weights
    last = consolidated_state_dict(work / "ckpt" / latest_tag(work / "ckpt"))
    for name, value in ours.state_dict().items():
        assert torch.equal(value, last[name]), name


def test_zero3_sigkill_after_a_step_then_resume_equals_uninterrupted(qwen_prepared, full_run,
                                                                     tmp_path):
    full, _ = full_run
    work = tmp_path / "killed"
    ranks = _start(qwen_prepared, work)
    deadline = time.time() + 500
    while ranks.poll() is None and time.time() < deadline:
        if "| step      5 |" in ranks.log.read_text(errors="replace"):
            ranks.kill()
            break
        time.sleep(0.02)
    _finish(ranks, expect_ok=False)
    assert ranks.returncode == -signal.SIGKILL
    assert latest_tag(work / "ckpt") == "step_00000004"
    text = _finish(_start(qwen_prepared, work, "--resume"))
    assert "resume from step 4" in text
    tag = f"step_{STEPS:08d}"
    a = consolidated_state_dict(full / "ckpt" / tag)
    b = consolidated_state_dict(work / "ckpt" / tag)
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, unequal


def test_zero3_fine_tunes_from_a_hugging_face_directory(qwen_prepared, full_run, tmp_path):
    """`train.init_from` a transformers directory (the full run's export converted): the model
    is built partitioned and filled from the file, and the first step's loss is the trained
    model's, not a fresh one's."""
    full, text = full_run
    hf_dir = tmp_path / "hf"
    run_cli(["convert", "--to-hf", str(full / "ckpt" / "export"), "--out", str(hf_dir)],
            cwd=tmp_path)
    tuned = _finish(_start(qwen_prepared, tmp_path / "tuned", f"train.init_from={hf_dir}",
                           "train.max_steps=2"))
    assert re.search(r"\| init_from .*: 0\.\d\dM weights", tuned), tuned[-2000:]
    scratch, first = _losses(text), _losses(tuned)
    assert sorted(first) == [1, 2]
    assert first[1] < scratch[1] - 0.5, (first, scratch)
