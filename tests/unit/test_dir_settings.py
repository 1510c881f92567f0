"""Directories a run fills (checkpoint.dir, logging.tensorboard_dir, moa.workdir), checked
before the first step: writable, not a file, not where the run itself replaces directories."""

from __future__ import annotations

import pytest

from moe_train.errors import DataError
from moe_train.utils.atomic import check_dir_setting


def test_dir_setting_that_is_a_file(tmp_path, monkeypatch) -> None:
    check_dir_setting("", "logging.tensorboard_dir")  # off
    check_dir_setting(tmp_path / "ck", "checkpoint.dir")
    # An existing directory is written into: its own access counts, not its parent's.
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and p != tmp_path)
    mount = tmp_path / "mount"
    mount.mkdir()
    check_dir_setting(mount, "checkpoint.dir")  # parent read-only, directory writable: fine
    with pytest.raises(DataError, match="checkpoint.dir: cannot write into .*mount"):
        monkeypatch.setattr(os, "access", lambda p, mode: p != mount)
        check_dir_setting(mount, "checkpoint.dir")
    monkeypatch.setattr(os, "access", real)
    (tmp_path / "ck").write_text("x")
    with pytest.raises(DataError, match="checkpoint.dir: .*ck exists and is not a directory"):
        check_dir_setting(tmp_path / "ck", "checkpoint.dir")


def test_tensorboard_logs_may_not_live_where_the_run_replaces_directories(tmp_path) -> None:
    """logging.tensorboard_dir inside checkpoint.dir/export (replaced whole by the export) or a
    step directory (rotated away) lost every event file without a word."""
    from moe_train.commands import check_dir_settings
    from moe_train.config import load_config
    from moe_train.errors import ConfigError

    ck = tmp_path / "ck"
    for inside in ("export", "export/tb", "step_00000004/tb"):
        cfg = load_config(None, [f"checkpoint.dir={ck}",
                                 f"logging.tensorboard_dir={ck / inside}"])
        with pytest.raises(ConfigError, match=rf"logging.tensorboard_dir: .* is inside "
                                              rf".*ck/{inside.split('/')[0]}, which the run"):
            check_dir_settings(cfg)
    for fine in (ck / "tb", tmp_path / "tb", ck / "exports"):
        check_dir_settings(load_config(None, [f"checkpoint.dir={ck}",
                                              f"logging.tensorboard_dir={fine}"]))
