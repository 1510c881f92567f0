"""Training checkpoints: DeepSpeed engine state plus our metadata; a kill never loses one.

Layout of `checkpoint.dir`:
  step_00001000/      DeepSpeed files (model, optimizer / ZeRO shards, lr scheduler),
                      experts_ep*of* (parallel/expert_checkpoint.py), optim_dense (ZeRO 1-3:
                      per-parameter fp32 values and Adam state, parallel/optim_state.py; ZeRO 0
                      in 16-bit: the fp32 values only; both tensor stores written one
                      parameter at a time, tied names as aliases), meta.json (config, step,
                      data position), rng_rank{r}.pt per rank, spm.model, manifest.json (data) and,
                      written last, complete.json (every file with its size)
  latest              the tag of the newest complete checkpoint

Saving (collective): every rank writes into `.tmp-step_N`; rank 0 then fsyncs the files, writes
complete.json, fsyncs the directory, renames it to `step_N`, moves `latest` (fsynced), and only then
removes old steps beyond `keep_last`, never the one `latest` names nor those in `keep` (the best
validation's, train.export_best). The step `latest` names is never saved again (a run resumed
from it that took no step, or the end-of-run save after the loop's); any other directory of the
same step (torn, or complete but left by a run killed before it moved `latest`) is replaced only
once the new one is complete. A step directory is used only if
complete.json lists exactly what is there (`verify`); a torn one is skipped with a warning naming
it and the step used instead.

Test hook: ``MOE_TRAIN_TEST_KILL_AT=PHASE`` (or ``PHASE@STEP``) SIGKILLs the process reaching that
phase of save_checkpoint: `engine_saved` (every rank, engine and expert files written), then on
rank 0 `before_rename`, `before_latest`, `before_rotate`; tests/distributed/test_kill_resume.py
uses it to die inside a save. Assumes the checkpoint directory is on a shared file system.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np
import torch

from moe_train.errors import CheckpointError
from moe_train.parallel.collectives import barrier, raise_if_any_rank_failed
from moe_train.parallel.expert_checkpoint import expert_modules, full_expert_state
from moe_train.parallel.optim_state import (adam_step, dense_params, has_unfused_masters,
                                             is_zero_partitioned, legacy_state_source,
                                             param_aliases,
                                             save_param_state)
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.parallel.zero3 import is_zero3
from moe_train.utils.atomic import atomic_path, replace_dir, write_errors_naming, write_json
from moe_train.utils.safe_load import load_torch
from moe_train.utils.tensor_source import TensorSource
from moe_train.utils.tensor_store import TensorStoreWriter, has_store, index_path, open_store

_TAG_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "complete.json"
DENSE_STORE = "optim_dense"
"""Per-parameter fp32 values and Adam moments (ZeRO 1-3), a tensor store."""
LEGACY_DENSE_OPTIM = "optim_dense.pt"
"""The same in checkpoints written before the stores."""
KILL_ENV = "MOE_TRAIN_TEST_KILL_AT"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
"""Rank 0's model states under ZeRO-3 (DeepSpeed's name; no 'mp_rank_00_model_states.pt')."""


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------------- RNG (weights_only safe)
def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states as tensors / plain tuples."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- completeness
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not fsync directories
    finally:
        os.close(fd)


def _files(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size for p in sorted(tag_dir.rglob("*"))
            if p.is_file() and p.name != COMPLETE}


def verify(tag_dir: str | Path) -> str | None:
    """Why `tag_dir` is not a complete checkpoint, or None when it is."""
    why = verify_files(tag_dir)
    if why is not None:
        return why
    try:
        read_meta(Path(tag_dir))
    except CheckpointError as exc:  # "<tag_dir>/meta.json: why" -> "meta.json: why"
        return str(exc).removeprefix(f"{tag_dir}{os.sep}")
    return None


def verify_files(tag_dir: str | Path) -> str | None:
    """Why `tag_dir` does not hold the files complete.json lists, or None when it does (its
    meta.json is not parsed: `read_meta` names what is wrong there)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return "does not exist"
    try:
        listed = json.loads((tag_dir / COMPLETE).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"no {COMPLETE} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{COMPLETE} is unreadable"
    if not isinstance(listed, dict) or not all(
            isinstance(size, int) and not isinstance(size, bool) for size in listed.values()):
        return f"{COMPLETE} is unreadable (its 'files' must map file names to sizes)"
    present = _files(tag_dir)
    for name, size in listed.items():
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} has {present[name]} bytes, {size} were written"
    return None


def list_tags(ckpt_dir: Path) -> list[str]:
    """Step directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG_RE.match(p.name)]
    return sorted(tags, key=lambda t: int(_TAG_RE.match(t).group(1)))


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def latest_tag(ckpt_dir: str | Path, warn: Callable[[str], None] | None = _warn) -> str | None:
    """The complete checkpoint to resume from, or None when the directory holds none.

    Normally the one `latest` names. When `latest` is dangling, garbage or names a torn step, the
    newest complete step is used with a one-line warning naming both; with no complete step to
    fall back to, a CheckpointError. Without `latest` (a run killed before its first pointer
    move), the newest complete step.
    """
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    complete = [t for t in reversed(list_tags(ckpt_dir)) if verify(ckpt_dir / t) is None]
    if not pointer.exists():
        return complete[0] if complete else None
    try:
        tag = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        tag = None
    if tag is None or not _TAG_RE.match(tag):
        reason = f"{pointer}: does not hold a step tag"
    else:
        why = verify(ckpt_dir / tag)
        if why is None:
            return tag
        reason = f"{pointer}: names {tag}, which is not a complete checkpoint ({why})"
    if not complete:
        raise CheckpointError(f"{reason}; no complete checkpoint to fall back to")
    if warn is not None:
        warn(f"{reason}; using the newest complete step {complete[0]}")
    return complete[0]


def _test_hook(phase: str, step: int) -> None:
    want = os.environ.get(KILL_ENV)
    if want and want in (phase, f"{phase}@{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _pointer(ckpt_dir: Path) -> str | None:
    """The tag `latest` names when it names a complete step, else None (never raises)."""
    try:
        tag = (ckpt_dir / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if _TAG_RE.match(tag) and verify(ckpt_dir / tag) is None else None


def _write_synced(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _rotate(ckpt_dir: Path, keep_last: int, latest: str, keep: Collection[str] = ()) -> None:
    """Remove all but the newest `keep_last` steps; never `latest` (called after it moved) nor
    a tag in `keep` (the best validation's checkpoint). Half-written saves of an interrupted
    run (``.tmp-step_N``, model-sized) go too: this run's own save is complete by now."""
    for stale in ckpt_dir.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        for old in list_tags(ckpt_dir)[:-keep_last]:
            if old != latest and old not in keep:
                shutil.rmtree(ckpt_dir / old, ignore_errors=True)


# ---------------------------------------------------------------------- save
def save_checkpoint(engine: Any, rt: ParallelRuntime, ckpt_dir: str | Path, step: int,
                    meta: dict[str, Any], attachments: dict[str, Path], keep_last: int,
                    save_extra: Callable[[Path], None] | None = None,
                    keep: Collection[str] = ()) -> Path:
    """Save engine + metadata as `step_{step}` and move `latest` to it (collective).

    `save_extra(tag_dir)` runs on every rank before the checkpoint is completed (expert shards).
    Rotation spares the tags in `keep`. Returns the step directory; the step `latest` names is
    left as it is (already saved).
    """
    ckpt_dir = Path(ckpt_dir)
    tag = step_tag(step)
    final = ckpt_dir / tag
    # Saved already, with the same state: nothing to write (same answer on every rank, so
    # nothing changes before the barrier). With other state (a validation since: a stop signal
    # at the last step saved it first, or a resume at max_steps) it is saved again, whole.
    if _pointer(ckpt_dir) == tag and _same_meta(final, meta):
        if rt.is_main:
            _rotate(ckpt_dir, keep_last, tag, keep)  # a run killed before rotating
        barrier(rt)
        return final
    tmp_tag = f".tmp-{tag}"
    tmp_dir = ckpt_dir / tmp_tag
    if rt.is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    barrier(rt)
    # A full disk: one line naming the file, the temporary directory removed, and every rank
    # stops (each phase ends in an agreement that a failed rank reaches too).
    def complete() -> None:
        if rt.is_main:
            _complete_step(tmp_dir, step, meta, attachments)

    _saved_everywhere(rt, tmp_dir, final,
                      lambda: _write_step(engine, rt, tmp_dir, meta, save_extra))
    _test_hook("engine_saved", step)
    _saved_everywhere(rt, tmp_dir, final, complete)
    failed = None
    if rt.is_main:  # the others wait in the agreement below, which a failure here reaches too
        try:
            _publish(ckpt_dir, tmp_dir, final, tag, step, keep_last, keep)
        except Exception as exc:  # noqa: BLE001  (raised by the agreement, on this rank)
            shutil.rmtree(tmp_dir, ignore_errors=True)  # gone already once it was renamed
            failed = exc
    raise_if_any_rank_failed(rt, failed, f"{final}: rank 0 could not rename this checkpoint "
                             "into place or point latest at it (its error line says why)")
    return final


def _same_meta(tag_dir: Path, meta: dict[str, Any]) -> bool:
    """Whether the step's meta.json holds `meta` (as JSON)."""
    try:
        return read_meta(tag_dir) == json.loads(json.dumps(meta))
    except CheckpointError:
        return False


def _publish(ckpt_dir: Path, tmp_dir: Path, final: Path, tag: str, step: int, keep_last: int,
             keep: Collection[str]) -> None:
    """Rank 0: the complete temporary directory renamed to `final`, `latest` pointed at it,
    older steps rotated out. A `final` already there (torn, left by a killed run, or this
    step saved again with newer state) is replaced in one swap where the file system can."""
    _test_hook("before_rename", step)
    replace_dir(tmp_dir, final)
    _fsync(ckpt_dir)
    _test_hook("before_latest", step)
    _write_synced(ckpt_dir / "latest", tag + "\n")
    _test_hook("before_rotate", step)
    _rotate(ckpt_dir, keep_last, tag, keep)


def _saved_everywhere(rt: ParallelRuntime, tmp_dir: Path, final: Path,
                      write: Callable[[], Any]) -> None:
    """Run one phase of a save on every rank, then agree (collective) that it succeeded
    everywhere; if not, the temporary directory goes and every rank raises: the failed one its
    OSError naming the file, the others PeerFailed."""
    failed = None
    try:
        with write_errors_naming(final, tmp_dir):
            write()
    except Exception as exc:  # noqa: BLE001  (not only OSError: the others must not wait)
        failed = exc

    def cleanup() -> None:
        if rt.is_main:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    raise_if_any_rank_failed(rt, failed, f"{final}: another rank could not write this "
                             "checkpoint (its error line names the file)", cleanup)


def _complete_step(tmp_dir: Path, step: int, meta: dict[str, Any],
                   attachments: dict[str, Path]) -> None:
    """Rank 0: metadata and attachments into `tmp_dir`, everything fsynced, then
    complete.json (every file with its size) last."""
    write_json(tmp_dir / "meta.json", meta)
    for name, src in attachments.items():
        shutil.copyfile(src, tmp_dir / name)
    files = _files(tmp_dir)
    for name in files:
        _fsync(tmp_dir / name)
    _write_synced(tmp_dir / COMPLETE, json.dumps({"step": step, "files": files}, indent=1))
    _fsync(tmp_dir)


def _write_step(engine: Any, rt: ParallelRuntime, tmp_dir: Path, meta: dict[str, Any],
                save_extra: Callable[[Path], None] | None) -> None:
    """Every file of a step checkpoint into `tmp_dir` (collective). A part that fails on one
    rank (a full disk) does not stop it: every rank runs every part, so that the gathers and
    barriers inside them stay matched, and the first error is raised at the end."""
    errors: list[Exception] = []

    def part(write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001  (raised below, once every part has run)
            errors.append(exc)

    def engine_state() -> None:
        with _deferred_engine_writes(engine):
            engine.save_checkpoint(str(tmp_dir.parent), tag=tmp_dir.name,
                                   client_state={"moe_train": meta}, save_latest=False)

    def rng() -> None:
        with atomic_path(tmp_dir / f"rng_rank{rt.rank}.pt") as tmp:
            torch.save(rng_state(), tmp)

    part(engine_state)
    part(rng)
    if save_extra is not None:
        part(lambda: save_extra(tmp_dir))
    partitioned = is_zero_partitioned(engine.optimizer)
    if partitioned or has_unfused_masters(engine.optimizer):  # collective: every rank
        def dense() -> None:
            experts = {id(p) for _, m in expert_modules(engine.module) for p in m.parameters()}
            writer = TensorStoreWriter(tmp_dir, DENSE_STORE, active=rt.is_main)
            params = dense_params(engine.module, experts, frozen=is_zero3(engine.optimizer))
            # ZeRO 0 in 16-bit: the masters only (DeepSpeed's own files hold the moments)
            save_param_state(params, engine.optimizer, writer, moments=partitioned)
            writer.close({"step": adam_step(engine.optimizer), "lr_scheduler": {
                "last_epoch": int(getattr(engine.lr_scheduler, "last_epoch", 0))},
                "aliases": param_aliases(engine.module, params)})

        part(dense)
    if errors:
        raise errors[0]


ENGINE_WRITES = (("checkpoint_engine", ("save", "makedirs")), (None, ("_copy_recovery_script",)))
"""The methods through which DeepSpeed's `save_checkpoint` writes files: its checkpoint
engine's, and the engine's own copy of its recovery scripts (ZeRO 1-3, rank 0)."""


@contextlib.contextmanager
def _deferred_engine_writes(engine: Any) -> Iterator[None]:
    """DeepSpeed's file writes inside `save_checkpoint` (`ENGINE_WRITES`) record their first
    error instead of raising: the rank then still runs the collectives that follow them
    (ZeRO-3's gathers, the final barrier), and the error is raised once `save_checkpoint` has
    returned. Later writes are skipped."""
    errors: list[Exception] = []

    def deferred(write: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if errors:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (raised after save_checkpoint)
                errors.append(exc)
                return None

        return call

    patched: list[tuple[Any, str, Any]] = []  # (object, method, its own attribute or None)
    for attr, methods in ENGINE_WRITES:
        obj = engine if attr is None else getattr(engine, attr, None)
        for name in methods:
            if obj is not None and callable(getattr(obj, name, None)):
                patched.append((obj, name, vars(obj).get(name)))
                setattr(obj, name, deferred(getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, own in patched:
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------- load
def read_dense_state(tag_dir: Path) -> tuple[TensorSource, dict[str, Any]] | None:
    """(lazy per-parameter fp32 values and moments, {step, lr_scheduler}) of a ZeRO 1-3
    checkpoint: the optim_dense store, or the optim_dense.pt of older checkpoints; None when
    the checkpoint has neither (ZeRO 0)."""
    if has_store(tag_dir, DENSE_STORE):
        return open_store(tag_dir, DENSE_STORE)
    path = tag_dir / LEGACY_DENSE_OPTIM
    if not path.is_file():
        return None
    state = load_torch(path, "per-parameter optimizer state")
    return legacy_state_source(state, str(path)), {k: state[k] for k in ("step", "lr_scheduler")
                                                    if k in state}


def read_meta(tag_dir: str | Path) -> dict[str, Any]:
    path = Path(tag_dir) / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; not a moe_train checkpoint")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable meta data ({type(exc).__name__}); expected "
                              "the JSON a moe_train checkpoint writes") from None
    if not isinstance(meta, dict) or "config" not in meta or "step" not in meta:
        raise CheckpointError(f"{path}: expected a JSON object with 'step' and 'config'")
    step, config = meta["step"], meta["config"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: 'step' is {step!r}; expected a step number")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: 'config' is {type(config).__name__}; expected the "
                              "run's config as a JSON object")
    return meta


def _aliases(meta: dict[str, Any], src: TensorSource, tag_dir: Path) -> dict[str, str]:
    """The dense store's {alias: stored name} of tied parameters ({} in older checkpoints)."""
    aliases = meta.get("aliases", {})
    if not (isinstance(aliases, dict) and all(
            isinstance(k, str) and isinstance(v, str) and f"param/{v}" in src.shapes
            for k, v in aliases.items())):
        raise CheckpointError(f"{index_path(tag_dir, DENSE_STORE)}: meta.aliases must map "
                              "parameter names to parameters the store holds (tied weights)")
    return aliases


def consolidated_state_dict(tag_dir: str | Path) -> dict[str, torch.Tensor]:
    """Model weights of a step checkpoint, read without DeepSpeed: the model states, with the
    trainable ones from the per-parameter fp32 state where there is one (ZeRO 1-3, and ZeRO 0
    in 16-bit: under ZeRO-3 the model states hold only partitions, and in 16-bit training the
    masters are what the export holds; an fp32 run at ZeRO 0 has no store and needs none)."""
    path = Path(tag_dir) / "mp_rank_00_model_states.pt"
    if not path.is_file() and (Path(tag_dir) / ZERO3_MODEL_STATES).is_file():
        path = Path(tag_dir) / ZERO3_MODEL_STATES  # buffers whole, parameters partitioned
    if not path.is_file():
        raise CheckpointError(f"{path}: missing model states")
    states = load_torch(path, "DeepSpeed model states", mmap=True)  # the optimizer's unread
    state = states.get("module") if isinstance(states, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: no 'module' weights in the model states")
    state = dict(state)
    dense = read_dense_state(Path(tag_dir))
    if dense is not None:  # a tied parameter is stored once, its other names are aliases
        src, meta = dense
        state.update({k[len("param/"):]: src.get(k) for k in src.names()
                      if k.startswith("param/")})
        aliases = _aliases(meta, src, Path(tag_dir))
        state.update({alias: state[name] for alias, name in aliases.items()})
    state.update(full_expert_state(Path(tag_dir)))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
