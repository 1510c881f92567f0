"""Shared fixtures: a tiny synthetic corpus prepared once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BENCHMARK_SMOKE_ENV = "MOE_TRAIN_BENCHMARK_SMOKE"
"""Set (to anything) to run the `benchmark_smoke` tests under CI=true as well."""


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "benchmark_smoke: a whole benchmark script at --quick size (minutes of CPU); "
        f"skipped under CI=true unless {BENCHMARK_SMOKE_ENV} is set")


def pytest_collection_modifyitems(config, items) -> None:
    """CI's time budget (25 minutes on two cores) leaves out the three longest benchmark
    smoke runs: each drives a benchmark script end to end, over code the pipeline and CLI
    tests cover. `make test` outside CI runs them, as does CI with MOE_TRAIN_BENCHMARK_SMOKE."""
    if os.environ.get("CI") != "true" or os.environ.get(BENCHMARK_SMOKE_ENV):
        return
    skip = pytest.mark.skip(reason=f"benchmark smoke run: outside CI's time budget (set "
                                   f"{BENCHMARK_SMOKE_ENV}=1 to run it)")
    for item in items:
        if "benchmark_smoke" in item.keywords:
            item.add_marker(skip)
SHARED_DATA = ROOT.parent / "shared" / "data" / "opus-multidomain"


def _own_port_range() -> None:
    """Each test worker picks rendezvous ports from its own range (MOE_TRAIN_PORT_RANGE, read by
    `free_port`; the CLI runs inherit it): jobs of two workers then never pick the same port in
    the seconds between the pick and rank 0's listen (seen once as EADDRINUSE)."""
    from moe_train.parallel.runtime import PORT_RANGE_ENV

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    lo = 20000 + 2000 * ((int(worker) if worker.isdigit() else 0) % 6)
    os.environ.setdefault(PORT_RANGE_ENV, f"{lo}-{lo + 1999}")


_own_port_range()


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_buffers():
    """Ranks killed on purpose (kill/resume tests) cannot unlink DeepSpeed's CPU all-reduce
    buffers (67 MB of RAM each, see parallel.runtime.shutdown): remove the ones this session
    created when it ends, except those a process still maps (another test worker's job)."""
    import time

    start = time.time() - 1
    yield
    mapped = _mapped_files()
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        try:
            if path.stat().st_mtime >= start and str(path) not in mapped:
                path.unlink()
        except OSError:
            pass


def _mapped_files() -> set[str]:
    """The files some process of this machine maps (/proc/*/maps; empty where unreadable)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(line.split(None, 5)[5] for line in text.splitlines()
                      if "deepspeed_allreduce_buffer" in line and line.count(" ") >= 5)
    return mapped


@pytest.fixture
def one_thread():
    """Tiny matrices: one torch thread is fastest and does not fight other processes for
    cores (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A 5-domain synthetic en->de corpus with train/dev/test splits (small)."""
    from moe_train.data.synthetic import generate_synthetic

    out = tmp_path_factory.mktemp("synthetic")
    generate_synthetic(out, num_domains=5, train_per_domain=120, dev_per_domain=8,
                       test_per_domain=8, seed=3)
    return out


@pytest.fixture(scope="session")
def tiny_prepared(tiny_corpus, tmp_path_factory) -> Path:
    """`tiny_corpus` prepared with a 300-piece sentencepiece model."""
    from moe_train.config import load_config
    from moe_train.data.corpus import discover
    from moe_train.data.prepare import prepare

    cfg = load_config(ROOT / "configs" / "debug-cpu.yaml", ["data.vocab_size=300", "data.pairs=[en-de]"])
    out = tmp_path_factory.mktemp("prepared") / "prepared"
    prepare(discover(tiny_corpus, cfg.data.pairs), out, cfg.data, seed=1)
    return out


@pytest.fixture(scope="session")
def qwen_prepared(tiny_corpus, tmp_path_factory) -> tuple[Path, Path]:
    """(prepared dir, tokenizer dir): `tiny_corpus` prepared for the tiny Qwen2-MoE with a
    400-token byte-level BPE tokenizer trained here (no download)."""
    from moe_train.config import load_config
    from moe_train.data.corpus import discover
    from moe_train.data.hf_tokenizer import train_bpe_tokenizer
    from moe_train.data.prepare import prepare

    work = tmp_path_factory.mktemp("qwen-data")
    texts = [line for f in sorted(Path(tiny_corpus).rglob("*train*"))
             for line in f.read_text(encoding="utf-8").splitlines()]
    tok = train_bpe_tokenizer(texts, work / "tokenizer", 400)
    cfg = load_config(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml", [f"data.tokenizer={tok}"])
    prepare(discover(tiny_corpus, cfg.data.pairs), work / "prepared", cfg.data, seed=1)
    return work / "prepared", tok


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID")
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "PMIX_")


def launcher_var(name: str) -> bool:
    """A variable by which a child process would think it is one rank of a launched job."""
    return name in _LAUNCHER_VARS or name.startswith(_LAUNCHER_PREFIXES)


def cli_env() -> dict[str, str]:
    """Environment for running `python -m moe_train` in a subprocess (single process)."""
    env = {k: v for k, v in os.environ.items() if not launcher_var(k)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m moe_train ARGS` (forked from a warm interpreter, see tests/cli_runner.py);
    on failure show its output."""
    from tests.cli_runner import run_moe_train

    proc = run_moe_train(args, cwd, env or cli_env(), timeout=timeout, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"moe-train {' '.join(args)} exited {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def debug_overrides(prepared: Path, work: Path, *extra: str) -> list[str]:
    """debug-cpu.yaml pointed at `prepared`, writing under `work`."""
    return [f"data.prepared_dir={prepared}", f"checkpoint.dir={work / 'ckpt'}",
            f"logging.tensorboard_dir={work / 'tb'}", *extra]


def load_benchmark(name: str):
    """benchmarks/<name>.py as the module `name` (its sibling scripts importable while it
    loads)."""
    import importlib.util

    bench_dir = str(ROOT / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench_dir)
    return module
