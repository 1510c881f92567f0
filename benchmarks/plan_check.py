"""The memory planner (`moe-train plan`) against measured CPU training steps.

    .venv/bin/python benchmarks/plan_check.py [--out PATH]

For each case, `moe_train.eval.plan_measure.measured_vs_planned`: the peak live tensor bytes of
a real fp32 training step (forward, label-smoothed loss, backward, AdamW step; gradients and Adam's
state alive; recorded by torch.profiler's memory events, see `measure_peak`) next to
`plan_memory` for the same shape (1 process, ZeRO 0, ep 1, fp32, CPU kernels). Cases: the two
`MEASURED_CHECKS` (a 24M-parameter seq2seq MoE and a 13M-parameter Qwen2-MoE), variants of
each (gelu, no dropout with k=1, all-MoE layers, grouped-query attention with k=4, dense
layers, no shared expert), and Qwen with transformers' activation checkpointing (large and
small vocabulary). `acceptance`: per case the relative error of the total and of the working
set (what the step adds to parameters, gradients and optimizer state), the bound 15%.
Writes benchmarks/results/plan_check_cpu.json.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_train.config import load_config  # noqa: E402
from moe_train.eval.plan_measure import MEASURED_CHECKS, measured_vs_planned  # noqa: E402
from moe_train.utils.atomic import write_json  # noqa: E402
from moe_train.utils.provenance import finish, provenance  # noqa: E402
from moe_train.utils.cli_args import command_line, results_path, script_parser  # noqa: E402

BOUND = 0.15
CASES: list[tuple[str, str, list[str], int | None, int | None, bool]] = [
    # (case, base check, extra overrides, micro-batch, seq len (None: the check's), ckpt)
    ("seq2seq", "seq2seq", [], None, None, False),
    ("seq2seq_gelu", "seq2seq", ["model.activation=gelu"], 8, 128, False),
    ("seq2seq_no_dropout_k1", "seq2seq", ["model.dropout=0.0", "moe.k=1"], None, None, False),
    ("seq2seq_all_moe_16_experts", "seq2seq",
     ["model.n_heads=8", "moe.num_experts=16", "moe.layers=all", "model.encoder_layers=2",
      "model.decoder_layers=2"], 4, 200, False),
    ("qwen", "qwen", [], None, None, False),
    ("qwen_gqa_k4", "qwen", ["qwen.num_key_value_heads=4", "moe.k=4"], 4, 256, False),
    ("qwen_dense_layers", "qwen", ["moe.layers=0,2", "qwen.intermediate_size=768"], None, None,
     False),
    ("qwen_no_shared_expert", "qwen",
     ["qwen.shared_expert_intermediate_size=0", "moe.expert_ffn_dim=512"], 2, 300, False),
    ("qwen_checkpointing", "qwen", [], None, None, True),
    ("qwen_checkpointing_small_vocab", "qwen", ["qwen.vocab_size=600"], 8, 256, True),
]
MIB = 2**20


def run_case(name: str, check: str, extra: list[str], micro_batch: int | None,
             seq_len: int | None, ckpt: bool) -> dict:
    path, overrides, mb, sl = MEASURED_CHECKS[check]
    cfg = load_config(ROOT / path, overrides + extra)
    r = measured_vs_planned(cfg, micro_batch or mb, seq_len or sl, activation_checkpointing=ckpt)
    m, p = r["measured"], r["planned"]
    row = {"case": name, "config": path, "overrides": overrides + extra,
           "micro_batch": micro_batch or mb, "seq_len": seq_len or sl,
           "activation_checkpointing": ckpt, "parameters": m["parameters"],
           "measured_mib": {"peak": m["peak"] / MIB, "static": m["static"] / MIB,
                            "working": m["working"] / MIB,
                            "optimizer_step": m["optimizer_working"] / MIB},
           "planned_mib": {"total": p["total"] / MIB, "static": p["static"] / MIB,
                           "working": p["working"] / MIB,
                           "optimizer_step": p["optimizer_step"] / MIB,
                           **{k: v / MIB for k, v in p["activation_terms"].items()}},
           "peak_phase": m["peak_phase"],
           "relative_error": r["relative_error"],
           "working_relative_error": r["working_relative_error"]}
    print(f"{name:32s} measured {m['peak'] / MIB:8.1f} MiB (working {m['working'] / MIB:7.1f}) "
          f"planned {p['total'] / MIB:8.1f} (working {p['working'] / MIB:7.1f}) "
          f"error {r['relative_error']:+.2%} / {r['working_relative_error']:+.2%}")
    return row


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--out", default=None, help="default benchmarks/results/plan_check_cpu.json")
    args = ap.parse_args(argv)
    out = results_path(args.out, ROOT / "benchmarks" / "results" / "plan_check_cpu.json")
    prov = provenance(command_line(__file__, argv))
    warnings.simplefilter("ignore", FutureWarning)
    rows = [run_case(*case) for case in CASES]
    record = {
        "benchmark": "plan_check_cpu",
        "method": "peak of the running sum of torch.profiler memory events (c10 CPU allocator) "
                  "over the second training step; static = live bytes at that step's start",
        "results": rows,
        "acceptance": {r["case"]: {"total_error": round(r["relative_error"], 4),
                                   "working_error": round(r["working_relative_error"], 4),
                                   "within_bound": max(abs(r["relative_error"]),
                                                       abs(r["working_relative_error"])) <= BOUND}
                       for r in rows},
        "bound": BOUND,
        "provenance": finish(prov),
    }
    write_json(out, record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
