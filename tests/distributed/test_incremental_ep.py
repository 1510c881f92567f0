"""Incremental decoding equals full decoding under expert parallelism (ep_size 2, gloo).

The routed variants of tests/unit/test_incremental_all_routers.py, their experts (MoE FFNs and
adapters) sharded over two ranks with the all-to-all dispatcher. The ranks decode batches of
different sizes; on each, T cached single-token steps give the logits of one full decode, and
both equal the unsharded model's (1e-5, every position).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.distributed.two_ranks import init_ep2, spawn_two
from tests.unit.test_incremental_all_routers import T, VARIANTS, _batch, _model

EP_VARIANTS = ["switch", "topk k=3", "topp", "sentence k=2", "task learned (lang_pair / tgt_lang)",
               "gumbel moe", "adapters gumbel, both sides", "adapters sentence k=2, both sides",
               "thor top-2 (mixed, context)", "thor top-p (argmax, scalar gate)"]


def _worker(rank: int, port: int, out: str) -> None:
    from moe_train.parallel.expert_parallel import wire_expert_parallel

    rt = init_ep2(rank, port)
    src_BS, tgt_BT, ctx = _batch()
    if rank == 1:  # a smaller batch on the other rank: the all-to-alls carry uneven loads
        rows = torch.tensor([2, 0])
        src_BS, tgt_BT, ctx = src_BS[rows], tgt_BT[rows], ctx.index_select(rows)
    result = {}
    with torch.no_grad():
        for name in EP_VARIANTS:
            ref = _model(VARIANTS[name])
            ep = copy.deepcopy(ref)
            assert wire_expert_parallel(ep, rt) > 0, name
            enc = ep.encode(src_BS, ctx)
            full = ep.decode(tgt_BT, enc, ctx)[0]
            cache = ep.new_decoder_cache()
            inc = torch.cat([ep.decode(tgt_BT[:, t:t + 1], enc, ctx, cache)[0] for t in range(T)], 1)
            ref_full = ref.decode(tgt_BT, ref.encode(src_BS, ctx), ctx)[0]
            result[name] = {"inc_vs_full": (inc - full).abs().amax(dim=(0, 2)).tolist(),
                            "ep_vs_ref": (full - ref_full).abs().amax(dim=(0, 2)).tolist()}
    dist.destroy_process_group()
    torch.save(result, f"{out}.{rank}.pt")


def test_incremental_equals_full_under_expert_parallelism(tmp_path):
    out = str(tmp_path / "r")
    spawn_two(_worker, out, 240, "expert-parallel decoding")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}.pt", weights_only=True)
        assert list(got) == EP_VARIANTS
        for name, errs in got.items():
            assert max(errs["inc_vs_full"]) <= 1e-5, (rank, name, errs)
            assert max(errs["ep_vs_ref"]) <= 1e-5, (rank, name, errs)
