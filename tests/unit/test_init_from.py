"""`train.init_from`: a fresh run starts from an export, a checkpoint-shaped export of another
model, or a local Hugging Face Qwen2-MoE directory (sharded safetensors), read one tensor at a
time; names and shapes must match exactly."""

import json

import pytest
import torch

from moe_train.config import load_config
from moe_train.errors import CheckpointError
from moe_train.models.build import build_model
from moe_train.models.hf_qwen2moe import qwen_hf_config
from moe_train.models.hf_io import ours_to_hf
from moe_train.train.export import export_inference
from moe_train.train.init_from import build_start_model, load_init_weights
from moe_train.utils.tensor_source import TensorSource

V = 60
MANIFEST = {"vocab_size": V, "pad_id": 0, "langs": ["de", "en"], "domains": ["a"]}


def seq2seq(*extra: str):
    return load_config(None, ["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64",
                              "model.encoder_layers=2", "model.decoder_layers=2",
                              "moe.num_experts=4", "moe.layers=all", *extra])


def qwen(*extra: str):
    return load_config(None, [
        "model.arch=hf_qwen2_moe", f"qwen.vocab_size={V}", "qwen.hidden_size=32",
        "qwen.num_hidden_layers=2", "qwen.num_attention_heads=4", "qwen.num_key_value_heads=2",
        "qwen.intermediate_size=48", "qwen.shared_expert_intermediate_size=40",
        "qwen.max_position_embeddings=64", "moe.num_experts=4", "moe.k=2",
        "moe.expert_ffn_dim=24", "moe.layers=all", *extra])


def differ(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sb = b.state_dict()
    return [k for k, v in a.state_dict().items() if not torch.equal(v, sb[k])]


def test_a_run_starts_from_an_export_of_the_same_model(tmp_path) -> None:
    torch.manual_seed(5)
    trained = build_model(seq2seq(), MANIFEST)
    export = export_inference(tmp_path / "export", trained.state_dict(), seq2seq(), MANIFEST, [])
    torch.manual_seed(1)  # the run's own seed would give other weights
    fresh, loaded = build_start_model(seq2seq(), MANIFEST, {}, is_main=True)
    assert loaded == 0 and differ(fresh, trained)
    torch.manual_seed(1)
    model, loaded = build_start_model(seq2seq(f"train.init_from={export}"), MANIFEST, {}, True)
    assert not differ(model, trained)
    assert loaded == sum(p.numel() for p in trained.parameters())
    # resuming (load=False) reads nothing: the checkpoint's weights win
    torch.manual_seed(1)
    model, loaded = build_start_model(seq2seq(f"train.init_from={export}"), MANIFEST, {}, True,
                                      load=False)
    assert loaded == 0 and not differ(model, fresh)


def test_weights_of_another_shape_or_missing_paths_are_one_line_errors(tmp_path) -> None:
    torch.manual_seed(5)
    other = seq2seq("model.ffn_dim=48")
    export = export_inference(tmp_path / "export", build_model(other, MANIFEST).state_dict(),
                              other, MANIFEST, [])
    with pytest.raises(CheckpointError,
                       match=r"train.init_from: .*this run.s config.*of other shape.*w1_EDF"):
        build_start_model(seq2seq(f"train.init_from={export}"), MANIFEST, {}, True)
    with pytest.raises(CheckpointError, match="not found"):
        build_start_model(seq2seq(f"train.init_from={tmp_path / 'nothing'}"), MANIFEST, {}, True)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    with pytest.raises(CheckpointError, match="Hugging Face model directory; expected model.arch"):
        build_start_model(seq2seq(f"train.init_from={hf_dir}"), MANIFEST, {}, True)


def test_the_run_s_data_must_use_the_source_s_tokenizer_domains_and_languages(tmp_path) -> None:
    """Names and shapes alone let a run start from embeddings of another vocabulary."""
    (tmp_path / "spm.model").write_bytes(b"the export's tokenizer")
    export = export_inference(tmp_path / "export", build_model(seq2seq(), MANIFEST).state_dict(),
                              seq2seq(), MANIFEST, [tmp_path / "spm.model"])
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "spm.model").write_bytes(b"the export's tokenizer")
    run = seq2seq(f"train.init_from={export}", f"data.prepared_dir={prepared}")
    build_start_model(run, MANIFEST, {}, True)  # the same data settings: fine
    with pytest.raises(CheckpointError, match=r"train.init_from: .*prepared: its domains b are "
                                              r"not the model's \(a, .*export\)"):
        build_start_model(run, {**MANIFEST, "domains": ["b"]}, {}, True)
    (prepared / "spm.model").write_bytes(b"another tokenizer")
    with pytest.raises(CheckpointError, match=r"train.init_from: .*prepared: its spm.model is "
                                              r"not the model's"):
        build_start_model(run, MANIFEST, {}, True)


def test_each_tensor_is_read_once_and_tied_weights_once() -> None:
    cfg = qwen("qwen.tie_word_embeddings=true")
    torch.manual_seed(3)
    state = build_model(cfg, MANIFEST).state_dict()
    reads: list[str] = []
    src = TensorSource.from_dict(state, "memory")
    counted = TensorSource(src.shapes, lambda n: reads.append(n) or state[n].clone(), "memory")
    model = build_model(cfg, MANIFEST)
    load_init_weights(model, counted)
    assert sorted(reads) == sorted(set(reads))  # never twice
    assert "hf.lm_head.weight" not in reads  # the embedding's tensor, loaded once
    assert len(reads) == len(state) - 1
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_qwen_run_starts_from_a_sharded_hugging_face_directory(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = qwen()
    torch.manual_seed(7)
    source = build_model(cfg, MANIFEST).eval()
    hf = transformers.Qwen2MoeForCausalLM(qwen_hf_config(cfg)).eval()
    hf.load_state_dict(ours_to_hf(source.state_dict(), "test"), strict=True)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    torch.manual_seed(1)
    model, loaded = build_start_model(qwen(f"train.init_from={tmp_path / 'hf'}"), MANIFEST, {},
                                      True)
    assert loaded == sum(p.numel() for p in source.parameters())
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits_BTV, hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert not differ(model, source)


def test_deepspeed_refusing_the_partitioned_build_is_one_config_line() -> None:
    """A decoder-only model fine-tuned under ZeRO-3 is built inside DeepSpeed's zero.Init,
    which reads the config before deepspeed.initialize does: its refusal of a raw entry is the
    same one line (it was a pydantic traceback)."""
    from moe_train.errors import ConfigError
    from moe_train.train.ds_config import build_deepspeed_config

    cfg = qwen("optim.zero_stage=3", "train.init_from=/nonexistent",
               "deepspeed.zero_optimization.reduce_bucket_size=-5")
    ds = build_deepspeed_config(cfg, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^deepspeed config \(DeepSpeedZeroConfig\): "
                                          r"reduce_bucket_size: Input should be greater than 0"):
        build_start_model(cfg, MANIFEST, ds, True, load=False)  # a resume: nothing is read
