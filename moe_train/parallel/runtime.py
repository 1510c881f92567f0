"""Process-group runtime: discovering ranks, initialising torch.distributed through DeepSpeed.

`detect_launch(env)` is the one place that reads a launcher's environment (a pure function, tested
over fake environments). Launch modes, all ending in the same `ParallelRuntime`:
- `deepspeed` launcher, `torchrun`: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* are in the env.
- `mpirun` of Open MPI (OMPI_COMM_WORLD_*), MPICH or Intel MPI (PMI_RANK / PMI_SIZE, Hydra's
  MPI_LOCALRANKID / MPI_LOCALNRANKS), PMIx (PMIX_RANK; the size from the launcher's own variables).
  The rendezvous is rank 0's (its MASTER_ADDR / MASTER_PORT, else its host and a free port),
  broadcast through mpi4py: mpirun passes its environment to the ranks of its own node only.
- `srun` without a launcher: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; the master is the first
  host of the step's node list, the port `slurm_port(job, step)` (as launch/slurm.sbatch).
- No launcher: one process, world size 1, on a free local port (the debug mode CI runs).

The runtime object is the one container of process-group state: pass it down, never store it in a
module global.
"""

from __future__ import annotations

import datetime
import importlib
import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moe_train.errors import ConfigError
from moe_train.utils.malloc import tune_cpu_allocator

LAUNCH_FAMILIES = {"deepspeed": "env", "torchrun": "env", "env": "env", "openmpi": "mpi",
                   "mpich": "mpi", "pmix": "mpi", "slurm": "slurm", "single": "single"}


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low(path: str = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel hands to outgoing connections (IANA's 49152 where unknown)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))  # every address: the rendezvous store listens on all of them
        except OSError:
            return False
    return True


PORT_RANGE_ENV = "MOE_TRAIN_PORT_RANGE"


def port_range(env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """The ports [lo, hi] rendezvous ports are picked from when MOE_TRAIN_PORT_RANGE="LO-HI"
    is set (a firewall's open range; jobs started side by side given disjoint ones never pick
    the same port), else None."""
    text = env.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    if sep and lo.strip().isdigit() and hi.strip().isdigit() and \
            1024 <= int(lo) <= int(hi) <= 65535:
        return int(lo), int(hi)
    raise ConfigError(f"{PORT_RANGE_ENV}={text!r}: expected LO-HI, two port numbers with "
                      f"1024 <= LO <= HI <= 65535")


def free_port(ephemeral_low: int | None = None) -> int:
    """A TCP port that is free on this host right now: from MOE_TRAIN_PORT_RANGE when set,
    else below the kernel's ephemeral range.

    A port from bind(0) lies inside that range, so any outgoing connection (another job's gloo
    mesh, say) may be given it before the launcher's rank 0 listens on it seconds later: seen as
    EADDRINUSE. Ports below the range are only ever taken by an explicit bind.
    """
    low = _ephemeral_low() if ephemeral_low is None else ephemeral_low
    chosen = port_range()
    span = chosen or ((max(1024, low - 8192), low - 1) if low > 4096 else None)
    if span is not None:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randint(*span)
            if _bindable(port):
                return port
    if chosen is not None:
        raise ConfigError(f"{PORT_RANGE_ENV}={chosen[0]}-{chosen[1]}: no free port found there "
                          f"(64 tries); expected a range with ports nothing else holds")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchInfo:
    """Where a process sits in its job, as its launcher's environment says."""

    kind: str
    """deepspeed, torchrun, env (RANK/WORLD_SIZE set otherwise), openmpi, mpich, pmix, slurm,
    single."""
    rank: int
    world_size: int | None
    """None: the environment does not say (PMIx alone); MPI is asked at start-up."""
    local_rank: int | None
    """None: an MPI environment that does not say; counted per host through MPI at start-up."""
    local_world_size: int | None
    master_addr: str | None = None
    """Rendezvous host; None under mpirun (rank 0's, through mpi4py)."""
    master_port: int | None = None

    @property
    def family(self) -> str:
        """env (deepspeed / torchrun), mpi, slurm or single: what the training log shows."""
        return LAUNCH_FAMILIES[self.kind]

    @property
    def multi_process(self) -> bool:
        """More than one rank (or not known without asking MPI)."""
        return self.world_size is None or self.world_size > 1

    @property
    def needs_mpi(self) -> bool:
        """Something only MPI can tell: the size, local rank or the rendezvous address."""
        if self.family != "mpi":
            return False
        return (self.world_size is None or self.local_rank is None
                or (self.multi_process and (self.master_addr is None or self.master_port is None)))


SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 12000
"""`slurm_port`'s range, 20000-31999: below Linux's default ephemeral ports (32768-60999),
which an outgoing connection may be given before rank 0 listens."""


def slurm_port(job: int, step: int = 0) -> int:
    """The rendezvous port every rank of SLURM job `job`, step `step` derives alike: steps of
    one job (`srun ... &` side by side) get different ports, and so do the first steps of any
    12000 consecutive job ids (7919 is prime to the span; `job * 100` repeated every 120 ids, so
    two jobs sharing a first node met on one port). launch/slurm.sbatch uses step 0's."""
    return SLURM_PORT_BASE + (job * 7919 + step) % SLURM_PORT_SPAN


SIZE_VARS = {"deepspeed": "WORLD_SIZE", "torchrun": "WORLD_SIZE", "env": "WORLD_SIZE",
             "openmpi": "OMPI_COMM_WORLD_SIZE", "mpich": "PMI_SIZE",
             "pmix": "SLURM_STEP_NUM_TASKS", "slurm": "SLURM_STEP_NUM_TASKS"}
"""The variable a launcher's world size comes from (error messages)."""


def _int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of `names` set in `env`, as an integer (None when none is set)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={env[name]!r}: expected an "
                                  "integer (set by the launcher)") from None
    return None


def parse_first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: `node[03-05,9],gpu1` -> `node03`, `a,b` -> `a`,
    `rack[1-2]-node[01-04]` -> `rack1-node01` (each bracket gives its first value)."""
    first, depth = "", 0
    for char in nodelist.strip():  # the first element: up to a comma outside brackets
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            break
        first += char
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1), maxsplit=1)[0],
                  first)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (`scontrol show hostnames` if there, else parsed)."""
    if shutil.which("scontrol"):
        try:
            proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                  text=True, timeout=30)
            if proc.returncode == 0 and proc.stdout.split():
                return proc.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return parse_first_host(nodelist)


def _tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node `node` from SLURM's `2(x3),1` form (None when it does not parse)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """Started by `srun` (a job step), not the batch script (which has SLURM_PROCID=0 too)."""
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def detect_launch(env: Mapping[str, str],
                  resolve_host: Callable[[str], str] = first_host) -> LaunchInfo:
    """Which launcher started this process, and this process's rank, world and local rank/world.

    Checked in order: RANK + WORLD_SIZE (deepspeed, torchrun), Open MPI, MPICH / Intel MPI (PMI),
    PMIx, a SLURM step, else one process. `resolve_host` turns a SLURM node list into its first
    host (injectable so that tests need no SLURM).
    """
    in_step = _in_slurm_step(env)
    slurm_local = _int(env, "SLURM_LOCALID") if in_step else None
    slurm_world = (_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
                   if in_step else None)
    if "RANK" in env and "WORLD_SIZE" in env:
        if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
            kind = "torchrun"
        elif "CROSS_RANK" in env or "LOCAL_SIZE" in env:
            kind = "deepspeed"
        else:
            kind = "env"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK")  # None: SLURM's, below, or 0
        local_world = _int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    elif "OMPI_COMM_WORLD_SIZE" in env:
        kind = "openmpi"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH / Intel MPI (Hydra), srun --mpi=pmi2
        kind = "mpich"
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID")
        local = slurm_local if local is None else local
        local_world = _int(env, "MPI_LOCALNRANKS")
    elif "PMIX_RANK" in env:
        # PMIx puts no size in the environment (a client asks PMIx_Get(PMIX_JOB_SIZE)): under
        # srun --mpi=pmix (its namespace slurm.pmix.JOB.STEP) it is the step's task count;
        # otherwise (prterun, mpirun in a batch script: the step's tasks are its daemons) MPI
        # is asked.
        kind = "pmix"
        by_srun = env.get("PMIX_NAMESPACE", "").startswith("slurm.pmix.")
        rank, local_world = _int(env, "PMIX_RANK"), None
        world, local = (slurm_world, slurm_local) if by_srun else (None, None)
    elif in_step:
        kind = "slurm"
        rank, world, local_world = _int(env, "SLURM_PROCID"), slurm_world or 1, None
        local = slurm_local or 0
    else:
        half = [name for name in ("RANK", "WORLD_SIZE") if name in env]
        if half:  # RANK=1 alone would train as a job of its own, into the same directory
            other = ({"RANK", "WORLD_SIZE"} - set(half)).pop()
            raise ConfigError(f"launcher environment: {half[0]}={env[half[0]]!r} is set but "
                              f"{other} is not; expected both (as torchrun and deepspeed set "
                              "them) or neither")
        return LaunchInfo("single", 0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1",
                          _port(env))
    if rank is None:
        raise ConfigError(f"launcher environment ({kind}): no rank variable set")
    if world is not None and world < 1:
        raise ConfigError(f"launcher environment ({kind}): {SIZE_VARS[kind]}={world}; expected "
                          "the number of ranks, at least 1")
    # srun started the ranks themselves (one per task), not a launcher inside one step (mpirun
    # from the batch script starts its daemons by srun on the other nodes only, so there the
    # step's variables describe the daemons: every rank must then ask MPI alike)
    srun_ranks = in_step and (kind == "slurm" or (
        slurm_world == world and _int(env, "SLURM_PROCID") == rank))
    if kind == "env" and local is None:  # srun with hand-set RANK / WORLD_SIZE: SLURM's
        local = slurm_local if srun_ranks and slurm_local is not None else 0
    if srun_ranks and local_world is None and kind in ("mpich", "pmix", "slurm", "env"):
        local_world = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE",
                                             env.get("SLURM_TASKS_PER_NODE", "")),
                                     _int(env, "SLURM_NODEID") or 0)
    if world is not None and not 0 <= rank < world:
        raise ConfigError(f"launcher environment ({kind}): rank {rank} outside world size {world}")
    if local is not None and local_world is not None and not 0 <= local < local_world:
        raise ConfigError(f"launcher environment ({kind}): local rank {local} outside the "
                          f"{local_world} ranks of this node (LOCAL_RANK / its launcher's)")
    if local is not None and local < 0:
        raise ConfigError(f"launcher environment ({kind}): local rank {local}; expected >= 0")
    addr, port = env.get("MASTER_ADDR") or None, _port(env)
    if world == 1:  # one process: a local free port, whatever the launcher
        return LaunchInfo(kind, 0, 1, 0, 1, addr or "127.0.0.1", port)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if srun_ranks and nodelist:  # every rank derives the same rendezvous, no MPI needed
        addr = addr or resolve_host(nodelist)
        job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
        if port is None and job is not None:
            port = slurm_port(job, _int(env, "SLURM_STEP_ID", "SLURM_STEPID") or 0)
    elif LAUNCH_FAMILIES[kind] == "mpi":  # each rank's environment may differ: rank 0's, by MPI
        addr = port = None
    if port is None and LAUNCH_FAMILIES[kind] != "mpi":  # each rank would pick its own port
        raise ConfigError(f"launcher environment ({kind}): {world or 'several'} ranks but "
                          "MASTER_PORT is not set; expected the rendezvous port every rank "
                          "shares (MASTER_ADDR / MASTER_PORT, as torchrun and deepspeed set)")
    return LaunchInfo(kind, rank, world, local, local_world, addr, port)


def _port(env: Mapping[str, str]) -> int | None:
    """MASTER_PORT (0 or unset: None), checked to be a TCP port."""
    port = _int(env, "MASTER_PORT")
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={port}: expected a TCP port, "
                          "1-65535")
    return port or None


def _mpi_complete(info: LaunchInfo) -> LaunchInfo:
    """Ask MPI (mpi4py) what the environment did not say: size, local rank, rendezvous."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(MPI.Get_processor_name())
    # rank 0's MASTER_* (mpirun gives its environment to its own node's ranks only), else its
    # host and a free port: one rendezvous for all
    mine = (os.environ.get("MASTER_ADDR") or socket.gethostname(),
            _port(os.environ) or free_port()) if rank == 0 else None
    addr, port = comm.bcast(mine, root=0)
    return replace(info, rank=rank, world_size=world,
                   local_rank=sum(h == hosts[rank] for h in hosts[:rank]),
                   local_world_size=hosts.count(hosts[rank]), master_addr=addr, master_port=port)


@dataclass
class ParallelRuntime:
    """Where this process sits in the job, and the process groups it uses."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    launcher: str = "none"
    """How ranks were discovered (`LaunchInfo.family`): env (deepspeed / torchrun), mpi, slurm,
    single, or none (no process group)."""
    launch_kind: str = "none"
    """The launcher itself (`LaunchInfo.kind`): deepspeed, torchrun, openmpi, mpich, pmix, ..."""
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

    info = detect_launch(os.environ)
    if info.needs_mpi:
        info = _mpi_complete(info)
    rank, world, local_rank = info.rank, int(info.world_size), int(info.local_rank)
    local_world = info.local_world_size or 1
    # deepspeed.init_distributed (env:// rendezvous) reads these, whatever launcher set the job up.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world),
                      MASTER_ADDR=info.master_addr or "127.0.0.1",
                      MASTER_PORT=str(info.master_port or free_port()))
    if "OMP_NUM_THREADS" not in os.environ:  # share the CPU cores among the ranks of a node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        # NCCL: one GPU per rank; unless each rank sees its own (srun --gpus-per-task binds
        # them), the node's ranks share the GPUs this one sees
        per_task = "SLURM_GPUS_PER_TASK" in os.environ
        if local_world > gpus and (backend or "nccl") == "nccl" and not per_task:
            raise ConfigError(f"launcher environment ({info.kind}): {local_world} ranks on this "
                              f"node but {gpus} GPU(s); expected at most one rank per GPU "
                              f"(launch fewer, or hide the GPUs with CUDA_VISIBLE_DEVICES= to run "
                              f"the ranks on CPU)")
        torch.cuda.set_device(local_rank % gpus)
        device = torch.device("cuda", torch.cuda.current_device())
        backend = backend or "nccl"
    else:
        device = torch.device("cpu")
        backend = backend or "gloo"
        if tune_allocator:
            tune_cpu_allocator()
        _skip_deepspeed_shm_allreduce()
    if not dist.is_initialized():
        # Dynamo (which the optimizers import) keeps, from its import on, references to the
        # world group if it exists then, so `shutdown` could not free it: import it first.
        importlib.import_module("torch._dynamo")
        try:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                       verbose=False, timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistNetworkError as exc:  # the port taken (EADDRINUSE), no rank 0 to reach
            reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            raise ConfigError(f"rendezvous {os.environ['MASTER_ADDR']}:"
                              f"{os.environ['MASTER_PORT']} ({info.kind}): {reason}; expected a "
                              "port no other job holds and rank 0 reachable (MASTER_ADDR / "
                              "MASTER_PORT)") from None
    return ParallelRuntime(rank=rank, world_size=world, local_rank=local_rank, backend=backend,
                           device=device, launcher=info.family, launch_kind=info.kind)


def _skip_deepspeed_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from loading its shared-memory all-reduce op.

    Only DeepSpeed's inference all-reduce uses it; training runs every collective through gloo.
    Loading it JIT-compiles C++ at a machine's first start (about 50 s on two cores; it needs a
    compiler, and compiles again whenever the command differs, as for another virtual
    environment) and maps a 67 MB buffer per rank in /dev/shm. DeepSpeed consults
    `deepspeed.ops.__compatible_ops__` (one dict for the process) before loading it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False


DEEPSPEED_SHM_OP = "deepspeed_shm_comm"
DEEPSPEED_SHM_DIR = "/dev/shm"


def deepspeed_shm_buffer(rank: int, env: Mapping[str, str] = os.environ) -> str | None:
    """The shared-memory file DeepSpeed's CPU all-reduce (deepspeed_shm_comm) creates for
    `rank` of the job `env` describes: ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (67 MB of RAM-backed tmpfs each); None without a master address and port."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        return None
    return f"{DEEPSPEED_SHM_DIR}/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def shutdown(runtime: ParallelRuntime, barrier: bool = True) -> None:
    """Tear down the process groups (safe to call when nothing was initialised) while Python is
    whole, and unlink this rank's DeepSpeed shared-memory all-reduce buffer.

    - `barrier`: wait for the peers first (a clean end). An error path passes False: a peer may
      be inside another collective, and a barrier there would hang both.
    - torch's `destroy_process_group` only shuts the backends down: DeepSpeed's group registries
      (and whatever model or engine is not yet collected) still hold the group objects, so their
      gloo worker threads would live on into interpreter finalization, where a worker that
      still has to release a tensor's Python object can abort the process ("terminate called
      without an active exception", exit -6, once in CI) after a run that succeeded.
      DeepSpeed's own teardown drops its references, and the garbage is collected here, which
      stops those threads now.
    - `init_runtime` keeps DeepSpeed's shared-memory all-reduce from loading; where it loaded
      all the same (a DeepSpeed that does not consult its op table first), DeepSpeed never
      removes its buffer: every run would leave 67 MB per rank in /dev/shm, that is in RAM,
      until reboot. The peers' mappings stay valid after the unlink (each mapped the others' at
      start-up)."""
    import gc

    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    if runtime.distributed and barrier:
        dist.barrier()
    if ds_comm.is_initialized():  # also releases DeepSpeed's cached groups
        ds_comm.destroy_process_group()
    else:  # a group DeepSpeed did not start (tests)
        dist.destroy_process_group()
    gc.collect()
    path = deepspeed_shm_buffer(rank)
    if path is not None and os.path.isfile(path):
        os.unlink(path)
