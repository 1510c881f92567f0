"""The stages' probe trainer (MoA's distilled gate, GAD's classifier head) on 1 and 2 gloo ranks:
with a batch the ranks cannot split evenly (7 rows: 4 and 3), two ranks must still train the
model one rank does, and report the same loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from moe_train.parallel.runtime import free_port, shutdown
from tests.distributed.two_ranks import init_launched_rank, spawn_ranks


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x_ND = rng.normal(size=(9, 4)).astype(np.float32)
    x_ND[0] *= 20  # one row with a large gradient: a wrong weighting of the rows shows
    return x_ND, np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])


def _worker(rank: int, port: int, world: int, out: str) -> None:
    from moe_train.stages.probe import fit_probe

    rt = init_launched_rank(rank, port, world)
    torch.manual_seed(0)
    x_ND, y_N = _data()
    module, loss = fit_probe(nn.Linear(4, 3), x_ND, y_N, steps=20, lr=0.1, batch=7, seed=3,
                             rt=rt)
    torch.save({"state": module.state_dict(), "loss": loss}, f"{out}.{world}.{rank}.pt")
    shutdown(rt)


def test_two_ranks_train_the_probe_one_rank_trains(tmp_path) -> None:
    out = str(tmp_path / "probe")
    for world in (1, 2):
        spawn_ranks(_worker, (free_port(), world, out), world)
    one = torch.load(f"{out}.1.0.pt", weights_only=True)
    assert one["loss"] > 0
    for rank in range(2):
        two = torch.load(f"{out}.2.{rank}.pt", weights_only=True)
        for name, value in one["state"].items():
            torch.testing.assert_close(two["state"][name], value, rtol=0, atol=1e-5)
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)  # the whole batches' loss
