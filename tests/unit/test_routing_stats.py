"""Routing statistics: exact slot counts, task routing purity, rank sharding, metrics, files."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError, DataError
from moe_train.eval.routing_stats import (RoutingRecorder, RoutingStats, collect_routing_stats,
                                          column_purity, expert_purity, load_cv,
                                          normalized_mutual_info, write_routing_stats)
from moe_train.models.build import build_model, moe_layers
from moe_train.models.context import ForwardContext
from moe_train.parallel.runtime import ParallelRuntime

PAD, BOS, EOS, V = 0, 2, 3, 64
ENC, DEC = "encoder_layers.1.ffn", "decoder_layers.1.ffn"
TINY = ["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "moe.num_experts=4", "moe.k=1",
        "moe.decoder_router=task", "moe.decoder_task_source=domain", "moe.num_tasks=3"]
# corpus c: domain c; languages 0=de 1=en 2=fr; pairs de-en, fr-en, de-fr
PAIRS = [(0, 1), (2, 1), (0, 2)]
MANIFEST = {
    "domains": ["it", "law", "med"], "langs": ["de", "en", "fr"],
    "pad_id": PAD, "bos_id": BOS, "eos_id": EOS, "vocab_size": V,
    "corpora": [{"name": f"c{c}", "domain_id": c, "src_lang_id": s, "tgt_lang_id": t}
                for c, (s, t) in enumerate(PAIRS)],
}


class FakeDataset:
    """ShardedDataset look-alike with fixed lengths (see tests/unit/test_batching.py)."""

    def __init__(self, sizes: list[int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n = sum(sizes)
        self.corpus_sizes = list(sizes)
        self.corpus_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.src_lengths = rng.integers(1, 9, n).astype(np.int64)
        self.tgt_lengths = rng.integers(1, 9, n).astype(np.int64)
        self.corpus_ids = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
        self.domain_ids = self.corpus_ids.copy()
        self.src_lang_ids = np.asarray([PAIRS[c][0] for c in self.corpus_ids], dtype=np.int64)
        self.tgt_lang_ids = np.asarray([PAIRS[c][1] for c in self.corpus_ids], dtype=np.int64)
        self.manifest = MANIFEST

    def __len__(self) -> int:
        return len(self.src_lengths)

    def src(self, i: int) -> np.ndarray:
        return 10 + (i + np.arange(self.src_lengths[i], dtype=np.int64)) % 50

    def tgt(self, i: int) -> np.ndarray:
        return 10 + (3 * i + np.arange(self.tgt_lengths[i], dtype=np.int64)) % 50


def _model(extra: list[str] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(overrides=TINY + (extra or [])),
                       {"vocab_size": V, "pad_id": PAD})


def _tokens_by_domain(ds: FakeDataset, side: str) -> np.ndarray:
    """Real tokens per domain: source = tokens + eos, decoder input = bos + tokens."""
    lengths = (ds.src_lengths if side == "src" else ds.tgt_lengths) + 1
    return np.bincount(ds.domain_ids, weights=lengths, minlength=3).astype(np.int64)


@pytest.fixture(scope="module")
def dataset() -> FakeDataset:
    return FakeDataset([4, 3, 5])


@pytest.fixture(scope="module")
def stats(dataset: FakeDataset) -> RoutingStats:
    return collect_routing_stats(_model(), dataset, MANIFEST, ParallelRuntime(), max_tokens=40)


def test_totals_equal_real_token_slots(stats: RoutingStats, dataset: FakeDataset) -> None:
    src_D, tgt_D = _tokens_by_domain(dataset, "src"), _tokens_by_domain(dataset, "tgt")
    assert list(stats.layers) == [ENC, DEC] and stats.sentences == 12
    for layer, per_domain in ((ENC, src_D), (DEC, tgt_D)):
        t = stats.layers[layer]
        assert t.tokens == per_domain.sum()  # k = 1: one slot per real token
        np.testing.assert_array_equal(t.expert_domain.sum(0), per_domain)
        # pair d (= corpus d) and target languages en (corpora 0, 1) and fr (corpus 2)
        assert stats.tasks == ["de-en", "de-fr", "fr-en"] and stats.tgt_langs == ["en", "fr"]
        np.testing.assert_array_equal(t.expert_task.sum(0), per_domain[[0, 2, 1]])
        np.testing.assert_array_equal(t.expert_tgt_lang.sum(0),
                                      [per_domain[0] + per_domain[1], per_domain[2]])
        # the same slots seen three ways
        assert t.expert_domain.sum() == t.expert_task.sum() == t.expert_tgt_lang.sum()
        np.testing.assert_array_equal(t.expert_domain.sum(1), t.expert_task.sum(1))


def test_task_router_by_domain_puts_each_domain_on_one_expert(stats: RoutingStats) -> None:
    dec = stats.layers[DEC].expert_domain
    for d in range(3):
        col = dec[:, d]
        assert np.count_nonzero(col) == 1 and col.max() == col.sum() > 0
    summary = stats.summary()["layers"]
    assert summary[DEC]["domain_purity"] == {"it": 1.0, "law": 1.0, "med": 1.0}
    assert summary[DEC]["routing_entropy"] > 0  # learned task gate: a softmax, not one-hot
    # a token router at random init does not route a whole domain to one expert
    assert min(v for v in summary[ENC]["domain_purity"].values()) < 1.0


def test_fixed_assignment_gives_hand_computed_table(dataset: FakeDataset) -> None:
    model = _model(["moe.encoder_router=task", "moe.encoder_task_source=domain",
                    "moe.assignment=[[2],[0],[3]]", "moe.decoder_router=dense"])
    stats = collect_routing_stats(model, dataset, MANIFEST, ParallelRuntime(), max_tokens=40)
    expected = np.zeros((4, 3), dtype=np.int64)
    for d, e in enumerate([2, 0, 3]):
        expected[e, d] = _tokens_by_domain(dataset, "src")[d]
    np.testing.assert_array_equal(stats.layers[ENC].expert_domain, expected)
    layer = stats.summary()["layers"][ENC]
    assert layer["routing_entropy"] is None  # a fixed table has no distribution
    assert layer["tokens_per_expert"] == expected.sum(1).tolist()
    assert layer["expert_purity"] == 1.0 and layer["domain_nmi"] == pytest.approx(1.0)


def test_a_soft_gate_counts_each_token_at_its_largest_weight_adapter(
        dataset: FakeDataset) -> None:
    """Gated Adapters' gate mixes all E adapters into every token: counting its E slots would
    give equal rows whatever the gate does (purity 1/E, NMI 0). Each token counts once, at
    its largest-weight adapter: a gate that weights adapter 1 most everywhere fills row 1."""
    import dataclasses

    from moe_train.moe.gated_router import GatedRouter

    torch.manual_seed(0)
    model = build_model(load_config(overrides=[
        "model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "adapters.num_experts=3",
        "adapters.router=gated", "adapters.sides=both", "adapters.dim=8",
        "gated.gate_loss=none"]), {"vocab_size": V, "pad_id": PAD})
    routers = [m for m in model.modules() if isinstance(m, GatedRouter)]
    assert routers
    for router in routers:
        def forward(x_TD, rctx=None, _inner=router.forward):
            routing = _inner(x_TD, rctx)
            weights_TK = torch.full_like(routing.weights_TK, 0.2)
            weights_TK[:, 1] = 0.6
            return dataclasses.replace(routing, weights_TK=weights_TK)
        router.forward = forward
    stats = collect_routing_stats(model, dataset, MANIFEST, ParallelRuntime(), max_tokens=40)
    assert stats.layers
    for name, t in stats.layers.items():
        side = "src" if name.startswith("encoder") else "tgt"
        per_domain = _tokens_by_domain(dataset, side)
        np.testing.assert_array_equal(t.expert_domain[1], per_domain)
        assert t.expert_domain[[0, 2]].sum() == 0 and t.tokens == per_domain.sum()
        assert stats.summary()["layers"][name]["domain_purity"] == {
            "it": 1.0, "law": 1.0, "med": 1.0}


def test_ranks_partition_the_data_and_fillers_are_not_counted(dataset: FakeDataset,
                                                              stats: RoutingStats) -> None:
    # max_tokens 40 cuts the 12 sentences into 3 batches: rank 1 of 2 gets one real batch
    # and one filler that must run but not be counted
    parts = [collect_routing_stats(_model(), dataset, MANIFEST,
                                   ParallelRuntime(rank=r, world_size=2), max_tokens=40)
             for r in (0, 1)]
    for layer in (ENC, DEC):
        summed = sum(p.layers[layer].expert_domain for p in parts)
        np.testing.assert_array_equal(summed, stats.layers[layer].expert_domain)
    assert parts[0].sentences + parts[1].sentences == 12
    first = collect_routing_stats(_model(), dataset, MANIFEST, ParallelRuntime(), max_tokens=40,
                                  max_batches=1)
    assert 0 < first.sentences < 12
    assert first.layers[ENC].tokens < stats.layers[ENC].tokens


def test_recorder_removes_hooks_and_needs_labels() -> None:
    model = _model().eval()
    routers = [layer.router for _, layer in moe_layers(model)]
    src = torch.tensor([[11, 12, 13, EOS], [14, EOS, PAD, PAD]])
    tgt = torch.tensor([[BOS, 20, 21], [BOS, PAD, PAD]])
    ctx = ForwardContext(domain_ids_B=torch.tensor([0, 2]), src_lang_B=torch.tensor([0, 2]),
                         tgt_lang_B=torch.tensor([1, 1]))
    with RoutingRecorder(model, num_domains=3, num_langs=3) as rec:
        assert all(len(r._forward_hooks) == 1 for r in routers)
        with pytest.raises(RuntimeError, match="set_batch"):
            model(src, tgt, ctx)
        rec.set_batch(None)
        model(src, tgt, ctx)  # runs, not counted
        assert int(rec.tables()[ENC].tokens) == 0
        rec.set_batch(ctx)
        model(src, tgt, ctx)
    assert all(len(r._forward_hooks) == 0 for r in routers)
    tables = rec.tables()
    # 4 + 2 real source tokens, 3 + 1 real decoder inputs
    assert tables[ENC].expert_domain_EN.sum(0).tolist() == [4, 0, 2]
    assert tables[DEC].expert_domain_EN.sum(0).tolist() == [3, 0, 1]
    # pair ids src * 3 + tgt: de-en = 1, fr-en = 7
    assert tables[ENC].expert_pair_EP.sum(0).nonzero().view(-1).tolist() == [1, 7]
    model(src, tgt, ctx)  # after exit: no hook, no change
    assert torch.equal(rec.tables()[ENC].expert_domain_EN, tables[ENC].expert_domain_EN)
    with pytest.raises(ValueError, match="domain_ids_B has ids outside"):
        rec.set_batch(ctx.replace(domain_ids_B=torch.tensor([0, 3])))


def test_metrics_hand_computed() -> None:
    table = np.array([[3, 0], [1, 4]])  # experts x domains
    assert column_purity(table) == [0.75, 1.0]
    assert column_purity(np.array([[0, 2], [0, 0]]))[0] is None
    assert load_cv(np.array([3, 5])) == pytest.approx(0.25)  # std 1, mean 4
    assert load_cv(np.zeros(4)) is None
    assert expert_purity(table) == pytest.approx(7 / 8)
    assert expert_purity(np.array([[3, 3], [0, 2]])) == pytest.approx(5 / 8)  # rows: experts
    assert normalized_mutual_info(np.array([[5, 0], [0, 7]])) == pytest.approx(1.0)
    assert normalized_mutual_info(np.array([[2, 2], [3, 3]])) == pytest.approx(0.0, abs=1e-12)
    # [[1,1],[0,2]]: U = 4, expert sums (2, 2), domain sums (1, 3); MI = sum n/U ln(U n / (n_e n_d))
    mi = 0.25 * np.log(4 * 1 / (2 * 1)) + 0.25 * np.log(4 * 1 / (2 * 3)) \
        + 0.5 * np.log(4 * 2 / (2 * 3))
    h_e, h_n = np.log(2), -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    assert normalized_mutual_info(np.array([[1, 1], [0, 2]])) == pytest.approx(
        mi / ((h_e + h_n) / 2))


def test_write_routing_stats_files(stats: RoutingStats, tmp_path) -> None:
    scored = {"checkpoint": "run/export", "split": "test"}
    paths = write_routing_stats(stats, tmp_path / "routing", scored)
    out = tmp_path / "routing"
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {"written_by": "moe-train routing-stats", **scored,
                       **json.loads(json.dumps(stats.summary()))}  # what was routed
    from moe_train.eval.routing_tables import check_out_dir

    assert check_out_dir(out) == out  # an earlier output: --out may replace it
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in paths)  # nothing else left (no temporary files)
    assert len(paths) == 2 * 3 * 2 + 3  # + all_layers.csv, layers.csv, summary.json
    with open(out / f"{DEC}.expert_domain.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["expert", "it", "law", "med"]
    np.testing.assert_array_equal(np.array(rows[1:], dtype=np.int64)[:, 1:],
                                  stats.layers[DEC].expert_domain)
    assert [r[0] for r in rows[1:]] == ["0", "1", "2", "3"]
    with open(out / f"{ENC}.expert_task.csv", newline="") as f:
        assert next(csv.reader(f)) == ["expert", "de-en", "de-fr", "fr-en"]
    with open(out / "all_layers.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:5] == ["layer", "expert", "domain:it", "domain:law", "domain:med"]
    assert len(rows) == 1 + 2 * 4 and rows[5][:2] == [DEC, "0"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"][ENC]["token_slots"] == stats.layers[ENC].tokens
    for p in paths:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
            assert width >= 300 and height >= 200


def test_an_extracted_sub_network_s_rows_are_the_full_model_s_expert_ids(
        stats: RoutingStats, tmp_path) -> None:
    """An extracted export keeps some of the full model's experts, renumbered 0..; its tables
    name each row by the full model's id (extract.json), so they compare with the full
    model's."""
    import dataclasses

    sub = dataclasses.replace(stats, expert_ids={DEC: [1, 3, 4, 6]})
    out = tmp_path / "sub"
    write_routing_stats(sub, out, {})
    for kind in ("expert_domain", "expert_tgt_lang"):
        with open(out / f"{DEC}.{kind}.csv", newline="") as f:
            assert [r[0] for r in list(csv.reader(f))[1:]] == ["1", "3", "4", "6"]
    with open(out / f"{ENC}.expert_domain.csv", newline="") as f:  # not extracted: as it is
        assert [r[0] for r in list(csv.reader(f))[1:]] == ["0", "1", "2", "3"]
    with open(out / "all_layers.csv", newline="") as f:
        assert [r["expert"] for r in csv.DictReader(f) if r["layer"] == DEC] == ["1", "3", "4",
                                                                                  "6"]
    summary = json.loads((out / "summary.json").read_text())["layers"]
    assert summary[DEC]["expert_ids"] == [1, 3, 4, 6] and "expert_ids" not in summary[ENC]


def test_user_errors(dataset: FakeDataset) -> None:
    dense = build_model(load_config(overrides=TINY[:6]), {"vocab_size": V, "pad_id": PAD})
    with pytest.raises(ConfigError, match="no MoE layer"):
        collect_routing_stats(dense, dataset, MANIFEST, ParallelRuntime(), max_tokens=40)
    two_domains = dict(MANIFEST, domains=["it", "law"])
    with pytest.raises(DataError, match="domain_ids up to 2 but the manifest lists 2 domains"):
        collect_routing_stats(_model(), dataset, two_domains, ParallelRuntime(), max_tokens=40)


def test_experts_per_token_and_layers_csv(stats: RoutingStats, dataset: FakeDataset,
                                          tmp_path) -> None:
    # top-1 token router (encoder) and task router (decoder): one expert per real token
    for layer, side in ((ENC, "src"), (DEC, "tgt")):
        t = stats.layers[layer]
        np.testing.assert_array_equal(t.tokens_domain, _tokens_by_domain(dataset, side))
        assert t.experts_per_token == 1.0 and t.candidate_usage is None
        np.testing.assert_array_equal(t.experts_per_token_by("domain"), [1.0, 1.0, 1.0])
    assert stats.summary()["experts_per_token"] == {"all": 1.0, "encoder": 1.0, "decoder": 1.0}
    assert stats.group_metrics()["pairs"]["fr-en"] == {"experts_per_token": 1.0}
    write_routing_stats(stats, tmp_path / "r")
    with open(tmp_path / "r" / "layers.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["layer", "side", "tokens", "experts_per_token", "candidate_usage",
                       "experts_per_token:it", "experts_per_token:law", "experts_per_token:med"]
    assert rows[1] == [ENC, "encoder", str(stats.layers[ENC].tokens), "1", "", "1", "1", "1"]
    assert rows[2][:2] == [DEC, "decoder"] and len(rows) == 3


def test_decoder_only_layers_are_the_decoder_side() -> None:
    """Qwen2-MoE's blocks (hf.model.layers.*) count as its decoder in the routing tables."""
    from moe_train.eval.routing_tables import _side

    assert _side("hf.model.layers.3.mlp.moe") == "decoder"
    assert _side("encoder_layers.1.ffn") == "encoder" and _side("decoder_layers.0.ffn") == \
        "decoder"
    assert _side("lm_head") == "other"


def test_evaluate_checks_the_references_before_decoding() -> None:
    """A split without raw text (train) fails before the search, not after it."""
    from moe_train.errors import DataError
    from moe_train.eval.evaluate import evaluate_dataset

    def no_raw(i: int) -> str:
        raise DataError("train: raw text is only kept for dev and test splits")

    dataset = type("D", (), {"raw_tgt": staticmethod(no_raw), "__len__": lambda self: 3})()

    def model(*args, **kwargs):
        raise AssertionError("decoded before the reference check")

    with pytest.raises(DataError, match="raw text"):
        evaluate_dataset(model, dataset, None, {}, None, None, 1024)


def test_evaluate_scores_each_direction_and_domain_apart(monkeypatch) -> None:
    """en->de translated perfectly and de->en not at all: each direction's score is its own."""
    import moe_train.eval.evaluate as evaluate

    refs = ["a b c d e f", "g h i j k l", "m n o p q r", "s t u v w x"]
    dataset = type("D", (), {"raw_tgt": staticmethod(refs.__getitem__),
                             "__len__": lambda self: 4, "domain_ids": np.array([0, 1, 0, 1]),
                             "src_lang_ids": np.array([0, 0, 1, 1]),
                             "tgt_lang_ids": np.array([1, 1, 0, 0])})()
    monkeypatch.setattr(evaluate, "translate_dataset",
                        lambda *a, **k: {0: refs[0], 1: refs[1], 2: "zzz", 3: "yyy"})
    metrics, _ = evaluate.evaluate_dataset(None, dataset, None, {"domains": ["it", "law"],
                                                                 "langs": ["en", "de"]},
                                           None, None, 100)
    assert {p: m["bleu"] for p, m in metrics["pairs"].items()} == {"en-de": 100.0, "de-en": 0.0}
    assert set(metrics["domains"]) == {"it", "law"} and metrics["domains"]["it"]["bleu"] < 100


@pytest.mark.parametrize("columns", [["de"], ["de", "en", "fr", "cs", "ja", "ko", "zh", "es"]])
def test_heatmap_title_and_colorbar_label_stay_inside_the_image(columns, tmp_path,
                                                                  monkeypatch) -> None:
    """A long layer name in a narrow figure used to be cut at the image's edges."""
    from matplotlib.figure import Figure

    from moe_train.eval.routing_tables import plot_heatmap

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                  save(fig, *a, **k)))
    table = np.arange(4 * len(columns)).reshape(4, len(columns))
    plot_heatmap(table, columns, "hf.model.layers.23.mlp: experts x target languages "
                 "(1234567 token slots)", "target language", tmp_path / "t.png")
    fig = figures[0]
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [fig.axes[0].title, fig.axes[1].yaxis.label]
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()
        assert box.y0 <= extent.y0 and extent.y1 <= box.y1, text.get_text()
