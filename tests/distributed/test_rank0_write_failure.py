"""Rank 0 alone writes a checkpoint's metadata and the export: when that fails (a full disk),
every rank stops with one line (rank 0 naming the file, the other pointing at it) instead of
rank 1 training on alone or both waiting for each other until the process-group timeout."""

import time

import pytest

from moe_train.train.checkpoint import latest_tag
from tests.cli_runner import Ranks
from tests.conftest import ROOT, cli_env, debug_overrides
from tests.distributed.test_kill_resume import CONFIG

PATCHES = {
    "export": ("from moe_train.train import checkpointer as m\n"
               "orig = m.Checkpointer.export\n"
               "def patched(self, tag_dir):\n"
               "    if self.rt.is_main:\n"
               "        raise OSError(errno.ENOSPC, 'No space left on device',\n"
               "                      str(self.export_dir))\n"
               "    return orig(self, tag_dir)\n"
               "m.Checkpointer.export = patched\n"),
    "save": ("from moe_train.train import checkpoint as m\n"
             "orig = m._complete_step\n"
             "def patched(tmp_dir, step, meta, attachments):\n"
             "    if step == 2:\n"
             "        raise OSError(errno.ENOSPC, 'No space left on device',\n"
             "                      str(tmp_dir / 'meta.json'))\n"
             "    return orig(tmp_dir, step, meta, attachments)\n"
             "m._complete_step = patched\n"),
    # inside DeepSpeed's save_checkpoint, before its final barrier: rank 0's model states
    # through its checkpoint engine (ZeRO 0) ...
    "deepspeed": ("from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine as m\n"
                  "orig = m.TorchCheckpointEngine.save\n"
                  "def patched(self, state_dict, path):\n"
                  "    if 'step_00000002' in str(path) and 'mp_rank_00_model' in str(path):\n"
                  "        raise OSError(errno.ENOSPC, 'No space left on device', str(path))\n"
                  "    return orig(self, state_dict, path)\n"
                  "m.TorchCheckpointEngine.save = patched\n"),
    # ... and its copy of zero_to_fp32.py beside the steps by shutil (ZeRO 1-3, rank 0)
    "script": ("import deepspeed.runtime.engine as m\n"
               "copies = []\n"
               "def copy(src, dst):\n"
               "    copies.append(dst)\n"
               "    if len(copies) > 2:  # the second save: two scripts each\n"
               "        raise OSError(errno.ENOSPC, 'No space left on device', str(dst))\n"
               "    return orig(src, dst)\n"
               "orig, m.copyfile = m.copyfile, copy\n"),
    # a shard of the ZeRO-1 dense store, mid-way through the per-parameter gathers
    "shard": ("from moe_train.utils import tensor_store as m\n"
              "init = m.TensorStoreWriter.__init__\n"
              "m.TensorStoreWriter.__init__ = lambda self, d, stem, active=True, max_bytes=0: \\\n"
              "    init(self, d, stem, active, 4096)\n"
              "orig = m.save_tensors\n"
              "def patched(path, tensors, metadata=None):\n"
              "    if 'step_00000002' in str(path) and path.name.endswith('00001.safetensors'):\n"
              "        raise OSError(errno.ENOSPC, 'No space left on device', str(path))\n"
              "    return orig(path, tensors, metadata=metadata)\n"
              "m.save_tensors = patched\n"),
}
PATCHES["export3"] = (  # ZeRO-3 streams the export: rank 0 fails before the gathers begin
    "import tempfile\n"
    "orig = tempfile.mkdtemp\n"
    "def patched(*args, prefix=None, **kwargs):\n"
    "    if prefix == '.export.':\n"
    "        raise OSError(errno.ENOSPC, 'No space left on device', str(kwargs.get('dir')))\n"
    "    return orig(*args, prefix=prefix, **kwargs)\n"
    "tempfile.mkdtemp = patched\n")
EXTRA = {"shard": ["optim.zero_stage=1"], "script": ["optim.zero_stage=1"],
         "export3": ["optim.zero_stage=3",
                     "deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]}
"""Overrides a case needs beside the common ones."""


@pytest.mark.parametrize("where", ["export", "export3", "save", "deepspeed", "script", "shard"])
def test_a_rank0_write_failure_stops_every_rank_in_one_line(tiny_prepared, tmp_path, where):
    script = tmp_path / "run.py"
    script.write_text("import errno, sys\n" + PATCHES[where] +
                      "from moe_train.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    start = time.time()
    ranks = Ranks(["train", "--config", CONFIG,
                   *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=3",
                                    "checkpoint.save_every=1", "train.validate_every=0",
                                    "train.bleu_sentences=4", "data.max_tokens=400",
                                    *EXTRA.get(where, []))],
                  ROOT, cli_env(), tmp_path / "log", script=script)
    text = ranks.finish(expect_ok=False, timeout=300)
    assert ranks.returncode != 0 and time.time() - start < 250, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    ckpt = tmp_path / "ckpt"
    if where in ("export", "export3"):
        assert f"error: {ckpt / 'export'}: No space left on device" in text, text[-3000:]
        assert f"error: {ckpt}: another rank failed at the end of training" in text
    elif where in ("deepspeed", "script", "shard"):  # before: the ranks waited in different
        # collectives (the script is copied beside the steps, the others into the step)
        named = ckpt / "zero_to_fp32.py" if where == "script" else f"{ckpt / 'step_00000002'}/"
        assert f"error: {named}" in text and ": No space left on device" in text, text[-3000:]
        assert f"error: {ckpt / 'step_00000002'}: another rank could not write" in text
        assert latest_tag(ckpt, warn=None) == "step_00000001" and not list(ckpt.glob(".tmp-*"))
        assert "| step      3 |" not in text
    else:
        assert f"error: {ckpt / 'step_00000002' / 'meta.json'}: No space left on device" in text
        assert f"error: {ckpt / 'step_00000002'}: another rank could not write" in text
        assert latest_tag(ckpt, warn=None) == "step_00000001" and not list(ckpt.glob(".tmp-*"))
        assert "| step      3 |" not in text  # rank 1 did not train on alone


def test_an_error_on_one_rank_ends_every_rank_with_its_message(tiny_prepared, tmp_path):
    """Rank 1 raises in the middle of training (an OOM, a bad batch on one node): it must not
    wait at the end-of-run barrier while rank 0 waits in the step's all-reduce (both until the
    process group's 30-minute timeout, its error never printed); it leaves, and rank 0 fails
    on the broken collective."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from moe_train.train import trainer as m\n"
        "orig = m.Trainer._forward_loss\n"
        "def patched(self, batch):\n"
        "    if self.rt.rank == 1 and self.step + 1 >= 2:\n"
        "        raise RuntimeError('simulated failure on rank 1')\n"
        "    return orig(self, batch)\n"
        "m.Trainer._forward_loss = patched\n"
        "from moe_train.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    start = time.time()
    ranks = Ranks(["train", "--config", CONFIG,
                   *debug_overrides(tiny_prepared, tmp_path, "train.max_steps=4",
                                    "checkpoint.save_every=10", "train.validate_every=0",
                                    "data.max_tokens=400")],
                  ROOT, cli_env(), tmp_path / "log", script=script)
    text = ranks.finish(expect_ok=False, timeout=300)
    assert ranks.returncode != 0 and time.time() - start < 150, text[-3000:]
    assert "simulated failure on rank 1" in text, text[-3000:]
