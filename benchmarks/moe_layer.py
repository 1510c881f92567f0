"""MoE layer benchmark: our layer vs DeepSpeed's stock MoE, Megatron-core permute, and two floors.

    .venv/bin/python benchmarks/moe_layer.py [--device cpu|cuda] [--quick] [--experts 8 32 128]
                                             [--ks 1 2]

Forward + backward of one MoE layer over T tokens at E in {8, 32, 128}, k in {1, 2} (CPU: D=256,
F=1024, T=4096 fp32; CUDA: D=1024, F=4096, T=16384 bf16), every implementation on the same x_TD
and output gradient: ours (MoELayer, dropless), DeepSpeed's stock MoE (capacity 1.0),
Megatron-core's moe_utils permute/unpermute around a per-expert loop, and two floors measured in
the same run: our Experts alone on rows pre-permuted with our router's counts, and one dense
(T*k x D)@(D x F), relu, (F x D) pair. Also peak memory, our layer's stage times, and the EP=2
all-to-all bytes against the minimum (moe_layer_ep.py). Every implementation runs under the same
CPU allocator (`--allocator`, default: `tune_cpu_allocator`, as `init_runtime` applies it).
Writes benchmarks/results/moe_layer_<device>.json (`--quick`: tiny sizes, ..._quick.json);
benchmarks/README.md explains every field.

Shape legend: T tokens, D model dim, F expert FFN dim, E experts, K slots per token, N routed
rows (T*K: dropless), B batch (1 here).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from measure import Step, measure_peak, profile_top_ops, time_interleaved  # noqa: E402
from moe_layer_ep import ep_bytes  # noqa: E402  (benchmarks/ is sys.path[0])

from moe_train.config import RouterConfig  # noqa: E402
from moe_train.models.context import ForwardContext  # noqa: E402
from moe_train.moe.dispatcher import LocalDispatcher  # noqa: E402
from moe_train.moe.experts import Experts  # noqa: E402
from moe_train.moe.layer import MoELayer  # noqa: E402
from moe_train.moe.registry import build_router  # noqa: E402
from moe_train.parallel.runtime import free_port, init_runtime  # noqa: E402
from moe_train.utils.atomic import write_json  # noqa: E402
from moe_train.utils.malloc import tune_cpu_allocator  # noqa: E402
from moe_train.utils.provenance import finish, provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    command_line, int_at_least, results_path, script_parser)


@dataclasses.dataclass(frozen=True)
class Shape:
    D: int
    F: int
    T: int
    T_ep: int
    """Tokens per rank in the EP=2 byte count."""
    dtype: torch.dtype
    experts: tuple[int, ...] = (8, 32, 128)
    ks: tuple[int, ...] = (1, 2)
    reps: int = 7
    warmup: int = 2


SHAPES = {
    "cpu": Shape(D=256, F=1024, T=4096, T_ep=1024, dtype=torch.float32, reps=15),
    "cuda": Shape(D=1024, F=4096, T=16384, T_ep=1024, dtype=torch.bfloat16, reps=20, warmup=5),
}
QUICK = Shape(D=64, F=256, T=512, T_ep=64, dtype=torch.float32, experts=(8, 32), reps=2,
              warmup=1)
AUX_COEF, Z_COEF = 0.01, 0.001


# --- the implementations -------------------------------------------------------------------

def build_ours(E: int, k: int, shape: Shape, seed: int = 0) -> MoELayer:
    """Our layer as moe_train.models.build makes it: top-k router, dropless dispatch."""
    torch.manual_seed(seed)
    cfg = RouterConfig(k=k, capacity_factor=0.0, aux_loss_coef=AUX_COEF, z_loss_coef=Z_COEF)
    return MoELayer(build_router("topk", shape.D, E, cfg), LocalDispatcher(E, 0.0),
                    Experts(E, shape.D, shape.F))


def ffn(D: int, F_: int) -> nn.Module:
    return nn.Sequential(nn.Linear(D, F_), nn.ReLU(), nn.Linear(F_, D))


class MegatronStyleMoE(nn.Module):
    """Megatron-core's dropless path: `topk_routing_with_score_function`, its aux and z losses,
    `permute`, a loop over per-expert FFN modules, `unpermute` with the routing probs."""

    def __init__(self, E: int, k: int, D: int, F_: int) -> None:
        super().__init__()
        from megatron.core.transformer.moe import moe_utils
        self.mu, self.k, self.E = moe_utils, k, E
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(ffn(D, F_) for _ in range(E))

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        logits_TE = self.gate(x_TD).float()
        probs_TE, map_TE = self.mu.topk_routing_with_score_function(logits_TE, self.k)
        counts_E = map_TE.sum(0)
        aux = self.mu.switch_load_balancing_loss_func(
            logits_TE.softmax(-1), counts_E, x_TD.size(0), self.k, self.E, AUX_COEF) \
            + self.mu.z_loss_func(logits_TE, Z_COEF)
        x_ND, _, sorted_N = self.mu.permute(x_TD, map_TE)
        chunks = torch.split(x_ND, counts_E.tolist())
        y_ND = torch.cat([expert(c) for c, expert in zip(chunks, self.experts)])
        return self.mu.unpermute(y_ND, sorted_N, x_TD.shape, probs=probs_TE,
                                 routing_map=map_TE), aux

    @torch.no_grad()
    def load_from(self, ours: MoELayer) -> None:
        """Take `ours`'s router and expert weights."""
        self.gate.weight.copy_(ours.router.gate.weight.weight)
        ex = ours.experts
        for e, mlp in enumerate(self.experts):
            mlp[0].weight.copy_(ex.w1_EDF[e].t()), mlp[0].bias.copy_(ex.b1_EF[e])
            mlp[2].weight.copy_(ex.w2_EFD[e].t()), mlp[2].bias.copy_(ex.b2_ED[e])


def build_deepspeed(E: int, k: int, shape: Shape) -> nn.Module:
    """DeepSpeed's stock MoE; it needs a process group (made in `main`) for its groups."""
    from deepspeed.moe.layer import MoE
    moe = MoE(shape.D, expert=ffn(shape.D, shape.F), num_experts=E, ep_size=1, k=k,
              capacity_factor=1.0)
    moe.set_deepspeed_parallelism()
    return moe


@dataclasses.dataclass
class Inputs:
    """One configuration's shared data: x, output gradients, our layer and its routing."""

    x_TD: Tensor
    g_TD: Tensor
    x_ND: Tensor
    """x rows permuted by our router (expert-contiguous): the floors' input."""
    g_ND: Tensor
    counts_E: Tensor
    ours: MoELayer


def make_inputs(E: int, k: int, shape: Shape, device: str) -> Inputs:
    gen = torch.Generator().manual_seed(1234)
    x_TD, g_TD = (torch.randn(shape.T, shape.D, generator=gen).to(device, shape.dtype)
                  for _ in range(2))
    ours = build_ours(E, k, shape).to(device, shape.dtype)
    with torch.no_grad():
        x_ND, counts_E, _ = ours.dispatcher.dispatch(x_TD, ours.router.route(x_TD))
    g_ND = torch.randn(x_ND.shape, generator=gen).to(device, shape.dtype)
    return Inputs(x_TD, g_TD, x_ND.contiguous(), g_ND, counts_E, ours)


def fwd_bwd(leaves: list[Tensor], run: Step, release: Callable[[], None] = lambda: None
            ) -> Step:
    """A step: reset the leaves' grads to None, run forward + backward; `step.leaves` and
    `step.release` (drops gradient storage kept between steps) are for the memory measurement."""
    def step() -> dict[str, Any]:
        for t in leaves:
            t.grad = None
        return run()
    step.leaves, step.release = leaves, release  # type: ignore[attr-defined]
    return step


def step_ours(inp: Inputs) -> Step:
    layer, x = inp.ours, inp.x_TD.clone().requires_grad_(True)

    def run() -> dict[str, Any]:
        y_BTD, aux = layer(x.view(1, *x.shape), ForwardContext())
        torch.autograd.backward([y_BTD.view_as(x), sum(aux.values())],
                                [inp.g_TD, torch.ones((), device=x.device)])
        return {"dropped_slots": int(layer.dropped_slots),
                "routed_slots": int(layer.tokens_per_expert_E.sum())}
    return fwd_bwd([x, *layer.parameters()], run, layer.experts.grad_buffers.clear)


def step_deepspeed(moe: nn.Module, inp: Inputs) -> Step:
    x = inp.x_TD.clone().requires_grad_(True)
    seen: dict[str, Any] = {}
    moe.deepspeed_moe.gate.register_forward_hook(lambda m, i, out: seen.update(out=out))

    def run() -> dict[str, Any]:
        y_BTD, l_aux, _ = moe(x.view(1, *x.shape))
        torch.autograd.backward([y_BTD.view_as(x), AUX_COEF * l_aux],
                                [inp.g_TD, torch.ones((), device=x.device)])
        _, capacity, E, ids_KT, _, _, counts_E = seen["out"]  # the gate's sparse-route output
        C = int(capacity)
        return {"dropped_slots": int((ids_KT < 0).sum()), "routed_slots": int(counts_E.sum()),
                "capacity": C, "computed_rows": C * int(E),
                "dropped_from_capacity": int((counts_E - C).clamp(min=0).sum())}
    return fwd_bwd([x, *moe.parameters()], run)


def step_expert_gemms(inp: Inputs) -> Step:
    experts, x = inp.ours.experts, inp.x_ND.clone().requires_grad_(True)
    return fwd_bwd([x, *experts.parameters()],
                   lambda: experts(x, inp.counts_E).backward(inp.g_ND) or {},
                   experts.grad_buffers.clear)


def step_dense(inp: Inputs, shape: Shape) -> Step:
    gen = torch.Generator().manual_seed(7)
    w1 = (torch.randn(shape.D, shape.F, generator=gen) * 0.05).to(inp.x_ND)
    w2 = (torch.randn(shape.F, shape.D, generator=gen) * 0.05).to(inp.x_ND)
    x, b1, b2 = inp.x_ND.clone(), w1.new_zeros(shape.F), w1.new_zeros(shape.D)
    leaves = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2)]

    def run() -> dict[str, Any]:
        torch.addmm(b2, F.relu(torch.addmm(b1, x, w1)), w2).backward(inp.g_ND)
        return {}
    return fwd_bwd(leaves, run)


def build_steps(E: int, k: int, shape: Shape, device: str, only: str | None = None
                ) -> tuple[Inputs, dict[str, Step]]:
    """The fwd+bwd step of every implementation (or only of `only`) at one configuration."""
    inp = make_inputs(E, k, shape, device)
    steps: dict[str, Step] = {}
    if only in (None, "ours"):
        steps["ours"] = step_ours(inp)
    if only in (None, "deepspeed"):
        torch.manual_seed(1)
        moe = build_deepspeed(E, k, shape).to(device, shape.dtype)
        with torch.no_grad():  # the same gate as ours
            moe.deepspeed_moe.gate.wg.weight.copy_(inp.ours.router.gate.weight.weight)
        steps["deepspeed"] = step_deepspeed(moe, inp)
    if only in (None, "megatron"):
        mod = MegatronStyleMoE(E, k, shape.D, shape.F).to(device, shape.dtype)
        mod.load_from(inp.ours)
        x = inp.x_TD.clone().requires_grad_(True)
        steps["megatron"] = fwd_bwd([x, *mod.parameters()], lambda: torch.autograd.backward(
            mod(x), [inp.g_TD, torch.ones((), device=x.device)]) or {"dropped_slots": 0})
    if only in (None, "expert_gemms"):
        steps["expert_gemms"] = step_expert_gemms(inp)
    if only in (None, "dense_gemm"):
        steps["dense_gemm"] = step_dense(inp, shape)
    return inp, steps


# --- measuring -----------------------------------------------------------------------------

def peak_in_subprocess(impl: str, E: int, k: int, args: argparse.Namespace) -> dict[str, Any]:
    """CPU: `measure_peak` in a fresh interpreter whose malloc gives every block of 64 KiB or
    more back to the OS when freed, so that RSS follows the live tensors (whatever --allocator
    says: memory kept in the heap would hide the peak)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(Path(__file__)), "--peak-child", impl, str(E), str(k),
           "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"peak_error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def stage_breakdown(inp: Inputs, device: str, warmup: int, reps: int) -> dict[str, float]:
    """Median ms of our layer's stages, each run alone fwd + bwd on the same data: route (gate,
    softmax, top-k, aux losses), dispatch (histogram, stable sort, row gather), combine
    (weighted scatter-add), record (the logging statistics, no grad)."""
    layer = inp.ours
    x = inp.x_TD.clone().requires_grad_(True)
    one = torch.ones((), device=x.device)
    with torch.no_grad():
        routing = layer.router.route(inp.x_TD)
        _, _, meta = layer.dispatcher.dispatch(inp.x_TD, routing)
    y_ND = inp.x_ND.clone().requires_grad_(True)
    w_TK = routing.weights_TK.clone().requires_grad_(True)
    meta_w, gw_TK = dataclasses.replace(meta, weights_TK=w_TK), torch.randn_like(w_TK)

    def route() -> dict:
        r = layer.router.route(x)
        torch.autograd.backward([r.weights_TK, sum(r.aux_losses.values())], [gw_TK, one])
        return {}

    steps = {
        "route": fwd_bwd([x, *layer.router.parameters()], route),
        "dispatch": fwd_bwd([x], lambda: layer.dispatcher.dispatch(x, routing)[0]
                            .backward(inp.g_ND) or {}),
        "combine": fwd_bwd([y_ND, w_TK], lambda: layer.dispatcher.combine(y_ND, meta_w)
                           .backward(inp.g_TD) or {}),
        "record": lambda: layer._record(routing, meta) or {},
    }
    times, _ = time_interleaved(steps, device, warmup, reps)
    return {f"{n}_ms": round(statistics.median(t), 3) for n, t in times.items()}


def equivalence_check() -> dict[str, Any]:
    """Ours and the Megatron-style baseline with the same weights compute the same function
    (a like-for-like comparison): max |difference| of the outputs and of the input gradients,
    on a small fp32 case on the CPU whatever device the timings use (recorded as `device`
    and `dtype`, so a CUDA record does not read as a check of its bf16 kernels)."""
    out: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
    for k in (1, 2):
        inp = make_inputs(8, k, dataclasses.replace(QUICK, T=256, D=32, F=64), "cpu")
        mod = MegatronStyleMoE(8, k, 32, 64)
        mod.load_from(inp.ours)
        x0, x1 = (inp.x_TD.clone().requires_grad_(True) for _ in range(2))
        y0, y1 = inp.ours(x0[None], ForwardContext())[0][0], mod(x1)[0]
        torch.autograd.backward([y0, y1], [inp.g_TD, inp.g_TD])
        out[f"k{k}"] = {"max_abs_diff_y": float((y0 - y1).abs().max()),
                        "max_abs_diff_dx": float((x0.grad - x1.grad).abs().max())}
        if out[f"k{k}"]["max_abs_diff_y"] > 1e-4:
            raise AssertionError(f"megatron-style baseline differs from ours: {out}")
    return out


# --- the run -------------------------------------------------------------------------------

def bench_config(E: int, k: int, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    inp, steps = build_steps(E, k, shape, device)
    times, info = time_interleaved(steps, device, shape.warmup, shape.reps)
    med = {n: statistics.median(t) for n, t in times.items()}
    counts = inp.counts_E.tolist()
    row: dict[str, Any] = {
        "experts": E, "k": k, "routed_slots": sum(counts),
        "tokens_per_expert": {"min": min(counts), "max": max(counts), "mean": sum(counts) / E,
                              "counts": counts},
        "impls": {name: {"ms": round(med[name], 3), "ms_reps": [round(t, 2) for t in times[name]],
                         "vs_expert_gemms": round(med[name] / med["expert_gemms"], 3),
                         "vs_dense_gemm": round(med[name] / med["dense_gemm"], 3), **info[name]}
                  for name in steps}}
    row["ours_stages"] = stages = stage_breakdown(inp, device, shape.warmup, shape.reps)
    stages["experts_ms"] = round(med["expert_gemms"], 3)
    stages["sum_ms"] = round(sum(stages.values()), 3)
    stages["overhead_vs_floor_ms"] = round(med["ours"] - med["expert_gemms"], 3)
    row["ours_profile_top_ops"] = profile_top_ops(steps["ours"], device)
    inp_grad_buffer_bytes = inp.ours.experts.grad_buffers.nbytes()
    del steps, inp
    gc.collect()
    for name in row["impls"]:
        if device == "cuda":
            _, one = build_steps(E, k, shape, device, only=name)
            row["impls"][name].update(measure_peak(one[name], device))
            del one
        else:
            row["impls"][name].update(peak_in_subprocess(name, E, k, args))
    ours = row["impls"]["ours"]
    ours["grad_buffer_bytes"] = inp_grad_buffer_bytes
    row["ep2"] = ep_bytes(build_ours, E, k, shape)
    row["acceptance"] = {
        "ours_within_1.15x_expert_gemms": ours["vs_expert_gemms"] <= 1.15,
        "ours_no_token_dropped": ours["dropped_slots"] == 0,
        "ours_faster_than_deepspeed_at_E_ge_32": None if E < 32
        else ours["ms"] < row["impls"]["deepspeed"]["ms"],
        "ep2_bytes_within_1.05x_min": row["ep2"]["ratio_to_min"] <= 1.05}
    return row


def memory_flat_in_E(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Our transient memory (peak minus the gradients) per k: its largest value over E within
    1.25x of its value at the smallest E, i.e. no growth with E beyond the expert weights.
    None where a k was measured at fewer than two expert counts (nothing to compare)."""
    ratios = {}
    for k in sorted({r["k"] for r in rows}):
        mem = [r["impls"]["ours"].get("peak_minus_grad_bytes")  # smallest E first
               for r in sorted(rows, key=lambda r: r["experts"]) if r["k"] == k]
        if len(mem) < 2 or None in mem or mem[0] <= 0:
            return {"ours_peak_minus_grad_flat_in_E": None}
        ratios[f"k{k}"] = round(max(mem) / mem[0], 3)
    return {"ours_peak_minus_grad_flat_in_E": all(v <= 1.25 for v in ratios.values()),
            "ours_peak_minus_grad_max_over_smallest_E": ratios}


def megatron_status() -> dict[str, Any]:
    """Megatron-core's MoE utilities imported here, and whether apex / Transformer Engine (its
    fused paths) are installed: without them it falls back to the unfused torch path."""
    import importlib.util

    try:
        import deepspeed.moe.layer  # noqa: F401
        import megatron.core.transformer.moe.moe_utils  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"error: benchmarks/moe_layer.py needs deepspeed and megatron-core "
                         f"(`make setup` installs them: .[dev]); {err}") from None
    return {"apex_installed": importlib.util.find_spec("apex") is not None,
            "transformer_engine_installed":
                importlib.util.find_spec("transformer_engine") is not None}


ALLOCATORS = ("tuned", "default")
METHOD = {
    "fields": "benchmarks/README.md defines every implementation and field",
    "megatron": "megatron.core.transformer.moe.moe_utils permute/unpermute around a per-expert "
                "loop (the unfused path)",
    "ep2_min": "min_bytes_routed_rows = 4 x (routed slots whose expert is on the other rank) x "
               "D x element bytes, over both ranks: each such row goes out and its output comes "
               "back in forward, and its gradient makes the same two trips in backward",
}


def _holds_on_every_row(rows: list[dict], key: str) -> bool | None:
    """Whether acceptance item `key` holds on every row it applies to; None when it applies to
    none (e.g. a subset run without E >= 32), not a vacuous True."""
    applies = [r["acceptance"][key] for r in rows if r["acceptance"][key] is not None]
    return all(applies) if applies else None


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    ap.add_argument("--threads", type=int_at_least(1), default=2,
                    help="torch CPU threads (default 2)")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="tuned",
                    help="CPU malloc for every implementation: tuned (tune_cpu_allocator, what "
                         "init_runtime applies) or default (glibc's)")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/moe_layer_<device>[_quick]"
                         "[_alloc-<allocator>][_e<E...>][_k<k...>].json")
    ap.add_argument("--experts", type=int_at_least(1), nargs="+", default=None,
                    help="expert counts to run (default: the shape's, 8 32 128)")
    ap.add_argument("--ks", type=int_at_least(1), nargs="+", default=None,
                    help="experts per token to run (default: 1 2)")
    ap.add_argument("--peak-child", nargs=3, metavar=("IMPL", "E", "K"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: expected a CUDA GPU, found none")
    device = args.device
    shape = QUICK if args.quick else SHAPES[device]
    for name, values in (("experts", args.experts), ("ks", args.ks)):
        if values is not None:
            shape = dataclasses.replace(shape, **{name: tuple(values)})
    if max(shape.ks) > min(shape.experts):
        ap.error(f"--ks/--experts: expected every k at most the fewest experts, got k "
                 f"{list(shape.ks)} with {list(shape.experts)} experts")
    odd = [E for E in shape.experts if E % 2]
    if odd:
        ap.error(f"--experts: expected even counts (each is also measured split over two "
                 f"expert-parallel ranks), got {odd}")
    if args.peak_child:  # RSS measurement: glibc as the parent's environment set it
        init_runtime(tune_allocator=False)
        torch.set_num_threads(args.threads)
        impl, E, k = args.peak_child
        _, steps = build_steps(int(E), int(k), shape, device, only=impl)
        print(json.dumps(measure_peak(steps[impl], device)))
        return
    suffix = ("" if args.allocator == "tuned" else f"_alloc-{args.allocator}") + \
        (f"_e{'-'.join(map(str, shape.experts))}" if args.experts else "") + \
        (f"_k{'-'.join(map(str, shape.ks))}" if args.ks else "") + \
        ("_quick" if args.quick else "")  # last: *_quick.json is never committed
    out = results_path(
        args.out, ROOT / "benchmarks" / "results" / f"moe_layer_{device}{suffix}.json")
    allocator: dict[str, Any] = {"mode": args.allocator}
    if args.allocator == "tuned":
        allocator.update(tune_cpu_allocator())
    init_runtime(tune_allocator=False)  # one process (gloo on CPU): DeepSpeed's MoE wants one
    torch.set_num_threads(args.threads)
    megatron = megatron_status()
    # after set_num_threads: records the threads every timing uses
    prov = provenance(command_line(__file__, argv))
    equivalence, rows = equivalence_check(), []
    configs = [(E, k) for E in shape.experts for k in shape.ks]
    for E, k in configs:
        rows.append(row := bench_config(E, k, shape, args))
        brief = {n: (v["ms"], v["vs_expert_gemms"]) for n, v in row["impls"].items()}
        print(f"E={E} k={k} {brief} ep2={row['ep2']['ratio_to_min']}", flush=True)
        # after every configuration, so a run stopped early leaves what it measured
        write_json(out, {
            "config": {"device": device, "threads": args.threads, "quick": args.quick,
                       "experts": list(shape.experts), "ks": list(shape.ks)},
            "complete": len(rows) == len(configs),
            "configurations_done": [[r["experts"], r["k"]] for r in rows],
            "allocator": allocator, "megatron_core": megatron,
            "shape": {"D": shape.D, "F": shape.F, "T": shape.T, "dtype": str(shape.dtype),
                      "reps": shape.reps, "warmup": shape.warmup},
            "method": METHOD, "equivalence_check": equivalence, "results": rows,
            "acceptance": {**{key: _holds_on_every_row(rows, key)
                              for key in rows[0]["acceptance"]},
                           **memory_flat_in_E(rows)},
            "provenance": finish(dict(prov)),
        })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
