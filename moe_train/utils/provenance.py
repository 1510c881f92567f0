"""Where a result came from: code version, command, machine, libraries, time.

Every benchmark JSON and every stage record carries ``provenance(argv)`` so a number can be tied
to the commit and the machine that produced it. ``finish(prov)`` adds what is known only at the
end (load average, wall time): a busy machine at either end spoils a CPU timing.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
"""The checkout the running moe_train package lives in."""

LIBRARIES = ("torch", "deepspeed", "numpy", "scikit-learn", "sentencepiece", "sacrebleu",
             "megatron-core", "triton", "safetensors", "skops", "transformers")
"""Distributions whose versions are recorded (None where not installed)."""

MAX_DIRTY_PATHS = 20
SOURCE_COMMIT_ENV = "MOE_TRAIN_SOURCE_COMMIT"
"""Names the commit of a tree that is a copy without .git (checked only when git finds none)."""


def _git(*args: str, repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """Commit, dirty flag and changed paths of `repo`; commit None (and why) when it is not a
    git checkout or git is missing."""
    try:
        top = Path(_git("rev-parse", "--show-toplevel", repo=repo).strip()).resolve()
        if top != Path(repo).resolve():  # an installed copy inside some other checkout
            raise subprocess.SubprocessError(f"the enclosing checkout is {top}, not this code's")
        commit = _git("rev-parse", "HEAD", repo=repo).strip()
        # untracked files count whatever the user's git config says (status.showUntrackedFiles)
        status = _git("status", "--porcelain", "--untracked-files=normal",
                      "--ignore-submodules=none", repo=repo).splitlines()
    except (OSError, subprocess.SubprocessError) as err:
        reason = getattr(err, "stderr", None) or str(err)
        note = f"not a git checkout: {repo} ({reason.strip().splitlines()[-1:]})"
        given = os.environ.get(SOURCE_COMMIT_ENV)
        if given:  # a copied tree (e.g. shipped to a GPU machine): the sender names its commit
            return {"commit": given, "dirty": None,
                    "note": f"{note}; commit from {SOURCE_COMMIT_ENV}"}
        return {"commit": None, "dirty": None, "note": note}
    paths = [line[3:] for line in status]
    return {"commit": commit, "dirty": bool(paths), "dirty_paths": paths[:MAX_DIRTY_PATHS],
            "dirty_paths_total": len(paths)}


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo, else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model, logical cores, torch threads, load average now, GPU name if CUDA."""
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(), "platform": platform.platform(), "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_1_5_15min_start": list(os.getloadavg()), "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = {"name": torch.cuda.get_device_name(), "count": torch.cuda.device_count(),
                       "cuda": torch.version.cuda}
    return info


def library_versions() -> dict[str, str | None]:
    """Python and the installed versions of LIBRARIES (from package metadata, no import)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def now_iso() -> str:
    """The current UTC time as provenance writes it."""
    return _now().isoformat(timespec="seconds")


def provenance(argv: list[str] | None = None, repo: Path = REPO) -> dict[str, Any]:
    """The provenance record of a run started with `argv` (default: sys.argv)."""
    return {"git": git_state(repo), "command": [sys.executable, *(argv if argv is not None
                                                                     else sys.argv)],
            "cwd": os.getcwd(), "machine": machine(), "libraries": library_versions(),
            "started_at": now_iso()}


def finish(prov: dict[str, Any]) -> dict[str, Any]:
    """`prov` completed at the end of the run: load average now, end time, wall seconds."""
    end = _now()
    out = dict(prov, finished_at=end.isoformat(timespec="seconds"))
    out["machine"] = dict(prov["machine"], loadavg_1_5_15min_end=list(os.getloadavg()))
    out["wall_seconds"] = round(
        (end - datetime.datetime.fromisoformat(prov["started_at"])).total_seconds())
    return out


def digest_files(paths: list[Path], root: Path, chunk_bytes: int = 1 << 20) -> str:
    """sha256 over the names (relative to `root`) and contents of `paths`, streamed in chunks:
    the identity of a checkpoint or a data split, whatever its size."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def digest_tree(root: Path) -> str:
    """`digest_files` of every regular file under `root` (hidden temporary files excepted)."""
    root = Path(root)
    return digest_files([p for p in root.rglob("*") if p.is_file() and
                         not p.name.startswith(".")], root)
