"""Raw-text translation gives task routers the ids they need (language pair, target, domain) and
starts every source with the tags the model's data had (domain tag, then language tag)."""

from __future__ import annotations

import pytest
import torch

from moe_train.eval.raw_text import source_prefix
from moe_train.config import load_config
from moe_train.config.schema import EvalConfig
from moe_train.data.prepare import load_manifest, load_vocab
from moe_train.errors import ConfigError, DataError
from moe_train.eval.decode import RawTextLabels, encode_lines, translate_lines
from moe_train.models.build import build_model


class FakeVocab:
    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def encode_batch(self, lines):
        return [[4 + (ord(c) % 20) for c in line] for line in lines]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _model(source: str):
    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.ffn_dim=32",
                             "model.encoder_layers=1", "model.decoder_layers=2",
                             "moe.num_experts=4", "moe.k=1", "moe.encoder_router=dense",
                             "moe.decoder_router=task", f"moe.decoder_task_source={source}",
                             "moe.num_tasks=4"])
    torch.manual_seed(0)
    return build_model(cfg, {"vocab_size": 30, "pad_id": 0}).eval()


@pytest.mark.parametrize("source, labels", [
    ("tgt_lang", RawTextLabels(tgt_lang=1)),
    ("lang_pair", RawTextLabels(src_lang=0, tgt_lang=1, num_langs=2)),
    ("domain", RawTextLabels(domain=3)),
])
def test_task_routers_translate_raw_text_with_labels(source, labels):
    model = _model(source)
    ecfg = EvalConfig(beam=2, max_len_a=0.0, max_len_b=4)
    lines = ["abc", "hello there"]
    with pytest.raises(ConfigError, match="needs task ids"):
        translate_lines(model, FakeVocab(), lines, ecfg, torch.device("cpu"))
    out = translate_lines(model, FakeVocab(), lines, ecfg, torch.device("cpu"), labels=labels)
    assert len(out) == 2


def test_labels_fill_every_row_of_the_context():
    src = torch.tensor([[5, 6, 0], [7, 0, 0]])
    ctx = RawTextLabels(src_lang=2, tgt_lang=0, domain=1, num_langs=3).context(src, 0)
    assert ctx.src_lang_B.tolist() == [2, 2] and ctx.tgt_lang_B.tolist() == [0, 0]
    assert ctx.domain_ids_B.tolist() == [1, 1] and ctx.extras["num_langs"] == 3
    assert ctx.src_pad_mask_BS.tolist() == [[False, False, True], [False, True, True]]
    assert RawTextLabels().context(src, 0).tgt_lang_B is None


def test_source_prefix_follows_the_manifest(tiny_prepared):
    vocab, manifest = load_vocab(tiny_prepared), load_manifest(tiny_prepared)
    domains = manifest["domains"]
    dom = vocab.domain_tag_id(domains[2])
    lang = vocab.lang_tag_id("de")  # tiny_prepared translates en -> de
    assert source_prefix(manifest, vocab, domains[2], "de") == []  # untagged data
    bare = {k: v for k, v in manifest.items() if k not in ("corpora", "domains")}
    assert source_prefix(bare, vocab, None, None) == []  # _check_manifest lets both be absent
    tagged = {**manifest, "domain_tags": True}
    assert source_prefix(tagged, vocab, domains[2], None) == [dom]
    both = {**tagged, "lang_tags": True}
    assert source_prefix(both, vocab, domains[2], None) == [dom, lang]  # the only target
    with pytest.raises(ConfigError, match=f"--domain: this model .*data.domain_tags.* "
                                          f"{', '.join(domains)}; choose one"):
        source_prefix(tagged, vocab, None, None)
    with pytest.raises(ConfigError, match=f"--domain: 'cooking' is not one of the model's "
                                          rf"\({', '.join(domains)}\)"):
        source_prefix(tagged, vocab, "cooking", None)
    with pytest.raises(ConfigError, match=r"--tgt-lang: 'en' is not one of the model's \(de\)"):
        source_prefix(both, vocab, domains[2], "en")  # a language, but no target
    # served corpora of one domain (an extracted sub-network's view): no --domain needed
    one = {**tagged, "corpora": [c for c in manifest["corpora"] if c["domain"] == domains[2]]}
    assert source_prefix(one, vocab, None, None) == [dom]
    with pytest.raises(ConfigError, match=rf"--domain: '{domains[0]}' is not one of"):
        source_prefix(one, vocab, domains[0], None)


def test_encoded_lines_start_with_the_prefix_which_counts_towards_the_limit():
    ids = FakeVocab().encode_batch(["abc"])[0]
    assert encode_lines(FakeVocab(), ["abc"], 6, prefix_ids=[20, 21]) == [[20, 21, *ids]]
    with pytest.raises(DataError, match="input:1: 6 source tokens"):
        encode_lines(FakeVocab(), ["abc"], 5, prefix_ids=[20, 21])


def test_lines_to_translate_are_spaced_as_prepared_data_is():
    """prepare collapses whitespace (a NEL, a vertical tab, doubled spaces); so does what
    `translate` / `evaluate --src` encode, or a line would tokenize unlike its training twin.
    A blank line stays blank."""
    raw = ["  the\x85patient\vtakes   it ", "", "a\u2028b"]
    assert encode_lines(FakeVocab(), raw, None) == \
        FakeVocab().encode_batch(["the patient takes it", "", "a b"])


def test_raw_text_labels_take_only_what_the_model_trained_on():
    """Languages and domains are checked against the corpora the model saw, not every name in
    its manifest: en is one of its languages but never a target (an untrained task row)."""
    from types import SimpleNamespace

    from moe_train.eval.raw_text import raw_text_labels
    from moe_train.config import load_config

    manifest = {"langs": ["de", "en", "fr"], "domains": ["it", "law"],
                "corpora": [{"src_lang": "en", "tgt_lang": "de", "domain": "law"},
                            {"src_lang": "en", "tgt_lang": "fr", "domain": "law"}]}
    inf = SimpleNamespace(manifest=manifest, cfg=load_config(None, []))  # a full model

    def labels(**flags):
        return raw_text_labels(inf, SimpleNamespace(**flags))

    got = labels(tgt_lang="fr", src_lang=None, domain=None)
    assert (got.tgt_lang, got.src_lang, got.domain) == (2, 1, 1)  # the only source and domain
    for flags, message in (({"tgt_lang": "en"}, "--tgt-lang: 'en' is not one of the model's "
                            r"\(de, fr\)"), ({"src_lang": "fr"}, r"'fr' .* \(en\)"),
                           ({"domain": "it"}, r"--domain: 'it' .* \(law\)")):
        with pytest.raises(ConfigError, match=message):
            labels(**{"tgt_lang": None, "src_lang": None, "domain": None, **flags})


def test_blank_lines_translate_to_blank_lines():
    """The model never trained on an empty source: a blank or whitespace-only line gives an
    empty line in its place (the others as translated without it), not an invented sentence."""
    model = _model("tgt_lang")
    ecfg = EvalConfig(beam=1, max_len_a=0.0, max_len_b=4)
    labels = RawTextLabels(tgt_lang=1)
    alone = translate_lines(model, FakeVocab(), ["abc", "hello there"], ecfg,
                            torch.device("cpu"), labels=labels)
    out = translate_lines(model, FakeVocab(), ["abc", "", "   ", "hello there"], ecfg,
                          torch.device("cpu"), labels=labels)
    assert out == [alone[0], "", "", alone[1]] and alone[0] != ""


def test_a_line_the_tokenizer_keeps_nothing_of_translates_to_a_blank_line():
    """A zero-width space or a stray BOM is not blank to str.strip() but encodes to nothing:
    the model would translate an empty source (it never saw one) into invented text."""
    class Dropping(FakeVocab):
        def encode_batch(self, lines):
            return [[4 + (ord(c) % 20) for c in line if c not in "\u200b\ufeff"]
                    for line in lines]

    model = _model("tgt_lang")
    out = translate_lines(model, Dropping(), ["abc", "\u200b", "\ufeff", "hello"],
                          EvalConfig(beam=2, max_len_a=0.0, max_len_b=4), torch.device("cpu"),
                          labels=RawTextLabels(tgt_lang=1))
    assert out[1] == out[2] == "" and out[0] and out[3]


def test_a_decoder_only_prompt_leaves_room_for_its_translation():
    """Cut to the positions, a long prompt lost its template's tail and left one output token
    (an empty translation); the source's words are cut instead, keeping the template."""
    from moe_train.data.prompts import DEFAULT_PROMPT, fit_prompt

    count = lambda text: len(text.split())  # noqa: E731  (a word per token)
    text = " ".join(f"w{i}" for i in range(30))
    prompt, kept = fit_prompt(DEFAULT_PROMPT, text, "de", "en", count, limit=1000)
    assert kept is None and text in prompt
    prompt, kept = fit_prompt(DEFAULT_PROMPT, text, "de", "en", count, limit=40)
    template_tokens = count(DEFAULT_PROMPT.format(source="", src_name="German",
                                                  tgt_name="English"))
    # the prompt and a translation as long as the source; its eos is predicted, never fed
    assert 0 < kept < 30 and template_tokens + 2 * kept <= 40
    assert template_tokens + 2 * (kept + 1) > 40  # the most words that fit
    # 41 positions: 9 + 16 prompt tokens and 16 outputs fed (the 17th, eos, never is)
    assert template_tokens == 9 and fit_prompt(DEFAULT_PROMPT, text, "de", "en", count,
                                               limit=41)[1] == 16
    assert prompt.endswith("English:")  # the template's tail is kept
    assert fit_prompt(DEFAULT_PROMPT, text, "de", "en", count, limit=5)[1] == 0


def test_text_to_translate_may_not_hold_a_control_token(tiny_prepared):
    """A tag typed in the input (`<dom:law>`, `<2de>`, or full-width as NFKC reads it) became
    the tag itself and steered the model; prepare refuses it in training text, and so do
    translate / evaluate --src, naming the input line."""
    from types import SimpleNamespace

    from moe_train.eval.raw_text import translate_raw

    vocab, manifest = load_vocab(tiny_prepared), load_manifest(tiny_prepared)
    domain = manifest["domains"][0]
    inf = SimpleNamespace(vocab=vocab, cfg=SimpleNamespace(decoder_only=False))
    for tag in (f"<dom:{domain}>", "<2de>", "\uff1c2de\uff1e"):
        with pytest.raises(DataError, match=r"^in\.txt:2: holds '<(dom:|2de)[^']*>', which this "
                                            "model's tokenizer reads as a control token"):
            translate_raw(inf, SimpleNamespace(), "in.txt", ["fine", f"a {tag} b"], None, "cpu")
    # text that only looks like one is translated
    from moe_train.eval.raw_text import _check_no_control_tokens

    _check_no_control_tokens(vocab, ["a <2xx> b", "<dom:nowhere>", "<2 de>"], "in.txt")
