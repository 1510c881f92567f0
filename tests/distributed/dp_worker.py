"""Worker for the data-parallel equivalence test (run as a subprocess, one per rank).

Trains `steps` optimizer steps through the real `Trainer.train_step` and saves, per rank, the
reduced gradients of step 1 (observed when train_step asks for the gradient norm: after the
accumulation-boundary backward, before clipping and the optimizer step), the global gradient norm
of every step (`trainer.last_grad_norm`), and the parameters after every step.
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
    module = trainer.engine.module
    rt = trainer.rt  # with its expert-parallel groups
    record = {"grads": None, "params": [], "norms": [], "nonfinite": [], "ep_rank": rt.ep_rank,
              "ep_size": rt.ep_size}
    norm = trainer._grad_norm

    def observe_then_norm():
        if record["grads"] is None:
            record["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters()
                               if p.grad is not None}
        return norm()

    trainer._grad_norm = observe_then_norm  # an observer; train_step itself is unchanged
    for _ in range(int(steps)):
        sums = trainer.train_step()
        record["nonfinite"].append(sums["nonfinite"])
        record["norms"].append(trainer.last_grad_norm)
        record["params"].append({n: p.detach().clone() for n, p in module.named_parameters()})
    record["step"] = trainer.step
    torch.save(record, f"{out}.rank{rt.rank}.pt")
    shutdown(rt)


if __name__ == "__main__":
    main(*sys.argv[1:])
