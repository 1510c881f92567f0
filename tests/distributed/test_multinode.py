"""Multi-node launches for real, on the one-machine cluster of ../shared/tools/local-cluster.sh.

- `launch/multinode.sh HOSTFILE CONFIG ...`: `deepspeed --hostfile` over pdsh/ssh to the two
  "nodes" node1 and node2 (one rank each);
- `sbatch launch/slurm.sbatch CONFIG ...` with GPUS_PER_NODE=2: one DeepSpeed launcher per node
  through srun (--no_ssh), two CPU ranks.

Both train world size 2 and write both ranks' RNG state. The tests never start the cluster; they
skip, saying why, when it is not up. `.ci/run` starts it, checks each piece and lists the ones that
work in MOE_TRAIN_CLUSTER ("ssh,slurm"; "up" means both): a listed piece that is missing then fails
its tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import ROOT, cli_env, debug_overrides

HOSTFILE = Path("/tmp/hostfile-2nodes")
MULTINODE = ROOT / "launch" / "multinode.sh"
SBATCH_SCRIPT = ROOT / "launch" / "slurm.sbatch"
SETUP = "run `bash ../shared/tools/local-cluster.sh all` as root"
# Overrides that a shell would split or glob: they must reach every rank intact.
TRICKY = ["data.pairs=[en-de]", "data.domains=[it, law, medical, religion, subtitles]"]


def _short_run(overrides: list[str]) -> list[str]:
    return [*overrides, "train.max_steps=4", "checkpoint.save_every=4", "train.validate_every=0",
            "train.bleu_sentences=5", "data.max_tokens=400", *TRICKY]


def skip_unless_cluster(why: str | None, piece: str) -> None:
    """Skip with `why` (or fail, when CI found `piece`, "ssh" or "slurm", working and said so)."""
    if why is None:
        return
    listed = os.environ.get("MOE_TRAIN_CLUSTER", "")
    if listed == "up" or piece in listed.split(","):
        pytest.fail(f"MOE_TRAIN_CLUSTER={listed} but {piece} is unusable: {why}")
    pytest.skip(why)


def _ssh_cluster_missing() -> str | None:
    if not HOSTFILE.is_file():
        return f"{HOSTFILE} missing ({SETUP})"
    if shutil.which("pdsh") is None:
        return f"pdsh not installed ({SETUP})"
    try:
        proc = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "node2", "true"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ssh node2: {exc} ({SETUP})"
    if proc.returncode != 0:
        return f"`ssh -o BatchMode=yes node2 true` failed: {proc.stderr.strip()[:200]} ({SETUP})"
    return None


def _slurm_partition() -> tuple[str | None, str | None]:
    """(partition, None) when SLURM can run a job here, else (None, why not)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return None, f"sinfo/sbatch not installed ({SETUP})"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %a %t"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"sinfo: {exc}"
    rows = [line.split() for line in proc.stdout.splitlines() if len(line.split()) == 3]
    if proc.returncode != 0 or not rows:
        return None, f"sinfo: no partition ({proc.stderr.strip()[:200] or SETUP})"
    usable = [(p.rstrip("*"), p.endswith("*")) for p, avail, state in rows
              if avail == "up" and state.rstrip("*~#") in ("idle", "mix", "mixed", "alloc", "allocated")]
    if not usable:
        return None, f"sinfo: no partition up with a usable node ({proc.stdout.strip()[:200]})"
    names = [name for name, _ in usable]
    if "debug" in names:
        return "debug", None
    return next((name for name, default in usable if default), names[0]), None


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher; on timeout interrupt it (DeepSpeed then kills its remote ranks) and fail."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:3])} ... did not finish in {timeout:.0f}s\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _check_trained(out: str, ckpt: Path) -> None:
    assert "world 2 (env, gloo)" in out, out[-5000:]
    assert (ckpt / "latest").read_text().strip() == "step_00000004"
    step = ckpt / "step_00000004"
    assert (step / "rng_rank0.pt").is_file() and (step / "rng_rank1.pt").is_file(), \
        sorted(p.name for p in step.iterdir())
    assert json.loads((step / "meta.json").read_text())["world_size"] == 2
    data = json.loads((ckpt / "export" / "config.json").read_text())["data"]
    assert data["pairs"] == ["en-de"]
    assert data["domains"] == ["it", "law", "medical", "religion", "subtitles"]


def test_multinode_sh_pdsh_two_nodes(tiny_prepared, tmp_path):
    skip_unless_cluster(_ssh_cluster_missing(), "ssh")
    from moe_train.parallel.runtime import free_port

    # Launched from a work directory outside the checkout, with a relative hostfile, as users do;
    # a file that `data.pairs=[en-de]` would glob to on the remote shell if it went unquoted.
    shutil.copy(HOSTFILE, tmp_path / "hostfile")
    (tmp_path / "data.pairs=e").touch()
    env = cli_env()
    env["MASTER_PORT"] = str(free_port())
    cmd = ["bash", str(MULTINODE), "hostfile", str(ROOT / "configs" / "debug-cpu.yaml"),
           *_short_run(debug_overrides(tiny_prepared, tmp_path / "w"))]
    proc = _run(cmd, tmp_path, env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "pdsh -S -f 1024 -w node1,node2" in proc.stdout  # the real multi-node path
    _check_trained(proc.stdout, tmp_path / "w" / "ckpt")


def _sbatch(tmp_path: Path, overrides: list[str]) -> tuple[str, Path]:
    """Submit the template for two CPU ranks on one node: (job id, its output file)."""
    partition, why = _slurm_partition()
    skip_unless_cluster(why, "slurm")
    env = cli_env()
    env["GPUS_PER_NODE"] = "2"
    name = f"moe-test-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "slurm-%j.out"
    cmd = ["sbatch", "--parsable", "-p", partition, "--nodes=1", f"--job-name={name}", "-o", str(log),
           str(SBATCH_SCRIPT), "configs/debug-cpu.yaml", *overrides]
    sub = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    return job, Path(str(log).replace("%j", job))


def _wait_job(job: str, out_file: Path, until: Callable[[], bool] = lambda: False,
              timeout: float = 240) -> str:
    """Wait for `job` to end (or `until()` to hold), cancelling it if it is still there at the
    end; return its state while it ran ("" once it has left the queue)."""
    deadline, state = time.monotonic() + timeout, "PENDING"
    try:
        while time.monotonic() < deadline:
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            if not state or until():
                return state
            time.sleep(2)
        if state == "PENDING":
            skip_unless_cluster(f"SLURM job {job} still pending after {timeout:.0f} s (node busy?)",
                                "slurm")
        pytest.fail(f"SLURM job {job} still {state} after {timeout:.0f} s\n"
                    f"{out_file.read_text()[-4000:] if out_file.exists() else ''}")
    finally:
        if state and not until():
            subprocess.run(["scancel", job], capture_output=True, timeout=30)


def _job_info(job: str) -> str:
    """`scontrol show job` (kept by slurmctld for MinJobAge seconds; "" after)."""
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                          timeout=30).stdout


def test_sbatch_template_two_cpu_ranks(tiny_prepared, tmp_path):
    job, out_file = _sbatch(tmp_path, _short_run(debug_overrides(tiny_prepared, tmp_path / "w")))
    _wait_job(job, out_file)
    out = out_file.read_text() if out_file.exists() else f"(no {out_file})"
    info = _job_info(job)
    if "ExitCode=" in info:
        assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + out[-5000:]
    assert "1 node(s) x 2 rank(s) = world 2" in out, out[-5000:]
    _check_trained(out, tmp_path / "w" / "ckpt")


def test_sbatch_template_stops_on_the_early_signal_with_a_checkpoint(tiny_prepared, tmp_path):
    """`--signal=USR1@120` (what the template asks for) as `scancel -s USR1` sends it: to every
    process of the step. The task's shell and the launcher outlive it; both ranks stop after
    one step with a checkpoint there and the task exits 128 + SIGUSR1."""
    overrides = [*debug_overrides(tiny_prepared, tmp_path / "w"), "train.max_steps=100000",
                 "checkpoint.save_every=1000", "train.validate_every=0", "train.log_every=1",
                 "data.max_tokens=400"]
    job, out_file = _sbatch(tmp_path, overrides)

    def stepping() -> bool:
        return out_file.exists() and "| step      3 |" in out_file.read_text(errors="replace")

    assert _wait_job(job, out_file, stepping), out_file.read_text()[-4000:]
    subprocess.run(["scancel", "-s", "USR1", job], check=True, timeout=30)
    _wait_job(job, out_file)
    out = out_file.read_text(errors="replace")
    tag = (tmp_path / "w" / "ckpt" / "latest").read_text().strip()
    step = int(tag[len("step_"):])
    assert out.count(f"\nstopped: SIGUSR1 at step {step}: saved") == 2, out[-5000:]
    assert "task 0: Exited with exit code 138" in out, out[-5000:]
    assert json.loads((tmp_path / "w" / "ckpt" / tag / "meta.json").read_text())["step"] == step


@pytest.mark.parametrize("case", ["no-args", "hostfile", "config", "bad-line", "twice"])
def test_multinode_sh_one_line_errors(tmp_path, case):
    config = str(ROOT / "configs" / "debug-cpu.yaml")
    (tmp_path / "hosts").write_text("node1 slots=1\nnode2\n")
    (tmp_path / "twice").write_text("node1 slots=1\nnode2 slots=1\nnode1 slots=2\n")
    args = {"no-args": [], "hostfile": ["nope", config], "config": ["hosts", "nope.yaml"],
            "bad-line": ["hosts", config], "twice": ["twice", config]}[case]
    proc = subprocess.run(["bash", str(MULTINODE), *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    expected = {"no-args": "usage: multinode.sh HOSTFILE CONFIG", "hostfile": "nope: hostfile not found",
                "config": "nope.yaml: config not found", "bad-line": "bad line 'node2'",
                "twice": "host 'node1' listed twice"}[case]
    assert expected in lines[0]


def _fake_launch(tmp_path: Path, hosts: str, *args: str, **env_extra: str):
    """multinode.sh with DEEPSPEED a script printing its arguments (one per line) and a pdsh
    on PATH: what it would run, without running it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "deepspeed"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    (bin_dir / "pdsh").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pdsh").chmod(0o755)
    (tmp_path / "hosts").write_text(hosts)
    env = {**cli_env(), "DEEPSPEED": str(fake), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           **env_extra}
    return subprocess.run(["bash", str(MULTINODE), "hosts", str(ROOT / "configs" /
                                                                 "debug-cpu.yaml"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)


def test_multinode_sh_passes_percent_signs_and_reaches_a_lone_remote_host(tmp_path):
    """pdsh replaces %h / %n per node: a % reaches every node as typed (doubled); one host
    that is not this machine is reached over pdsh too (--force_multi), not trained on here;
    an absolute DS_ENV_FILE is checked like a relative one."""
    two = _fake_launch(tmp_path, "node1 slots=1\nnode2 slots=1\n", "checkpoint.dir=/c/run%h")
    assert two.returncode == 0, two.stderr
    lines = two.stdout.splitlines()
    assert "checkpoint.dir=/c/run%%h" in lines and "--force_multi" not in lines
    lone = _fake_launch(tmp_path, "node1 slots=2\n")
    assert lone.returncode == 0 and "--force_multi" in lone.stdout.splitlines(), lone.stderr
    here = _fake_launch(tmp_path, "localhost slots=2\n", "checkpoint.dir=/c/run%h")
    assert "--force_multi" not in here.stdout.splitlines()
    assert "checkpoint.dir=/c/run%h" in here.stdout.splitlines()  # no pdsh: as typed
    envfile = tmp_path / "envfile"
    envfile.write_text("A=1\n#OMP_NUM_THREADS=4\n")
    bad = _fake_launch(tmp_path, "node1 slots=1\nnode2 slots=1\n", DS_ENV_FILE=str(envfile))
    assert bad.returncode == 2 and f"{envfile}:2: expected KEY=value" in bad.stderr
