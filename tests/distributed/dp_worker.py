"""Worker for the data-parallel equivalence test (run as a subprocess, one per rank).

Trains `steps` optimizer steps with the real Trainer and saves, per rank, the reduced gradients
of step 1 (read after the accumulation-boundary backward, before clipping and the optimizer
step), the global gradient norm of every step, and the parameters after every step.
"""

import sys

import torch

from moe_train.config import load_config
from moe_train.parallel.runtime import init_runtime, shutdown
from moe_train.train.trainer import Trainer


def main(config: str, out: str, steps: int, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    rt = init_runtime()
    trainer = Trainer(cfg, rt)
    engine = trainer.engine
    rt = trainer.rt  # with its expert-parallel groups
    record = {"grads": None, "params": [], "norms": [], "ep_rank": rt.ep_rank,
              "ep_size": rt.ep_size}
    for step in range(int(steps)):
        micro = next(trainer.batches)
        for i, batch in enumerate(micro):
            scaled, _, _ = trainer._forward_loss(batch.to(rt.device))
            engine.backward(scaled)
            if i == len(micro) - 1:
                if step == 0:
                    record["grads"] = {n: p.grad.detach().clone()
                                       for n, p in engine.module.named_parameters()
                                       if p.grad is not None}
                trainer._clip_gradients()
                record["norms"].append(trainer.last_grad_norm)
            engine.step()
        record["params"].append({n: p.detach().clone()
                                 for n, p in engine.module.named_parameters()})
    torch.save(record, f"{out}.rank{rt.rank}.pt")
    shutdown(rt)


if __name__ == "__main__":
    main(*sys.argv[1:])
