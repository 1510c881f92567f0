"""benchmarks/moa_synthetic.py without running it: the acceptance checks it records per seed
and the mean / spread over seeds."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("moa_synthetic")


def _models(moa: float, backbone: float, random: float, top1: float) -> dict:
    return {"moa": {"bleu": moa, "random_routing": {"bleu": random}},
            "backbone": {"bleu": backbone}, "top1": {"bleu": top1}}


def _routing(gate: tuple, clus: tuple, switch_nmi: float) -> dict:
    return {"distilled_gate": {"pur": gate[0], "nmi": gate[1]},
            "clusterer": {"pur": clus[0], "nmi": clus[1]},
            "switch_sl/router_sentence": {"pur": 0.3, "nmi": switch_nmi}}


def _sig(delta: float, p_top1_not_better: float) -> dict:
    return {"top1": {"bleu": {"delta": delta, "ci95": [delta - 1, delta + 1],
                              "p_b_not_better": p_top1_not_better}}}


def test_checks_pass_and_fail_on_the_issue_bars(bench) -> None:
    good = bench.checks(_models(30.0, 28.9, 20.0, 29.5), _routing((0.95, 0.85), (0.96, 0.86),
                                                                   0.4), _sig(0.5, 0.9))
    assert all(c["holds"] for c in good.values()), good
    assert good["moa_bleu_ge_backbone_plus_1"]["value"] == 1.1
    bad = bench.checks(_models(29.5, 28.9, 29.6, 29.6), _routing((0.89, 0.85), (0.93, 0.86),
                                                                  0.43), _sig(-0.1, 0.04))
    failed = {name for name, c in bad.items() if not c["holds"]}
    assert failed == {"gate_pur_ge_0.9", "gate_within_0.02_of_clusterer",
                      "moa_bleu_ge_backbone_plus_1", "moa_above_random_routing",
                      "switch_sl_gate_nmi_le_half_moa", "gumbel_k4_ge_top1",
                      "gumbel_k4_not_significantly_below_top1"}


def test_a_gumbel_deficit_inside_the_noise_is_reported_apart(bench) -> None:
    """-0.2 BLEU that the paired bootstrap cannot tell from noise: the literal item fails,
    the significance item holds, and both carry their figures."""
    out = bench.checks(_models(29.3, 28.0, 20.0, 29.5), _routing((0.95, 0.85), (0.96, 0.86),
                                                                  0.4), _sig(-0.2, 0.31))
    assert out["gumbel_k4_ge_top1"] == {"value": -0.2, "holds": False}
    assert out["gumbel_k4_not_significantly_below_top1"]["holds"] is True
    assert out["gumbel_k4_not_significantly_below_top1"]["value"]["ci95"] == [-1.2, 0.8]


def _write_eval(work, run: str, model: str, hyps: list[str], refs: list[str]) -> dict:
    d = work / run / "evaluate" / "hypotheses"
    d.mkdir(parents=True)
    (d / "references.txt").write_text("".join(r + "\n" for r in refs))
    (d / f"{model}.txt").write_text("".join(h + "\n" for h in hyps))
    return {"evaluate": {"done": {model: {}}}}


def test_significance_pairs_moa_with_each_run_own_model(bench, tmp_path, capsys) -> None:
    refs = [f"word {i} and word {i + 1} in a sentence" for i in range(40)]
    worse = [r.replace("and", "or") if i % 2 else r for i, r in enumerate(refs)]
    runs = {"moa": _write_eval(tmp_path, "moa", "adapters", refs, refs),
            "top1": _write_eval(tmp_path, "top1", "adapters", worse, refs),
            "switch_sl": _write_eval(tmp_path, "switch_sl", "backbone", refs, refs)}
    (tmp_path / "moa" / "evaluate" / "hypotheses" / "backbone.txt").write_text(
        "".join(w + "\n" for w in worse))
    runs["moa"]["evaluate"]["done"]["backbone"] = {}
    sig = bench.significance(tmp_path, runs, samples=100)
    assert set(sig) == {"backbone", "top1", "switch_sl"}
    assert sig["top1"]["bleu"]["delta"] > 0 and sig["top1"]["bleu"]["p_a_not_better"] < 0.05
    assert sig["switch_sl"]["bleu"]["delta"] == 0
    (tmp_path / "top1" / "evaluate" / "hypotheses" / "references.txt").write_text("other\n")
    with pytest.raises(SystemExit) as exc:
        bench.significance(tmp_path, runs, samples=10)
    assert exc.value.code == 2 and "other test sentences" in capsys.readouterr().err


def test_pooled_significance_joins_the_seeds_test_sentences(bench, tmp_path) -> None:
    """Two seeds with their own test sentences and opposite MoA - top-1 deltas: the pooled
    bootstrap pairs each seed's sentences with that seed's models (any cross-seed pairing would
    score hypotheses against other sentences), resamples the seeds apart, leaves out a model
    that only one seed has, and the across-seed Gumbel items carry the mean and the interval."""
    seeds = []
    for name, moa_better in (("s1", True), ("s2", False)):
        refs = [f"{name} word {i} and word {i + 1} in a sentence" for i in range(40)]
        worse = [r.replace("and", "or") if i % 2 else r for i, r in enumerate(refs)]
        moa, top1 = (refs, worse) if moa_better else (worse, refs)
        work = tmp_path / name
        runs = {"moa": _write_eval(work, "moa", "adapters", moa, refs),
                "top1": _write_eval(work, "top1", "adapters", top1, refs)}
        (work / "moa" / "evaluate" / "hypotheses" / "backbone.txt").write_text(
            "".join(w + "\n" for w in worse))
        if name == "s1":
            runs["adpt"] = _write_eval(work, "adpt", "adapters", refs, refs)
        seeds.append((work, runs))
    pooled = bench.pooled_significance(seeds, samples=200)
    assert set(pooled) == {"backbone", "top1"} and pooled["top1"]["strata"] == [40, 40]
    top1 = pooled["top1"]["bleu"]
    assert top1["delta"] == 0.0 and top1["ci95"][0] < 0 < top1["ci95"][1]
    assert top1["a"] == top1["b"] > 85  # hypotheses scored against their own seed's sentences
    assert pooled["backbone"]["bleu"]["delta"] > 0
    per_seed = {s: {"checks": {"gumbel_k4_ge_top1": {"value": v}}}
                for s, v in (("s1", 2.5), ("s2", -2.5))}
    out = bench.pooled_checks(per_seed, pooled)
    assert out["gumbel_k4_mean_delta_over_seeds_ge_0"] == {
        "value": 0.0, "per_seed": [2.5, -2.5], "holds": True}
    assert out["gumbel_k4_not_significantly_below_top1_pooled"]["holds"] is True
    assert bench.pooled_checks(per_seed, {"backbone": pooled["backbone"]}) == {}


@pytest.mark.parametrize("flag, text", [("seeds", "2101,x"), ("seeds", "2101,2101"),
                                        ("seeds", ""), ("runs", "top1,moa"),
                                        ("runs", "moa,top2"), ("runs", "moa,adpt,adpt")])
def test_bad_seeds_and_runs_are_one_error_line(bench, capsys, flag, text) -> None:
    with pytest.raises(SystemExit) as exc:
        getattr(bench, f"parse_{flag}")(text)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"error: --{flag}:") and err.count("\n") == 1
    assert bench.parse_seeds("3, 1,2") == [3, 1, 2]
    assert bench.parse_runs("moa, adpt") == ["moa", "adpt"]


def test_summary_is_mean_and_spread_of_shared_leaves(bench) -> None:
    def rec(bleu: float, holds: bool) -> dict:
        return {"translation": {"moa": {"bleu": bleu, "flag": True}},
                "moa_recipe_minutes": 10.0, "checks": {"x": {"holds": holds}}}

    out = bench.summary({"1": rec(20.0, True), "2": rec(22.0, True), "3": rec(24.0, False)})
    assert out["stats"]["translation/moa/bleu"] == {"mean": 22.0, "std": 1.633, "min": 20.0,
                                                     "max": 24.0}
    assert "translation/moa/flag" not in out["stats"]  # booleans are not figures
    assert out["checks_hold_on_every_seed"] == {"x": False}


def test_the_unf_d_control_is_checked_when_it_ran(bench) -> None:
    models = _models(30.0, 28.9, 20.0, 29.5)
    routing = _routing((0.95, 0.85), (0.96, 0.86), 0.4)
    assert "moa_above_continued_training" not in bench.checks(models, routing, _sig(0.5, 0.9))
    models["continued"] = {"bleu": 30.2}  # the extra training alone beats MoA
    out = bench.checks(models, routing, _sig(0.5, 0.9))["moa_above_continued_training"]
    assert out == {"value": -0.2, "holds": False}


def test_synth_options_replace_preset_fields_and_refuse_bad_ones(bench, capsys) -> None:
    from moe_train.data.synthetic import PRESETS

    opts = bench.synth_options("domain-matters", ["shared_words=96", "ambiguous=120",
                                                  "cue_rate=0.9"])
    assert (opts.shared_words, opts.ambiguous, opts.cue_rate) == (96, 120, 0.9)
    assert opts.shared_rate == PRESETS["domain-matters"].shared_rate
    for preset, pairs, says in [("nope", [], "--preset: expected one of"),
                                ("domain-matters", ["colour=1"], "expected KEY=VALUE"),
                                ("domain-matters", ["ambiguous=lots"], "expected an integer"),
                                ("domain-matters", ["cue_rate=most"], "expected a number"),
                                ("domain-matters", ["ambiguous=200"], "synthetic ambiguous")]:
        with pytest.raises(SystemExit) as exc:
            bench.synth_options(preset, pairs)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


def test_a_corpus_made_with_other_options_is_not_reused(bench, tmp_path, capsys) -> None:
    from moe_train.data.synthetic import SynthOptions

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "domains.json").write_text('{"options": {"ambiguous": 4}}')
    with pytest.raises(SystemExit) as exc:
        bench.make_corpus(tmp_path, 1, {}, SynthOptions(ambiguous=5))
    assert exc.value.code == 2 and "made with other synthetic options" in capsys.readouterr().err


def test_set_overrides_are_checked_by_the_config_loader_first(bench, capsys) -> None:
    bench.check_overrides(["optim.warmup_steps=1000", "moa.adapter_warmup_steps=150"])
    for bad, says in [("foo", "expected key.sub=value"),
                      ("optim.warmup_stepz=5", "unknown field"),
                      ("optim.warmup_steps=-1", "non-negative integer")]:
        with pytest.raises(SystemExit) as exc:
            bench.check_overrides([bad])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("error: --set: ") and says in err, err
        assert err.count("\n") == 1
