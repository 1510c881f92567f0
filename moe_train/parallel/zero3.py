"""ZeRO stage 3: MoE layers as leaf modules, per-parameter state access, gathered weights.

Under ZeRO-3 DeepSpeed partitions every parameter over the data-parallel ranks and gathers a
module's parameters in a hook before its forward. Our MoE layer is marked a ZeRO-3 leaf
(`mark_moe_leaf_modules`): all its parameters (router, every expert, shared expert) are gathered
once when the layer starts, whatever experts its tokens use, so a rank whose batch leaves an
expert idle never waits for a gather the others skip (the hang transformers' own blocks have
unless marked). Expert parallelism stays with ZeRO 0-2.

Per-parameter access mirrors parallel/optim_state.py for ZeRO 1/2: getting a full fp32 value
or Adam moment is COLLECTIVE (an all-gather over the parameter's partition group), setting is
local (each rank writes its own partition: the fp32 master copy and, for values, the working
copy ``ds_tensor``). The partition of a parameter is its ``ds_tensor`` (padded to equal
sizes); the fp32 and Adam partitions are located through the optimizer's ``grad_position``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_train.utils.malloc import release_free_heap

MOMENTS = ("exp_avg", "exp_avg_sq")


def is_zero3(optimizer: Any) -> bool:
    """Whether `optimizer` is DeepSpeed's ZeRO stage 3 optimizer."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat")


def mark_moe_leaf_modules(model: nn.Module) -> int:
    """Mark every `MoELayer` of `model` a ZeRO-3 leaf module; returns how many there are."""
    from deepspeed.utils import set_z3_leaf_modules

    from moe_train.moe.layer import MoELayer

    count = sum(isinstance(m, MoELayer) for m in model.modules())
    if count:
        set_z3_leaf_modules(model, [MoELayer])
    return count


def register_tied_outputs(model: nn.Module) -> int:
    """Register each tied output projection's table (an embedding's parameter, used outside
    the embedding's forward) as an external parameter of the projection module, so ZeRO-3
    gathers it there, also when search calls the model's `decode` itself. Returns how many."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    from moe_train.models.transformer import TiedOutput

    tied = [m for m in model.modules() if isinstance(m, TiedOutput)]
    for module in tied:
        register_external_parameter(module, module.weight)
    return len(tied)


def _partition(optimizer: Any, p: nn.Parameter, key: str | None) -> tuple[Tensor, int]:
    """(this rank's fp32 partition of `p` or of its Adam state `key`, partition rank)."""
    part, _ = optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False,
                                                      optim_state_key=key)
    return part, dist.get_rank(group=optimizer._get_param_partition_group(p))


def z3_get(optimizer: Any, p: nn.Parameter, key: str | None) -> Tensor:
    """Full fp32 value (key None) or Adam state of `p` on CPU (collective)."""
    part, _ = _partition(optimizer, p, key)
    return optimizer._fp32_state_allgather(p, part).detach().cpu().clone()


def _ensure_moments(optimizer: Any, p: nn.Parameter, step: float) -> None:
    group_idx = optimizer.grad_position[optimizer.get_param_id(p)][0]
    flat = optimizer.fp32_partitioned_groups_flat[group_idx]
    slot = optimizer.optimizer.state[flat]
    if not all(k in slot for k in MOMENTS):  # Adam's state is created lazily
        slot.update({k: torch.zeros_like(flat) for k in MOMENTS})
        slot["step"] = torch.tensor(step, dtype=torch.float32)


def z3_set(optimizer: Any, p: nn.Parameter, key: str | None, value: Tensor,
           step: float = 0.0) -> None:
    """Write this rank's partition of the full `value` (local)."""
    if key is not None:
        _ensure_moments(optimizer, p, step)
    part, rank = _partition(optimizer, p, key)
    copy_partition(part, value, rank)
    if key is None:
        copy_partition(p.ds_tensor, value, rank)


def copy_partition(part: Tensor, value: Tensor, rank: int) -> None:
    """Write rank `rank`'s partition of the full `value` into `part` (equal partitions, the
    last one padded with zeros)."""
    flat, dst = value.reshape(-1), part.view(-1)
    lo = rank * dst.numel()
    n = max(0, min(dst.numel(), flat.numel() - lo))
    with torch.no_grad():
        dst.zero_()
        dst[:n].copy_(flat[lo:lo + n].to(dst.device, dst.dtype))


def adam_step(optimizer: Any) -> float:
    """Adam's update count under ZeRO-3 (0.0 before the first step)."""
    for slot in optimizer.optimizer.state.values():
        if "step" in slot:
            return float(slot["step"])
    return 0.0


def local_values(p: nn.Parameter) -> Tensor:
    """The values of `p` this rank holds, flattened: the parameter itself, or under ZeRO-3
    outside a forward (when `p` is an empty placeholder) the real elements of its partition
    ``ds_tensor``, without the last partition's uninitialised padding."""
    if not hasattr(p, "ds_tensor") or p.numel() > 0:
        return p.detach().reshape(-1)
    part = p.ds_tensor.detach().reshape(-1)
    rank = dist.get_rank(group=p.ds_process_group) if dist.is_initialized() else 0
    return part[:max(0, min(part.numel(), p.ds_numel - rank * part.numel()))]


def full_shape(p: nn.Parameter) -> torch.Size:
    """A parameter's full shape, partitioned (ZeRO-3) or not."""
    return getattr(p, "ds_shape", p.shape)


def is_partitioned(model: nn.Module) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitioned (forwards are then collective:
    every rank must run the same number of them)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def zero3_grad_norm(optimizer: Any) -> float:
    """The exact unscaled global gradient norm under ZeRO-3 before `engine.step()`: DeepSpeed's
    own per-group norms of the reduced gradient partitions (collective)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    norm = combine_grad_norm_groups(optimizer._get_norm_groups())
    return float(norm) / float(optimizer.loss_scale)


@contextlib.contextmanager
def skipped_zero3_step(optimizer: Any) -> Iterator[None]:
    """`step()` inside this block sees an invalid gradient norm and takes DeepSpeed's own
    overflow path: gradients dropped, no update, the loss scaler told."""
    optimizer._get_norm_groups = lambda: [torch.tensor(float("inf"))]
    try:
        yield
    finally:
        del optimizer._get_norm_groups  # the class's method again


def full_numel(p: nn.Parameter) -> int:
    """A parameter's full element count, partitioned (ZeRO-3) or not."""
    return int(getattr(p, "ds_numel", p.numel()))


def gathered_tensors(model: nn.Module, keep: bool = True) -> Iterator[tuple[str, Tensor | None]]:
    """(name, fp32 CPU copy) of every state-dict entry of a ZeRO-3 partitioned model, each
    parameter gathered only while its copy is made (collective: every rank iterates to the
    end). Ranks that do not `keep` get None and hold nothing beyond one gathered parameter."""
    import deepspeed

    for name, t in model.state_dict(keep_vars=True).items():
        with deepspeed.zero.GatheredParameters([t] if hasattr(t, "ds_id") else [],
                                               modifier_rank=None):
            value = None
            if keep:
                value = t.detach().float().cpu().clone() if t.is_floating_point() else \
                    t.detach().cpu().clone()
        yield name, value


def gathered_state_dict(model: nn.Module, keep: bool = True) -> dict[str, Tensor]:
    """The full state dict of a ZeRO-3 partitioned model, fp32 copies on CPU, kept only where
    `keep` (collective; `gathered_tensors`)."""
    return {name: value for name, value in gathered_tensors(model, keep) if value is not None}


@contextlib.contextmanager
def partitioned_build(ds_config: dict[str, Any], trim: bool = True) -> Iterator[None]:
    """Modules built inside have their parameters partitioned as each is created
    (`deepspeed.zero.Init`): a model too large for one process never exists whole. Their
    values are meaningless until loaded (`load_partitioned`): parent modules cannot
    re-initialize partitioned children, so this is for models whose weights come from a file.

    On the CPU every parameter is made whole in the heap and then cut to its partition, which
    leaves holes glibc keeps: building the 3.52B Trim-MoE on two ranks without a trim, ranks
    peaked at 4.6 GiB and, in some runs, 8.2-8.4 GiB, above the whole model's 6.6 GiB, for a
    3.3 GiB bf16 partition. The heap is trimmed after each module, which keeps the peak at 3.9
    GiB (`trim` False leaves it alone; benchmarks/zero3_memory.py measures both)."""
    import deepspeed
    import torch._dynamo  # noqa: F401  imported before zero.Init patches torch.Tensor

    try:  # transformers imports dynamo-checked code lazily inside model constructors
        import transformers.masking_utils  # noqa: F401
        import transformers.models.qwen2_moe.modeling_qwen2_moe  # noqa: F401
    except ImportError:
        pass
    from deepspeed.accelerator import get_accelerator

    init = deepspeed.zero.Init
    if trim and get_accelerator().device_name() == "cpu":
        class _TrimmingInit(init):  # type: ignore[misc, valid-type]
            def _post_init_method(self, module: nn.Module) -> None:
                super()._post_init_method(module)
                if any(True for _ in module.parameters(recurse=False)):
                    release_free_heap()
        init = _TrimmingInit
    with init(config_dict_or_path=ds_config):
        yield


@torch.no_grad()
def load_partitioned(model: nn.Module, read: Callable[[str], Tensor], is_main: bool) -> None:
    """Fill a model tensor by tensor, in state-dict order. A ZeRO-3 partitioned parameter is
    collective: `read(name)` runs on the main rank only and its value is scattered to every
    rank's partition (`GatheredParameters` with modifier rank 0); anything not partitioned
    (buffers, or every tensor of a plain model) is read on every rank. A parameter tied under
    several names is loaded once."""
    import deepspeed

    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not hasattr(t, "ds_id"):
            t.copy_(read(name))
            continue
        with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
            if is_main:
                t.data.copy_(read(name))
