"""EP=2 all-to-all bytes of our MoE layer, for benchmarks/moe_layer.py (the `ep2` field).

Two gloo ranks (torch.multiprocessing) each build the same-seeded layer, wire it with
`wire_expert_parallel` (experts split 50/50, `AllToAllDispatcher`) and run fwd + bwd on their
own tokens, with torch.distributed inside moe_train.parallel.expert_parallel wrapped so that
every all_to_all_single logs what it sends; the total is compared with the minimum
(benchmarks/README.md, `ep2`).

Shape legend: T tokens, K slots per token, E experts, D model dim.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moe_train.models.context import ForwardContext
from moe_train.parallel.runtime import free_port, init_runtime, shutdown

Build = Callable[[int, int, Any], nn.Module]


class CountingDist:
    """Stands in for torch.distributed inside moe_train.parallel.expert_parallel and logs what
    each all_to_all_single sends: bytes to the other ranks, and in total (self included)."""

    def __init__(self, real: Any, rank: int, world: int) -> None:
        self.real, self.rank, self.world = real, rank, world
        self.phase = "forward"
        self.log: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        splits = list(input_split_sizes or [input.size(0) // self.world] * self.world)
        row_bytes = input[0].numel() * input.element_size() if input.size(0) else 0
        self.log.append({"phase": self.phase,
                         "kind": "tokens" if input.is_floating_point() else "counts",
                         "bytes_remote": (sum(splits) - splits[self.rank]) * row_bytes,
                         "bytes_total": sum(splits) * row_bytes})
        return self.real.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                           group=group, async_op=async_op)


def ep_worker(rank: int, port: int, build: Build, E: int, k: int, shape: Any, out_dir: str
              ) -> None:
    """One of two EP ranks: wire our layer, run fwd + bwd on this rank's tokens, log bytes."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import moe_train.parallel.expert_parallel as ep
    rt = ep.setup_expert_parallel(init_runtime(), 2)
    layer = build(E, k, shape)  # the same seed on both ranks: one global initialisation
    assert ep.wire_expert_parallel(nn.ModuleList([layer]), rt) == 1
    counter = ep.dist = CountingDist(ep.dist, rt.ep_rank, 2)
    seen: dict[str, Any] = {}
    layer.router.register_forward_hook(lambda m, i, out: seen.update(routing=out))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, shape.T_ep, shape.D, generator=gen, requires_grad=True)
    y, aux = layer(x, ForwardContext())
    counter.phase = "backward"
    torch.autograd.backward([y, sum(aux.values())], [torch.randn_like(y), torch.ones(())])
    ids_TK = seen["routing"].expert_ids_TK
    remote_TK = (ids_TK >= 0) & (ids_TK // (E // 2) != rt.ep_rank)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({
        "log": counter.log, "remote_rows": int(remote_TK.sum()),
        "remote_tokens": int(remote_TK.any(1).sum()),  # P=2: a single remote rank
        "row_bytes": shape.D * x.element_size(), "dropped_slots": int(layer.dropped_slots)}))
    ep.dist = counter.real
    shutdown(rt)


def ep_bytes(build: Build, E: int, k: int, shape: Any) -> dict[str, Any]:
    """Bytes the all-to-alls of one EP=2 fwd+bwd step send between ranks, vs. the minimum;
    `build(E, k, shape)` makes our layer (with a fixed seed), `shape` has T_ep and D."""
    import torch.multiprocessing as mp
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # byte counts do not depend on the device: the
    try:  # two ranks run on CPU (gloo), also where one GPU could not hold two NCCL ranks
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(ep_worker, args=(free_port(), build, E, k, shape, tmp), nprocs=2,
                     join=True)
            ranks = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    finally:
        if hidden is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    log = [entry for r in ranks for entry in r["log"]]
    sent = sum(e["bytes_remote"] for e in log)
    by_kind = {f"{p}_{kind}_bytes": sum(e["bytes_remote"] for e in log
                                        if e["phase"] == p and e["kind"] == kind)
               for p in ("forward", "backward") for kind in ("tokens", "counts")}
    minimum = sum(4 * r["remote_rows"] * r["row_bytes"] for r in ranks)
    minimum_dedup = sum(4 * r["remote_tokens"] * r["row_bytes"] for r in ranks)
    return {"ranks_on": "cpu (gloo)", "tokens_per_rank": shape.T_ep, "element_bytes": ranks[0]["row_bytes"] // shape.D,
            "calls": len(log),
            "bytes_sent_remote": sent, **by_kind,
            "bytes_incl_self": sum(e["bytes_total"] for e in log),
            "min_bytes_routed_rows": minimum, "ratio_to_min": round(sent / minimum, 4),
            "min_bytes_unique_tokens": minimum_dedup,
            "ratio_to_unique_min": round(sent / minimum_dedup, 4),
            "dropped_slots": sum(r["dropped_slots"] for r in ranks)}
