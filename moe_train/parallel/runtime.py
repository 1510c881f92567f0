"""Process-group runtime: discovering ranks, initialising torch.distributed through DeepSpeed.

Launch modes, all ending in the same `ParallelRuntime`:
- `deepspeed` launcher or `torchrun`: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* are in the env.
- `mpirun` (OpenMPI, MPICH, Intel MPI): ranks come from mpi4py; rank 0's host and a free port are
  broadcast so every rank rendezvouses on them.
- No launcher: one process, world size 1, on a free local port (the debug mode CI runs).

The runtime object is the one container of process-group state: pass it down, never store it in a
module global.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_train.utils.malloc import tune_cpu_allocator

_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launched_by_mpi() -> bool:
    return "RANK" not in os.environ and any(v in os.environ for v in _MPI_SIZE_VARS)


def _mpi_discovery() -> None:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from mpi4py."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    master = (socket.gethostname(), free_port()) if rank == 0 else None
    master_addr, master_port = comm.bcast(master, root=0)
    hosts = comm.allgather(MPI.Get_processor_name())
    local_rank = sum(h == hosts[rank] for h in hosts[:rank])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(hosts.count(hosts[rank])))
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))


def _single_process_env() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


@dataclass
class ParallelRuntime:
    """Where this process sits in the job, and the process groups it uses."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    launcher: str = "none"
    """How ranks were discovered: env (deepspeed / torchrun), mpi, single, or none (no dist)."""
    dp_group: Any = None
    """Data-parallel group (None: the world group)."""
    ep_size: int = 1
    """Expert-parallel degree (moe.ep_size)."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group."""
    ep_group: Any = None
    """Ranks that split the experts of a layer among them (None when ep_size is 1)."""
    edp_group: Any = None
    """Ranks that hold the same experts (expert-data-parallel group)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend != "none"

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_world(self) -> int:
        return self.world_size


def init_runtime(backend: str | None = None, timeout_s: int = 1800,
                 tune_allocator: bool = True) -> ParallelRuntime:
    """Discover the launch mode, initialise torch.distributed via DeepSpeed, pick the device.

    On CPU, `tune_allocator` applies `moe_train.utils.malloc.tune_cpu_allocator` (glibc keeps
    large freed blocks for reuse instead of mapping and zeroing them anew every step); pass
    False to keep the C library's defaults.
    """
    import deepspeed
    import torch.distributed as dist

    if _launched_by_mpi():
        _mpi_discovery()
        launcher = "mpi"
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launcher = "env"
    else:
        _single_process_env()
        launcher = "single"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    if "OMP_NUM_THREADS" not in os.environ:  # share the CPU cores among the ranks of a node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = backend or "nccl"
    else:
        device = torch.device("cpu")
        backend = backend or "gloo"
        if tune_allocator:
            tune_cpu_allocator()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelRuntime(rank=rank, world_size=world, local_rank=local_rank, backend=backend,
                           device=device, launcher=launcher)


def shutdown(runtime: ParallelRuntime) -> None:
    """Tear down the process group (safe to call when nothing was initialised)."""
    import torch.distributed as dist

    if runtime.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
