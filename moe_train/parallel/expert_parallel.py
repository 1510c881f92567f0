"""Expert parallelism: DeepSpeed's expert / expert-data groups, the all-to-all dispatcher, and
wiring both into an already-built (single-device) model.

With ep_size P, rank r of an expert-parallel group holds experts [r*E/P, (r+1)*E/P) of every MoE
layer. `AllToAllDispatcher` sorts routed rows by global expert (contiguous per destination rank),
exchanges per-expert counts, then the rows with variable split sizes (`all_to_all_single`, no
capacity padding), and regroups what it received by local expert; `combine` runs the same route
backwards. Expert parameters are marked the way DeepSpeed's engine recognises (``allreduce =
False`` and the ``ep_size_P`` group name), so it reduces their gradients over the expert-data-
parallel group and counts them once in the gradient norm.

Shape legend: T tokens, K slots, E experts (global), L local experts (E / P), P ep size,
N rows sent by this rank, M rows received, D model dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_train.config.moe import task_count
from moe_train.errors import ConfigError
from moe_train.kernels.histogram import expert_histogram
from moe_train.kernels.permute import permute, unpermute
from moe_train.moe.dispatcher import LocalDispatcher
from moe_train.moe.experts import StackedExperts
from moe_train.moe.layer import MoELayer
from moe_train.moe.routing import Routing
from moe_train.parallel.runtime import ParallelRuntime


def ep_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of size `ep_size`."""
    return f"ep_size_{ep_size}"


def setup_expert_parallel(rt: ParallelRuntime, ep_size: int) -> ParallelRuntime:
    """Create (through DeepSpeed's groups) the expert-parallel and expert-data-parallel groups."""
    if rt.world_size % ep_size:
        raise ConfigError(f"moe.ep_size: expected a divisor of the world size "
                          f"({rt.world_size}), got {ep_size}")
    if ep_size == 1:
        return dataclasses.replace(rt, ep_size=1)
    from deepspeed.utils import groups

    name = ep_group_name(ep_size)
    groups._create_expert_and_data_parallel(ep_size)
    ep_group = groups._get_expert_parallel_group(name)
    return dataclasses.replace(rt, ep_size=ep_size, ep_group=ep_group,
                               ep_rank=dist.get_rank(group=ep_group),
                               edp_group=groups._get_expert_data_parallel_group(name))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int],
                group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """Differentiable variable-split all-to-all over `group`."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass(frozen=True)
class AllToAllMeta:
    """What `AllToAllDispatcher.combine` needs."""

    row_map_N: Tensor
    weights_TK: Tensor
    num_tokens: int
    dropped: Tensor
    send_splits: list[int]
    """Rows this rank sent to each ep rank."""
    recv_splits: list[int]
    """Rows this rank received from each ep rank."""
    local_order_M: Tensor
    """Permutation of the received rows that groups them by local expert."""


class AllToAllDispatcher:
    """Dispatch over an expert-parallel group of `ep_size` ranks (dropless unless capped)."""

    def __init__(self, num_experts: int, ep_size: int, ep_group: Any,
                 capacity_factor: float = 0.0) -> None:
        if num_experts % ep_size:
            raise ConfigError(f"moe.num_experts: expected a multiple of moe.ep_size "
                              f"({ep_size}), got {num_experts}")
        self.num_experts, self.ep_size, self.group = num_experts, ep_size, ep_group
        self.num_local = num_experts // ep_size
        self.local = LocalDispatcher(num_experts, capacity_factor)

    def dispatch(self, x_TD: Tensor, routing: Routing, drop: bool = True
                 ) -> tuple[Tensor, Tensor, AllToAllMeta]:
        """(rows this rank's experts receive, grouped by local expert; their counts_L; meta).
        One host sync: the send and receive splits are read together, and the rows sent (N,
        their sum) go to `permute`, which then reads nothing itself."""
        ids_TK, weights_TK, dropped = self.local.route_slots(routing, drop)
        P, L = self.ep_size, self.num_local
        counts_PL = expert_histogram(ids_TK, self.num_experts).view(P, L)
        recv_counts_PL = torch.empty_like(counts_PL)
        dist.all_to_all_single(recv_counts_PL, counts_PL.contiguous(), group=self.group)
        send_splits, recv_splits = torch.stack([counts_PL.sum(1), recv_counts_PL.sum(1)]).tolist()
        x_ND, row_map_N, _ = permute(x_TD, ids_TK, self.num_experts, num_rows=sum(send_splits))
        x_MD = all_to_all(x_ND, recv_splits, send_splits, self.group)
        # received rows are ordered (source rank, local expert): regroup by local expert
        local_ids_M = torch.repeat_interleave(
            torch.arange(L, device=x_TD.device).repeat(P), recv_counts_PL.reshape(-1),
            output_size=x_MD.size(0))
        local_order_M = torch.sort(local_ids_M, stable=True).indices
        x_local_MD = x_MD.index_select(0, local_order_M)
        meta = AllToAllMeta(row_map_N, weights_TK, x_TD.size(0), dropped, send_splits,
                            recv_splits, local_order_M)
        return x_local_MD, recv_counts_PL.sum(0), meta

    def combine(self, y_local_MD: Tensor, meta: AllToAllMeta) -> Tensor:
        y_MD = torch.empty_like(y_local_MD).index_copy(0, meta.local_order_M, y_local_MD)
        y_ND = all_to_all(y_MD, meta.send_splits, meta.recv_splits, self.group)
        return unpermute(y_ND, meta.row_map_N, meta.weights_TK, meta.num_tokens)


def _shard_experts(experts: StackedExperts, ep_rank: int, ep_size: int) -> None:
    """Keep only this rank's slice [ep_rank*L, (ep_rank+1)*L) of every stacked parameter."""
    L = experts.num_experts // ep_size
    for name, param in list(experts.named_parameters(recurse=False)):
        local = param.data[ep_rank * L:(ep_rank + 1) * L].clone()
        setattr(experts, name, nn.Parameter(local, requires_grad=param.requires_grad))
    experts.num_experts = L


def wire_expert_parallel(model: nn.Module, rt: ParallelRuntime) -> int:
    """Shard every MoE layer's experts over the ep group and swap in the all-to-all dispatcher.

    Call after the model is built with the same seed on every rank (so the slices form the same
    global initialisation as an EP=1 model) and before the DeepSpeed engine is created. Returns
    the number of MoE layers wired.
    """
    if rt.ep_size == 1:
        return 0
    wired = 0
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        E = module.router.num_experts
        _shard_experts(module.experts, rt.ep_rank, rt.ep_size)
        module.dispatcher = AllToAllDispatcher(E, rt.ep_size, rt.ep_group,
                                               module.dispatcher.capacity_factor)
        for param in module.experts.parameters():
            # DeepSpeed's marks for expert parameters: reduced over the expert-data group
            param.allreduce = False
            param.group_name = ep_group_name(rt.ep_size)
        wired += 1
    return wired


def moe_param_groups(model: nn.Module, groups: list[dict[str, Any]], ep_size: int
                     ) -> list[dict[str, Any]]:
    """Split each optimizer group into its dense and its expert parameters.

    The layout is the same at every ep size (so optimizer state saved at one ep size loads at
    another); with ep_size > 1 the expert groups carry DeepSpeed's MoE marks (``moe: True`` and
    the ep group's name), so ZeRO partitions them over the expert-data-parallel group.
    """
    expert_ids = {id(p) for m in model.modules() if isinstance(m, StackedExperts)
                  for p in m.parameters()}
    out: list[dict[str, Any]] = []
    for group in groups:
        dense = [p for p in group["params"] if id(p) not in expert_ids]
        experts = [p for p in group["params"] if id(p) in expert_ids]
        if dense:
            out.append({**group, "params": dense})
        if experts:
            marks = ({"moe": True, "name": ep_group_name(ep_size)} if ep_size > 1
                     else {"name": f"{group.get('name', 'group')}_experts"})
            out.append({**group, "params": experts, **marks})
    return out


def check_moe_against_data(cfg: Any, manifest: dict[str, Any]) -> None:
    """Task routers need task ids the prepared data has, and enough task embeddings."""
    moe = cfg.moe
    if getattr(cfg, "uses_thor", False) and cfg.thor.num_tasks:
        source = cfg.thor.task_source
        if cfg.thor.num_tasks < task_count(source, manifest):
            raise ConfigError(f"thor.num_tasks: expected at least "
                              f"{task_count(source, manifest)} (tasks by "
                              f"{source} in the prepared data, see thor.task_source), got "
                              f"{cfg.thor.num_tasks}")
    for side in ("encoder", "decoder"):
        if moe.router_name(side) != "task":
            continue
        field = f"moe.{side}_task_source"
        source = getattr(moe, f"{side}_task_source")
        if source == "task_ids":
            raise ConfigError(f"{field}: task_ids, but the prepared data carries no task ids "
                              "(use lang_pair, tgt_lang or domain)")
        tasks = getattr(moe, f"{side}_task_table") or len(moe.assignment) or moe.num_tasks
        if not tasks:
            continue  # a learned gate with num_tasks 0 takes the data's count
        if tasks < task_count(source, manifest):
            raise ConfigError(f"moe.num_tasks: expected at least "
                              f"{task_count(source, manifest)} (tasks by "
                              f"{source} in the prepared data, see {field}), got {tasks}")


@contextlib.contextmanager
def deepspeed_sees_moe_layers() -> Iterator[None]:
    """During `deepspeed.initialize`, let the engine recognise our `MoELayer` as an MoE layer.

    DeepSpeed enables its expert-gradient reduction (over the expert-data-parallel group) and
    ZeRO's MoE parameter-group partitioning only when it finds its own MoE class in the model;
    it checks with `isinstance(module, MoE)`, so the name is widened to (MoE, MoELayer) for the
    duration of the call. Nothing else of DeepSpeed's MoE machinery is used.
    """
    import deepspeed.runtime.engine as engine_module

    original = engine_module.MoE
    engine_module.MoE = (original, MoELayer)
    try:
        yield
    finally:
        engine_module.MoE = original


@contextlib.contextmanager
def without_deepspeed_moe_checkpointing(engine: Any) -> Iterator[None]:
    """Save / load engine state with DeepSpeed's own MoE checkpoint layout switched off (it
    expects its MoE modules); our expert tensors go through parallel.expert_checkpoint."""
    flag = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = flag
