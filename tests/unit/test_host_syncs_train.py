"""Host syncs of the training paths, counted on CPU (tests/sync_points.py).

Each path runs once to warm up, then once under `SyncPoints`; the bound is what the path must
read to go on (a size the host needs, the step's one finite check), nothing per aux loss, per
layer of a check or per micro-batch of a log value. The Trainer runs in a spawned process (it
initialises torch.distributed), once for all of its paths.

Shape legend: B sentences, L positions per sentence, T tokens, K slots, E experts, D model dim.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from moe_train.config import load_config
from moe_train.data.batching import Batch
from moe_train.errors import ConfigError
from moe_train.models.build import build_model, moe_layers
from moe_train.models.context import ForwardContext
from moe_train.models.transformer import ModelOutput
from moe_train.moe.routing import TARGET_TOKENS_KEY, Routing
from moe_train.moe.thor_router import GOLD_TASK_KEY, TASK_PROBS_KEY
from tests.conftest import ROOT, debug_overrides
from tests.sync_points import SyncPoints

pytestmark = pytest.mark.usefixtures("one_thread")


def _counted(fn, *args, **kwargs) -> SyncPoints:
    """`fn(*args, **kwargs)` once to warm up, then once counted."""
    fn(*args, **kwargs)
    with SyncPoints() as syncs:
        fn(*args, **kwargs)
    return syncs


def _at_most(syncs: SyncPoints, bound: int, what: str, total: int | None = None) -> None:
    total = syncs.total() if total is None else total
    assert total <= bound, f"{what}: {total} host syncs, expected at most {bound}:\n" + \
        "\n".join(syncs.where())


def _in(syncs: SyncPoints, path: str) -> int:
    """The syncs attributed to moe_train/`path`."""
    return sum(n for (where, _), n in syncs.counts.items() if where.startswith(f"moe_train/{path}"))


# ------------------------------------------------------------------ loss, dispatch, kernels
def test_label_smoothed_nll_reads_nothing():
    """Pad positions are zeroed, not selected (was: two masked_select)."""
    from moe_train.train.loss import label_smoothed_nll

    torch.manual_seed(0)
    logits_BTV = torch.randn(4, 7, 30)
    target_BT = torch.randint(1, 30, (4, 7))
    target_BT[1, 3:] = 0
    target_BT[3, 5:] = 0
    _at_most(_counted(label_smoothed_nll, logits_BTV, target_BT, 0, 0.1), 0, "label_smoothed_nll")


def test_capacity_limit_reads_nothing():
    """The capacity stays a device tensor and the counts are a scatter-add (was: int() of the
    routed slots and a bincount); a capped dispatch reads only the token sort's N."""
    from moe_train.moe.dispatcher import LocalDispatcher, apply_capacity

    g = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(-1, 4, (40, 2), generator=g)
    _at_most(_counted(apply_capacity, ids_TK, 4, 1.1), 0, "apply_capacity")
    routing = Routing(expert_ids_TK=ids_TK, weights_TK=torch.rand(40, 2, generator=g),
                      probs_TE=None, num_experts=4)
    capped = LocalDispatcher(4, capacity_factor=1.0)
    _at_most(_counted(capped.dispatch, torch.randn(40, 8), routing), 1, "capped dispatch")


def test_capacity_edge_keeps_python_rounding():
    """1.1 * 100 / 2 is 55.000000000000007 in floating point: 55 slots, not 56."""
    from moe_train.moe.dispatcher import apply_capacity

    ids_TK = torch.tensor([[0], [1]] * 50)
    ids_TK[:60] = 0  # expert 0 is offered 80 slots, keeps 55
    kept, dropped = apply_capacity(ids_TK, 2, 1.1)
    assert int((kept == 0).sum()) == 55 and int(dropped) == 25


def test_sentence_fast_path_reads_once():
    """One read of (bad, N), then a static-size selection (was: int(bad), masked_select)."""
    from moe_train.kernels.permute import permute, sort_slots

    E, B, L, K = 5, 4, 6, 2
    g = torch.Generator().manual_seed(1)
    ids_BK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    ids_TK = ids_BK.repeat_interleave(L, dim=0)
    ids_TK[L + 4:2 * L] = -1  # sentence 1 ends in padding
    x_TD = torch.randn(B * L, 8)
    syncs = _counted(permute, x_TD, ids_TK, E, expert_ids_BK=ids_BK)
    _at_most(syncs, 1, "permute, sentence fast path")
    row_map_N, counts_E = sort_slots(ids_TK, E)
    fast = permute(x_TD, ids_TK, E, expert_ids_BK=ids_BK)
    assert torch.equal(fast.row_map_N, row_map_N) and torch.equal(fast.counts_E, counts_E)


def test_expert_parallel_dispatch_reads_once(monkeypatch):
    """Send and receive splits read together, and N handed to permute (was: the token sort's N
    and two tolist). One process: the all-to-all exchanges are the identity."""
    import torch.distributed as dist

    from moe_train.parallel.expert_parallel import AllToAllDispatcher

    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, *a, **k: out.copy_(inp))
    torch.manual_seed(0)
    T, K, E = 12, 2, 4
    ids_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids_TK[3, 1] = -1
    routing = Routing(expert_ids_TK=ids_TK, weights_TK=torch.full((T, K), 0.5), probs_TE=None,
                      num_experts=E)
    dispatcher = AllToAllDispatcher(E, 2, None)
    x_TD = torch.randn(T, 8)

    def dispatch_combine():
        x_MD, counts_L, meta = dispatcher.dispatch(x_TD, routing)
        return dispatcher.combine(x_MD * 2, meta), counts_L

    syncs = _counted(dispatch_combine)
    _at_most(syncs, 1, "AllToAllDispatcher dispatch + combine")
    y_TD, counts_L = dispatch_combine()
    torch.testing.assert_close(y_TD, 2 * x_TD * (ids_TK >= 0).sum(1, keepdim=True) * 0.5)
    assert counts_L.tolist() == [(ids_TK == e).sum().item() + (ids_TK == e + 2).sum().item()
                                 for e in range(2)]


# ------------------------------------------------------------------ gated adapters (ce)
def _gated_model():
    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                             "model.encoder_layers=2", "model.decoder_layers=2",
                             "adapters.num_experts=3", "adapters.router=gated",
                             "adapters.sides=both", "adapters.dim=8", "gated.gate_loss=ce"])
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": 30, "pad_id": 0}).train()


def _gated_forward(model, domains_B: torch.Tensor):
    src_BS = torch.randint(4, 30, (3, 5), generator=torch.Generator().manual_seed(2))
    ctx = ForwardContext(domain_ids_B=domains_B, extras={TARGET_TOKENS_KEY: 12})
    return model(src_BS, src_BS[:, :4], ctx)


def _ids_reads(syncs: SyncPoints) -> int:
    """The host reads of the gold-id checks (gated_router, and routing.ids_on_host that they
    share with task routers and THOR)."""
    return _in(syncs, "moe/gated_router") + _in(syncs, "moe/routing")


def test_gated_gold_domains_checked_once_per_forward():
    """Every gated layer of a forward gets the batch's one domain tensor: checked once (was:
    once per layer, here 4). Each forward has a new tensor, as each batch does."""
    model = _gated_model()
    assert sum(1 for _ in moe_layers(model)) == 4
    _gated_forward(model, torch.tensor([0, 2, 1]))
    with SyncPoints() as syncs:
        _gated_forward(model, torch.tensor([0, 2, 1]))
    assert _ids_reads(syncs) == 1, "\n".join(syncs.where())


def test_two_id_sources_on_one_side_are_read_once_each():
    """Task routers by target language and gated adapters by domain on the same layers: their
    checks alternate between two ids tensors, each read once per forward (a one-tensor memo
    read both again at every layer: 8 reads here, 24 with 6+6 layers)."""
    cfg = load_config(None, [
        "model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2", "moe.num_experts=4", "moe.layers=all", "moe.k=2",
        "moe.encoder_router=task", "moe.decoder_router=task", "moe.num_tasks=3",
        "moe.encoder_task_source=tgt_lang", "moe.decoder_task_source=tgt_lang",
        "adapters.num_experts=3", "adapters.router=gated", "adapters.sides=both",
        "adapters.dim=8", "gated.gate_loss=ce"])
    torch.manual_seed(0)
    model = build_model(cfg, {"vocab_size": 30, "pad_id": 0}).train()
    assert sum(1 for _ in moe_layers(model)) == 8

    def forward():
        src_BS = torch.randint(4, 30, (3, 5), generator=torch.Generator().manual_seed(2))
        ctx = ForwardContext(domain_ids_B=torch.tensor([0, 2, 1]),
                             tgt_lang_B=torch.tensor([1, 0, 2]),
                             extras={TARGET_TOKENS_KEY: 12})
        return model(src_BS, src_BS[:, :4], ctx)

    forward()
    with SyncPoints() as syncs:
        forward()
    assert _ids_reads(syncs) == 2, "\n".join(syncs.where())


def test_gated_gold_domain_error_is_unchanged():
    """An id without an adapter stops the first gated layer's loss with the same error, also
    for a tensor that passed before and was changed in place."""
    model = _gated_model()
    with pytest.raises(ConfigError, match=r"^adapters\.num_experts: domain id 3 has no adapter "
                                          r"\(expected one adapter per domain, got 3\)$"):
        _gated_forward(model, torch.tensor([0, 3, 1]))
    domains_B = torch.tensor([0, 2, 1])
    _gated_forward(model, domains_B)
    domains_B[1] = 4
    with pytest.raises(ConfigError, match="domain id 4 has no adapter"):
        _gated_forward(model, domains_B)


# ------------------------------------------------------------------ trainer hooks
def _batch(indices: list[int]) -> Batch:
    B = len(indices)
    tok, ids = torch.ones(B, 2, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    return Batch(tok, tok, tok, torch.tensor(indices), ids, ids, ids, ids, 2 * B, 2 * B, 2 * B,
                 split="train")


def test_teacher_probs_lookup_reads_nothing():
    """The rows are looked up where the batch is (was: indices copied to the host and back)."""
    from moe_train.moe.gated_router import TEACHER_PROBS_KEY
    from moe_train.train.hooks import TeacherProbs

    probs_NE = np.array([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]], dtype=np.float32)
    hook = TeacherProbs(probs_NE)
    _at_most(_counted(hook.batch_extras, _batch([2, 0])), 0, "TeacherProbs.batch_extras")
    got = hook.batch_extras(_batch([2, 0, 2]))[TEACHER_PROBS_KEY]
    assert torch.equal(got, torch.from_numpy(probs_NE[[2, 0, 2]]))


def test_task_accuracy_reads_nothing():
    """The correct count stays on the device until the log line (was: .item() per batch)."""
    from moe_train.train.hooks import TaskAccuracy

    probs_BK = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    out = ModelOutput(torch.zeros(1, 1, 1), {}, {TASK_PROBS_KEY: probs_BK,
                                                 GOLD_TASK_KEY: torch.tensor([0, 0, 0])})
    hook = TaskAccuracy()
    _at_most(_counted(hook.metrics, out, _batch([0, 1, 2])), 0, "TaskAccuracy.metrics")
    right, total = hook.metrics(out, _batch([0, 1, 2]))["task_accuracy"]
    assert (float(right), float(total)) == (2.0, 3.0)


# ------------------------------------------------------------------ gradient norm
class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched: the host's work launching kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_grad_norm_and_clip_work_does_not_grow_with_layers():
    """One fused norm per group and one fused clip (was: four ops per parameter), the same
    norm; its one sync is the float it returns (the trainer reads it with the finite flag)."""
    from moe_train.parallel.collectives import grad_norm_and_clip
    from moe_train.parallel.runtime import ParallelRuntime

    ops, params = [], []
    for layers in (1, 4):
        cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                                 "moe.num_experts=4", "moe.layers=every_other",
                                 f"model.encoder_layers={layers}",
                                 f"model.decoder_layers={layers}"])
        model = build_model(cfg, {"vocab_size": 30, "pad_id": 0})
        experts = {id(p) for _, m in moe_layers(model) for p in m.experts.parameters()}
        torch.manual_seed(0)
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        with _Ops() as counted, SyncPoints() as syncs:
            norm = grad_norm_and_clip(model, experts, ParallelRuntime(), 1e-3)
        _at_most(syncs, 1, "grad_norm_and_clip")
        want = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().item()
        assert norm == pytest.approx(want, rel=1e-12)
        coef = 1e-3 / (norm + 1e-6)
        assert all(torch.equal(p.grad, g * coef) for p, g in zip(model.parameters(), grads))
        ops.append(counted.n)
        params.append(len(grads))
    assert params[1] > params[0] + 20 and ops[1] == ops[0], (params, ops)


# ------------------------------------------------------------------ the Trainer
def _paused(syncs: SyncPoints, fn):
    """`fn` run with the counter paused: DeepSpeed's optimizer step is not ours (AdamW reads
    its step counters with .item(), host tensors on a GPU too)."""
    def run(*args, **kwargs):
        syncs.__exit__(None, None, None)
        try:
            return fn(*args, **kwargs)
        finally:
            syncs.__enter__()
    return run


def _measure(name: str, trainer, fn, record: dict, prepare=None) -> object:
    """Warm up and count `fn` (a Trainer path; `prepare` runs uncounted before it is counted);
    record its total, sites and forwards."""
    fn()
    if prepare is not None:
        prepare()
    forward, forwards = trainer._forward_loss, []
    trainer._forward_loss = lambda batch: forwards.append(1) or forward(batch)
    step = trainer.engine.step
    with SyncPoints() as syncs:
        trainer.engine.step = _paused(syncs, step)
        result = fn()
    trainer.engine.step, trainer._forward_loss = step, forward
    record[name] = {"total": syncs.total(), "where": syncs.where(), "forwards": len(forwards),
                    "outside_kernels": syncs.total() - _in(syncs, "kernels/")}
    return result


def _trainer_worker(rank: int, port: int, prepared: str, work: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from moe_train.parallel.runtime import init_runtime, shutdown
    from moe_train.train.trainer import Trainer

    rt = init_runtime()
    over = debug_overrides(Path(prepared), Path(work), "model.dropout=0.0", "data.max_tokens=300",
                           "moe.num_experts=4", "moe.layers=all", "optim.grad_accum=2",
                           "optim.clip_norm=0.5", "train.validate_every=0",
                           "train.progress_bar=false", "logging.tensorboard_dir=")
    trainer = Trainer(load_config(ROOT / "configs" / "debug-cpu.yaml", over), rt)
    record: dict = {"moe_layers": len(trainer.moe_layers)}
    _measure("train_step", trainer, trainer.train_step, record)
    record["grad_norm"] = trainer.last_grad_norm
    # the log line of a window with a step's sums and aux losses in it (that step uncounted)
    _measure("_log", trainer, trainer._log, record,
             prepare=lambda: trainer.window.add_step(trainer.train_step()))
    _measure("validate_loss", trainer, trainer.validate_loss, record)
    torch.save(record, Path(work) / "record.pt")
    shutdown(rt)


@pytest.fixture(scope="module")
def trainer_syncs(tiny_prepared, tmp_path_factory) -> dict:
    from moe_train.parallel.runtime import free_port

    work = tmp_path_factory.mktemp("host_syncs")
    mp.spawn(_trainer_worker, args=(free_port(), str(tiny_prepared), str(work)), nprocs=1,
             join=True)
    return torch.load(work / "record.pt")


def _inherent(rec: dict, layers: int) -> int:
    """Per MoE layer and forward: the token sort's N and the grouped GEMM's split sizes."""
    return 2 * layers * rec["forwards"]


def test_train_step_reads_once_besides_the_expert_sizes(trainer_syncs):
    """Loss and aux sums stay on the device; the finite flag and the gradient norm are read
    together (was, with 2 micro-batches and 2 aux losses: 4 masked_select, 8 item, the norm
    and the flag)."""
    rec = trainer_syncs["train_step"]
    assert rec["forwards"] == 2 and trainer_syncs["grad_norm"] > 0
    bound = 1 + _inherent(rec, trainer_syncs["moe_layers"])
    assert rec["total"] <= bound and rec["outside_kernels"] <= 1, "\n".join(rec["where"])


def test_log_line_reads_once(trainer_syncs):
    """Window sums, aux losses and every MoE layer's scalars in one read (was: 1 + 3 per
    layer)."""
    rec = trainer_syncs["_log"]
    assert rec["total"] <= 1, "\n".join(rec["where"])


def test_validation_reads_once_besides_the_expert_sizes(trainer_syncs):
    """Dev sums stay on the device until the end (was: 2 per batch, and 2 per aux loss)."""
    rec = trainer_syncs["validate_loss"]
    assert rec["forwards"] >= 1
    bound = 1 + _inherent(rec, trainer_syncs["moe_layers"])
    assert rec["total"] <= bound and rec["outside_kernels"] <= 1, "\n".join(rec["where"])
