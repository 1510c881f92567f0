"""`shape_model` gives `build_model`'s names and shapes on the meta device without running any
initialisation, so that `translate`, `evaluate`, `params` and `average` do not import
torch._dynamo (2-3 s of every start: the Python meta kernels of init ops and of the position
table import it); `skip_init` puts only what is built inside uninitialised."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from moe_train.config import load_config
from moe_train.models.build import build_model, shape_model, skip_init
from moe_train.models.layers import SinusoidalPositions
from tests.conftest import ROOT

MANIFEST = {"vocab_size": 50, "pad_id": 0, "langs": ["de", "fr"]}


def _cfg(name: str):
    return load_config(ROOT / "configs" / name, ["model.d_model=16", "model.n_heads=2",
                                                 "model.ffn_dim=32", "model.max_positions=64"])


@pytest.mark.parametrize("name", ["debug-cpu.yaml", "thor-synthetic-cpu.yaml"])
def test_shape_model_has_build_models_names_and_shapes_on_meta(name):
    cfg = _cfg(name)
    built, shaped = build_model(cfg, MANIFEST), shape_model(cfg, MANIFEST)
    assert {k: v.shape for k, v in shaped.state_dict().items()} == \
        {k: v.shape for k, v in built.state_dict().items()}
    assert all(p.device.type == "meta" for p in shaped.parameters())


def test_building_on_meta_does_not_import_dynamo():
    code = ("import sys\n"
            "from moe_train.config import load_config\n"
            "from moe_train.models.build import shape_model\n"
            f"cfg = load_config({str(ROOT / 'configs' / 'thor-synthetic-cpu.yaml')!r})\n"
            f"shape_model(cfg, {MANIFEST!r})\n"
            "print('torch._dynamo' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_skip_init_leaves_tensors_alone_inside_only():
    with pytest.raises(KeyError), skip_init():
        weight = torch.full((3, 4), 7.0)
        assert nn.init.normal_(weight) is weight and torch.all(weight == 7.0)
        assert torch.all(nn.init.xavier_uniform_(weight) == 7.0)
        assert torch.all(weight.uniform_() == 7.0)
        raise KeyError("inside")
    assert not torch.all(nn.init.normal_(torch.full((3, 4), 7.0)) == 7.0)


def test_transformers_first_imported_inside_still_initialises_later_models():
    """transformers keeps torch.nn.init's functions from its import on: replacing them inside
    skip_init once left every later Hugging Face model uninitialised."""
    code = ("import sys, torch\n"
            "from moe_train.models.build import skip_init\n"
            "with skip_init():\n"
            "    import transformers.initialization\n"
            "w = torch.full((4, 4), 7.0)\n"
            "transformers.initialization.normal_(w)\n"
            "print(bool(torch.all(w == 7.0)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_position_table_is_the_cpus_on_any_device():
    cpu = SinusoidalPositions(10, 32).table_PD
    with torch.device("meta"):
        meta = SinusoidalPositions(10, 32).table_PD
    assert meta.device.type == "meta" and meta.shape == cpu.shape == (32, 10)
    assert torch.allclose(cpu[1, :5], torch.sin(torch.exp(
        -torch.log(torch.tensor(10000.0)) * torch.arange(5) / 4)))
    assert torch.all(cpu[0, 5:] == 1.0)
