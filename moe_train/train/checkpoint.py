"""Training checkpoints: DeepSpeed engine state plus our metadata, written atomically.

Layout of `checkpoint.dir`:
  step_00001000/      DeepSpeed files (model, optimizer / ZeRO shards, lr scheduler),
                      meta.json (config, step, data position), rng_rank{r}.pt per rank,
                      spm.model and manifest.json (so a checkpoint is self-contained)
  latest              the tag of the newest complete checkpoint, written last

Every rank saves into a hidden temporary tag; rank 0 renames it into place once all ranks are
done and only then moves the `latest` pointer, so a run killed at any moment leaves the previous
checkpoint intact. Assumes the checkpoint directory is on a file system shared by all nodes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from moe_train.errors import CheckpointError
from moe_train.parallel.collectives import barrier
from moe_train.parallel.expert_checkpoint import full_expert_state
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.utils.atomic import atomic_path, write_json, write_text

_TAG_RE = re.compile(r"^step_(\d+)$")


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_tag(ckpt_dir: str | Path) -> str | None:
    """The tag the `latest` pointer names, or None when there is no complete checkpoint."""
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text(encoding="utf-8").strip()
    if not (Path(ckpt_dir) / tag).is_dir():
        raise CheckpointError(f"{pointer}: names {tag!r}, which does not exist")
    return tag


def list_tags(ckpt_dir: Path) -> list[str]:
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG_RE.match(p.name)]
    return sorted(tags, key=lambda t: int(_TAG_RE.match(t).group(1)))


def save_checkpoint(engine: Any, rt: ParallelRuntime, ckpt_dir: str | Path, step: int,
                    meta: dict[str, Any], attachments: dict[str, Path], keep_last: int,
                    save_extra: Callable[[Path], None] | None = None) -> Path:
    """Save engine + metadata as `step_{step}` and move `latest` to it (collective).

    `save_extra(tag_dir)` runs on every rank before the checkpoint is completed (expert shards).
    """
    ckpt_dir = Path(ckpt_dir)
    tag = step_tag(step)
    tmp_tag = f".tmp-{tag}"
    if rt.is_main:
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)
    barrier(rt)
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state={"moe_train": meta},
                           save_latest=False)
    with atomic_path(ckpt_dir / tmp_tag / f"rng_rank{rt.rank}.pt") as tmp:
        torch.save(rng_state(), tmp)
    if save_extra is not None:
        save_extra(ckpt_dir / tmp_tag)
    barrier(rt)
    final = ckpt_dir / tag
    if rt.is_main:
        write_json(ckpt_dir / tmp_tag / "meta.json", meta)
        for name, src in attachments.items():
            shutil.copyfile(src, ckpt_dir / tmp_tag / name)
        if final.exists():
            shutil.rmtree(final)
        (ckpt_dir / tmp_tag).rename(final)
        write_text(ckpt_dir / "latest", tag + "\n")
        if keep_last > 0:
            for old in list_tags(ckpt_dir)[:-keep_last]:
                shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    barrier(rt)
    return final


def load_checkpoint(engine: Any, rt: ParallelRuntime, ckpt_dir: str | Path,
                    tag: str | None = None, load_extra: Callable[[Path], None] | None = None
                    ) -> dict[str, Any]:
    """Restore engine state, this rank's RNG state, and return our metadata.

    Expert tensors are not in DeepSpeed's module states (see parallel/expert_checkpoint.py):
    the module loads non-strictly and `load_extra(tag_dir)` restores them.
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint to resume from (no 'latest' pointer)")
    path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True,
                                          load_module_strict=load_extra is None)
    if path is None:
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    if load_extra is not None:
        load_extra(ckpt_dir / tag)
    rng_file = ckpt_dir / tag / f"rng_rank{rt.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client["moe_train"]


def read_meta(tag_dir: str | Path) -> dict[str, Any]:
    path = Path(tag_dir) / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; not a moe_train checkpoint")
    return json.loads(path.read_text(encoding="utf-8"))


def consolidated_state_dict(tag_dir: str | Path) -> dict[str, torch.Tensor]:
    """Model weights of a step checkpoint, read without DeepSpeed (ZeRO stages 0-2 keep them whole)."""
    path = Path(tag_dir) / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing model states")
    state = torch.load(path, map_location="cpu", weights_only=False)["module"]
    state.update(full_expert_state(Path(tag_dir)))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
