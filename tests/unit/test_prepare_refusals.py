"""What `prepare` refuses in its input: control pieces inside corpus text (sentencepiece tags,
a Hugging Face tokenizer's special tokens), a limit that leaves no training pair; and the HF
tokenizer's own pad row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_train.data.prepare import prepare
from moe_train.errors import DataError
from tests.unit.test_prepare import _cfg, _corpus


def test_a_sentence_holding_a_tag_piece_is_refused_by_file_and_line(tmp_path: Path) -> None:
    """sentencepiece would read `<2en>` / `<dom:law>` inside text as the tag itself; nothing is
    written. A tag of another vocabulary (`<2fr>` here) is plain text."""
    law = _corpus(tmp_path / "data", "law", 30, seed=3)
    lines = law.tgt.read_text().splitlines()
    lines[4] = "<2fr> is text here"
    law.tgt.write_text("\n".join(lines) + "\n")
    prepare([law], tmp_path / "ok", _cfg(dev_per_domain=3, test_per_domain=3))
    # full-width brackets: sentencepiece's NFKC reads them as the tag
    for line_no, tag, written in ((7, "<2en>", "<2en>"), (12, "<dom:law>", "<dom:law>"),
                                  (9, "<2en>", "\uff1c2en\uff1e"),
                                  (10, "<dom:law>", "\uff1cdom:law\uff1e")):
        lines[line_no - 1] = f"see {written} here"
        law.tgt.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=rf"^{re.escape(str(law.tgt))}:{line_no}: holds "
                                            rf"'{re.escape(tag)}', which this vocabulary keeps"):
            prepare([law], tmp_path / "out", _cfg(dev_per_domain=3, test_per_domain=3))
        assert not (tmp_path / "out").exists()
        lines[line_no - 1] = "fine again"



def test_a_sentence_holding_a_special_token_of_the_hf_tokenizer_is_refused(tmp_path: Path
                                                                           ) -> None:
    """A Hugging Face tokenizer reads its special tokens inside any text too: a corpus line
    holding `<|endoftext|>` would train an end of text in mid-sentence."""
    from moe_train.data.hf_tokenizer import HFTokenizer, train_bpe_tokenizer

    law = _corpus(tmp_path / "data", "law", 30, seed=3)
    tok = train_bpe_tokenizer(law.src.read_text().splitlines(), tmp_path / "tok", 200)
    assert HFTokenizer(tok).special_tokens() == ["<|endoftext|>"]
    cfg = _cfg(dev_per_domain=3, test_per_domain=3, tokenizer=str(tok))
    lines = law.src.read_text().splitlines()
    lines[5] = "a <2en> and <dom:law> are plain text here"
    law.src.write_text("\n".join(lines) + "\n")
    prepare([law], tmp_path / "ok", cfg)
    lines[8] = "ends <|endoftext|> early"
    law.src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(law.src))}:9: holds "
                                        r"'<\|endoftext\|>', which this vocabulary keeps for a "
                                        r"special token; remove or reword it$"):
        prepare([law], tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists()

def test_the_hf_pad_row_is_past_the_largest_id_not_the_count(tmp_path: Path) -> None:
    """With pad_token = eos_token, pad gets its own row past the tokenizer's ids; where the ids
    leave a gap, the count of tokens is a real id (here eos): pad must be one past the largest."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from moe_train.data.hf_tokenizer import HFTokenizer

    vocab = {c: i for i, c in enumerate("abcdefgh")}  # ids 0..7; 8 unused; eos 9
    vocab["<|endoftext|>"] = 9
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    hf = HFTokenizer(tmp_path)
    assert hf._tok.get_vocab_size(with_added_tokens=True) == 9  # the count is eos's id
    assert (hf.eos_id, hf.pad_id, hf.size) == (9, 10, 11)


def test_a_data_max_len_that_skips_every_training_pair_is_refused(tmp_path: Path) -> None:
    """Nothing left to train on is an error of `prepare` (naming the limit), not a directory
    that `train` refuses later; nothing is written."""
    law = _corpus(tmp_path / "data", "law", 30, seed=3)
    with pytest.raises(DataError, match=r"no training pair is left \(\d+ longer than "
                                        r"data.max_len=2 tokens, 0 with no tokens\)"):
        prepare([law], tmp_path / "out", _cfg(max_len=2, dev_per_domain=3, test_per_domain=3))
    assert not (tmp_path / "out").exists()
