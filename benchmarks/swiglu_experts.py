"""SwiGLU experts on the CPU: `swiglu_ffn` forward + backward against two floors.

    .venv/bin/python benchmarks/swiglu_experts.py [--reps 15] [--quick] [--out PATH]

Qwen2-MoE-style expert sizes, D=512, F=352, T=2048 tokens routed top-k by uniform random
scores (no slot dropped, N = T*k rows): E=60 experts with k=4, and E=8 with k=2. Timed, median
(and minimum) over --reps runs after a warm-up, the implementations taking turns (round robin,
`kernels.timed`) so a slow spell of a shared machine hits them all alike:

- `swiglu_ffn`: ours, as `SwiGLUExperts` runs it on CPU (weight gradients in a `GradBuffers`,
  `.grad` dropped between steps so the storage is reused); `swiglu_ffn_no_buffers` without it.
- `grouped_torch`: `swiglu_grouped` on the torch backend (three grouped GEMMs; the GPU path's
  math), for information.
- `per_expert_floor`: the same SwiGLU chain per expert on the same counts, plain torch ops with
  autograd over per-expert leaves (its own x rows and three D x F / F x D weights per expert:
  no stacked tensor, no gather or scatter), backward through `torch.autograd.backward`.
- `dense_floor`: one SwiGLU chain over all N rows with one weight set: the same FLOPs as the
  experts in three large GEMMs per direction.

The ratios `swiglu_ffn / per_expert_floor` and `swiglu_ffn / dense_floor` (medians) are under
`acceptance`. The glibc allocator is tuned first (`tune_cpu_allocator`, as `init_runtime` does)
for every implementation alike. Writes benchmarks/results/swiglu_experts_cpu.json; `--quick`
(tiny sizes, 2 reps) checks the script and writes swiglu_experts_cpu_quick.json.

Shape legend: T tokens, k experts per token, N = T*k routed rows, E experts, D model dim,
F expert FFN dim.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from kernels import timed  # noqa: E402
from real_data import write_record  # noqa: E402

from moe_train.kernels.grad_buffers import GradBuffers  # noqa: E402
from moe_train.kernels.swiglu_ffn import swiglu_ffn, swiglu_grouped  # noqa: E402
from moe_train.utils.malloc import tune_cpu_allocator  # noqa: E402
from moe_train.utils.provenance import provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    command_line, int_at_least, results_path, script_parser)

FULL = {"T": 2048, "D": 512, "F": 352, "configs": [(60, 4), (8, 2)], "reps": 15}
QUICK = {"T": 128, "D": 64, "F": 48, "configs": [(8, 2)], "reps": 2}


def routed_counts(T: int, E: int, k: int, seed: int = 0) -> torch.Tensor:
    """counts_E of a uniform random top-k routing of T tokens (every slot kept)."""
    g = torch.Generator().manual_seed(seed)
    ids_Tk = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    return torch.bincount(ids_Tk.flatten(), minlength=E)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
           ) -> torch.Tensor:
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def impls(counts_E: torch.Tensor, D: int, F_: int, seed: int = 1
          ) -> dict[str, Callable[[], torch.Tensor | None]]:
    """Forward + backward closures of every implementation, on the same numbers (returning
    the output when asked, for the agreement check)."""
    g = torch.Generator().manual_seed(seed)
    E, N = counts_E.numel(), int(counts_E.sum())
    sizes = counts_E.tolist()
    x_ND = torch.randn(N, D, generator=g)
    ws = [torch.randn(E, D, F_, generator=g) * 0.02, torch.randn(E, D, F_, generator=g) * 0.02,
          torch.randn(E, F_, D, generator=g) * 0.02]
    grad_ND = torch.randn(N, D, generator=g)

    x_leaf = x_ND.clone().requires_grad_(True)
    w_leaves = [w.clone().requires_grad_(True) for w in ws]
    stacked_leaves = [x_leaf, *w_leaves]
    bufs = GradBuffers()

    def stacked(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            for leaf in stacked_leaves:
                leaf.grad = None
            y = fn()
            y.backward(grad_ND)
            return y.detach()
        return run

    # per-expert floor: each expert's rows and weights are leaves of their own
    experts = [(x_e.clone().requires_grad_(True), *(w[e].clone().requires_grad_(True) for w in ws),
                g_e) for e, (x_e, g_e) in enumerate(zip(x_ND.split(sizes), grad_ND.split(sizes)))
               if sizes[e]]

    def per_expert_floor() -> torch.Tensor:
        for leaves in experts:
            for leaf in leaves[:4]:
                leaf.grad = None
        ys = [swiglu(*leaves[:4]) for leaves in experts]
        torch.autograd.backward(ys, [leaves[4] for leaves in experts])
        return torch.cat([y.detach() for y in ys])

    dense = [x_ND.clone().requires_grad_(True), *(w[0].clone().requires_grad_(True) for w in ws)]

    def dense_floor() -> None:
        for leaf in dense:
            leaf.grad = None
        swiglu(*dense).backward(grad_ND)

    return {
        "swiglu_ffn": stacked(lambda: swiglu_ffn(x_leaf, *w_leaves, counts_E, bufs)),
        "swiglu_ffn_no_buffers": stacked(lambda: swiglu_ffn(x_leaf, *w_leaves, counts_E)),
        "grouped_torch": stacked(lambda: swiglu_grouped(x_leaf, *w_leaves, counts_E,
                                                        backend="torch")),
        "per_expert_floor": per_expert_floor,
        "dense_floor": dense_floor,
    }


def bench(T: int, E: int, k: int, D: int, F_: int, reps: int) -> dict:
    counts_E = routed_counts(T, E, k)
    fns = impls(counts_E, D, F_)
    y_ours, y_floor = fns["swiglu_ffn"](), fns["per_expert_floor"]()
    torch.testing.assert_close(y_ours, y_floor, atol=1e-5, rtol=1e-4)  # same numbers
    times = timed(fns, "cpu", reps)
    for name, (med, low) in times.items():
        print(f"E={E:3d} k={k} N={T * k:5d} {name:22s} {med:9.2f} ms (min {low:.2f})",
              flush=True)
    ours = times["swiglu_ffn"][0]
    return {"E": E, "k": k, "T": T, "N": T * k, "D": D, "F": F_,
            "rows_per_expert": {"min": int(counts_E.min()), "max": int(counts_E.max()),
                                "empty_experts": int((counts_E == 0).sum())},
            "ms": {name: round(t[0], 3) for name, t in times.items()},
            "min_ms": {name: round(t[1], 3) for name, t in times.items()},
            "ratios": {"over_per_expert_floor": round(ours / times["per_expert_floor"][0], 3),
                       "over_dense_floor": round(ours / times["dense_floor"][0], 3)}}


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 reps (a smoke test)")
    ap.add_argument("--reps", type=int_at_least(1), default=None,
                    help="timed runs per implementation")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/swiglu_experts_cpu[_quick].json")
    args = ap.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    s = QUICK if args.quick else FULL
    reps = args.reps or s["reps"]
    suffix = "_quick" if args.quick else ""
    out = results_path(
        args.out, ROOT / "benchmarks" / "results" / f"swiglu_experts_cpu{suffix}.json")
    allocator = tune_cpu_allocator()
    torch.manual_seed(0)
    results = [bench(s["T"], E, k, s["D"], s["F"], reps) for E, k in s["configs"]]
    record = {
        "benchmark": f"swiglu_experts_cpu{suffix}",
        "config": {"quick": args.quick, "reps": reps, "T": s["T"], "D": s["D"], "F": s["F"],
                   "experts_topk": s["configs"], "dtype": "float32", "routing": "uniform top-k"},
        "timing": "ms: median, min_ms: minimum over reps of forward + backward; "
                  "implementations take turns",
        "allocator": allocator, "results": results,
        "acceptance": {f"E{r['E']}_k{r['k']}": r["ratios"] for r in results},
    }
    write_record(out, record, prov)


if __name__ == "__main__":
    main()
