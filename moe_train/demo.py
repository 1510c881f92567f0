"""`moe-train demo`: the embedded default, end to end on a laptop CPU.

Generates the synthetic multi-domain corpus (no download), prepares it, trains a small
Transformer in-process on the DeepSpeed engine, evaluates the held-out test set with beam search
and prints per-domain BLEU. Each step reuses a finished artifact, so a second run resumes.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

from moe_train.config.loader import load_config, merge, read_yaml


def demo_config(workdir: Path, minutes: float | None, overrides: list[str]):
    """The packaged demo recipe with its paths under `workdir`."""
    recipe = resources.files("moe_train") / "recipes" / "demo.yaml"
    with resources.as_file(recipe) as path:
        base = read_yaml(path)
    paths = {"data": {"prepared_dir": str(workdir / "prepared")},
             "checkpoint": {"dir": str(workdir / "checkpoints")},
             "logging": {"tensorboard_dir": str(workdir / "tensorboard")}}
    if minutes is not None:
        paths["train"] = {"max_minutes": minutes}
    return load_config(base=merge(base, paths), overrides=overrides)


def run_demo(workdir: Path, minutes: float | None = None, overrides: list[str] | None = None
             ) -> dict:
    """Run the whole demo; returns the test metrics."""
    from moe_train.commands import run_training
    from moe_train.data.corpus import discover
    from moe_train.data.prepare import prepare
    from moe_train.data.shards import ShardedDataset
    from moe_train.data.synthetic import generate_synthetic
    from moe_train.eval.evaluate import evaluate_dataset, format_table
    from moe_train.parallel.runtime import ParallelRuntime
    from moe_train.train.export import load_for_inference
    from moe_train.utils.atomic import write_json

    t0 = time.time()
    workdir = workdir.resolve()
    cfg = demo_config(workdir, minutes, overrides or [])
    data_dir = workdir / "data"
    if not (data_dir / "domains.json").is_file():
        print(f"[demo] generating the synthetic corpus in {data_dir}", flush=True)
        generate_synthetic(data_dir, seed=cfg.train.seed)
    prepared = Path(cfg.data.prepared_dir)
    if not (prepared / "manifest.json").is_file():
        print(f"[demo] preparing (sentencepiece + shards) into {prepared}", flush=True)
        manifest = prepare(discover(data_dir), prepared, cfg.data, seed=cfg.train.seed)
        sizes = {k: v["sentences"] for k, v in manifest["splits"].items()}
        print(f"[demo] {sizes} pairs, vocabulary {manifest['vocab_size']}", flush=True)
    print(f"[demo] training ({cfg.train.max_steps} steps at most, "
          f"{cfg.train.max_minutes} min budget)", flush=True)
    summary = run_training(cfg, resume=True)

    print("[demo] evaluating the test set with beam search", flush=True)
    inf = load_for_inference(Path(cfg.checkpoint.dir) / "export")
    test = ShardedDataset(prepared, "test")
    metrics, _ = evaluate_dataset(inf.model, test, inf.vocab, inf.manifest, ParallelRuntime(),
                                  inf.cfg.eval, cfg.data.max_tokens)
    write_json(workdir / "test_metrics.json", metrics)
    print(format_table(metrics))
    print(f"[demo] sacreBLEU {metrics['all']['bleu_signature']}")
    print(f"[demo] done in {(time.time() - t0) / 60:.1f} min | {summary['step']} steps | "
          f"{summary['train_tokens_per_s']:.0f} target tokens/s")
    print(f"[demo] work directory: {workdir}")
    print(f"[demo]   checkpoint:  {cfg.checkpoint.dir} (export: {summary['export']})")
    print(f"[demo]   TensorBoard: tensorboard --logdir {cfg.logging.tensorboard_dir}")
    print(f"[demo]   metrics:     {workdir / 'test_metrics.json'}")
    return metrics
