"""Hugging Face Qwen2-MoE directories <-> moe_train models: weight mapping and `convert`
(the config's mapping and checks are in models/hf_config.py).

`moe-train convert --from-hf DIR --out OUT` reads a local model directory (config.json,
safetensors, single or sharded, tokenizer files) and writes a moe_train export of the same
model: our config, our weights, the tokenizer copied. ``--to-hf CHECKPOINT --out OUT`` writes
a directory transformers loads with ``Qwen2MoeForCausalLM.from_pretrained``, experts saved one
by one and files sharded as `save_pretrained` saves them (``--dtype``, ``--max-shard-size``).
Weights map one to one except in the sparse blocks:

    HF (per layer i, ``model.layers.{i}.mlp.``)    ours (``hf.model.layers.{i}.mlp.moe.``)
    gate.weight                       (E, D)        router.gate.weight.weight    (E, D)
    experts.gate_up_proj              (E, 2F, D)    experts.w_gate_EDF, w_up_EDF (E, D, F)
    experts.down_proj                 (E, D, F)     experts.w_down_EFD           (E, F, D)
    shared_expert.{gate,up,down}_proj.weight        shared_expert.{gate,up,down}_proj.weight
    shared_expert_gate.weight         (1, D)        shared_expert.gate.weight    (1, D)

Checkpoints saved per expert (``experts.{e}.{gate,up,down}_proj.weight``, as transformers and
the released Qwen1.5-MoE-A2.7B files store them) are stacked on the way in; stacked files are
read as well. Every other name gets the ``hf.``
prefix. Files are read with safetensors only (no code runs); bad input is a one-line error.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.models.hf_config import (HF_SPECIAL_IDS, SPECIAL_ID_KEYS, config_from_hf,
                                       hf_config_dict)
from moe_train.utils.atomic import atomic_dir
from moe_train.utils.provenance import finish, provenance
from moe_train.utils.safe_load import read_json_object, require_file, save_tensors
from moe_train.utils.tensor_source import Shape, TensorSource, safetensors_source

PREFIX = "hf."
HF_INDEX = "model.safetensors.index.json"
CONVERT_REPORT = "convert.json"
"""What `convert` writes beside the weights (its source and counts): marks a directory as an
earlier convert output, which a new convert into it may replace."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "tokenizer.model")
"""Files copied with the weights in both directions when present (never executed)."""
_SPARSE = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\..+|shared_expert\..+|"
                     r"shared_expert_gate\.weight)$")
_LEGACY = re.compile(r"experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_DERIVED = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
"""Rotary frequencies some older files hold: a buffer computed from the config, which
transformers ignores on load; so do we."""


# ----------------------------------------------------------------------------------- weights
def hf_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, or the one."""
    index = model_dir / HF_INDEX
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index (weight_map)").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v for v in weight_map.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor names to shard files; "
                                  "expected a safetensors index")
        return [require_file(model_dir / name, "a weights shard named by the index")
                for name in sorted(set(weight_map.values()))]
    return [require_file(model_dir / "model.safetensors", "the model's weights "
                         "(model.safetensors or model.safetensors.index.json)")]


def hf_source(model_dir: Path, cfg: ExperimentConfig) -> TensorSource:
    """Our weights of a model directory, each read when asked (`hf_to_ours`)."""
    return hf_to_ours(safetensors_source(hf_weight_files(model_dir)), cfg, model_dir)


def hf_to_ours(src: TensorSource, cfg: ExperimentConfig, source: Path | str) -> TensorSource:
    """Our names and layouts of HF tensors (stacked or per-expert experts), lazily: reading one
    of ours reads only the HF tensors it is made of. Shapes are checked up front."""
    F_ = cfg.moe.expert_ffn_dim
    plan: dict[str, tuple[Shape, Callable[[], Tensor]]] = {}
    legacy: dict[tuple[int, str], dict[int, str]] = {}

    def same(name: str) -> tuple[Shape, Callable[[], Tensor]]:
        return src.shapes[name], lambda: src.get(name)

    def swap12(name: str, part: slice) -> tuple[Shape, Callable[[], Tensor]]:
        E, rows, D = src.shapes[name]
        rows = len(range(rows)[part])
        return (E, D, rows), lambda: src.get(name)[:, part].transpose(1, 2).contiguous()

    for name, shape in src.shapes.items():
        if _DERIVED.match(name):
            continue
        m = _SPARSE.match(name)
        if m is None:
            plan[PREFIX + name] = same(name)
            continue
        base, rest = f"{PREFIX}model.layers.{m.group(1)}.mlp.moe.", m.group(2)
        legacy_m = _LEGACY.match(rest)
        if rest == "gate.weight":
            plan[base + "router.gate.weight.weight"] = same(name)
        elif rest == "experts.gate_up_proj":
            if len(shape) != 3 or shape[1] != 2 * F_:
                raise CheckpointError(f"{source}: {name} has shape {shape}; expected "
                                      f"(E, {2 * F_}, D)")
            plan[base + "experts.w_gate_EDF"] = swap12(name, slice(0, F_))
            plan[base + "experts.w_up_EDF"] = swap12(name, slice(F_, 2 * F_))
        elif rest == "experts.down_proj":
            if len(shape) != 3:
                raise CheckpointError(f"{source}: {name} has shape {shape}; expected (E, D, "
                                      f"{F_})")
            plan[base + "experts.w_down_EFD"] = swap12(name, slice(None))
        elif legacy_m is not None:
            legacy.setdefault((int(m.group(1)), legacy_m.group(2)), {})[int(legacy_m.group(1))] \
                = name
        elif rest == "shared_expert_gate.weight":
            plan[base + "shared_expert.gate.weight"] = same(name)
        elif rest.startswith("shared_expert."):
            plan[base + rest] = same(name)
        else:
            raise CheckpointError(f"{source}: unknown tensor {name}; expected Qwen2-MoE weights")
    ours_name = {"gate": "w_gate_EDF", "up": "w_up_EDF", "down": "w_down_EFD"}
    for (layer, proj), per_expert in sorted(legacy.items()):
        if sorted(per_expert) != list(range(len(per_expert))):
            raise CheckpointError(f"{source}: layer {layer} {proj}_proj has experts "
                                  f"{sorted(per_expert)[:5]}...; expected 0..E-1")
        names = [per_expert[e] for e in range(len(per_expert))]
        shapes = {src.shapes[k] for k in names}
        if len(shapes) != 1 or len(src.shapes[names[0]]) != 2:
            raise CheckpointError(f"{source}: layer {layer} {proj}_proj has per-expert shapes "
                                  f"{sorted(shapes)[:3]}; expected one 2-D shape for all experts")
        shape = (len(names), *reversed(src.shapes[names[0]]))
        plan[f"{PREFIX}model.layers.{layer}.mlp.moe.experts.{ours_name[proj]}"] = (
            shape, lambda names=names: torch.stack([src.get(k).t() for k in names]).contiguous())
    lm_head, embed = PREFIX + "lm_head.weight", PREFIX + "model.embed_tokens.weight"
    if cfg.qwen.tie_word_embeddings and embed in plan:  # missing: named by the shape check
        plan[lm_head] = plan[embed] if lm_head not in plan else (
            plan[lm_head][0], lambda: _tied_head(src, source))
    return TensorSource.from_plan(plan, source)


def _tied_head(src: TensorSource, source: Path | str) -> Tensor:
    """The lm_head of a tied model whose file holds one too: refused unless it is the
    embedding (transformers 4 would use the embedding, transformers 5 the file's head)."""
    head, embedding = src.get("lm_head.weight"), src.get("model.embed_tokens.weight")
    if not torch.equal(head, embedding):
        raise CheckpointError(f"{source}: lm_head.weight differs from model.embed_tokens.weight "
                              "but tie_word_embeddings is true; expected equal tensors, or "
                              "tie_word_embeddings false to keep both")
    return head


def ours_to_hf(state: dict[str, Tensor], source: Path | str,
               per_expert: bool = False) -> dict[str, Tensor]:
    """HF names and layouts of our state dict: the stacked gate_up_proj / down_proj of
    transformers' modules, or with `per_expert` the ``experts.{e}.{gate,up,down}_proj.weight``
    files transformers itself saves (and other Qwen2-MoE readers expect)."""
    out: dict[str, Tensor] = {}
    gates: dict[str, Tensor] = {}
    for name, t in state.items():
        if not name.startswith(PREFIX):
            raise CheckpointError(f"{source}: tensor {name} is not part of a Qwen2-MoE model; "
                                  "expected a model.arch hf_qwen2_moe checkpoint")
        name = name[len(PREFIX):]
        m = re.match(r"(model\.layers\.\d+\.mlp\.)moe\.(.+)$", name)
        if m is None:
            out[name] = t
            continue
        base, rest = m.groups()
        if rest == "router.gate.weight.weight":
            out[base + "gate.weight"] = t
        elif rest in ("experts.w_gate_EDF", "experts.w_up_EDF"):
            gates[base + rest[len("experts."):]] = t
        elif rest == "experts.w_down_EFD":
            out[base + "experts.down_proj"] = t.transpose(1, 2).contiguous()
        elif rest == "shared_expert.gate.weight":
            out[base + "shared_expert_gate.weight"] = t
        elif rest.startswith("shared_expert."):
            out[base + rest] = t
        else:
            raise CheckpointError(f"{source}: {PREFIX}{name} has no place in transformers' "
                                  "Qwen2-MoE (convert --to-hf needs the topk router: a gate "
                                  "matrix and nothing else)")
    for key in sorted(k for k in gates if k.endswith("w_gate_EDF")):
        base = key[:-len("w_gate_EDF")]
        gate_up = torch.cat([gates[key], gates[base + "w_up_EDF"]], dim=2)  # (E, D, 2F)
        out[base + "experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
    return _per_expert(out) if per_expert else out


def _per_expert(stacked: dict[str, Tensor]) -> dict[str, Tensor]:
    """Stacked HF expert tensors split into transformers' saved per-expert layout."""
    out: dict[str, Tensor] = {}
    for name, t in stacked.items():
        if name.endswith("experts.gate_up_proj"):
            base, F_ = name[:-len("gate_up_proj")], t.size(1) // 2
            for e in range(t.size(0)):  # copies: views would share one storage
                out[f"{base}{e}.gate_proj.weight"] = t[e, :F_].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, F_:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(t.size(0)):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


# ---------------------------------------------------------------------------------- commands
def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def convert_from_hf(model_dir: str | Path, out_dir: str | Path, trim_to: int | None = None,
                    experts: str | None = None, calibration: str | Path | None = None,
                    k: int | None = None, calibration_lines: int = 2000) -> dict[str, Any]:
    """Write our export of a local HF Qwen2-MoE directory; returns a summary. With `trim_to`
    N (Trim-MoE, moe_train.models.hf_trim) every MoE layer keeps N routed experts: `experts`
    (indices, the same in every layer) or the N most used on the `calibration` text."""
    from moe_train.train.export import EXPORT_FORMAT, EXPORT_WEIGHTS

    prov = provenance()
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    hf = read_json_object(cfg_path, "a Hugging Face config.json")
    cfg = config_from_hf(hf, cfg_path)
    source = hf_source(model_dir, cfg)
    from moe_train.train.export import check_weights
    from moe_train.train.init_from import check_shapes, model_shapes

    shapes_of = _shape_model(cfg)  # on the meta device, built once for both checks
    check_shapes(model_shapes(shapes_of), source.shapes, model_dir)  # before any read
    state = source.materialize()
    check_weights(shapes_of, state, model_dir)  # and the values' types
    manifest = _manifest(cfg, hf, model_dir)
    kept = settings = None
    if trim_to is not None:
        state, cfg, kept, settings = _trim(state, cfg, manifest, model_dir, trim_to, experts,
                                           calibration, k, calibration_lines)
    with atomic_dir(Path(out_dir), overwrite=True) as tmp:
        save_tensors(tmp / EXPORT_WEIGHTS, {k: v.float() for k, v in state.items()},
                     metadata={"format": EXPORT_FORMAT})
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        copied = _copy_tokenizer(model_dir, tmp)
        if kept is not None:
            (tmp / "trim.json").write_text(json.dumps(kept, indent=1) + "\n")
        summary = {"tensors": len(state), "parameters": _numel(state,
                                                              cfg.qwen.tie_word_embeddings),
                   "tokenizer": copied}
        summary = summary if kept is None else {**summary, "kept_experts": kept}
        _write_report(tmp, model_dir, summary, prov,
                      {} if settings is None else {"trim": settings})
    return summary


def _manifest(cfg: ExperimentConfig, hf: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """Vocabulary facts of a converted model: its tokenizer's special ids when it has one."""
    from moe_train.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer

    manifest: dict[str, Any] = {"vocab_size": cfg.qwen.vocab_size, "tokenizer": "hf",
                                "langs": [], "domains": [], "corpora": [],
                                HF_SPECIAL_IDS: {key: hf[key] for key in SPECIAL_ID_KEYS
                                                 if key in hf}}
    if (model_dir / TOKENIZER_JSON).is_file():
        tok = HFTokenizer(model_dir)
        if len(tok) > cfg.qwen.vocab_size:
            raise ConfigError(f"{model_dir / TOKENIZER_JSON}: {len(tok)} tokens but the model's "
                              f"vocab_size is {cfg.qwen.vocab_size}; expected the model's own "
                              "tokenizer")
        return {**manifest, "pad_id": tok.pad_id, "eos_id": tok.eos_id, "bos_id": tok.bos_id}
    eos = hf.get("eos_token_id")
    if isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos):
        eos = eos[0]  # generation stops at any of them; ours at the first
    eos = eos if isinstance(eos, int) and not isinstance(eos, bool) else 0
    return {**manifest, "pad_id": eos, "eos_id": eos, "bos_id": eos}


def _trim(state: dict[str, Tensor], cfg: ExperimentConfig, manifest: dict[str, Any],
          model_dir: Path, n: int, experts: str | None, calibration: str | Path | None,
          k: int | None, lines: int):
    """Trim-MoE: (state, config, {layer: kept experts}) of `convert_from_hf`."""
    from moe_train.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer
    from moe_train.models.build import build_model, skip_init
    from moe_train.models.hf_qwen2moe import sparse_layers
    from moe_train.models.hf_trim import (calibration_lines, expert_usage, most_used,
                                          parse_experts, trim)

    E = cfg.moe.num_experts
    if not 1 <= n <= E:
        raise ConfigError(f"--trim: expected 1..{E} (the model's routed experts), got {n}")
    if (experts is None) == (calibration is None):
        raise ConfigError("--trim: expected either --experts (indices) or --calibration "
                          "(a text file to count expert use on)")
    if experts is not None:
        ids = parse_experts(experts, E)
        if len(ids) != n:
            raise ConfigError(f"--experts: expected {n} indices (--trim {n}), got {len(ids)}")
        keep = {i: ids for i in sparse_layers(cfg)}
    else:
        if not (model_dir / TOKENIZER_JSON).is_file():
            raise DataError(f"{model_dir / TOKENIZER_JSON}: missing; --calibration text is "
                            "tokenized with the model's own tokenizer (or pass --experts)")
        tokens = calibration_lines(calibration, HFTokenizer(model_dir), lines)
        with skip_init():  # loaded next
            model = build_model(cfg, manifest)
        model.load_state_dict(state, strict=True)
        usage = expert_usage(model, tokens, manifest["pad_id"])
        keep = {i: most_used(counts, n) for i, counts in usage.items()}
    state, cfg = trim(state, cfg, keep, k)
    settings = {"to": n, "experts": experts, "k": k, "calibration": None if calibration is None
                else str(Path(calibration).resolve()), "calibration_lines": lines}
    if calibration is not None:  # what the choice was made from: tokens routed per expert
        settings["expert_use"] = {str(i): [int(c) for c in counts]
                                  for i, counts in sorted(usage.items())}
    return state, cfg, {str(i): ids for i, ids in sorted(keep.items())}, settings


HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""`convert --to-hf --dtype` choices: the names transformers writes as a config's dtype."""
HF_MAX_SHARD = "50GB"
"""Default `--max-shard-size`: transformers' own `save_pretrained` default."""


def convert_to_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32",
                  max_shard_bytes: int | None = None) -> dict[str, Any]:
    """Write a transformers directory of a hf_qwen2_moe export or checkpoint, weights in
    `dtype` (float32 keeps the trained values exactly), split as `save_pretrained` splits them:
    one model.safetensors, or shards of at most `max_shard_bytes` (a larger tensor alone in
    its own) with model.safetensors.index.json."""
    from huggingface_hub import split_torch_state_dict_into_shards

    prov = provenance()
    where, cfg, manifest, state = read_qwen(checkpoint)
    if cfg.moe.decoder_router != "topk":  # transformers' Qwen2-MoE routes top-k, nothing else
        raise ConfigError(f"{where}: moe.decoder_router is {cfg.moe.decoder_router!r}; "
                          "expected 'topk', the only routing transformers' Qwen2-MoE has")
    if dtype not in HF_DTYPES:
        raise ConfigError(f"--dtype: expected one of {', '.join(HF_DTYPES)}, got {dtype!r}")
    hf_state = {name: t.to(HF_DTYPES[dtype])
                for name, t in ours_to_hf(state, where, per_expert=True).items()}
    if cfg.qwen.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    split = split_torch_state_dict_into_shards(
        hf_state, max_shard_size=max_shard_bytes or HF_MAX_SHARD)
    with atomic_dir(Path(out_dir), overwrite=True) as tmp:
        for filename, names in split.filename_to_tensors.items():
            save_tensors(tmp / filename, {n: hf_state[n] for n in names},
                         metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {**split.metadata, "total_parameters": _numel(hf_state)},
                     "weight_map": dict(sorted(split.tensor_to_filename.items()))}
            (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = {**hf_config_dict(cfg, manifest), "dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = _copy_tokenizer(where, tmp)
        summary = {"tensors": len(hf_state), "parameters": _numel(hf_state), "dtype": dtype,
                   "files": sorted(split.filename_to_tensors), "tokenizer": copied}
        _write_report(tmp, Path(checkpoint), summary, prov)
    return summary


def _write_report(out: Path, source: Path, summary: dict[str, Any], prov: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> None:
    """convert.json: what was converted (the source by absolute path), the summary, how it
    was asked for and where it ran."""
    report = {"from": str(source.resolve()), **summary, **(extra or {}),
              "provenance": finish(prov)}
    (out / CONVERT_REPORT).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def read_qwen(checkpoint: str | Path):
    """(directory, config, manifest, state dict) of a hf_qwen2_moe export or checkpoint, the
    weights checked against the config's model."""
    from moe_train.train.checkpoint import consolidated_state_dict
    from moe_train.train.export import read_parts, load_export_weights

    kind, where, cfg, manifest, _ = read_parts(checkpoint)
    if not cfg.decoder_only:
        raise ConfigError(f"{where}: model.arch is {cfg.model.arch!r}; expected a "
                          "hf_qwen2_moe export or checkpoint")
    state = load_export_weights(where) if kind == "export" else consolidated_state_dict(where)
    check_state(cfg, state, where)
    return where, cfg, manifest, state


def _shape_model(cfg: ExperimentConfig) -> torch.nn.Module:
    from moe_train.models.build import shape_model

    return shape_model(cfg, {"vocab_size": cfg.qwen.vocab_size, "pad_id": 0})


def check_state(cfg: ExperimentConfig, state: dict[str, Tensor], source: Path) -> None:
    """The names and shapes of the model `cfg` builds (on the meta device), else one line."""
    from moe_train.train.export import check_weights

    check_weights(_shape_model(cfg), state, source)


def _numel(state: dict[str, Tensor], tied: bool = False) -> int:
    """Parameters of a state dict, shared tensors once; `tied`: the output head is the
    embedding table (its copy not counted again)."""
    counted = {t.data_ptr(): t.numel() for k, t in state.items()
               if not (tied and k.endswith("lm_head.weight"))}
    return sum(counted.values())


def load_qwen(checkpoint: str | Path, device: torch.device | str = "cpu"):
    """(model in eval mode, config, manifest) of a hf_qwen2_moe export or checkpoint; the
    weights must match the config's model exactly."""
    from moe_train.models.build import build_model, skip_init

    _, cfg, manifest, state = read_qwen(checkpoint)
    with skip_init():  # loaded next
        model = build_model(cfg, manifest)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), cfg, manifest
