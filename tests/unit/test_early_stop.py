"""Early stopping: patience counts validations without improvement of the chosen dev metric."""

from __future__ import annotations

import json

import pytest

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.train.early_stop import EarlyStop
from tests.conftest import ROOT


def test_bleu_plateau_stops_after_patience_validations() -> None:
    stop = EarlyStop("bleu", patience=2, min_delta=0.5)
    seen = [stop.update(step, {"dev/loss": 1.0, "dev/bleu": bleu})
            for step, bleu in [(100, 10.0), (200, 20.0), (300, 20.3), (400, 25.0), (500, 24.0),
                               (600, 25.4)]]
    assert seen == [False, False, False, False, False, True]
    assert stop.state() == {"metric": "dev/bleu", "best": 25.0, "best_step": 400}
    assert stop.best_values == {"dev/loss": 1.0, "dev/bleu": 25.0} and not stop.improved


def test_improved_flags_each_new_best_and_state_round_trips() -> None:
    stop = EarlyStop("bleu", patience=3)
    flags = []
    for step, bleu in [(1, 5.0), (2, 4.0), (3, 6.0), (4, 6.0)]:
        stop.update(step, {"dev/bleu": bleu, "note": "text"})
        flags.append(stop.improved)
    assert flags == [True, False, True, False]
    again = EarlyStop("bleu", patience=3)
    assert again.state_dict()["best"] is None  # JSON-safe before any validation
    again.load_state_dict(json.loads(json.dumps(stop.state_dict())))
    assert again.state() == stop.state() and again.bad == 1
    assert again.best_values == {"dev/bleu": 6.0}
    assert again.update(5, {"dev/bleu": 5.0}) is False and again.update(6, {"dev/bleu": 1.0})
    other = EarlyStop("loss", patience=3)
    other.load_state_dict(stop.state_dict())  # another metric: starts over
    assert other.best_step == 0 and other.bad == 0


def test_an_off_schedule_best_is_exported_but_sets_no_bar() -> None:
    """Stopped at step 10 (max_steps, off a validate_every=4 schedule) and resumed: the step-10
    validation improves, yet the resumed run must stop where the uninterrupted one does (never,
    here: each scheduled validation beats the one before by more than min_delta). Step 10 may
    still be the export while it is the best value seen."""
    dev = {4: 8.367, 8: 7.956, 10: 7.756, 12: 7.603, 16: 7.388}
    full = EarlyStop("loss", patience=1, min_delta=0.18)
    assert [full.update(s, {"dev/loss": dev[s]}) for s in (4, 8, 12, 16)] == [False] * 4
    cut = EarlyStop("loss", patience=1, min_delta=0.18)
    for s in (4, 8):
        cut.update(s, {"dev/loss": dev[s]})
    assert not cut.update(10, {"dev/loss": dev[10]}, scheduled=False) and cut.improved
    assert cut.state() == {"metric": "dev/loss", "best": 7.756, "best_step": 10}
    resumed = EarlyStop("loss", patience=1, min_delta=0.18)
    resumed.load_state_dict(json.loads(json.dumps(cut.state_dict())))
    assert not resumed.update(12, {"dev/loss": dev[12]}) and not resumed.improved
    assert not resumed.update(16, {"dev/loss": dev[16]}) and resumed.improved
    assert resumed.state() == full.state() == {"metric": "dev/loss", "best": 7.388,
                                               "best_step": 16}
    old = cut.state_dict()
    del old["bar"]  # a checkpoint written before the bar was kept apart
    again = EarlyStop("loss", patience=1, min_delta=0.18)
    again.load_state_dict(old)
    assert again.bar == again.best


def test_loss_is_lower_better_and_missing_values_are_ignored() -> None:
    stop = EarlyStop("loss", patience=1)
    assert not stop.update(1, {"dev/loss": 3.0})
    assert not stop.update(2, {"dev/bleu": 1.0})  # no loss this time: not counted
    assert not stop.update(3, {"dev/loss": 2.0})
    assert stop.update(4, {"dev/loss": 2.5})
    assert not EarlyStop("loss", patience=0).update(5, {"dev/loss": 9.0})  # off


def test_config_checks() -> None:
    path = ROOT / "configs" / "debug-cpu.yaml"
    cfg = load_config(path, ["train.patience=3", "train.early_stop_metric=bleu",
                             "train.validate_every=50"])
    assert cfg.train.patience == 3
    with pytest.raises(ConfigError, match="train.early_stop_metric: expected loss or bleu"):
        load_config(path, ["train.early_stop_metric=chrf"])
    with pytest.raises(ConfigError, match="train.patience: expected 0 unless"):
        load_config(path, ["train.patience=2", "train.validate_every=0"])
