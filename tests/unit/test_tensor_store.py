"""Tensor stores (checkpoint files written one parameter at a time) and the older .pt files
they replace, which still load."""

import json

import pytest
import torch

from moe_train.errors import CheckpointError
from moe_train.parallel.expert_checkpoint import full_expert_state, read_expert_moments
from moe_train.parallel.optim_state import dense_params, param_aliases
from moe_train.train.checkpoint import consolidated_state_dict, read_dense_state
from moe_train.utils.tensor_store import TensorStoreWriter, has_store, open_store


def tensors(n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"param/layer{i}.w": torch.randn(10, 20, generator=g) for i in range(n)}  # 800 B


def test_the_writer_cuts_shards_by_size_and_reads_back_lazily(tmp_path) -> None:
    writer = TensorStoreWriter(tmp_path, "store", max_bytes=2000)
    for name, t in tensors().items():
        writer.add(name, t)
    assert writer.shards == 2 and len(writer.buffer) == 1  # two full shards, one buffered
    writer.add("big", torch.zeros(1000))  # larger than a shard: a shard of its own
    writer.close({"step": 3.0})
    shards = sorted(p.name for p in tmp_path.glob("store-*.safetensors"))
    assert shards == [f"store-{i:05d}.safetensors" for i in range(1, 5)]
    reads = []
    src, meta = open_store(tmp_path, "store")
    read = src.read
    src.read = lambda name: reads.append(name) or read(name)
    assert meta == {"step": 3.0} and len(src.shapes) == 6 and reads == []
    for name, t in tensors().items():
        assert torch.equal(src.get(name), t)
    assert reads == list(tensors())


def test_an_inactive_writer_keeps_and_writes_nothing(tmp_path) -> None:
    writer = TensorStoreWriter(tmp_path, "store", active=False, max_bytes=10)
    for name, t in tensors().items():
        writer.add(name, t)
    writer.close()
    assert writer.buffer == {} and not list(tmp_path.iterdir()) and not has_store(tmp_path, "store")


def test_a_bad_index_or_missing_shard_is_one_line(tmp_path) -> None:
    writer = TensorStoreWriter(tmp_path, "store", max_bytes=1000)
    for name, t in tensors(3).items():
        writer.add(name, t)
    writer.close()
    index = tmp_path / "store.index.json"
    obj = json.loads(index.read_text())
    index.write_text(json.dumps({**obj, "format": "other"}))
    with pytest.raises(CheckpointError, match="store.index.json: expected a moe_train-tensor"):
        open_store(tmp_path, "store")
    for bad in (1, ["a"], ""):  # a shard entry that is no file name
        name = next(iter(obj["weight_map"]))
        index.write_text(json.dumps({**obj, "weight_map": {**obj["weight_map"], name: bad}}))
        with pytest.raises(CheckpointError, match="store.index.json: expected a moe_train-tensor"):
            open_store(tmp_path, "store")
    index.write_text(json.dumps(obj))
    (tmp_path / "store-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="store-00002.safetensors: missing"):
        open_store(tmp_path, "store")


def test_checkpoints_written_before_the_stores_still_read(tmp_path) -> None:
    w = torch.arange(24.0).reshape(4, 3, 2)
    m = {"exp_avg": w + 1, "exp_avg_sq": w + 2}
    for r in range(2):  # two expert-parallel ranks, two experts each
        torch.save({"ep_size": 2, "ep_rank": r, "adam_step": 7.0,
                    "params": {"e.w": w[2 * r:2 * r + 2]},
                    "moments": {"e.w": {k: v[2 * r:2 * r + 2] for k, v in m.items()}}},
                   tmp_path / f"experts_ep{r}of2.pt")
    assert torch.equal(full_expert_state(tmp_path)["e.w"], w)
    assert torch.equal(read_expert_moments(tmp_path)["e.w"]["exp_avg_sq"], w + 2)
    torch.save({"step": 7.0, "params": {"d": w[0]}, "moments": {"d": {k: v[0] for k, v in
                                                                   m.items()}},
                "lr_scheduler": {"last_epoch": 7}}, tmp_path / "optim_dense.pt")
    src, meta = read_dense_state(tmp_path)
    assert meta == {"step": 7.0, "lr_scheduler": {"last_epoch": 7}}
    assert torch.equal(src.get("param/d"), w[0]) and torch.equal(src.get("exp_avg/d"), w[0] + 1)
    (tmp_path / "experts_ep1of2.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete expert files"):
        full_expert_state(tmp_path)


def test_a_tied_parameter_is_read_under_every_name_it_has(tmp_path) -> None:
    """named_parameters lists a tied table once; the dense store records the other names so a
    step directory read directly gives each of them the stored fp32 value, not the module's
    16-bit one."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3)
    model.head = torch.nn.Linear(3, 5, bias=False)
    model.head.weight = model.embed.weight
    params = dense_params(model, set())
    assert list(params) == ["embed.weight"]
    aliases = param_aliases(model, params)
    assert aliases == {"head.weight": "embed.weight"}
    master = torch.randn(5, 3)
    rounded = master.bfloat16()
    torch.save({"module": {"embed.weight": rounded, "head.weight": rounded}},
               tmp_path / "mp_rank_00_model_states.pt")
    writer = TensorStoreWriter(tmp_path, "optim_dense")
    writer.add("param/embed.weight", master)
    writer.close({"step": 1.0, "aliases": aliases})
    state = consolidated_state_dict(tmp_path)
    assert torch.equal(state["embed.weight"], master) and torch.equal(state["head.weight"], master)
    for bad in ({"head.weight": "nowhere"}, ["head.weight"], {"head.weight": 1}):
        writer = TensorStoreWriter(tmp_path, "optim_dense")
        writer.add("param/embed.weight", master)
        writer.close({"step": 1.0, "aliases": bad})
        with pytest.raises(CheckpointError, match="optim_dense.index.json: meta.aliases"):
            consolidated_state_dict(tmp_path)
