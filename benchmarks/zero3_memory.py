"""Per-rank memory of ZeRO-3 at scale on CPU: partitioned construction and checkpoint saving.

    .venv/bin/python benchmarks/zero3_memory.py [--quick] [--out PATH]

Two gloo ranks, spawned afresh for each part; resident memory sampled from /proc every 5 ms
during each phase (`peak_gib`: the phase's highest resident set, `grew_gib`: that minus the
resident set before it).
- construct_trim / construct_no_trim: the 3.52B Trim-MoE (configs/qwen1.5-moe-trim8.yaml, bf16)
  built by `partitioned_build`, as `train.init_from` does under ZeRO-3, with the per-module heap
  trim and without it; per rank its partition's bytes, against the whole model's bytes.
- checkpoint: a Qwen2-MoE of about 300M parameters (fp32, ZeRO-3, AdamW, one step taken):
  `save_checkpoint` (tensor stores, one gathered parameter at a time) and the export gather
  (`gathered_state_dict`, kept on rank 0), against, in the same run, the way checkpoints were
  written before the stores: every fp32 value and both Adam moments gathered at once on every
  rank.
Writes benchmarks/results/zero3_memory_cpu[_quick].json.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from real_data import write_record  # noqa: E402

from moe_train.utils.provenance import provenance  # noqa: E402
from moe_train.utils.cli_args import command_line, results_path, script_parser  # noqa: E402

GIB = 2**30
WORLD = 2
MID = ["model.arch=hf_qwen2_moe", "qwen.vocab_size=32000", "qwen.hidden_size=1024",
       "qwen.num_hidden_layers=8", "qwen.num_attention_heads=16", "qwen.num_key_value_heads=16",
       "qwen.intermediate_size=2816", "qwen.shared_expert_intermediate_size=2816",
       "qwen.max_position_embeddings=256", "moe.num_experts=8", "moe.k=2",
       "moe.expert_ffn_dim=704", "moe.layers=all"]
QUICK = ["qwen.vocab_size=500", "qwen.hidden_size=64", "qwen.num_hidden_layers=2",
         "qwen.num_attention_heads=4", "qwen.num_key_value_heads=4", "qwen.intermediate_size=96",
         "qwen.shared_expert_intermediate_size=96", "moe.expert_ffn_dim=48"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def phase(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """Run `fn` while sampling the resident set; (its result, {peak_gib, grew_gib})."""
    before, peak, stop = _rss(), [_rss()], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out = fn()
    finally:
        stop.set()
        thread.join()
    peak[0] = max(peak[0], _rss())
    return out, {"peak_gib": round(peak[0] / GIB, 3),
                 "grew_gib": round((peak[0] - before) / GIB, 3)}


def _construct(rt, quick: bool, trim: bool) -> dict[str, Any]:
    from moe_train.config import load_config
    from moe_train.models.build import build_model
    from moe_train.parallel.zero3 import partitioned_build
    from moe_train.train.ds_config import build_deepspeed_config

    cfg = load_config(ROOT / "configs" / "qwen1.5-moe-trim8.yaml",
                      ["optim.zero_stage=3", "optim.precision=bf16", *(QUICK if quick else [])])
    ds = build_deepspeed_config(cfg, rt.world_size, rt.device)

    def build() -> torch.nn.Module:
        with partitioned_build(ds, trim=trim):
            return build_model(cfg, {"vocab_size": cfg.qwen.vocab_size, "pad_id": 0})

    model, mem = phase(build)
    params = list(model.parameters())
    return {**mem, "partition_gib": round(sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                                       for p in params) / GIB, 3),
            "whole_model_gib": round(sum(p.ds_numel * p.ds_tensor.element_size()
                                         for p in params) / GIB, 3),
            "parameters": sum(p.ds_numel for p in params)}


def _checkpoint(rt, quick: bool, work: str) -> dict[str, Any]:
    import deepspeed

    from moe_train.config import load_config
    from moe_train.models.build import build_model
    from moe_train.parallel.expert_checkpoint import (detach_experts_from_state_dict,
                                                      save_expert_shards)
    from moe_train.parallel.optim_state import fp32_param, get_moments
    from moe_train.parallel.zero3 import gathered_state_dict, mark_moe_leaf_modules
    from moe_train.train.checkpoint import save_checkpoint
    from moe_train.train.ds_config import build_deepspeed_config
    from moe_train.utils.malloc import release_free_heap

    cfg = load_config(None, [*MID, *(QUICK if quick else []), "optim.zero_stage=3",
                             "optim.precision=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": cfg.qwen.vocab_size, "pad_id": 0})
    detach_experts_from_state_dict(model)
    mark_moe_leaf_modules(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
        dist_init_required=False, config=build_deepspeed_config(cfg, rt.world_size, rt.device))
    ids = torch.randint(1, cfg.qwen.vocab_size, (2, 32), generator=torch.Generator()
                        .manual_seed(rt.rank))
    out = engine(ids)
    engine.backward(torch.nn.functional.cross_entropy(
        out.logits_BTV[:, :-1].reshape(-1, cfg.qwen.vocab_size), ids[:, 1:].reshape(-1)))
    engine.step()
    del out
    full = sum(p.ds_numel for p in engine.module.parameters())
    opt = engine.optimizer

    def save() -> None:
        save_checkpoint(engine, rt, work, 1, {"step": 1, "config": cfg.to_dict()}, {}, 0,
                        save_extra=lambda d: save_expert_shards(engine.module, opt, rt, d))

    def gather_all_at_once() -> int:  # what checkpoints did before the tensor stores
        held = {n: (fp32_param(opt, p), get_moments(opt, p))
                for n, p in engine.module.named_parameters()}
        return len(held)

    result = {"parameters": full, "fp32_model_gib": round(4 * full / GIB, 3),
              "values_and_moments_gib": round(12 * full / GIB, 3)}
    for name, fn in (("save_checkpoint", save), ("old_gather_all_at_once", gather_all_at_once),
                     ("export_gather", lambda: len(gathered_state_dict(
                         engine.module, keep=rt.is_main)))):
        release_free_heap()
        _, result[name] = phase(fn)
    return result


def _worker(rank: int, port: int, part: str, quick: bool, work: str, out: str) -> None:
    from tests.distributed.two_ranks import init_launched_rank

    from moe_train.parallel.runtime import shutdown

    rt = init_launched_rank(rank, port, WORLD)
    record = _checkpoint(rt, quick, work) if part == "checkpoint" else \
        _construct(rt, quick, trim=part == "construct_trim")
    torch.save(record, f"{out}.{rank}.pt")
    shutdown(rt)


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true", help="tiny models (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    prov = provenance(command_line(__file__, argv))
    out = results_path(args.out, ROOT / "benchmarks" / "results" /
                       f"zero3_memory_cpu{'_quick' if args.quick else ''}.json")
    from moe_train.parallel.runtime import free_port

    parts: dict[str, list[dict[str, Any]]] = {}
    for part in ("construct_trim", "construct_no_trim", "checkpoint"):  # fresh ranks each
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(free_port(), part, args.quick, f"{tmp}/ckpt", f"{tmp}/r"),
                     nprocs=WORLD, join=True)
            parts[part] = [torch.load(f"{tmp}/r.{r}.pt", weights_only=True)
                           for r in range(WORLD)]
        print(part, parts[part], flush=True)
    k = parts["checkpoint"]
    acceptance = {
        "construct_peak_below_whole_model": all(x["peak_gib"] < x["whole_model_gib"]
                                                for x in parts["construct_trim"]),
        "save_grows_less_than_the_old_gather": all(
            x["save_checkpoint"]["grew_gib"] < x["old_gather_all_at_once"]["grew_gib"]
            for x in k),
        "export_grows_less_on_rank1_which_keeps_nothing": k[1]["export_gather"]["grew_gib"]
        < k[0]["export_gather"]["grew_gib"]}
    record = {"benchmark": "zero3_memory_cpu", "world": WORLD, "quick": args.quick,
              "ranks": {part: {str(r): v for r, v in enumerate(vals)}
                        for part, vals in parts.items()}, "acceptance": acceptance,
              "method": {"peak_gib": "highest resident set sampled every 5 ms during the phase",
                         "grew_gib": "peak_gib minus the resident set before the phase",
                         "heap": "malloc_trim(0) before each phase; during a phase glibc keeps "
                                 "up to 1 GiB of freed heap (moe_train.utils.malloc, applied by "
                                 "init_runtime on CPU), so grew_gib includes freed transients"}}
    write_record(out, record, prov)


if __name__ == "__main__":
    main()
