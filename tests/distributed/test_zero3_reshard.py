"""A ZeRO-3 checkpoint resumes at another world size (2 -> 1 -> 2 gloo ranks) without DeepSpeed's
module-only load, which unpickled every rank's optimizer file (its zero_to_fp32) and wanted a
model-states file per rank of the new world (a grown world crashed). Frozen parameters (an
adapter stage's backbone) are kept in the step directory, so it also loads for translate /
evaluate (their ZeRO-3 model states hold empty placeholders)."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_train.parallel.runtime import free_port, shutdown
from tests.conftest import ROOT
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks

FROZEN = "encoder_layers."


def _cfg(prepared: str, work: str, steps: int):
    from moe_train.config import load_config

    return load_config(ROOT / "configs" / "debug-cpu.yaml", [
        f"data.prepared_dir={prepared}", f"checkpoint.dir={work}/ckpt", "optim.zero_stage=3",
        "deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
        f"train.max_steps={steps}", "checkpoint.save_every=1", "checkpoint.keep_last=5",
        "train.validate_every=0",
        "train.bleu_sentences=2", "eval.beam=1", "data.max_tokens=300", "optim.lr=0.02",
        "optim.warmup_steps=1", "logging.tensorboard_dir=", "train.progress_bar=false"])


def _train(rt, prepared: str, work: str, steps: int, resume: bool) -> None:
    from moe_train.train.hooks import TrainerHooks
    from moe_train.train.trainer import Trainer

    class Freeze(TrainerHooks):
        def init_model(self, model):
            for name, p in model.named_parameters():
                if name.startswith(FROZEN):
                    p.requires_grad_(False)

    real_load = torch.load

    def weights_only_load(*args, **kwargs):  # nothing of ours is ever unpickled
        assert kwargs.get("weights_only") is True, (args, kwargs)
        return real_load(*args, **kwargs)

    torch.load = weights_only_load
    try:
        Trainer(_cfg(prepared, work, steps), rt, resume=resume, hooks=[Freeze()]).fit()
    finally:
        torch.load = real_load


def _worker(rank: int, port: int, world: int, prepared: str, work: str, steps: int,
            resume: bool) -> None:
    rt = init_launched_rank(rank, port, world)
    _train(rt, prepared, work, steps, resume)
    shutdown(rt)


def _ranks(world: int, *args) -> None:
    spawn_ranks(_worker, (free_port(), world, *args), world)


def _copy_step(src: Path, dst: Path, step: int) -> None:
    import shutil

    tag = f"step_{step:08d}"
    (dst / "ckpt").mkdir(parents=True)
    shutil.copytree(src / "ckpt" / tag, dst / "ckpt" / tag)
    (dst / "ckpt" / "latest").write_text(tag + "\n")


def test_zero3_resumes_at_another_world_size_with_frozen_parameters(tiny_prepared, tmp_path):
    from moe_train.train.checkpoint import consolidated_state_dict
    from moe_train.train.export import load_export_weights, load_for_inference

    prepared = str(tiny_prepared)
    _ranks(2, prepared, str(tmp_path / "w2"), 3, False)  # 3 steps on 2 ranks
    step3 = tmp_path / "w2" / "ckpt" / "step_00000003"
    saved = consolidated_state_dict(step3)
    export = load_export_weights(tmp_path / "w2" / "ckpt" / "export")
    assert saved.keys() == export.keys()
    assert all(torch.equal(saved[k], export[k]) for k in saved)  # frozen ones too, whole
    load_for_inference(step3)  # a step directory translates

    _copy_step(tmp_path / "w2", tmp_path / "w1", 3)  # 2 -> 1: one more step
    _ranks(1, prepared, str(tmp_path / "w1"), 4, True)
    step4 = consolidated_state_dict(tmp_path / "w1" / "ckpt" / "step_00000004")
    _copy_step(tmp_path / "w1", tmp_path / "w2b", 4)  # 1 -> 2: one more step
    _ranks(2, prepared, str(tmp_path / "w2b"), 5, True)
    step5 = consolidated_state_dict(tmp_path / "w2b" / "ckpt" / "step_00000005")

    start = consolidated_state_dict(tmp_path / "w2" / "ckpt" / "step_00000001")
    for name, value in saved.items():
        if name.startswith(FROZEN):  # restored exactly, never moved
            assert torch.equal(step4[name], value) and torch.equal(step5[name], value), name
    trained = [k for k in saved if not k.startswith(FROZEN) and saved[k].is_floating_point()]
    travelled = max((saved[k] - start[k]).abs().max().item() for k in trained)
    after = max(max((step4[k] - saved[k]).abs().max().item(),
                    (step5[k] - step4[k]).abs().max().item()) for k in trained)
    # each resumed step starts from the saved weights (an unloaded model would start from
    # its initialisation, as far from them as the two steps that moved them)
    assert after < 0.8 * travelled, (after, travelled)

