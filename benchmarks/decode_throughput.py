"""Decode throughput of task-level MoE (seed 002 Fig. 4 analog) and plain decoding vs MarianMT.

    .venv/bin/python benchmarks/decode_throughput.py [--quick] [--out PATH]

Models (random init, fp32, eval, one process, the same source sentences; shape legend below):
- ``token_moe``: token-level MoE, top-2 of E experts in every layer of both sides;
- ``task_moe``: Token/Target hybrid (seed 002's best row): token-routed encoder, decoder routed
  by target language (top-2 of E) - the same parameter count as token_moe;
- ``task_extracted``: task_moe's en->de sub-network (`moe-train extract`): 2 experts per decoder
  layer, the encoder unchanged;
- ``dense_active``: dense, FFN 2F in every layer: the parameters one token of the MoE models uses.

Decode sweep: greedy over batch sizes, every sentence exactly L tokens (eos banned before L and
forced at L, the same work for every model); target tokens/s per batch size and the peak; the
encoder / decoder split of the time at the largest batch. Rounds rotate over the models and the
fastest round counts. Training: forward + backward + AdamW on token-budget batches, target
tokens/s of each MoE model against dense_active. Plain decoding: moe_train's dense model against
transformers' MarianMTModel of the same shape (d256, 3+3 layers, FFN 1024, 8k vocabulary),
greedy and beam 5, batch 64, the same sources and the same output length per sentence (lengths
vary as in real data; each system decodes as it does, moe_train dropping finished sentences from
the batch), sentences/s. EP=2: the
token MoE decoding on two gloo ranks, all-to-all time as a share of decode time
(decode_throughput_ep.py). Writes benchmarks/results/decode_throughput_cpu[_quick].json.

Shape legend: B sentences per batch, S source length, L output tokens, D model dim, F expert FFN
dim, E experts, V vocabulary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from real_data import write_record  # noqa: E402

from moe_train.config import load_config  # noqa: E402
from moe_train.eval.extract import extract, load_extracted  # noqa: E402
from moe_train.eval.params import count_model  # noqa: E402
from moe_train.eval.search import beam_search, greedy_search  # noqa: E402
from moe_train.models.build import build_model  # noqa: E402
from moe_train.models.context import ForwardContext  # noqa: E402
from moe_train.moe.routing import NUM_LANGS_KEY  # noqa: E402
from moe_train.utils.provenance import provenance  # noqa: E402
from moe_train.utils.cli_args import (  # noqa: E402
    command_line, exit_bad_input, results_path, script_parser)

PAD, BOS, EOS = 0, 1, 2
LANGS = ["cs", "de", "en", "fr"]
TASK = "en-de"
MANIFEST_BASE = {"pad_id": PAD, "langs": LANGS, "domains": ["news"]}
SIZES = {"full": {"D": 256, "heads": 4, "layers": 3, "F": 1024, "E": 16, "V": 8000, "L": 24,
                  "batches": [1, 8, 32, 128, 256], "train_tokens": 2048, "train_steps": 6,
                  "marian_sentences": 256, "rounds": 3, "marian_rounds": 5,
                  "min_seconds": 1.0},
         "quick": {"D": 32, "heads": 2, "layers": 2, "F": 64, "E": 4, "V": 300, "L": 6,
                   "batches": [1, 8], "train_tokens": 128, "train_steps": 2,
                   "marian_sentences": 8, "rounds": 1, "marian_rounds": 1,
                   "min_seconds": 0.0}}


def sized(base: dict[str, Any], experts: int | None, batches: str | None, ep: bool
          ) -> dict[str, Any]:
    """`base` with the expert count and batch sweep the command line asks for (`ep`: the EP=2
    run follows, which splits the experts over two ranks); a bad value is one `error:` line and
    exit status 2, before anything runs."""
    s = dict(base)
    if experts is not None:
        if experts < 2 or (ep and experts % 2):
            even = ", and even (the EP=2 run splits them over two ranks)" if ep else ""
            exit_bad_input(f"--experts: expected at least 2 (top-2 routing){even}, got {experts}")
        s["E"] = experts
    if batches is not None:
        try:
            s["batches"] = sorted({int(b) for b in batches.split(",")})
        except ValueError:
            exit_bad_input(f"--batches: expected comma-separated integers, got {batches!r}")
        if s["batches"][0] < 1:
            exit_bad_input(f"--batches: expected sizes of at least 1, got {batches!r}")
    return s


def model_overrides(s: dict[str, Any], kind: str) -> list[str]:
    base = [f"model.d_model={s['D']}", f"model.n_heads={s['heads']}",
            f"model.encoder_layers={s['layers']}", f"model.decoder_layers={s['layers']}",
            "model.dropout=0.0", f"model.ffn_dim={s['F']}", "model.max_positions=256"]
    moe = [f"moe.num_experts={s['E']}", "moe.k=2", "moe.layers=all", "moe.capacity_factor=0.0"]
    return {"dense": base,
            "dense_active": [*base, f"model.ffn_dim={2 * s['F']}"],
            "token_moe": [*base, *moe],
            "task_moe": [*base, *moe, "moe.decoder_router=task",
                         "moe.decoder_task_source=tgt_lang"]}[kind]


def build(s: dict[str, Any], kind: str, seed: int = 0):
    cfg = load_config(None, model_overrides(s, kind))
    torch.manual_seed(seed)
    return cfg, build_model(cfg, {**MANIFEST_BASE, "vocab_size": s["V"]}).eval()


def sources(s: dict[str, Any], n: int, seed: int = 1, device: str = "cpu"
            ) -> tuple[torch.Tensor, ForwardContext]:
    """n random sources of 10..30 tokens (ending in eos, padded), all en->de, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 31, (n,), generator=gen)
    src_BS = torch.full((n, int(lengths.max())), PAD)
    for b, length in enumerate(lengths.tolist()):
        src_BS[b, :length - 1] = torch.randint(3, s["V"], (length - 1,), generator=gen)
        src_BS[b, length - 1] = EOS
    src_BS = src_BS.to(device)
    src, tgt = LANGS.index("en"), LANGS.index("de")
    ctx = ForwardContext(src_pad_mask_BS=src_BS.eq(PAD),
                         src_lang_B=torch.full((n,), src, device=device),
                         tgt_lang_B=torch.full((n,), tgt, device=device),
                         domain_ids_B=torch.zeros(n, dtype=torch.long, device=device),
                         extras={NUM_LANGS_KEY: len(LANGS)})
    return src_BS, ctx


def decode(model, src_BS: torch.Tensor, ctx: ForwardContext, L: int, beam: int = 1) -> int:
    """Decode exactly L tokens per sentence; returns the number of target tokens."""
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=0.0, max_len_b=L, ctx=ctx,
              min_len=L)
    with torch.no_grad():
        out = greedy_search(model, src_BS, **kw) if beam == 1 else \
            beam_search(model, src_BS, beam=beam, lenpen=1.0, **kw)
    assert all(len(h) == L - 1 for h in out), "every sentence decodes exactly L tokens"
    return len(out) * L


def sync() -> None:
    """Wait for queued GPU work, so that a timer stops after it (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], int], min_seconds: float) -> float:
    """Units per second of `fn` (which returns its units), repeated for at least min_seconds."""
    fn()  # warm-up
    sync()
    units, start = 0, time.perf_counter()
    while True:
        units += fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return units / elapsed


def best_of_rounds(jobs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each job once per round, rotating the order; the best rate of each."""
    best: dict[str, float] = {}
    names = list(jobs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            best[name] = max(best.get(name, 0.0), jobs[name]())
    return best


def decode_sweep(s: dict[str, Any], models: dict[str, Any], device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"batch_sizes": s["batches"], "tokens_per_s": {}, "peak": {}}
    for B in s["batches"]:
        src_BS, ctx = sources(s, B, seed=B, device=device)
        jobs = {name: (lambda m=m: timed(lambda: decode(m, src_BS, ctx, s["L"]),
                                         s["min_seconds"]))
                for name, m in models.items()}
        for name, rate in best_of_rounds(jobs, s["rounds"]).items():
            out["tokens_per_s"].setdefault(name, []).append(round(rate, 1))
        print(f"batch {B:>4}: " + ", ".join(f"{n} {out['tokens_per_s'][n][-1]:.0f}"
                                            for n in models), flush=True)
    for name, rates in out["tokens_per_s"].items():
        i = max(range(len(rates)), key=rates.__getitem__)
        out["peak"][name] = {"tokens_per_s": rates[i], "batch": s["batches"][i]}
    return out


def encoder_split(s: dict[str, Any], models: dict[str, Any], device: str) -> dict[str, Any]:
    """Share of greedy decode time spent in the encoder, at the largest batch: encoder and
    whole decode each timed in the sweep's rotated rounds (`best_of_rounds`), so a figure is
    the best of several, as the sweep's are, not one sample."""
    B = s["batches"][-1]
    src_BS, ctx = sources(s, B, seed=B, device=device)

    def encode(m: Any) -> int:
        with torch.no_grad():
            m.encode(src_BS, ctx)
        sync()
        return 1

    jobs = {}
    for name, m in models.items():
        jobs[f"{name}/encoder"] = lambda m=m: timed(lambda: encode(m), s["min_seconds"])
        jobs[f"{name}/total"] = lambda m=m: timed(
            lambda: decode(m, src_BS, ctx, s["L"]) and 1, s["min_seconds"])
    rates = best_of_rounds(jobs, s["rounds"])
    split = {}
    for name in models:
        enc_s, total_s = 1.0 / rates[f"{name}/encoder"], 1.0 / rates[f"{name}/total"]
        split[name] = {"encoder_ms": round(enc_s * 1e3, 2), "total_ms": round(total_s * 1e3, 2),
                       "decoder_ms": round((total_s - enc_s) * 1e3, 2),
                       "encoder_share": round(enc_s / total_s, 4)}
    return {"batch": B, "models": split}


def train_throughput(s: dict[str, Any], kinds: list[str], device: str) -> dict[str, Any]:
    """Target tokens/s of forward + backward + AdamW on one token-budget batch per step."""
    B = max(1, s["train_tokens"] // 24)
    src_BS, ctx = sources(s, B, seed=7, device=device)
    tgt_BT = torch.randint(3, s["V"], (B, 25), generator=torch.Generator().manual_seed(8))
    tgt_BT[:, 0] = BOS
    tgt_BT = tgt_BT.to(device)
    models = {k: build(s, k)[1].to(device).train() for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(kind: str) -> int:
        model, opt = models[kind], opts[kind]
        out = model(src_BS, tgt_BT[:, :-1], ctx)
        loss = F.cross_entropy(out.logits_BTV.flatten(0, 1), tgt_BT[:, 1:].flatten())
        loss = loss + sum(out.aux_losses.values()) if out.aux_losses else loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return tgt_BT[:, 1:].numel()

    def job(kind: str) -> float:
        step(kind)  # warm-up
        sync()
        start = time.perf_counter()
        tokens = sum(step(kind) for _ in range(s["train_steps"]))
        sync()
        return tokens / (time.perf_counter() - start)

    rates = best_of_rounds({k: (lambda k=k: job(k)) for k in kinds}, s["rounds"])
    return {"target_tokens_per_step": B * 24, "steps_per_round": s["train_steps"],
            "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
            "ratio_vs_dense_active": {k: round(rates[k] / rates["dense_active"], 3)
                                      for k in kinds if k != "dense_active"}}


class ForcedLengths:
    """A moe_train model whose sentence i ends after exactly lengths_B[i] tokens (eos banned
    before, forced then), like `ForcedLengthsProcessor` does for transformers: both systems
    then decode the same number of tokens per sentence. The lengths ride in the encoder
    output's per-sentence extras, so beam expansion and batch pruning carry them along."""

    def __init__(self, model, lengths_B: torch.Tensor) -> None:
        self.model, self.lengths_B = model, lengths_B
        self.max_positions = model.max_positions

    def encode(self, src_BS, ctx=None):
        enc = self.model.encode(src_BS, ctx)
        enc.extras = {**enc.extras, "target_len_B": self.lengths_B}
        return enc

    def new_decoder_cache(self):
        return self.model.new_decoder_cache()

    def decode(self, tgt_in_BT, enc, ctx=None, cache=None):
        logits_BTV, aux = self.model.decode(tgt_in_BT, enc, ctx, cache)
        made_B = torch.full_like(enc.extras["target_len_B"], cache.length)  # bos + outputs
        force_logits(logits_BTV[:, -1], made_B, enc.extras["target_len_B"])
        return logits_BTV, aux


def force_logits(logits_BV: torch.Tensor, made_B: torch.Tensor, lengths_B: torch.Tensor) -> None:
    """In place: the next token is output number made_B; eos only when it is number lengths_B."""
    at_end_B = made_B.eq(lengths_B)
    logits_BV[made_B.lt(lengths_B), EOS] = -torch.inf
    logits_BV[at_end_B] = -torch.inf
    logits_BV[at_end_B, EOS] = 0.0


def realistic_batches(s: dict[str, Any], n: int, batch: int, seed: int = 11,
                      device: str = "cpu"):
    """n sentence pairs with source lengths 5..40 and target lengths 0.6..1.5 times those
    (2..80), sorted by source length as a translation server batches them; (src_BS, lengths_B)
    per batch of `batch`, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    src_len = torch.randint(5, 41, (n,), generator=gen)
    ratio = 0.6 + 0.9 * torch.rand(n, generator=gen)
    tgt_len = (src_len * ratio).round().long().clamp(2, 80)
    order = src_len.argsort(stable=True)
    out = []
    for i in range(0, n, batch):
        idx = order[i:i + batch]
        src_BS = torch.full((len(idx), int(src_len[idx].max())), PAD)
        for b, length in enumerate(src_len[idx].tolist()):
            src_BS[b, :length - 1] = torch.randint(3, s["V"], (length - 1,), generator=gen)
            src_BS[b, length - 1] = EOS
        out.append((src_BS.to(device), tgt_len[idx].to(device)))
    return out


def marian_comparison(s: dict[str, Any], device: str) -> dict[str, Any] | None:
    """Dense moe_train vs MarianMTModel of the same shape: sentences/s, greedy and beam 5, on
    the same sentences with the same output lengths (see `realistic_batches`)."""
    try:
        from transformers import LogitsProcessor, LogitsProcessorList, MarianConfig, \
            MarianMTModel
    except ImportError as exc:
        return {"skipped": f"transformers not installed ({exc})"}

    class ForcedLengthsProcessor(LogitsProcessor):
        def __init__(self, lengths_B: torch.Tensor, beams: int) -> None:
            self.lengths_N = lengths_B.repeat_interleave(beams)

        def __call__(self, input_ids, scores):
            made_N = torch.full_like(self.lengths_N, input_ids.shape[1])  # start + outputs
            force_logits(scores, made_N, self.lengths_N)
            return scores

    mcfg = MarianConfig(vocab_size=s["V"], d_model=s["D"], encoder_layers=s["layers"],
                        decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                        decoder_attention_heads=s["heads"], encoder_ffn_dim=s["F"],
                        decoder_ffn_dim=s["F"], max_position_embeddings=256, pad_token_id=PAD,
                        eos_token_id=EOS, decoder_start_token_id=BOS, dropout=0.0,
                        activation_function="relu")
    torch.manual_seed(0)
    marian = MarianMTModel(mcfg).to(device).eval()
    ours = build(s, "dense")[1].to(device)
    n, batch = s["marian_sentences"], min(64, s["marian_sentences"])
    batches = realistic_batches(s, n, batch, device=device)

    def ours_run(beam: int) -> int:
        for src_BS, len_B in batches:
            kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_a=0.0, max_len_b=255,
                      ctx=ForwardContext(src_pad_mask_BS=src_BS.eq(PAD)))
            model = ForcedLengths(ours, len_B)
            with torch.no_grad():
                out = greedy_search(model, src_BS, **kw) if beam == 1 else \
                    beam_search(model, src_BS, beam=beam, lenpen=1.0, **kw)
            assert [len(h) + 1 for h in out] == len_B.tolist()
        return n

    def marian_run(beam: int) -> int:
        for src_BS, len_B in batches:
            with torch.no_grad():
                out = marian.generate(
                    input_ids=src_BS, attention_mask=src_BS.ne(PAD), num_beams=beam,
                    do_sample=False, max_new_tokens=int(len_B.max()),
                    logits_processor=LogitsProcessorList([ForcedLengthsProcessor(len_B, beam)]))
            ends = [row.index(EOS) if EOS in row else -1 for row in out[:, 1:].tolist()]
            assert [e + 1 for e in ends] == len_B.tolist()
        return n

    tokens = int(sum(int(len_B.sum()) for _, len_B in batches))
    result: dict[str, Any] = {"sentences": n, "batch": batch, "target_tokens": tokens,
                              "lengths": "source 5..40, target 0.6..1.5x source, sorted",
                              "params": {"moe_train": sum(p.numel() for p in ours.parameters()),
                                         "marian": sum(p.numel() for p in marian.parameters())}}
    for beam in (1, 5):
        jobs = {"moe_train": lambda b=beam: timed(lambda: ours_run(b), s["min_seconds"]),
                "marian": lambda b=beam: timed(lambda: marian_run(b), s["min_seconds"])}
        rates = best_of_rounds(jobs, s["marian_rounds"])  # the noisiest comparison: 5 rounds
        key = "greedy" if beam == 1 else f"beam{beam}"
        result[key] = {"sentences_per_s": {k: round(v, 2) for k, v in rates.items()},
                       "ratio": round(rates["moe_train"] / rates["marian"], 3)}
        print(f"{key}: {result[key]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-ep", action="store_true", help="skip the EP=2 measurement")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per MoE layer (default: the size's E, 16 at full size)")
    ap.add_argument("--batches", default=None,
                    help="comma-separated decode batch sizes (default: the size's sweep)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the decode sweep and encoder split: no training, MarianMT or EP")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the models run (cuda: one GPU, fp32, and no EP=2 run, which "
                         "uses gloo CPU ranks)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: expected a CUDA GPU, found none")
    device, args.no_ep = args.device, args.no_ep or args.device == "cuda"
    prov = provenance(command_line(__file__, argv))
    s = sized(SIZES["quick" if args.quick else "full"], args.experts, args.batches,
              ep=not (args.no_ep or args.sweep_only))
    name = "decode_throughput" + (f"_e{args.experts}" if args.experts else "") + \
        ("_sweep" if args.sweep_only else "_batches" if args.batches else "")
    out = results_path(args.out, ROOT / "benchmarks" / "results" /
                       f"{name}_{device}{'_quick' if args.quick else ''}.json")

    models: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for kind in ("token_moe", "task_moe", "dense_active"):
        cfg, models[kind] = build(s, kind)
        if kind == "task_moe":
            manifest = {**MANIFEST_BASE, "vocab_size": s["V"]}
            ext = extract(models[kind], cfg, manifest, TASK)
            models["task_extracted"] = load_extracted(ext, manifest)
    models = {name: m.to(device) for name, m in models.items()}
    for name, m in models.items():
        r = count_model(m)
        params[name] = {"total": r["total"], "decoder": r["decoder"],
                        "active_per_token": r["active_all"]}
    print(f"parameters: {params}", flush=True)

    sweep = decode_sweep(s, models, device)
    split = encoder_split(s, models, device)
    train = marian = ep = None
    if not args.sweep_only:
        train = train_throughput(s, ["token_moe", "task_moe", "dense_active"], device)
        print(f"training: {train}", flush=True)
        marian = marian_comparison(s, device)
    if not (args.no_ep or args.sweep_only):
        from decode_throughput_ep import ep_decode_share

        ep = ep_decode_share(s, model_overrides(s, "token_moe"), sources, decode)
        print(f"ep2: {ep}", flush=True)

    peak = sweep["peak"]
    acceptance: dict[str, Any] = {
        "extracted_over_token_moe_peak": round(peak["task_extracted"]["tokens_per_s"]
                                               / peak["token_moe"]["tokens_per_s"], 3)}
    acceptance["holds"] = {
        "extracted_peak_at_least_2x_token_moe": acceptance["extracted_over_token_moe_peak"] >= 2}
    if train:
        acceptance["moe_train_over_dense_active"] = train["ratio_vs_dense_active"]
        acceptance["holds"]["moe_training_at_least_0.8x_dense"] = all(
            v >= 0.8 for v in train["ratio_vs_dense_active"].values())
    if marian and "greedy" in marian:
        acceptance["dense_over_marian_greedy"] = marian["greedy"]["ratio"]
        acceptance["dense_over_marian_beam5"] = marian["beam5"]["ratio"]
    if "dense_over_marian_greedy" in acceptance:
        acceptance["holds"]["dense_decoding_at_least_1.5x_marian"] = (
            acceptance["dense_over_marian_greedy"] >= 1.5
            and acceptance["dense_over_marian_beam5"] >= 1.5)
    record = {"benchmark": "decode_throughput", "device": device, "sizes": s, "task": TASK,
              "params": params,
              "decode_sweep": sweep, "encoder_decoder_split": split, "training": train,
              "marian": marian, "ep2": ep, "acceptance": acceptance}
    write_record(out, record, prov)


if __name__ == "__main__":
    main()
