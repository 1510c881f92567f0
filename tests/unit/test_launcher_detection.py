"""The one launcher detection (`detect_launch`) over the environments real launchers set."""

import pytest

from moe_train.errors import ConfigError
from moe_train.parallel.runtime import LaunchInfo, detect_launch, parse_first_host

SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}
# The batch script itself (no srun): SLURM_PROCID=0 and SLURM_NTASKS, but no step.
BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "8",
         "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}
DEEPSPEED = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
             "CROSS_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-node1-1234@1"}
HYDRA = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4",
         "PMI_FD": "5"}  # MPICH and Intel MPI (both Hydra)
PMI2_SRUN = {**SRUN, "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "7"}  # srun --mpi=pmi2
PMIX_SRUN = {**SRUN, "PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.4242.0"}  # srun --mpi=pmix

CASES = {
    # name: (env, kind, rank, world, local_rank, local_world, master_addr, master_port)
    "no launcher": ({}, "single", 0, 1, 0, 1, "127.0.0.1", None),
    "no launcher, port given": ({"MASTER_PORT": "1234"}, "single", 0, 1, 0, 1, "127.0.0.1", 1234),
    "deepspeed": (DEEPSPEED, "deepspeed", 3, 4, 1, 2, "node1", 29500),
    "torchrun": (TORCHRUN, "torchrun", 2, 4, 0, 2, "10.0.0.1", 29400),
    "RANK/WORLD_SIZE only": ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"},
                             "env", 1, 2, 0, None, "h", 9),
    "deepspeed under srun (slurm.sbatch)": ({**SRUN, **DEEPSPEED}, "deepspeed", 3, 4, 1, 2, "node1", 29500),
    "torchrun under srun, one task per node": (
        {**SRUN, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", **TORCHRUN, "LOCAL_WORLD_SIZE": ""},
        "torchrun", 2, 4, 0, None, "10.0.0.1", 29400),  # not SLURM's one task per node
    "open mpi (mpirun / prterun)": (OPENMPI, "openmpi", 3, 4, 1, 2, None, None),
    # mpirun passes its environment to its own node's ranks only: rank 0's MASTER_*, by MPI
    "open mpi with MASTER_ADDR": ({**OPENMPI, "MASTER_ADDR": "n0", "MASTER_PORT": "7"},
                                  "openmpi", 3, 4, 1, 2, None, None),
    "mpich / intel mpi (hydra)": (HYDRA, "mpich", 6, 8, 2, 4, None, None),
    "srun --mpi=pmi2": (PMI2_SRUN, "mpich", 5, 8, 1, 4, "gpu07", 24398),
    "srun --mpi=pmix": (PMIX_SRUN, "pmix", 5, 8, 1, 4, "gpu07", 24398),
    "pmix alone (size from MPI)": ({"PMIX_RANK": "1", "PMIX_NAMESPACE": "ns"}, "pmix", 1, None, None,
                                   None, None, None),
    "srun without launcher": (SRUN, "slurm", 5, 8, 1, 4, "gpu07", 24398),
    "srun, MASTER_* given": ({**SRUN, "MASTER_ADDR": "m", "MASTER_PORT": "5"}, "slurm", 5, 8, 1, 4, "m", 5),
    "srun, SLURM_NPROCS only": ({"SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_NPROCS": "2",
                                 "SLURM_LOCALID": "0", "SLURM_NODELIST": "a,b", "SLURM_JOBID": "3"},
                                "slurm", 0, 2, 0, None, "a", 31758),  # job 3, step 1
    "srun -n 1": ({**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},
                  "slurm", 0, 1, 0, 1, "127.0.0.1", None),  # one process: a free local port
    "sbatch script, not a step": (BATCH, "single", 0, 1, 0, 1, "127.0.0.1", None),
    # srun with RANK / WORLD_SIZE set by hand: the node's ranks are SLURM's (all on GPU 0 else)
    "srun with hand-set RANK / WORLD_SIZE": ({**SRUN, "RANK": "5", "WORLD_SIZE": "8"}, "env", 5,
                                             8, 1, 4, "gpu07", 24398),
    # mpirun from the batch script on two nodes: the ranks on the other node run inside the
    # daemons' srun step (1 task); they ask MPI like the ranks on mpirun's node, not SLURM
    # prterun from the batch script: the step's one task is its daemon, not the job's size
    "pmix from sbatch, rank on a daemon's node": (
        {"PMIX_RANK": "4", "PMIX_NAMESPACE": "prterun-n01-1234@1", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
         "SLURM_STEP_NODELIST": "n02"}, "pmix", 4, None, None, None, None, None),
    "mpirun in sbatch, rank on a daemon's node": (
        {**OPENMPI, "OMPI_COMM_WORLD_RANK": "8", "OMPI_COMM_WORLD_SIZE": "16", "PMIX_RANK": "8",
         "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
         "SLURM_STEP_NODELIST": "n2", "SLURM_STEP_NUM_TASKS": "1"},
        "openmpi", 8, 16, 1, 2, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_detect_launch(name):
    env, kind, rank, world, local, local_world, addr, port = CASES[name]
    hosts_asked: list[str] = []

    def resolve(nodelist: str) -> str:
        hosts_asked.append(nodelist)
        return parse_first_host(nodelist)

    info = detect_launch(env, resolve_host=resolve)
    assert info == LaunchInfo(kind, rank, world, local, local_world, addr, port)
    if addr == "gpu07":  # the first host of the step's node list, resolved once
        assert hosts_asked == [env["SLURM_STEP_NODELIST"]]


def test_family_and_mpi_needs():
    assert detect_launch(DEEPSPEED).family == detect_launch(TORCHRUN).family == "env"
    assert {detect_launch(e).family for e in (OPENMPI, HYDRA, PMIX_SRUN)} == {"mpi"}
    assert detect_launch(SRUN, parse_first_host).family == "slurm"
    # MPI is asked only for what the environment leaves out.
    assert detect_launch(OPENMPI).needs_mpi  # no rendezvous address
    # mpirun: rank 0's rendezvous for all, whatever a rank's own environment holds
    assert detect_launch({**OPENMPI, "MASTER_ADDR": "n0", "MASTER_PORT": "7"}).needs_mpi
    assert not detect_launch(PMIX_SRUN, parse_first_host).needs_mpi  # srun gives all of it
    assert detect_launch({"PMIX_RANK": "0"}).needs_mpi  # size unknown
    assert not detect_launch(SRUN, parse_first_host).needs_mpi
    assert not detect_launch({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "9"}).needs_mpi
    # commands._runtime() starts a process group exactly when more than one rank may exist.
    assert not detect_launch({}).multi_process and not detect_launch(BATCH).multi_process
    assert detect_launch({"PMIX_RANK": "0"}).multi_process and detect_launch(HYDRA).multi_process
    assert not detect_launch({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}
                             ).multi_process


@pytest.mark.parametrize("nodelist,first", [
    ("node1", "node1"), ("a,b,c", "a"), ("node[03-05,9]", "node03"), ("node[7,2-3],gpu1", "node7"),
    ("rack1-[01-02]-ib", "rack1-01-ib"), ("gpu1,node[3-4]", "gpu1"), (" vm ", "vm"),
    ("rack[1-2]-node[01-04]", "rack1-node01"), ("a[1-2]b[3-4],c", "a1b3")])
def test_parse_first_host(nodelist, first):
    assert parse_first_host(nodelist) == first


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "no rank variable"),
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "rank 4 outside world size 4"),
    ({**SRUN, "SLURM_LOCALID": "one"}, "SLURM_LOCALID='one'"),
    # each rank would pick its own port and wait alone until the process group's timeout
    ({"RANK": "1", "WORLD_SIZE": "2"}, "2 ranks but MASTER_PORT is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT=99999: expected a TCP"),
    ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not"),  # it trained alone as rank 0
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE='2' is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "9"}, "WORLD_SIZE=0; expected the number"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "local rank 2 outside the 2 ranks of this node"),
    ({**TORCHRUN, "LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": ""}, "local rank -1; expected >= 0"),
])
def test_bad_launcher_env_is_one_config_error(env, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        detect_launch(env, resolve_host=parse_first_host)


def test_more_ranks_than_gpus_on_a_node_is_one_config_error(monkeypatch):
    """NCCL takes one GPU per rank: two local ranks on a one-GPU node would crash inside
    init_process_group; init_runtime says so first, naming the way out."""
    import torch

    from moe_train.parallel.runtime import init_runtime

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"2 ranks on this node but 1 GPU\(s\).*"
                                          r"CUDA_VISIBLE_DEVICES="):
        init_runtime()


def test_srun_gpus_per_task_is_not_more_ranks_than_gpus(monkeypatch):
    """srun --gpus-per-task=1 shows each rank its own GPU: 4 ranks on a node, 1 GPU each."""
    import torch

    from moe_train.parallel import runtime

    for key, value in {**SRUN, "SLURM_GPUS_PER_TASK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)

    class Started(Exception):
        pass

    def stop(*args, **kwargs):
        raise Started

    monkeypatch.setattr(torch.cuda, "current_device", stop)  # past the check: enough
    with pytest.raises(Started):
        runtime.init_runtime()
    assert picked == [0]


def test_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path, monkeypatch):
    """Outgoing connections are given ports from the ephemeral range; a rendezvous port picked
    there can be taken before rank 0 listens on it, so free_port picks below it, or from
    MOE_TRAIN_PORT_RANGE when set."""
    import socket

    from moe_train.parallel.runtime import PORT_RANGE_ENV, _ephemeral_low, free_port

    monkeypatch.setenv(PORT_RANGE_ENV, "40100-40103")
    assert {free_port() for _ in range(40)} <= {40100, 40101, 40102, 40103}
    for bad in ("40100", "9-20", "50000-40000", "a-b", "1024-70000"):
        monkeypatch.setenv(PORT_RANGE_ENV, bad)
        with pytest.raises(ConfigError, match=f"{PORT_RANGE_ENV}=.*expected LO-HI"):
            free_port()
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("", 0))
    try:  # a range whose one port is taken: an error, not a port outside it
        busy = held.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{busy}-{busy}")
        with pytest.raises(ConfigError, match="no free port found there"):
            free_port()
    finally:
        held.close()
    monkeypatch.delenv(PORT_RANGE_ENV)

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(1024 <= p < low for p in ports), (low, ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))
    # no room below the range (a machine whose range starts low): bind(0)'s port instead
    assert free_port(ephemeral_low=1024) >= 1024
    (tmp_path / "range").write_text("32768\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 32768
    (tmp_path / "range").write_text("garbage")
    assert _ephemeral_low(str(tmp_path / "range")) == 49152


def test_steps_of_one_slurm_job_get_their_own_port_below_the_ephemeral_range():
    """`srun ... &` twice in one allocation: the two steps' ranks must not meet on one port."""
    from moe_train.parallel.runtime import slurm_port

    ports = {slurm_port(job, step) for job in (1, 4242, 10**7 + 3) for step in range(4)}
    assert len(ports) == 12 and all(20000 <= p < 32768 for p in ports)
    # two jobs on one first node: any 12000 consecutive ids get 12000 ports (job * 100 had 120)
    assert len({slurm_port(job) for job in range(1000, 13000)}) == 12000
    one, two = ({**SRUN, "SLURM_STEP_ID": str(i), "SLURM_STEPID": str(i)} for i in (0, 1))
    assert detect_launch(one, parse_first_host).master_port != \
        detect_launch(two, parse_first_host).master_port


def test_a_taken_rendezvous_port_is_one_config_error(tmp_path):
    """MASTER_PORT held by another job (two runs sharing an inherited MASTER_PORT): one
    ConfigError naming the address, not DeepSpeed's DistNetworkError traceback."""
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = ("from moe_train.errors import ConfigError\n"
                "from moe_train.parallel.runtime import init_runtime\n"
                "try:\n    init_runtime()\nexcept ConfigError as exc:\n    print(exc)\n")
        env = {**cli_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "WORLD_SIZE": "1"}
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]  # after DeepSpeed's accelerator warning
    assert line.startswith(f"rendezvous 127.0.0.1:{port} (env): ") and "EADDRINUSE" in line, \
        proc.stdout
