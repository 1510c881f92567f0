"""Worker: resume a Trainer from a checkpoint (at any ep size) and save its logits on a fixed batch.

Usage (one process per rank): ep_outputs_worker.py CONFIG OUT [a.b=value ...]
"""

import sys

import torch

from moe_train.config import load_config
from moe_train.data.batching import eval_batches
from moe_train.eval.decode import batch_context
from moe_train.parallel.runtime import init_runtime, shutdown
from moe_train.train.trainer import Trainer


def main(config: str, out: str, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    rt = init_runtime()
    trainer = Trainer(cfg, rt, resume=True)
    model = trainer.engine.module.eval()
    vocab = trainer.vocab
    batch = eval_batches(trainer.dev_set, 400, vocab.pad_id, vocab.bos_id, vocab.eos_id)[0]
    ctx = batch_context(batch, vocab.pad_id, len(trainer.manifest["langs"]))
    with torch.no_grad():
        logits = model(batch.src_tokens_BS, batch.tgt_in_BT, ctx).logits_BTV
    if rt.is_main:
        torch.save({"logits": logits, "step": trainer.step, "src": batch.src_tokens_BS,
                    "tgt_in": batch.tgt_in_BT}, out)
    shutdown(rt)


if __name__ == "__main__":
    main(*sys.argv[1:])
