"""Loading a step checkpoint into a running engine (train/checkpoint.py saves them).

At the world size and ep size it was saved at, DeepSpeed loads its own files (read with
weights_only, train/ds_load.py) and a resume continues bitwise. At another, the optimizer
partitions do not fit: under ZeRO 1/2 DeepSpeed loads the module only, under ZeRO-3 not even
that (its module-only load unpickles every rank's files and wants one per rank of the new
world), and every dense parameter with its Adam moments comes from the per-parameter store
(`optim_dense`), the experts from their own files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from moe_train.errors import CheckpointError
from moe_train.parallel.expert_checkpoint import expert_modules
from moe_train.parallel.optim_state import is_zero_partitioned, load_dense_state, state_keys
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.zero3 import is_zero3
from moe_train.train.checkpoint import (DENSE_STORE, ZERO3_MODEL_STATES, latest_tag,
                                        read_dense_state, read_meta, seed_rng,
                                        set_rng_state, verify)
from moe_train.train.ds_load import weights_only_loads
from moe_train.utils.safe_load import load_torch, require_file


def load_checkpoint(engine: Any, rt: ParallelRuntime, ckpt_dir: str | Path,
                    tag: str | None = None, load_extra: Callable[[Path], None] | None = None,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Restore engine state, this rank's RNG state, and return our metadata.

    Expert tensors are not in DeepSpeed's module states (see parallel/expert_checkpoint.py):
    the module loads non-strictly and `load_extra(tag_dir)` restores them. Under ZeRO 1/2 at
    another world size or ep size, DeepSpeed loads the module only (its optimizer partitions do
    not fit) and the per-parameter Adam state of optim_dense and the expert files is set.
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag or latest_tag(ckpt_dir, warn=lambda m: log(f"warning: {m}"))
    if tag is None:
        raise CheckpointError(f"{ckpt_dir}: no checkpoint to resume from (no complete step)")
    tag_dir = ckpt_dir / tag
    why = verify(tag_dir)
    if why is not None:
        raise CheckpointError(f"{tag_dir}: not a complete checkpoint ({why})")
    meta = read_meta(tag_dir)
    try:
        old_world = int(meta.get("world_size", 1))
        old_ep = int(meta.get("config", {}).get("moe", {}).get("ep_size", 1))
    except (TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{tag_dir}: meta.json's world_size or config.moe.ep_size is not "
                              "an integer; expected the metadata a save writes") from None
    same_world = old_world == rt.world_size
    portable = is_zero_partitioned(engine.optimizer) and not (same_world and old_ep == rt.ep_size)
    zero3 = is_zero3(engine.optimizer)
    if portable and zero3:
        # not DeepSpeed's module-only load: it unpickles every rank's optimizer files (its
        # zero_to_fp32) and wants a model-states file per rank of the new world; buffers are
        # whole in rank 0's, every parameter (frozen ones too) is in the dense store
        _load_buffers(engine, tag_dir)
    else:
        with weights_only_loads(engine):  # DeepSpeed itself would unpickle its files
            path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag,
                                             load_optimizer_states=not portable,
                                             load_lr_scheduler_states=not portable,
                                             load_module_only=portable,
                                             load_module_strict=load_extra is None)
        if path is None:
            raise CheckpointError(f"{tag_dir}: DeepSpeed could not load this checkpoint")
    if portable:
        _load_dense(engine, tag_dir, frozen=zero3)
        log(f"| resume: ZeRO optimizer state of world {old_world} / ep_size {old_ep} "
            f"resharded to world {rt.world_size} / ep_size {rt.ep_size}")
    if load_extra is not None:
        load_extra(tag_dir)
    rng_file = tag_dir / f"rng_rank{rt.rank}.pt"
    if same_world and rng_file.is_file():
        state = load_torch(rng_file, "RNG states")
        try:
            if not isinstance(state, dict):
                raise TypeError(f"a {type(state).__name__}")
            set_rng_state(state)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise CheckpointError(f"{rng_file}: not the RNG states a checkpoint holds "
                                  f"({type(exc).__name__}: {exc}); expected python, numpy and "
                                  "torch generator states") from None
    else:
        seed_rng(int(meta["config"]["train"]["seed"]) + rt.rank)
        log(f"| resume: checkpoint written at world size {old_world}, resumed at "
            f"{rt.world_size}: fresh RNG streams seeded from train.seed + rank; bitwise "
            "continuation holds only at the same world size")
    return meta


def _load_buffers(engine: Any, tag_dir: Path) -> None:
    """The module's buffers from rank 0's ZeRO-3 model states (buffers are not partitioned;
    its parameters there are, and are not read)."""
    path = tag_dir / ZERO3_MODEL_STATES
    states = load_torch(require_file(path, "DeepSpeed model states"), "DeepSpeed model states",
                        mmap=True)
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict):
        raise CheckpointError(f"{path}: no 'module' weights in the model states")
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            if name in module:  # a non-persistent buffer is not saved: the model makes it
                buf.copy_(module[name])


def _load_dense(engine: Any, tag_dir: Path, frozen: bool = False) -> None:
    dense = read_dense_state(tag_dir)
    if dense is None:
        raise CheckpointError(f"{tag_dir / DENSE_STORE}.index.json: missing; this checkpoint "
                              "cannot be resumed at another world size or ep size (resume with "
                              "the world size it was saved at)")
    src, meta = dense
    experts = {id(p) for _, m in expert_modules(engine.module) for p in m.parameters()}
    missing = [name for name, p in engine.module.named_parameters()
               if frozen and not p.requires_grad and id(p) not in experts
               and state_keys(name)["value"] not in src.shapes]
    if missing:
        raise CheckpointError(f"{src.where}: no value for frozen parameter {missing[0]!r}: saved "
                              "before ZeRO-3 checkpoints kept frozen parameters; resume it at "
                              "the world size it was saved at")
    load_dense_state(engine.module, engine.optimizer, src, float(meta.get("step", 0.0)),
                     experts, frozen=frozen)
    sched = engine.lr_scheduler
    if sched is None:
        return
    sched.last_epoch = meta["lr_scheduler"]["last_epoch"]
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
