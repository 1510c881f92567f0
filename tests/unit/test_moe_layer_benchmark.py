"""benchmarks/moe_layer.py: its memory verdict (it compares expert counts, so it needs two) and
its equivalence check."""

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


def test_equivalence_check_says_where_it_ran() -> None:
    """It runs on a small fp32 CPU case whatever the timed device: the record says so, so a
    CUDA record's check does not read as one of its bf16 kernels."""
    check = load_benchmark("moe_layer").equivalence_check()
    assert check["device"] == "cpu" and check["dtype"] == "float32"
    for k in ("k1", "k2"):
        assert check[k]["max_abs_diff_y"] < 1e-4 and check[k]["max_abs_diff_dx"] < 1e-4
