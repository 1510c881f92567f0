"""benchmarks/moa_real_data.py --test-dir without running the recipe: the corpus it prepares
takes train/dev from --data and test from DIR, so every model, the clusterer and the gate are
scored on DIR's sentences."""

from __future__ import annotations

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


def test_test_dir_replaces_the_carved_test_split(script, tmp_path: Path) -> None:
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
    with pytest.raises(SystemExit, match="--test-dir .*: .*no corpus files"):
        script.with_test_dir(str(data), str(tmp_path / "data" / "IT"), tmp_path / "m2")


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
