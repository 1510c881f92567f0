"""The host-sync bounds of tests/unit/test_host_syncs_*.py, checked where they matter: on a CUDA
device, counted by torch's own sync detector (`torch.cuda.set_sync_debug_mode("warn")`: a
warning at every operation that makes the host wait), attributed to the innermost moe_train
frame. Also the device-side ops the sync work brought in (`nonzero_static` in the
sentence-slot sort, `_foreach_norm` in the grad norm), against the CPU result."""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings
from dataclasses import fields

import pytest
import torch

from tests.sync_points import _PACKAGE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def cuda_syncs():
    """Yields a Counter of `moe_train/file.py` -> syncs the CUDA runtime reported there."""
    counts: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return
        where = "<outside>"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if frame.filename.startswith(_PACKAGE):
                where = f"moe_train/{frame.filename[len(_PACKAGE):]}"
                break
        counts[where] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_the_detector_sees_a_read() -> None:
    """The counter works: an .item() on the device is one sync, outside moe_train."""
    x = torch.ones(3, device="cuda")
    with cuda_syncs() as counts:
        x.sum().item()
    assert set(counts) == {"<outside>"} and counts["<outside>"] >= 1, counts


def _to_cuda(src_BS, ctx):
    from moe_train.models.context import ForwardContext

    moved = {f.name: getattr(ctx, f.name) for f in fields(ForwardContext)}
    moved = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    return src_BS.cuda(), ForwardContext(**moved)


def _decode(model, beam: int, seed: int, **batch) -> collections.Counter:
    """The unit test's search (STEPS steps, nobody finishes early) on CUDA: one warm-up, then
    one counted on a new batch."""
    from moe_train.eval.search import beam_search, greedy_search
    from tests.unit import test_host_syncs_decode as unit

    model = model.cuda()
    for measure in (False, True):
        src_BS, ctx = _to_cuda(*unit._batch(seed + measure, **batch)[::2])
        kwargs = dict(max_len_a=0.0, max_len_b=unit.STEPS, min_len=unit.STEPS, ctx=ctx)
        with cuda_syncs() as counts:
            if beam == 1:
                out = greedy_search(model, src_BS, unit.BOS, unit.EOS, unit.PAD, **kwargs)
            else:
                out = beam_search(model, src_BS, unit.BOS, unit.EOS, unit.PAD, beam=beam,
                                  **kwargs)
        assert [len(t) for t in out] == [unit.STEPS - 1] * unit.B
    return counts


def _in(counts, *files: str) -> int:
    return sum(counts[f"moe_train/{f}"] for f in files)


ROUTING = ("moe/sentence_router.py", "moe/routing.py", "moe/thor_router.py")


@pytest.mark.parametrize("beam", [1, 3])
def test_task_routed_search_syncs_on_cuda(beam: int) -> None:
    """CPU count: the task ids read once per search for all layers and steps, and search.py's
    smallest limit once (3); beam.py: one read per step, plus the copy of the tokens."""
    from tests.unit import test_host_syncs_decode as unit

    counts = _decode(unit._model(unit.TASK), beam, seed=10)
    assert _in(counts, *ROUTING, "eval/search.py") <= 3, counts
    assert _in(counts, "eval/beam.py") <= unit.STEPS + (2 if beam == 1 else 1), counts


def test_extracted_and_thor_search_syncs_on_cuda() -> None:
    """An extracted language-pair model reads the pair ids once (CPU: 1); THOR reads its id
    check and the search limit (CPU: 2)."""
    from moe_train.config import load_config
    from moe_train.eval.extract import extract, load_extracted
    from moe_train.models.build import build_model
    from tests.unit import test_host_syncs_decode as unit

    cfg = load_config(None, [*unit.TINY, *unit.TASK, "moe.encoder_task_source=lang_pair",
                             "moe.decoder_task_source=lang_pair"])
    torch.manual_seed(0)
    model = build_model(cfg, unit.MANIFEST).eval()
    sub = load_extracted(extract(model, cfg, unit.MANIFEST, "de-en"), unit.MANIFEST)
    counts = _decode(sub, 1, seed=20, lang_pair=(0, 1))
    assert _in(counts, *ROUTING) <= 1, counts
    counts = _decode(unit._model(unit.THOR), 1, seed=42)
    assert _in(counts, *ROUTING, "eval/search.py") <= 2, counts


def test_sentence_slot_sort_on_cuda_matches_cpu_with_one_sync() -> None:
    """nonzero_static (CUDA since torch 2.6) gives the CPU's rows, with the one read of N."""
    from moe_train.kernels.permute import sort_sentence_slots

    gen = torch.Generator().manual_seed(0)
    B, L, K, E = 16, 9, 2, 8
    ids_BK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B)])
    ids_BK[3, 1] = -1
    ids_TK = ids_BK.repeat_interleave(L, 0)
    ids_TK[torch.rand(B * L, generator=gen) < 0.2] = -1  # padding positions
    want = sort_sentence_slots(ids_TK, ids_BK, E)
    ids_TK_cuda, ids_BK_cuda = ids_TK.cuda(), ids_BK.cuda()
    with cuda_syncs() as counts:
        got = sort_sentence_slots(ids_TK_cuda, ids_BK_cuda, E)
    assert want is not None and got is not None
    assert all(torch.equal(w, g.cpu()) for w, g in zip(want, got))
    assert _in(counts, "kernels/permute.py") == 1, counts  # N, read where it is attributed


def test_grad_norm_on_cuda_matches_cpu_and_reads_nothing() -> None:
    """`_foreach_norm(dtype=float64)` over many gradients, some empty (the list torch 2.6 fixed
    for), equals the float64 CPU norm; nothing is read until the caller reads it."""
    from moe_train.parallel.collectives import _squared_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for n in (7, 0, 4096, 0, 300_000, 1, 0, 513)] * 40
    want = sum(float(g.double().square().sum()) for g in grads)
    grads_cuda = [g.cuda() for g in grads]
    with cuda_syncs() as counts:
        got = _squared_norm(grads_cuda, "cuda")
    assert _in(counts, "parallel/collectives.py") == 0, counts
    assert float(got) == pytest.approx(want, rel=1e-12)
