"""Task sub-network extraction (seed 002): per-side expert counts, the frozen task table, and
outputs of the extracted model identical to the full model's on the task's inputs (fp32,
greedy and beam, bit for bit) for each task-routed configuration; Table 1's serving figures from
an extracted 32-expert Target/Target config on the meta device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import ConfigError
from moe_train.eval.extract import extract, extraction_report, load_extracted, resolve_task
from moe_train.eval.params import count_parameters
from moe_train.eval.search import beam_search, greedy_search
from moe_train.models.build import build_model, moe_layers
from moe_train.models.context import ForwardContext
from moe_train.moe.dispatcher import DenseDispatcher
from moe_train.moe.routing import NUM_LANGS_KEY
from tests.conftest import ROOT

V, PAD, BOS, EOS = 40, 0, 1, 2
LANGS, DOMAINS = ["de", "en", "fr"], ["it", "law", "med"]
MANIFEST = {"vocab_size": V, "pad_id": PAD, "langs": LANGS, "domains": DOMAINS}
TINY = ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=2",
        "model.decoder_layers=2", "model.dropout=0.0", "optim.precision=fp32",
        "moe.num_experts=8", "moe.layers=all"]

CONFIGS = {  # name -> (overrides, task to extract)
    "token/target": (["moe.encoder_router=topk", "moe.decoder_router=task",
                      "moe.decoder_task_source=tgt_lang"], "en"),
    "target/target": (["moe.encoder_router=task", "moe.encoder_task_source=tgt_lang",
                       "moe.decoder_router=task", "moe.decoder_task_source=tgt_lang"], "fr"),
    "LP/LP k=3": (["moe.encoder_router=task", "moe.encoder_task_source=lang_pair",
                   "moe.decoder_router=task", "moe.decoder_task_source=lang_pair", "moe.k=3"],
                  "de-en"),
    "token/LP, per-side experts": (["moe.encoder_router=topk", "moe.decoder_router=task",
                                    "moe.decoder_task_source=lang_pair",
                                    "moe.decoder_num_experts=6"], "fr-en"),
    "domain/domain fixed, weighted": (
        ["moe.encoder_router=task", "moe.decoder_router=task", "moe.encoder_task_source=domain",
         "moe.decoder_task_source=domain", "moe.assignment=[[5, 1], [2, 7], [0, 3]]",
         "moe.assignment_weights=[[0.7, 0.3], [0.5, 0.5], [0.2, 0.8]]"], "law"),
    # adapters (kept whole) beside task-routed FFN experts: MoA's gate, or one per domain
    "token/target + MoA adapters": (["moe.encoder_router=topk", "moe.decoder_router=task",
                                     "moe.decoder_task_source=tgt_lang", "adapters.num_experts=4",
                                     "adapters.dim=4", "adapters.router=gumbel", "adapters.k=2"],
                                    "en"),
    "target/target + domain adapters": (
        ["moe.encoder_router=task", "moe.encoder_task_source=tgt_lang", "moe.decoder_router=task",
         "moe.decoder_task_source=tgt_lang", "adapters.num_experts=3", "adapters.dim=4",
         "adapters.router=task", "adapters.task_source=domain", "adapters.num_tasks=3",
         "adapters.k=1",
         "adapters.sides=both"], "fr"),
}


def _model(overrides: list[str]):
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, *overrides])
    model = build_model(cfg, MANIFEST)
    with torch.no_grad():  # spread the gates so tasks pick different experts
        for name, p in model.named_parameters():
            if "router" in name or "expert" in name or ".adapter." in name:
                p.normal_(0.0, 0.5)
    return cfg, model.eval()


def _inputs(task: str, n: int = 6) -> tuple[torch.Tensor, ForwardContext]:
    """n sources of the task (its pair / target / domain), ragged, with their labels."""
    gen = torch.Generator().manual_seed(3)
    src_BS = torch.randint(3, V, (n, 9), generator=gen)
    for b in range(n):
        length = 4 + b % 5
        src_BS[b, length - 1] = EOS
        src_BS[b, length:] = PAD
    if task in DOMAINS:
        src, tgt, dom = 0, 1, DOMAINS.index(task)
    else:
        pair = task.split("-")
        src, tgt = (LANGS.index(pair[0]), LANGS.index(pair[1])) if len(pair) == 2 else \
            (1 if task != "en" else 0, LANGS.index(task))
        dom = 0
    full = lambda v: torch.full((n,), v, dtype=torch.long)  # noqa: E731
    return src_BS, ForwardContext(src_lang_B=full(src), tgt_lang_B=full(tgt),
                                  domain_ids_B=full(dom), extras={NUM_LANGS_KEY: len(LANGS)})


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_extracted_sub_network_decodes_identically(name: str, one_thread) -> None:
    overrides, task = CONFIGS[name]
    cfg, model = _model(overrides)
    ext = extract(model, cfg, MANIFEST, task)
    sub = load_extracted(ext, MANIFEST)
    src_BS, ctx = _inputs(task)
    kwargs = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=0.0, max_len_b=12, ctx=ctx)
    greedy = greedy_search(model, src_BS, **kwargs)
    assert any(greedy)
    assert greedy_search(sub, src_BS, **kwargs) == greedy
    for beam in (2, 4):
        assert beam_search(sub, src_BS, beam=beam, **kwargs) == \
            beam_search(model, src_BS, beam=beam, **kwargs)
    # Bit for bit, not only the same argmax: the logits are equal.
    enc, sub_enc = model.encode(src_BS, ctx), sub.encode(src_BS, ctx)
    tgt_BT = torch.randint(3, V, (src_BS.size(0), 5), generator=torch.Generator().manual_seed(5))
    tgt_BT[:, 0] = BOS
    assert torch.equal(sub.decode(tgt_BT, sub_enc, ctx)[0], model.decode(tgt_BT, enc, ctx)[0])
    tgt_BT[::2, 3:] = PAD  # teacher forcing over padded targets (what `evaluate` scores)
    real_BT = tgt_BT.ne(PAD)
    assert torch.equal(sub.decode(tgt_BT, sub_enc, ctx)[0][real_BT],
                       model.decode(tgt_BT, enc, ctx)[0][real_BT])

    # Only k experts per task-routed layer remain; token-routed layers keep theirs.
    k = cfg.moe.k
    for (lname, full_layer), (sname, sub_layer) in zip(moe_layers(model), moe_layers(sub)):
        assert lname == sname
        task_routed = full_layer.router.name == "task" and lname.endswith(".ffn")
        assert sub_layer.experts.num_experts == (k if task_routed else
                                                 full_layer.experts.num_experts)
        # every token of the sub-network uses all k experts of a task-routed layer: no sort
        assert isinstance(sub_layer.dispatcher, DenseDispatcher) == task_routed
        assert list(sub_layer.router.parameters()) == [] or not task_routed
    total = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert total(sub) < total(model)


@torch.no_grad()
def test_extracted_model_refuses_other_tasks() -> None:
    cfg, model = _model(CONFIGS["token/target"][0])
    sub = load_extracted(extract(model, cfg, MANIFEST, "en"), MANIFEST)
    src_BS, ctx = _inputs("fr")
    enc = sub.encode(src_BS, ctx)  # the encoder routes by token: any task may pass
    with pytest.raises(ConfigError, match=r"serves tgt_lang id\(s\) \[1\] only, got id 2"):
        sub.decode(torch.full((6, 1), BOS), enc, ctx)


def test_extraction_errors_name_the_problem() -> None:
    cfg, model = _model(["moe.encoder_router=topk", "moe.decoder_router=topk"])
    with pytest.raises(ConfigError, match="neither side routes by task"):
        extract(model, cfg, MANIFEST, "en")
    cfg, model = _model(CONFIGS["LP/LP k=3"][0])
    with pytest.raises(ConfigError, match="routes by language pair; expected xx-yy"):
        extract(model, cfg, MANIFEST, "en")
    with pytest.raises(ConfigError, match="routes by domain"):
        resolve_task("news", "domain", MANIFEST)
    assert resolve_task("de-fr", "tgt_lang", MANIFEST) == 2
    assert resolve_task("de-fr", "src_lang", MANIFEST) == 0
    assert resolve_task("fr-de", "lang_pair", MANIFEST) == 2 * 3 + 0
    cfg, model = _model(CONFIGS["target/target"][0])
    ext = extract(model, cfg, MANIFEST, "en")
    with pytest.raises(ConfigError, match="already a sub-network"):
        extract(load_extracted(ext, MANIFEST), ext.cfg, MANIFEST, "en")
    qwen = load_config(ROOT / "configs" / "qwen-moe-tiny-cpu.yaml")
    with pytest.raises(ConfigError, match="decoder-only .* for the encoder-decoder"):
        extract(None, qwen, MANIFEST, "en")  # refused before the model is read


def test_learned_gate_frozen_into_a_table_is_what_forward_uses() -> None:
    cfg, model = _model(CONFIGS["LP/LP k=3"][0])
    router = moe_layers(model)[0][1].router
    ids_NK, weights_NK = router.table()
    assert ids_NK.shape == (9, 3) and torch.allclose(weights_NK.sum(-1), torch.ones(9))
    # The table as a fixed assignment with weights routes exactly as the learned gate.
    from moe_train.config.moe import RouterConfig
    from moe_train.moe.sentence_router import TaskRouter
    from moe_train.moe.routing import RoutingContext

    fixed = TaskRouter(16, 8, RouterConfig(k=3, assignment=ids_NK.tolist(),
                                           assignment_weights=weights_NK.tolist()))
    x_TD = torch.randn(9 * 2, 16)
    rctx = RoutingContext.from_batch(9, 2, task_ids_B=torch.arange(9))
    a, b = router(x_TD, rctx), fixed(x_TD, rctx)
    assert torch.equal(a.expert_ids_TK, b.expert_ids_TK)
    torch.testing.assert_close(a.weights_TK, b.weights_TK, rtol=0, atol=1e-7)


def test_table1_serving_figures_from_an_extracted_target_target_config() -> None:
    """Seed 002 Table 1, Task-level MoE 32e Target/Target: serving all 155M, serving decoder
    32M; the extracted model's own total is its serving size."""
    from moe_train.eval.extract import extracted_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "moe32-base-target.yaml")
    sub_cfg = extracted_config(cfg, "de", {"encoder": 16, "decoder": 16})
    full, sub = count_parameters(cfg, 64000), count_parameters(sub_cfg, 64000)
    assert sub["total"] == full["serving_all"] == sub["serving_all"]
    assert abs(sub["total"] / 155e6 - 1) < 0.02
    assert abs(sub["decoder"] / 32e6 - 1) < 0.02
    assert sub["decoder_num_experts"] == sub["encoder_num_experts"] == 2
    assert abs(full["total"] / 533e6 - 1) < 0.02


def test_extraction_report_has_table1_columns() -> None:
    cfg, model = _model(CONFIGS["token/target"][0])
    ext = extract(model, cfg, MANIFEST, "en")
    report = extraction_report(cfg, ext, MANIFEST)
    assert report["extracted"]["total"] == report["full"]["serving_all"]
    assert report["extracted"]["decoder"] < report["full"]["decoder"]
    assert report["task_ids"] == {"decoder": 1}
    assert all(len(v) == 2 for v in report["experts_kept"].values())


def test_per_side_expert_counts_and_table_fields_are_validated() -> None:
    with pytest.raises(ConfigError, match="moe.decoder_num_experts: expected a multiple of "
                                          "moe.ep_size"):
        load_config(None, ["moe.num_experts=8", "moe.ep_size=4", "moe.decoder_num_experts=6"])
    with pytest.raises(ConfigError, match="moe.encoder_task_table: expected 0 unless"):
        load_config(None, ["moe.num_experts=8", "moe.encoder_task_table=3"])
    with pytest.raises(ConfigError, match=r"moe.assignment_weights\[1\]"):
        load_config(None, ["moe.num_experts=4", "moe.k=1", "moe.assignment=[[0], [1]]",
                           "moe.assignment_weights=[[1.0], [-1.0]]"])
    cfg = load_config(None, [*TINY, "moe.encoder_num_experts=4", "moe.decoder_router=dense"])
    model = build_model(cfg, MANIFEST)
    assert [layer.experts.num_experts for _, layer in moe_layers(model)] == [4, 4]


TRAINED = {**MANIFEST, "corpora": [  # the data held en->de (law) and en->fr (it) only
    {"src_lang": "en", "tgt_lang": "de", "domain": "law"},
    {"src_lang": "en", "tgt_lang": "fr", "domain": "it"}]}


def test_only_tasks_the_model_trained_on_are_extracted() -> None:
    """A language the model never translated into (en: a source only), a pair or a domain it
    never saw would make an export that serves nothing: refused, naming what it serves."""
    assert resolve_task("de", "tgt_lang", TRAINED) == 0
    assert resolve_task("en-fr", "lang_pair", TRAINED) == 1 * 3 + 2
    assert resolve_task("law", "domain", TRAINED) == 1
    for task, source, serves in (("en", "tgt_lang", "de, fr"), ("de-en", "lang_pair",
                                 "en-de, en-fr"), ("med", "domain", "it, law"),
                                 ("fr", "src_lang", "en")):
        with pytest.raises(ConfigError, match=f"never trained on '{task}' .* serves {serves}$"):
            resolve_task(task, source, TRAINED)
    # a name it does not know lists what it serves, not every language of its data
    with pytest.raises(ConfigError, match=r"expected a language \(de, fr\) or a pair"):
        resolve_task("xx", "tgt_lang", TRAINED)


def test_sides_routing_by_different_sources_take_one_task_each() -> None:
    cfg, model = _model(["moe.encoder_router=task", "moe.encoder_task_source=domain",
                         "moe.decoder_router=task", "moe.decoder_task_source=tgt_lang"])
    with pytest.raises(ConfigError, match="the encoder routes by domain and the decoder routes by "
                                          "tgt_lang; give one task for each"):
        extract(model, cfg, TRAINED, "law")
    ext = extract(model, cfg, TRAINED, "law,de")
    assert ext.task_ids == {"encoder": 1, "decoder": 0}
    assert extract(model, cfg, TRAINED, "de,law").task_ids == ext.task_ids  # any order
    with pytest.raises(ConfigError, match="no corpus the model trained on has these tasks"):
        extract(model, cfg, TRAINED, "law,fr")  # law was en->de only: it would serve nothing
    with pytest.raises(ConfigError, match="exactly one part for the domain routing"):
        extract(model, cfg, TRAINED, "fr,de")


@pytest.mark.parametrize("encoder_source, encoder_id", [("src_lang", 0), ("lang_pair", 0 * 3 + 1)])
def test_a_language_pair_names_both_sides_of_a_mixed_routing(encoder_source, encoder_id) -> None:
    """An encoder routing by source language or pair and a decoder by target language, on data
    where a language is both a source and a target: ``de-en`` names both sides' tasks, as do
    one part per side; a part naming nothing, or tasks no corpus had together, are refused."""
    corpora = [{"src_lang": s, "tgt_lang": t, "domain": "law"}
               for s, t in (("en", "de"), ("de", "en"), ("en", "fr"), ("fr", "en"))]
    manifest = {**MANIFEST, "corpora": corpora}
    cfg, model = _model(["moe.encoder_router=task", f"moe.encoder_task_source={encoder_source}",
                         "moe.decoder_router=task", "moe.decoder_task_source=tgt_lang"])
    want = {"encoder": encoder_id, "decoder": 1}
    for task in ("de-en", "de-en,en"):
        assert extract(model, cfg, manifest, task).task_ids == want, task
    if encoder_source == "src_lang":  # parts in side order
        assert extract(model, cfg, manifest, "de,en").task_ids == want
    else:  # parts in any order where each names one side's task only
        assert extract(model, cfg, manifest, "en,de-en").task_ids == want
    for task, error in (("de-en,zz", "'zz' names no task"), ("de-en,", "'' names no task"),
                        ("de-en,fr", "no corpus the model trained on has these tasks together")):
        with pytest.raises(ConfigError, match=error):
            extract(model, cfg, manifest, task)


def test_an_extracted_sub_network_serves_only_its_tasks_corpora() -> None:
    """translate's language / domain defaults and checks, and evaluate's split check, see the
    corpora of the extracted task only; a full model serves every corpus."""
    from moe_train.eval.extract import serves, serving_manifest

    corpora = [*TRAINED["corpora"], {"src_lang": "de", "tgt_lang": "fr", "domain": "law"}]
    manifest = {**TRAINED, "corpora": corpora}
    cfg, model = _model(["moe.encoder_router=task", "moe.encoder_task_source=domain",
                         "moe.decoder_router=task", "moe.decoder_task_source=tgt_lang"])
    assert serving_manifest(cfg, manifest) is manifest
    sub = extract(model, cfg, manifest, "law,fr").cfg
    assert serving_manifest(sub, manifest)["corpora"] == [corpora[2]]  # law and into fr
    assert serving_manifest(sub, manifest)["langs"] == LANGS  # the ids stay whole
    check = serves(sub, manifest)
    assert [check(c) for c in corpora] == [False, False, True]
    cfg, model = _model(CONFIGS["token/target"][0])  # only the decoder routes by task
    sub = extract(model, cfg, manifest, "fr").cfg
    assert [c["tgt_lang"] for c in serving_manifest(sub, manifest)["corpora"]] == ["fr", "fr"]


@pytest.mark.parametrize("kind", ["spm", "hf"])
def test_the_extracted_export_carries_its_models_tokenizer(tmp_path: Path, kind: str) -> None:
    """sentencepiece's model, or a Hugging Face tokenizer's two files (data.tokenizer), as the
    source model's manifest says; extraction used to look for spm.model only."""
    from moe_train.eval.extract import write_extraction

    source = tmp_path / "model"
    source.mkdir()
    names = ["spm.model"] if kind == "spm" else ["tokenizer.json", "tokenizer_config.json"]
    for name in names:
        (source / name).write_text(f"{name} bytes")
    manifest = {**MANIFEST, **({"spm_model": "spm.model"} if kind == "spm" else
                               {"tokenizer": "hf"})}
    cfg, model = _model(CONFIGS["token/target"][0])
    ext = extract(model, cfg, manifest, "en")
    out = write_extraction(tmp_path / "sub", ext, manifest, source,
                           extraction_report(cfg, ext, manifest))
    assert [(out / n).read_text() for n in names] == [f"{n} bytes" for n in names]
    assert (out / "spm.model").exists() == (kind == "spm")
