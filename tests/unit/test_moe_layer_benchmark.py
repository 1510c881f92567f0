"""benchmarks/moe_layer.py's memory verdict: it compares expert counts, so it needs two."""

from __future__ import annotations

from tests.conftest import load_benchmark


def _row(E: int, k: int, transient: int) -> dict:
    return {"experts": E, "k": k, "impls": {"ours": {"peak_minus_grad_bytes": transient}}}


def test_flat_in_E_compares_expert_counts() -> None:
    bench = load_benchmark("moe_layer")
    flat = bench.memory_flat_in_E([_row(8, 1, 100), _row(32, 1, 110), _row(128, 1, 120)])
    assert flat == {"ours_peak_minus_grad_flat_in_E": True,
                    "ours_peak_minus_grad_max_over_smallest_E": {"k1": 1.2}}
    grows = bench.memory_flat_in_E([_row(8, 2, 100), _row(128, 2, 200)])
    assert grows["ours_peak_minus_grad_flat_in_E"] is False
    # `--experts 128 8`: the rows come in the order given; the verdict still compares to E=8
    assert bench.memory_flat_in_E([_row(128, 2, 200), _row(8, 2, 100)]) == grows


def test_flat_in_E_is_null_for_one_expert_count() -> None:
    """A run of one E (`--experts 128`) has nothing to compare: no verdict, not a pass."""
    bench = load_benchmark("moe_layer")
    flat = bench.memory_flat_in_E([_row(128, 1, 100), _row(128, 2, 180)])
    assert flat == {"ours_peak_minus_grad_flat_in_E": None}
