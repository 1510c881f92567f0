"""One rank: train a step with the experts frozen (what the adapter stage does to an MoE
backbone), save, resume in a new Trainer; print the expert tensors' max difference as JSON."""

import json
import sys

from moe_train.config import load_config
from moe_train.moe.experts import StackedExperts
from moe_train.parallel.runtime import init_runtime, shutdown
from moe_train.parallel.zero3 import local_values
from moe_train.train.hooks import TrainerHooks
from moe_train.train.trainer import Trainer


class FreezeExperts(TrainerHooks):
    def init_model(self, model):
        for m in model.modules():
            if isinstance(m, StackedExperts):
                m.requires_grad_(False)


def experts(trainer):  # this rank's values (its partition under ZeRO-3)
    return {n: local_values(p).clone() for n, p in trainer.engine.module.named_parameters()
            if ".experts." in n}


config, *overrides = sys.argv[1:]
rt = init_runtime()
first = Trainer(load_config(config, overrides), rt, hooks=[FreezeExperts()])
before = experts(first)
first.fit()
after = experts(first)
again = Trainer(load_config(config, [*overrides, "train.max_steps=2"]), rt, resume=True,
                hooks=[FreezeExperts()])
loaded = experts(again)
print(json.dumps({"trained": max((after[n] - before[n]).abs().max().item() for n in after),
                  "resumed": max((loaded[n] - after[n]).abs().max().item() for n in after),
                  "step": again.step}))
shutdown(rt)
