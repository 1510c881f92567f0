"""`moe-train extract` end to end: a token/target hybrid trained briefly on a synthetic
multilingual corpus, one direction extracted; `translate` and `evaluate` on the sub-network give
the full model's output on that task's inputs (greedy and beam, fp32); `params --checkpoint`
counts the sub-network; asking it for another task is a one-line error."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, debug_overrides, run_cli

CONFIG = str(ROOT / "configs" / "debug-cpu.yaml")
HYBRID = ["moe.num_experts=4", "moe.k=2", "moe.layers=all", "moe.encoder_router=topk",
          "moe.decoder_router=task", "moe.decoder_task_source=tgt_lang", "data.lang_tags=true",
          "data.pairs=[en-de,en-fr,de-en]", "data.vocab_size=300", "train.max_steps=120",
          "optim.lr=3e-3",
          "train.validate_every=0", "checkpoint.save_every=120"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("extract")
    run_cli(["synth", "--out", str(work / "corpus"), "--domains", "2", "--langs", "de,fr",
             "--train", "150", "--dev", "6", "--test", "10", "--seed", "5"], cwd=work)
    prepared = work / "prepared"
    run_cli(["prepare", "--config", CONFIG, "--data", str(work / "corpus"), "--out",
             str(prepared), *HYBRID], cwd=work)
    run_cli(["train", "--config", CONFIG, *debug_overrides(prepared, work, *HYBRID)], cwd=work)
    return work, prepared


def test_extracted_direction_translates_like_the_full_model(trained):
    work, prepared = trained
    ckpt, sub = work / "ckpt", work / "sub-fr"
    proc = run_cli(["extract", "--checkpoint", str(ckpt), "--task", "en-fr", "--out", str(sub)],
                   cwd=work)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["task_ids"] == {"decoder": report["task_ids"]["decoder"]}
    assert report["extracted"]["total"] == report["full"]["serving_all"]
    assert report["extracted"]["decoder"] < report["full"]["decoder"]
    assert "serving dec." in proc.stdout and (sub / "extract.json").is_file()
    params = json.loads(run_cli(["params", "--checkpoint", str(sub)], cwd=work)
                        .stdout.strip().splitlines()[-1])
    assert params["total"] == report["extracted"]["total"]
    assert params["decoder_num_experts"] == 2 and params["encoder_num_experts"] == 4

    src = prepared / "raw_en_fr.txt"
    lines = [ln for ln in (work / "corpus" / "law" / "law.en-fr.test.en").read_text()
             .splitlines()]
    src.write_text("".join(f"{ln}\n" for ln in lines))
    for beam in ("1", "4"):
        outs = []
        for model in (ckpt, sub):
            out = work / f"hyp.{model.name}.{beam}"
            run_cli(["translate", "--checkpoint", str(model), "--input", str(src), "--output",
                     str(out), "--src-lang", "en", "--tgt-lang", "fr", "--beam", beam], cwd=work)
            outs.append(out.read_text())
        assert outs[0] == outs[1] and outs[0].strip(), f"beam {beam}"

    # evaluate on raw text of that direction: the same hypotheses and scores
    ref = work / "corpus" / "law" / "law.en-fr.test.fr"
    results = [json.loads(run_cli(["evaluate", "--checkpoint", str(m), "--src", str(src),
                                   "--ref", str(ref), "--src-lang", "en", "--tgt-lang", "fr"],
                                  cwd=work).stdout.strip().splitlines()[-1])
               for m in (ckpt, sub)]
    assert results[0]["all"] == results[1]["all"]

    # the sub-network's only direction needs no flags (en -> fr: its one corpus)
    out = work / "hyp.noflags"
    run_cli(["translate", "--checkpoint", str(sub), "--input", str(src), "--output", str(out)],
            cwd=work)
    assert out.read_text() == outs[0]

    # another direction is refused in one line, naming the languages, before decoding
    proc = run_cli(["translate", "--checkpoint", str(sub), "--input", str(src), "--output",
                    str(work / "x"), "--src-lang", "en", "--tgt-lang", "de"], cwd=work,
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: --tgt-lang: 'de' is not one of this sub-network's "
                                   "(extracted with --task en-fr) (fr)")
    assert not (work / "x").exists()

    # so is the prepared test split, which holds the other directions too
    proc = run_cli(["evaluate", "--checkpoint", str(sub), "--prepared", str(prepared)],
                   cwd=work, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "its test split holds" in lines[0] and "law.de-en" in lines[0]
    assert "law.en-fr" not in lines[0] and "--task en-fr" in lines[0]
    assert lines[0].endswith("or give this task's sentences with --src / --ref")
    # routing-stats has no --src / --ref: its refusal points at data of the task instead
    proc = run_cli(["routing-stats", "--checkpoint", str(sub), "--prepared", str(prepared),
                    "--split", "test", "--out", str(work / "rs")], cwd=work, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("or data prepared from this task's corpora")
    assert "--src" not in proc.stderr and not (work / "rs").exists()
