"""Bad input caught up front (audit items 2, 3, 10, 11, 12 and the raw-text wording): each case
fails with one ``error:`` line and status 2 (or the one-line error the CLI prints that way),
naming the option, field or file, and leaves nothing behind.

The CLI cases call `moe_train.cli.main` in this process (no subprocess: each test is fast)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from moe_train.cli import main
from moe_train.config import load_config
from moe_train.config.schema import DataConfig
from moe_train.data.corpus import CorpusFiles, discover, plain_corpus
from moe_train.data.prepare import prepare
from moe_train.data.shards import ShardedDataset, write_shard
from moe_train.errors import ConfigError, DataError
from moe_train.eval.plan import PlanInputs
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _fails_cleanly(capsys, args: list[str], *needles: str) -> str:
    """Run the CLI in-process: status 2, nothing on stdout, exactly one ``error:`` line on
    stderr holding every needle and no traceback. Returns that line."""
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------- item 2: domain and language names are safe


def _pair_files(root: Path, n: int = 40) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    src, tgt = root / "a.src", root / "a.tgt"
    src.write_text("".join(f"das haus nummer {i}\n" for i in range(n)), encoding="utf-8")
    tgt.write_text("".join(f"the house number {i}\n" for i in range(n)), encoding="utf-8")
    return src, tgt


@pytest.mark.parametrize("option,value", [
    ("--domain", "../../evil"), ("--domain", "a/b"), ("--domain", ".."), ("--domain", "."),
    ("--domain", ".hidden"), ("--domain", "a b"), ("--domain", ""),
    ("--src-lang", "e-n"), ("--src-lang", "../x"), ("--tgt-lang", "d/e"), ("--tgt-lang", ""),
])
def test_prepare_refuses_unsafe_domain_and_language_names(tmp_path: Path, capsys, option: str,
                                                          value: str) -> None:
    src, tgt = _pair_files(tmp_path / "case" / "in")
    before = _snapshot(tmp_path)
    _fails_cleanly(capsys, ["prepare", "--src", str(src), "--tgt", str(tgt),
                            "--out", str(tmp_path / "case" / "out"), option, value,
                            "data.vocab_size=100"], option, repr(value))
    assert _snapshot(tmp_path) == before  # nothing written, inside --out or above it


def test_plain_corpus_names() -> None:
    ok = plain_corpus("a", "b", domain="JRC-Acquis", src_lang="pt_BR", tgt_lang="en")
    assert ok.name == "JRC-Acquis.pt_BR-en"
    assert plain_corpus("a", "b", domain="v1.2").domain == "v1.2"
    with pytest.raises(ConfigError, match=r"^--domain: expected a name of letters.*'a/b'"):
        plain_corpus("a", "b", domain="a/b")
    with pytest.raises(ConfigError, match=r"^--tgt-lang: expected a language code.*'d-e'"):
        plain_corpus("a", "b", tgt_lang="d-e")


def test_prepare_refuses_unsafe_names_given_directly(tmp_path: Path) -> None:
    src, tgt = _pair_files(tmp_path / "in")
    cfg = DataConfig(vocab_size=100, max_len=64, max_tokens=65)
    for domain, src_lang, bad in (("../evil", "de", "'../evil'"), ("law", "d/e", "'d/e'")):
        corpus = CorpusFiles(domain, src_lang, "en", "train", src, tgt)
        with pytest.raises(ConfigError, match=f"^{re.escape(str(src))}: .*{re.escape(bad)}"):
            prepare([corpus], tmp_path / "out", cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def _opus_file(root: Path, folder: str, name: str) -> Path:
    path = root / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x\n", encoding="utf-8")
    return path


def test_discover_checks_the_names_in_folder_and_file_names(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _opus_file(good, "JRC-Acquis", "JRC-Acquis.de-en.train.de")
    _opus_file(good, "JRC-Acquis", "JRC-Acquis.de-en.train.en")
    assert [c.name for c in discover(good)] == ["JRC-Acquis.de-en"]

    for case, domain, l1, needle in (
            ("spaced", "a b", "de", "domain 'a b' \\(the folder name\\)"),
            ("hidden", ".x", "de", "domain '.x'"),
            ("odd_lang", "law", "d@e", "language code 'd@e' in the file name")):
        bad = _opus_file(tmp_path / case, domain, f"{domain}.{l1}-en.train.{l1}")
        _opus_file(tmp_path / case, domain, f"{domain}.{l1}-en.train.en")
        with pytest.raises(DataError, match=needle) as info:
            discover(tmp_path / case)
        assert str(info.value).startswith(str(bad)), case


# ----------------------------------------------- item 3: token ids of a shard vs vocab_size


def _prepared(root: Path, src_ids: list[list[int]], vocab_size: int | None = 50,
              split: str = "train") -> Path:
    """A minimal prepared directory: one corpus, one split, the given source ids."""
    write_shard(root / split, "law.de-en", src_ids, [[4, 5]] * len(src_ids),
                raw_src=["a"] * len(src_ids), raw_tgt=["b"] * len(src_ids))
    manifest = {"version": 1, "domains": ["law"], "langs": ["de", "en"],
                "corpora": [{"name": "law.de-en", "domain_id": 0, "src_lang_id": 0,
                             "tgt_lang_id": 1}],
                "splits": {split: {"corpus_sizes": [len(src_ids)]}}, "data_config": {}}
    if vocab_size is not None:
        manifest["vocab_size"] = vocab_size
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root


def test_shard_ids_must_fit_the_vocabulary(tmp_path: Path) -> None:
    ok = ShardedDataset(_prepared(tmp_path / "ok", [[0, 7], [49]]), "train")
    assert list(ok.src(1)) == [49]
    shard = tmp_path / "high" / "train" / "law.de-en.src.bin"
    with pytest.raises(DataError) as info:
        ShardedDataset(_prepared(tmp_path / "high", [[3, 7], [50]]), "train")
    assert str(info.value).startswith(f"{shard}: token ids range over [3, 50], expected ids "
                                      "in [0, 50) (vocab_size 50 in manifest.json)")
    shard = tmp_path / "low" / "train" / "law.de-en.src.bin"
    with pytest.raises(DataError, match=r"range over \[-2, 7\], expected ids in \[0, 50\)"):
        ShardedDataset(_prepared(tmp_path / "low", [[-2, 7]]), "train")
    with pytest.raises(DataError, match="range over \\[-2, 7\\], expected non-negative ids"):
        ShardedDataset(_prepared(tmp_path / "none", [[-2, 7]], vocab_size=None), "train")
    with pytest.raises(DataError, match="manifest.json: vocab_size 'x', expected a positive"):
        ShardedDataset(_prepared(tmp_path / "typo", [[1]], vocab_size="x"), "train")


def test_train_on_a_shard_with_out_of_range_ids_fails_before_training(tmp_path: Path,
                                                                      capsys) -> None:
    """A real prepared directory whose train shard was overwritten (same size) with an id past
    the vocabulary: `train` names the shard at once (it used to fail with an IndexError from
    the embedding once training had started)."""
    src, tgt = _pair_files(tmp_path / "in")
    prepared = tmp_path / "prep"
    corpus = plain_corpus(src, tgt, domain="law", src_lang="de", tgt_lang="en")
    manifest = prepare([corpus], prepared, DataConfig(vocab_size=100, max_len=64, max_tokens=65,
                                                      dev_per_domain=2, test_per_domain=2))
    vocab_size = manifest["vocab_size"]
    shard = prepared / "train" / "law.de-en.src.bin"
    ids = np.fromfile(shard, dtype=np.int32)
    ids[len(ids) // 2] = vocab_size
    ids.tofile(shard)
    ckpt = tmp_path / "ckpt"
    before = _snapshot(tmp_path)
    _fails_cleanly(capsys, ["train", "--config", CONFIG, f"data.prepared_dir={prepared}",
                            f"checkpoint.dir={ckpt}", "logging.tensorboard_dir=",
                            "train.max_steps=1", "train.validate_every=0", "model.d_model=32",
                            "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
                            "model.decoder_layers=1", "model.max_positions=128"],
                   f"{shard}: token ids range over", f", {vocab_size}], expected ids in "
                   f"[0, {vocab_size}) (vocab_size {vocab_size} in manifest.json)")
    assert _snapshot(tmp_path) == before


# ------------------------------------------------------- minor: a deleted raw text file


def test_missing_raw_text_of_a_test_split_says_missing(tmp_path: Path) -> None:
    prepared = _prepared(tmp_path, [[1, 2]], split="test")
    raw = prepared / "test" / "law.de-en.raw.tgt"
    raw.unlink()
    test = ShardedDataset(prepared, "test")
    assert test.raw_src(0) == "a"
    with pytest.raises(DataError) as info:
        test.raw_tgt(0)
    assert str(info.value).startswith(f"{raw}: missing raw text file of the test split")
    assert "only kept" not in str(info.value)
    train = ShardedDataset(_prepared(tmp_path / "t", [[1]], split="train"), "train")
    (tmp_path / "t" / "train" / "law.de-en.raw.src").unlink()
    with pytest.raises(DataError, match="raw text is only kept for dev and test splits"):
        train.raw_src(0)


# ----------------------------------------------------- item 10: bounded, finite numbers


@pytest.mark.parametrize("value", ["inf", "1e308", "nan", "2e6"])
def test_plan_gpu_mem_must_be_finite(capsys, value: str) -> None:
    _fails_cleanly(capsys, ["plan", "--config", CONFIG, "--gpu-mem", value],
                   "--gpu-mem: expected a positive, finite number of GiB",
                   f"got {float(value)!r}")


def test_plan_inputs_gpu_mem_bounds() -> None:
    for value in (float("inf"), float("-inf"), 1e308, float(2**20 + 1)):
        with pytest.raises(ConfigError, match="^--gpu-mem: expected a positive, finite"):
            PlanInputs(gpu_mem_gb=value)
    assert PlanInputs(gpu_mem_gb=2**20).gpu_mem_gb == 2**20


BIG = 10**20


@pytest.mark.parametrize("field,value,says", [
    ("model.d_model", BIG, "below 2**31"), ("model.ffn_dim", 2**31, "below 2**31"),
    ("model.max_positions", BIG, "below 2**31"), ("model.encoder_layers", BIG, "at most 1024"),
    ("model.decoder_layers", 1025, "at most 1024"), ("data.vocab_size", BIG, "below 2**31"),
    ("data.max_tokens", BIG, "below 2**31"), ("moe.num_experts", 65537, "at most 65536"),
    ("moe.expert_ffn_dim", BIG, "below 2**31"), ("moe.num_tasks", BIG, "below 2**31"),
    ("moe.k", BIG, "at most 65536"), ("adapters.dim", BIG, "below 2**31"),
    ("qwen.vocab_size", BIG, "below 2**31"), ("qwen.num_hidden_layers", BIG, "at most 1024"),
    ("qwen.hidden_size", BIG, "below 2**31"), ("thor.num_candidates", BIG, "at most 65536"),
    ("eval.beam", BIG, "at most 1024"), ("moa.num_clusters", BIG, "at most 65536"),
])
def test_config_sizes_have_upper_bounds(field: str, value: int, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [f"{field}={value}"])
    message = str(info.value)
    assert message.startswith(f"override {field}={value}: {field}: expected ")
    assert says in message
    assert message.endswith(f"got {value}") and "\n" not in message


def test_config_size_bounds_keep_real_values() -> None:
    cfg = load_config(CONFIG, ["model.encoder_layers=1024", "moe.num_experts=65536",
                               "data.vocab_size=2147483647", "moe.k=2"])
    assert cfg.model.encoder_layers == 1024 and cfg.data.vocab_size == 2**31 - 1


def test_params_and_plan_with_absurd_sizes_fail_at_once(capsys) -> None:
    _fails_cleanly(capsys, ["params", "--config", CONFIG, f"model.d_model={BIG}"],
                   "model.d_model: expected", str(BIG))
    _fails_cleanly(capsys, ["params", "--config", CONFIG, f"data.vocab_size={BIG}"],
                   "data.vocab_size: expected", str(BIG))
    _fails_cleanly(capsys, ["plan", "--config", CONFIG, f"model.encoder_layers={BIG}"],
                   "model.encoder_layers: expected at most 1024", str(BIG))


# ----------------------------------------------- item 11: a failed synth creates nothing


@pytest.mark.parametrize("langs,needle", [("xx", "--langs"), ("", "--langs"),
                                          ("de", "--domains")])
def test_failed_synth_leaves_no_parent_directories(tmp_path: Path, capsys, langs: str,
                                                   needle: str) -> None:
    """Nothing is made, and the error names the flag (not the generator's field)."""
    extra = ["--domains", "9"] if needle == "--domains" else []
    line = _fails_cleanly(capsys, ["synth", "--out", str(tmp_path / "new" / "deep" / "c"),
                                   "--langs", langs, *extra], f"error: {needle}: expected")
    assert "synthetic" not in line
    assert list(tmp_path.iterdir()) == []


def test_synth_shared_words_reach_the_corpus_and_are_bounded(tmp_path: Path, capsys) -> None:
    _fails_cleanly(capsys, ["synth", "--out", str(tmp_path / "c"), "--shared-words", "200"],
                   "--shared-words: expected 0..96 words", "200")
    _fails_cleanly(capsys, ["synth", "--out", str(tmp_path / "c"), "--shared-words", "8",
                            "--ambiguous", "40"], "--ambiguous: expected 0..32", "40")
    assert list(tmp_path.iterdir()) == []
    assert main(["synth", "--out", str(tmp_path / "c"), "--domains", "2", "--train", "20",
                 "--dev", "0", "--test", "10", "--preset", "domain-matters", "--shared-words",
                 "8", "--ambiguous", "32"]) == 0
    info = json.loads((tmp_path / "c" / "domains.json").read_text())
    assert info["options"] == {"shared_rate": 0.5, "ambiguous": 32, "ambiguous_rate": 0.12,
                               "cue_rate": 0.95, "shared_words": 8}
    assert len(info["domains"][0]["ambiguous_words"]) == 32


def test_synth_under_a_file_fails_cleanly(tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("x\n")
    before = _snapshot(tmp_path)
    _fails_cleanly(capsys, ["synth", "--out", str(tmp_path / "f" / "sub" / "c")],
                   f"synth --out {tmp_path / 'f' / 'sub' / 'c'}: {tmp_path / 'f'} is not a "
                   "directory")
    assert _snapshot(tmp_path) == before


def test_synth_failing_while_generating_removes_the_parents_it_made(tmp_path: Path,
                                                                     monkeypatch) -> None:
    from moe_train.data import synthetic_dir

    def fails(out_dir, **options):
        (Path(out_dir) / "law").mkdir()
        raise ConfigError("synthetic: could draw only 3 distinct law sentences")

    monkeypatch.setattr(synthetic_dir, "generate_synthetic", fails)
    (tmp_path / "kept").mkdir()
    with pytest.raises(ConfigError, match="could draw only"):
        synthetic_dir.write_synthetic(tmp_path / "kept" / "a" / "b" / "c", num_domains=1,
                                      target_langs=["de"])
    assert [p.name for p in tmp_path.rglob("*")] == ["kept"]


# ----------------------------------------------------- item 12: demo --workdir is a file


def test_demo_workdir_that_is_a_file(tmp_path: Path, capsys) -> None:
    wd = tmp_path / "wd"
    wd.write_text("x\n")
    before = _snapshot(tmp_path)
    _fails_cleanly(capsys, ["demo", "--workdir", str(wd)],
                   f"demo --workdir {wd}: exists and is not a directory")
    _fails_cleanly(capsys, ["demo", "--workdir", str(wd / "sub")],
                   f"demo --workdir {wd / 'sub'}: {wd} is not a directory")
    assert _snapshot(tmp_path) == before


def test_synth_and_demo_helpers_accept_good_input(tmp_path: Path) -> None:
    from moe_train.data.synthetic_dir import check_options
    from moe_train.demo import check_workdir

    check_options(num_domains=2, target_langs=["de", "fr"], train_per_domain=5)
    check_workdir(tmp_path)
    check_workdir(tmp_path / "not" / "yet")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("item,field", [("nosuch.x.y=1", "nosuch"),
                                        ("model.d_model.x=1", "model.d_model")])
def test_an_override_under_a_bad_field_is_named(item: str, field: str) -> None:
    """The error comes from the command line, not the config file: it names the override."""
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, [item])
    assert str(info.value).startswith(f"override {item}: {field}: ")


@pytest.mark.parametrize("flag", ["--hyps", "--json"])
def test_evaluate_outputs_are_files_not_standard_output(capsys, tmp_path, flag) -> None:
    """`-` would have made a file named "-" (elsewhere it means a standard stream), and
    standard output already holds the scores."""
    _fails_cleanly(capsys, ["evaluate", "--checkpoint", str(tmp_path / "ck"), flag, "-"],
                   f"{flag}: expected a file path, got '-'")
    assert not (Path.cwd() / "-").exists()
    # nor standard output by another name: it overwrote the table printed there
    _fails_cleanly(capsys, ["evaluate", "--checkpoint", str(tmp_path / "ck"), flag,
                            "/dev/stdout"], f"{flag}: expected a file path, got '/dev/stdout'")


def test_evaluate_refuses_the_file_standard_output_goes_to(tmp_path, monkeypatch, capsys):
    """`evaluate --json res.txt > res.txt`: the JSON would overwrite the printed scores."""
    import io

    from moe_train.commands import _is_stdout

    out = tmp_path / "res.txt"
    with open(out, "w") as f:
        monkeypatch.setattr("sys.stdout", io.TextIOWrapper(io.FileIO(os.dup(f.fileno()), "w")))
        assert _is_stdout(out) and _is_stdout("/dev/stdout")
        assert not _is_stdout(tmp_path / "other.txt") and not _is_stdout(os.devnull)


@pytest.mark.parametrize("args,needle", [
    (["--src", "s.txt", "--ref", "r.txt", "--split", "dev"], "evaluate: --split name a prepared"),
    (["--src", "s.txt", "--ref", "r.txt", "--prepared", "p"], "evaluate: --prepared name a"),
    (["--tgt-lang", "fr"], "evaluate: --tgt-lang label raw text (--src / --ref)"),
    (["--split", "dev", "--domain", "law", "--src-lang", "en"],
     "evaluate: --src-lang / --domain label raw text")])
def test_evaluate_refuses_options_it_would_ignore(capsys, tmp_path, args, needle) -> None:
    """Scoring raw text, a prepared split's options would be ignored; scoring a prepared split,
    the raw-text labels would be (it scored every language and domain): refused, named."""
    _fails_cleanly(capsys, ["evaluate", "--checkpoint", str(tmp_path / "ck"), *args], needle)
