"""Beam and greedy search under expert parallelism: ranks with different batch sizes and
sentence lengths take the same number of decoder steps (no deadlock) and give the EP=1 output."""

import copy

import torch
import torch.distributed as dist

from moe_train.config import load_config
from moe_train.eval.search import beam_search, greedy_search
from moe_train.models.build import build_model
from moe_train.models.context import ForwardContext
from moe_train.parallel.collectives import all_ranks_true
from moe_train.parallel.expert_parallel import wire_expert_parallel
from tests.distributed.two_ranks import init_ep2, spawn_two

V = 30


def _model():
    cfg = load_config(overrides=["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64",
                                 "model.encoder_layers=2", "model.decoder_layers=2",
                                 "model.dropout=0.0", "moe.num_experts=4", "moe.k=2",
                                 "moe.layers=all"])
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": V, "pad_id": 0}).eval()


def _sources(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if rank == 0:  # three sentences, long
        src = torch.randint(4, V, (3, 9), generator=g)
        src[1, 6:] = 0
    else:  # one short sentence: finishes much earlier on its own
        src = torch.randint(4, V, (1, 2), generator=g)
    src[:, -1] = torch.where(src[:, -1] == 0, src[:, -1], torch.full_like(src[:, -1], 3))
    return src


def _worker(rank: int, port: int, out: str) -> None:
    rt = init_ep2(rank, port)
    ref = _model()
    ep = copy.deepcopy(ref)
    wire_expert_parallel(ep, rt)
    src = _sources(rank)
    ctx = ForwardContext(src_pad_mask_BS=src.eq(0))
    kw = dict(bos_id=2, eos_id=3, pad_id=0, max_len_a=1.0, max_len_b=4, ctx=ctx)
    sync = lambda done: all_ranks_true(rt, done)  # noqa: E731
    with torch.no_grad():
        result = {"beam_ep": beam_search(ep, src, beam=3, sync_done=sync, **kw),
                  "greedy_ep": greedy_search(ep, src, sync_done=sync, **kw)}
        dist.destroy_process_group()
        result["beam_ref"] = beam_search(ref, src, beam=3, **kw)
        result["greedy_ref"] = greedy_search(ref, src, **kw)
    torch.save(result, f"{out}.{rank}.pt")


def test_ep_search_is_lockstep_and_equals_ep1(tmp_path):
    out = str(tmp_path / "r")
    spawn_two(_worker, out, 120, "expert-parallel search")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}.pt")
        assert got["beam_ep"] == got["beam_ref"]
        assert got["greedy_ep"] == got["greedy_ref"]
        assert len(got["beam_ep"]) == (3 if rank == 0 else 1)
