"""A 2-rank gloo data-parallel step equals one rank on the same global batch.

Both runs go through the real `Trainer.train_step` (tests/distributed/dp_worker.py).

The one-rank run accumulates the two micro-batches the two ranks process (grad_accum=2); the
batch iterator gives both runs the same global group, and the loss is normalised by the step's
global target tokens, so gradients and updates must agree to float precision.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cli_env, debug_overrides

WORKER = Path(__file__).with_name("dp_worker.py")


def _launch(world: int, out: Path, overrides: list[str]) -> None:
    from moe_train.parallel.runtime import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        env = cli_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(ROOT / "configs" / "debug-cpu.yaml"), str(out), "3",
             *overrides], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-4000:]


def _slice(ref: torch.Tensor, name: str, got: dict) -> torch.Tensor:
    """The part of an EP=1 tensor that an EP rank holds (stacked experts are sliced on dim 0)."""
    if got["ep_size"] > 1 and ".experts." in name:
        n = ref.size(0) // got["ep_size"]
        return ref[got["ep_rank"] * n:(got["ep_rank"] + 1) * n]
    return ref


@pytest.mark.parametrize("variant", ["zero0", "zero1", "moe_ep2"])
def test_two_ranks_equal_one_rank(tiny_prepared, tmp_path, variant):
    zero_stage = 1 if variant == "zero1" else 0
    common = ["model.dropout=0.0", "optim.warmup_steps=1", "optim.lr=1e-3",
              f"optim.zero_stage={zero_stage}", "data.max_tokens=300", "train.progress_bar=false",
              "optim.clip_norm=0.5",
              # Adam divides by sqrt(v) + eps: with eps 1e-9, parameters whose gradient is zero
              # in exact arithmetic (attention key biases) turn rounding noise (~1e-9, which
              # differs with the summation order of the all-to-all) into full-size updates
              "optim.eps=1e-5"]
    one_extra, two_extra = [], []
    if variant == "moe_ep2":
        common += ["moe.num_experts=4", "moe.k=2"]
        one_extra, two_extra = ["moe.ep_size=1"], ["moe.ep_size=2"]
    one = tmp_path / "one"
    two = tmp_path / "two"
    _launch(1, one, debug_overrides(tiny_prepared, tmp_path / "w1", *common,
                                     "optim.grad_accum=2", *one_extra))
    _launch(2, two, debug_overrides(tiny_prepared, tmp_path / "w2", *common,
                                     "optim.grad_accum=1", *two_extra))
    ref = torch.load(f"{one}.rank0.pt")
    if zero_stage == 0:  # gradients large enough that the 1e-6 tolerance is a real check
        assert max(g.abs().max().item() for g in ref["grads"].values()) > 1e-2
    for rank in range(2):
        got = torch.load(f"{two}.rank{rank}.pt")
        if zero_stage == 0:  # ZeRO 1 keeps reduced gradients in its own partitions
            assert ref["grads"].keys() == got["grads"].keys()
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], _slice(g, name, got), rtol=0,
                                           atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # the clipping norm counts every expert once: equal to the one-rank norm (ZeRO 1: the
        # exact norm of DeepSpeed's gradient partitions)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
        assert ref["norms"][0] > 0.5  # so clipping was active
        assert got["nonfinite"] == ref["nonfinite"] == [0.0] * 3 and got["step"] == 3
        for step, params in enumerate(ref["params"]):
            for name, p in params.items():
                torch.testing.assert_close(got["params"][step][name], _slice(p, name, got),
                                           rtol=0, atol=1e-6,
                                           msg=lambda m, n=name, s=step: f"step {s + 1} {n}: {m}")
    # the run really trained: parameters moved by much more than the tolerance
    first = ref["params"][0]
    last = ref["params"][-1]
    assert max((last[n] - first[n]).abs().max().item() for n in first) > 1e-3
