"""benchmarks/moa_real_data.py --test-dir without running the recipe: the corpus it prepares
takes train/dev from --data and test from DIR, so every model, the clusterer and the gate are
scored on DIR's sentences."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_train.data.corpus import discover
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("moa_real_data")


def _write(root: Path, domain: str, split: str, lines: list[str]) -> None:
    for lang in ("de", "en"):
        path = root / domain / f"{domain}.de-en.{split}.{lang}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{lang} {line}\n" for line in lines))


def test_test_dir_replaces_the_carved_test_split(script, tmp_path: Path, capsys) -> None:
    data, tests = tmp_path / "data", tmp_path / "tests"
    for domain in ("IT", "Law"):
        _write(data, domain, "train", ["a", "b", "c"])
        _write(data, domain, "test", ["old"])  # --data's own test files are not used
        _write(tests, domain, "test", ["new one", "new two"])
    merged = Path(script.with_test_dir(str(data), str(tests), tmp_path / "merged"))
    found = {(c.domain, c.split): c for c in discover(merged)}
    assert set(found) == {("IT", "train"), ("IT", "test"), ("Law", "train"), ("Law", "test")}
    assert found[("IT", "test")].src.read_text() == "de new one\nde new two\n"
    assert found[("Law", "train")].src.resolve() == (data / "Law" / "Law.de-en.train.de")
    with pytest.raises(SystemExit) as exc:  # checked with the arguments, before anything runs
        script.main(["--test-dir", str(tmp_path / "data" / "IT")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert re.match(r"error: benchmarks/moa_real_data.py: argument --test-dir: .*no corpus files",
                    err)


def test_run_stage_goes_through_the_pipeline_reuse_check(script, tmp_path: Path,
                                                         monkeypatch) -> None:
    """run_stage always asks `moe-train pipeline --stage S --rerun-stale` (which reuses a
    current stage and reruns a stale one) and reports `reused` from whether the stage's record
    changed, keeping the minutes of the run that made it."""
    calls: list[list[str]] = []
    records = iter(['{"id": 1}', '{"id": 1}', '{"id": 2}'])  # new, unchanged, rerun

    class Proc:
        returncode, stdout = 0, "log\n"

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        done = tmp_path / "w" / "cluster" / "done.json"
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(next(records))
        return Proc()

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    first = script.run_stage("c.yaml", tmp_path / "w", "cluster", ["moa.pca_dim=4"])
    again = script.run_stage("c.yaml", tmp_path / "w", "cluster", ["moa.pca_dim=4"])
    rerun = script.run_stage("c.yaml", tmp_path / "w", "cluster", ["moa.pca_dim=5"])
    assert [r["reused"] for r in (first, again, rerun)] == [False, True, False]
    assert again["minutes"] == first["minutes"] and rerun["done"] == {"id": 2}
    assert all(c[c.index("--stage") + 1] == "cluster" and "--rerun-stale" in c for c in calls)
    assert calls[-1][-1] == "moa.pca_dim=5"


def _hyps(workdir: Path, model: str, lines: list[str]) -> None:
    d = workdir / "evaluate" / "hypotheses"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{model}.txt").write_text("".join(line + "\n" for line in lines))


def test_paired_bootstrap_runs_reads_each_run_hypotheses(script, tmp_path: Path, capsys) -> None:
    """MoA against the backbone and Switch-SL from the files their evaluate stages wrote; an
    evaluate stage without them (written before hypotheses were kept) is a one-line exit 2."""
    refs = [f"the {i} cat sat on the {i + 1} mat today" for i in range(40)]
    worse = [r.replace("sat", "stood") if i % 2 else r for i, r in enumerate(refs)]
    rs, sw = tmp_path / "rs", tmp_path / "switch-sl"
    for workdir in (rs, sw):
        _hyps(workdir, "references", refs)
    _hyps(rs, "adapters", refs)
    _hyps(rs, "backbone", worse)
    _hyps(sw, "adapters", refs)
    sig = script.paired_bootstrap_runs((rs, "adapters"), {"backbone": (rs, "backbone"),
                                                          "switch_sl": (sw, "adapters")},
                                       samples=100)
    assert sig["backbone"]["bleu"]["delta"] > 0
    assert sig["backbone"]["bleu"]["p_a_not_better"] < 0.05
    assert sig["switch_sl"]["bleu"]["delta"] == 0 == sig["switch_sl"]["chrf"]["delta"]
    _hyps(sw, "adapters", refs[:-1])
    with pytest.raises(SystemExit) as exc:
        script.paired_bootstrap_runs((rs, "adapters"), {"switch_sl": (sw, "adapters")})
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "adapters.txt: 39 lines, expected one per reference (40)" in err
    (sw / "evaluate" / "hypotheses" / "adapters.txt").unlink()
    with pytest.raises(SystemExit) as exc:
        script.paired_bootstrap_runs((rs, "adapters"), {"switch_sl": (sw, "adapters")})
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "adapters.txt: missing" in err and len(err.splitlines()) == 1


def test_checks_apply_issue_13_items_that_hold_on_real_data(script) -> None:
    """The learned gate is scored against half the distilled gate's NMI, MoA against the
    backbone + 1 BLEU and against Switch-SL, the gate against its clusterer; a check whose
    inputs the run lacks is absent rather than passing."""
    record = {
        "routing_vs_domains": {
            "rs": {"distilled_gate_test": {"pur": 0.62, "nmi": 0.46},
                   "clusterer_test": {"pur": 0.61, "nmi": 0.44}},
            "switch_sl": {"router_sentence_test": {"pur": 0.42, "nmi": 0.233}}},
        "translation": {"backbone": {"bleu": {"all": 8.28}},
                        "moa_rs": {"bleu": {"all": 8.73}},
                        "switch_sl": {"bleu": {"all": 8.90}}}}
    got = script.checks(record)
    assert got["switch_sl_gate_nmi_le_half_moa"] == {
        "value": 0.233, "bar": 0.23, "ratio": 0.507, "holds": False}
    assert got["moa_bleu_ge_backbone_plus_1"] == {"value": 0.45, "holds": False}
    assert got["moa_above_switch_sl"] == {"value": -0.17, "holds": False}
    assert got["gate_within_0.02_of_clusterer"]["holds"] is True
    record["routing_vs_domains"]["switch_sl"]["router_sentence_test"]["nmi"] = 0.2
    record["translation"]["moa_rs"]["bleu"]["all"] = 9.5
    got = script.checks(record)
    assert got["switch_sl_gate_nmi_le_half_moa"]["holds"] is True
    assert got["moa_bleu_ge_backbone_plus_1"]["holds"] is True
    assert got["moa_above_switch_sl"]["holds"] is True
    record["routing_vs_domains"]["switch_sl_moe"] = {
        "router_sentence_test": {"pur": 0.3, "nmi": 0.05}}
    record["translation"]["switch_sl_moe"] = {"bleu": {"all": 10.0}}
    got = script.checks(record)
    assert got["switch_sl_moe_gate_nmi_le_half_moa"]["holds"] is True
    assert got["moa_above_switch_sl_moe"] == {"value": -0.5, "holds": False}
    for name in ("switch_sl", "switch_sl_moe"):
        del record["routing_vs_domains"][name], record["translation"][name]
    assert set(script.checks(record)) == {"gate_within_0.02_of_clusterer",
                                          "moa_bleu_ge_backbone_plus_1"}


def test_bad_adapter_steps_is_one_line_exit_2_even_without_data(script, tmp_path: Path,
                                                                 capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        script.main(["--data", str(tmp_path / "no"), "--adapter-steps", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: benchmarks/moa_real_data.py: argument --adapter-steps: expected a positive "
        "integer, got '0' (see benchmarks/moa_real_data.py --help)")
