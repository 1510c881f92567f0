"""benchmarks/swiglu_experts.py at --quick sizes: the record holds every implementation's
timing, the two ratios against the floors, and provenance."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_swiglu_experts_quick(tmp_path) -> None:
    out = tmp_path / "swiglu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "swiglu_experts.py"),
                           "--quick", "--out", str(out)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "swiglu_experts_cpu_quick" and r["config"]["quick"]
    assert r["provenance"]["git"]["commit"] and r["provenance"]["command"]
    impls = {"swiglu_ffn", "swiglu_ffn_no_buffers", "grouped_torch", "per_expert_floor",
             "dense_floor"}
    for res in r["results"]:
        assert set(res["ms"]) == impls and min(res["ms"].values()) > 0
        ratios = res["ratios"]
        assert ratios == r["acceptance"][f"E{res['E']}_k{res['k']}"]
        assert abs(ratios["over_dense_floor"]
                   - res["ms"]["swiglu_ffn"] / res["ms"]["dense_floor"]) < 0.01
        assert ratios["over_per_expert_floor"] > 0
