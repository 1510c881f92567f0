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
