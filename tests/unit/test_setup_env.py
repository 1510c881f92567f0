"""tools/setup_env.py (what `make demo` / `make test` run first), with fakes: a broken venv is
seen as broken, and the packages of the venv python3 runs in are found."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("setup_env", ROOT / "tools" / "setup_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_venv_without_python_or_pip_is_broken(tmp_path) -> None:
    setup_env = _module()
    assert not setup_env.healthy(tmp_path / "bin" / "python")  # interpreter gone
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")  # runs, but has no pip
    fake.chmod(0o755)
    assert not setup_env.healthy(fake)
    assert setup_env.healthy(Path(sys.executable))


def test_the_packages_of_an_outer_venv_are_found(monkeypatch) -> None:
    setup_env = _module()
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert setup_env.outer_site_packages() == []  # not in a venv: nothing to add
    monkeypatch.setattr(sys, "prefix", "/some/venv")
    import sysconfig

    found = setup_env.outer_site_packages()
    assert found and all(p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
                         for p in found)


def test_a_torch_older_than_the_floor_is_refused_in_one_line() -> None:
    """A machine's own torch is kept, never replaced; one older than setup.py's floor is
    named with what to do instead of a resolver conflict (or a crash at the first step)."""
    import re

    setup_env = _module()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "setup.py").read_text())
    assert floor and tuple(map(int, floor.groups())) == setup_env.MIN_TORCH
    for new_enough in ("2.6.0", "2.6.1+cu124", "2.13.0+cpu", "2.7.0a0+79aa17489c",
                       "3.0.0a0+git1234", "2.10.0.dev2026", "2.6"):
        assert setup_env.too_old(new_enough) is None, new_enough
    for old in ("2.3.1+cu121", "2.5.0", "1.13.1", "2.6.0a0+ecf3bae40a", "2.6.0rc1"):
        line = setup_env.too_old(old)
        assert line and f"torch {old} found" in line and ">= 2.6" in line and "\n" not in line
