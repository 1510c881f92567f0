"""EP=2 decoding of the token-level MoE for benchmarks/decode_throughput.py (the `ep2` field):
the share of decode time spent in the all-to-alls (seed 002 Sec. 4.3.3: 36% for token-level
MoE on TPUs, 0.2% for task-level).

Two gloo ranks (torch.multiprocessing, one thread each) build the same-seeded model, shard its
experts with `wire_expert_parallel` and decode their own sentences greedily in lockstep, with
torch.distributed inside moe_train.parallel.expert_parallel wrapped so that every
all_to_all_single is timed. The share is all-to-all seconds over decode seconds, per rank.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moe_train.parallel.runtime import free_port, init_runtime, shutdown


class TimingDist:
    """Stands in for torch.distributed inside moe_train.parallel.expert_parallel and adds up
    the wall time of every all_to_all_single."""

    def __init__(self, real: Any) -> None:
        self.real, self.seconds, self.calls = real, 0.0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.real.all_to_all_single(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def _worker(rank: int, port: int, s: dict[str, Any], overrides: list[str], sources: Callable,
            decode: Callable, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import moe_train.parallel.expert_parallel as ep
    from moe_train.config import load_config
    from moe_train.models.build import build_model
    from moe_train.parallel.collectives import all_ranks_true

    rt = ep.setup_expert_parallel(init_runtime(), 2)
    cfg = load_config(None, overrides)
    torch.manual_seed(0)  # the same global initialisation on both ranks
    model = build_model(cfg, {"vocab_size": s["V"], "pad_id": 0, "langs": ["en"]}).eval()
    assert ep.wire_expert_parallel(model, rt) > 0
    B = s["batches"][-1] // 2 or 1
    src_BS, ctx = sources(s, B, seed=100 + rank)
    sync = lambda done: all_ranks_true(rt, done)  # noqa: E731
    from moe_train.eval.search import greedy_search

    def run() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            greedy_search(model, src_BS, bos_id=1, eos_id=2, pad_id=0, max_len_a=0.0,
                          max_len_b=s["L"], ctx=ctx, sync_done=sync, min_len=s["L"])
        return time.perf_counter() - start

    run()  # warm-up
    torch.distributed.barrier()  # start together: one rank's head start is no all-to-all time
    timing = ep.dist = TimingDist(ep.dist)
    total = run()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(
        {"decode_s": total, "all_to_all_s": timing.seconds, "calls": timing.calls,
         "sentences": B}))
    ep.dist = timing.real
    shutdown(rt)


def ep_decode_share(s: dict[str, Any], overrides: list[str], sources: Callable,
                    decode: Callable) -> dict[str, Any]:
    """All-to-all share of greedy decode time of the model `overrides` describe, EP=2."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(free_port(), s, overrides, sources, decode, tmp), nprocs=2,
                 join=True)
        ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    return {"sentences_per_rank": ranks[0]["sentences"], "tokens_per_sentence": s["L"],
            "threads_per_rank": 1, "ranks": ranks,
            "all_to_all_share": round(sum(r["all_to_all_s"] for r in ranks)
                                      / sum(r["decode_s"] for r in ranks), 4)}
