"""Two spawned gloo ranks with an expert-parallel group of both (ep_size 2), for EP tests.

Ranks start from a fork server that has imported torch and deepspeed once per test process
(`spawn_ranks`, `spawn_two`), instead of a fresh interpreter each (3-5 s of CPU a rank).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_train.parallel.runtime import ParallelRuntime, free_port

multiprocessing.set_forkserver_preload(["torch", "deepspeed"])


def spawn_ranks(worker: Callable, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(worker, args, nprocs)` from the fork server."""
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def init_ep2(rank: int, port: int) -> ParallelRuntime:
    """Inside a worker: join the 2-rank gloo group; one thread per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    return ParallelRuntime(rank=rank, world_size=2, backend="gloo", ep_size=2, ep_rank=rank,
                           ep_group=dist.new_group([0, 1]))


def spawn_two(worker: Callable[[int, int, str], None], out: str, timeout: float,
              what: str) -> None:
    """Run worker(rank, port, out) on ranks 0 and 1; fail on a hang (`what` deadlocked) or a
    non-zero exit."""
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{what} deadlocked"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def init_launched_rank(rank: int, port: int, world: int):
    """Inside an `mp.spawn` worker: the environment a launcher gives rank `rank` of `world`,
    one torch thread, DeepSpeed's warnings only; returns `init_runtime()`'s runtime."""
    import logging

    from moe_train.parallel.runtime import init_runtime

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return init_runtime()
