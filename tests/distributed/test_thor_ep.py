"""THOR-MoE under expert parallelism (ep_size 2, gloo, all-to-all dispatcher) equals ep_size 1:
training-mode outputs, losses (with every THOR aux loss) and gradients (1e-5), and beam search
(outputs, and the logits of every step, 1e-5).

The models are test_incremental_all_routers' THOR top-2 and top-p (context on both sides, the
task predictor, candidate sets), their experts sharded over two ranks that hold batches of
different sizes. Reference (the unsharded model): outputs, loss and non-expert gradients from the
rank's own batch; expert gradients summed over both ranks' batches (an expert serves the tokens
of the whole ep group), sliced to the rank's experts.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed.two_ranks import init_ep2, spawn_two
from tests.unit.test_incremental_all_routers import (
    BOS,
    EOS,
    PAD,
    THOR_TOPP_CONTEXT,
    VARIANTS,
    _batch,
    _Recorder,
    _model,
)

THOR_VARIANTS = {"thor top-2": VARIANTS["thor top-2 (mixed, context)"],
                 "thor top-p": THOR_TOPP_CONTEXT}
AUX = {"thor_task", "thor_task_balance", "thor_token_balance", "z_loss"}


def _rank_batch(rank: int):
    src_BS, tgt_BT, ctx = _batch()
    if rank == 1:  # one short sentence: uneven all-to-all loads, and it finishes first
        rows = torch.tensor([2])
        src_BS, tgt_BT, ctx = src_BS[rows], tgt_BT[rows], ctx.index_select(rows)
    return src_BS, tgt_BT, ctx


def _loss(model, src_BS, tgt_BT, ctx):
    out = model(src_BS, tgt_BT, ctx)
    labels_BT = torch.roll(tgt_BT, -1, dims=1)
    nll = F.cross_entropy(out.logits_BTV.flatten(0, 1), labels_BT.flatten())
    return nll + sum(out.aux_losses.values()), out


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _worker(rank: int, port: int, out: str) -> None:
    from moe_train.eval.search import beam_search
    from moe_train.parallel.collectives import all_ranks_true
    from moe_train.parallel.expert_parallel import wire_expert_parallel

    rt = init_ep2(rank, port)
    src_BS, tgt_BT, ctx = _rank_batch(rank)
    # ragged limits (source length + 2): sentences finish at different steps, so finished
    # ones leave the batch, and rank 1 finishes first and keeps stepping for rank 0
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=1.0, max_len_b=2, ctx=ctx, beam=3)
    result = {}
    for name, overrides in THOR_VARIANTS.items():
        ref = _model(overrides).train()  # no dropout, dropless: training mode is deterministic
        ep = copy.deepcopy(ref)
        assert wire_expert_parallel(ep, rt) == 4, name  # every layer of both stacks
        loss_ep, out_ep = _loss(ep, src_BS, tgt_BT, ctx)
        loss_ep.backward()
        loss_ref, out_ref = _loss(ref, src_BS, tgt_BT, ctx)
        loss_ref.backward()
        grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()
                     if p.grad is not None and not _is_expert(n)}
        ref.zero_grad()
        for r in range(2):  # expert gradients: the tokens of both ranks
            _loss(ref, *_rank_batch(r))[0].backward()
        num_local = 8 // 2
        for n, p in ref.named_parameters():
            if _is_expert(n):
                grads_ref[n] = p.grad[rank * num_local:(rank + 1) * num_local].clone()
        grads_ep = {n: p.grad for n, p in ep.named_parameters() if p.grad is not None}
        errors = {n: (grads_ep[n] - g).abs().max().item() for n, g in grads_ref.items()
                  if n in grads_ep}
        with torch.no_grad():
            ep.eval()
            ref.eval()
            ep_steps, ref_steps = _Recorder(ep), _Recorder(ref)
            beam_ep = beam_search(ep_steps, src_BS, sync_done=lambda d: all_ranks_true(rt, d),
                                  **kw)
            beam_ref = beam_search(ref_steps, src_BS, **kw)
        result[name] = {
            "aux": sorted(out_ep.aux_losses),
            "logits": (out_ep.logits_BTV - out_ref.logits_BTV).abs().max().item(),
            "loss": abs(loss_ep.item() - loss_ref.item()),
            "aux_err": max(abs(out_ep.aux_losses[k].item() - out_ref.aux_losses[k].item())
                           for k in out_ref.aux_losses),
            "grad_names": (sorted(grads_ep), sorted(grads_ref)),
            "grad_err": errors,
            "grad_norm": {n: g.norm().item() for n, g in grads_ref.items()},
            "beam": (beam_ep, beam_ref),
            # every step's next-token logits (a finished rank keeps stepping for the other)
            "beam_steps": (len(ep_steps.steps), len(ref_steps.steps)),
            "beam_rows": [step.shape[0] for step in ref_steps.steps],
            "beam_logits": max((a - b).abs().max().item()
                               for a, b in zip(ep_steps.steps, ref_steps.steps)),
        }
    dist.destroy_process_group()
    torch.save(result, f"{out}.{rank}.pt")


def test_thor_ep2_equals_ep1_in_outputs_gradients_and_beam_search(tmp_path):
    out = str(tmp_path / "r")
    spawn_two(_worker, out, 240, "THOR expert-parallel training and search")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}.pt", weights_only=True)
        assert list(got) == list(THOR_VARIANTS)
        for name, r in got.items():
            where = (rank, name)
            assert AUX <= set(r["aux"]), (where, r["aux"])
            assert ("thor_topp_entropy" in r["aux"]) == (name == "thor top-p"), where
            assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["aux_err"] <= 1e-5, (where, r)
            names_ep, names_ref = r["grad_names"]
            assert names_ep == names_ref, where
            assert max(r["grad_err"].values()) <= 1e-5, (where, r["grad_err"])
            # the comparison covers the THOR parts, with non-zero gradients
            for part in ("providers.", "task_gate", "context_gate", "experts.w1_EDF"):
                norms = [v for n, v in r["grad_norm"].items() if part in n]
                assert norms and min(norms) > 0, (where, part, norms)
            beam_ep, beam_ref = r["beam"]
            assert beam_ep == beam_ref and any(beam_ep), (where, beam_ep, beam_ref)
            assert len(beam_ep) == (4 if rank == 0 else 1)
            steps_ep, steps_ref = r["beam_steps"]
            assert steps_ref > 2 and r["beam_logits"] <= 1e-5, (where, r)
            if rank == 0:  # sentences of different limits left the batch one by one
                rows = r["beam_rows"]
                assert rows[0] == 4 * 3 and rows[-1] < rows[0], (where, rows)
                assert len({len(h) for h in beam_ep}) > 1, (where, beam_ep)
            else:  # finished first: kept stepping (dummy rows) while rank 0 decoded
                assert steps_ep > steps_ref, (where, steps_ep, steps_ref)
