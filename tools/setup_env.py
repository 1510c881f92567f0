"""Set up the project's virtual environment: what `make demo` and `make test` run first.

    python3 tools/setup_env.py [VENV]          (default .venv; standard library only)

- One set-up at a time: concurrent `make test` and `make demo` on a fresh clone wait for each
  other (an exclusive lock beside the venv) instead of running pip twice into one venv.
- Done once: the stamp ``VENV/.installed`` (newer than setup.py) says so and nothing runs.
- A venv that cannot run pip (python3-venv missing when it was made, its interpreter removed
  by an upgrade) is made again with ``--clear``, so a second `make` repairs the first.
- The venv sees the system's packages, and those of the virtual environment `python3` itself
  belongs to, so a machine that already has a (GPU) torch keeps it: torch is installed only
  where it is missing, and the rest installs against the torch found (a constraint), so no
  dependency can replace it with another build.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
"""What a machine without torch gets (a CPU build where no GPU wheel is offered)."""
MIN_TORCH = (2, 6)
"""The oldest torch kept (setup.py's floor): transformers 5 needs it, and so do CUDA's
nonzero_static and _foreach_norm's dtype, which the dispatch and the grad norm use."""


def say(text: str) -> None:
    print(f"setup: {text}", flush=True)


def run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True)


def healthy(python: Path) -> bool:
    """Whether the venv's interpreter runs and has pip."""
    return python.exists() and subprocess.run(
        [str(python), "-m", "pip", "--version"], capture_output=True).returncode == 0


def outer_site_packages() -> list[str]:
    """site-packages of the virtual environment this interpreter runs in (none outside one):
    ``--system-site-packages`` reaches only the base interpreter's, not an activated venv's."""
    if sys.prefix == sys.base_prefix:
        return []
    paths = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return sorted(p for p in paths if Path(p).is_dir())


def make_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if healthy(python):
        return python
    if venv.exists():
        say(f"{venv} cannot run pip; making it again")
    run(sys.executable, "-m", "venv", "--clear", "--system-site-packages", venv)
    outer = outer_site_packages()
    if outer:  # the packages of the venv python3 came from (e.g. its GPU torch)
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip()
        Path(purelib, "_outer_venv.pth").write_text("".join(f"{p}\n" for p in outer))
        say(f"the venv also sees {', '.join(outer)}")
    return python


def torch_version(python: Path) -> str | None:
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def too_old(version: str) -> str | None:
    """The one-line refusal of a torch found older than MIN_TORCH (None when new enough), as
    pip orders versions: a pre-release of the floor (2.6.0a0+git..., 2.6.0rc1) comes before
    it. It is kept, never replaced, so the user picks the build that suits their CUDA."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?([^+]*)", version)
    if not match:
        return None
    release = tuple(int(part or 0) for part in match.groups()[:3])
    pre = re.search(r"(a|b|rc|dev)\d*", match.group(4)) is not None
    floor = (*MIN_TORCH, 0)
    if release > floor or (release == floor and not pre):
        return None
    need = ".".join(map(str, MIN_TORCH))
    return (f"torch {version} found, but moe_train needs torch >= {need}: upgrade it (a build "
            f"for this machine's CUDA), or run make with a python3 that has no torch (then "
            f"{TORCH} is installed)")


def main() -> int:
    venv = ROOT / (sys.argv[1] if len(sys.argv) > 1 else ".venv")
    stamp = venv / ".installed"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if stamp.exists() and stamp.stat().st_mtime >= (ROOT / "setup.py").stat().st_mtime \
                and healthy(venv / "bin" / "python"):
            return 0
        stamp.unlink(missing_ok=True)
        python = make_venv(venv)
        version = torch_version(python)
        if version is None:
            say(f"no torch found: installing {TORCH}")
            run(python, "-m", "pip", "install", "-q", TORCH)
            version = torch_version(python)
        elif refusal := too_old(version):
            print(f"setup: error: {refusal}", file=sys.stderr)
            return 2
        else:
            say(f"keeping the torch found ({version})")
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
            pin.write(f"torch=={version}\n")
        try:
            run(python, "-m", "pip", "install", "-q", "-c", pin.name, "-e", f"{ROOT}[dev]")
        finally:
            os.unlink(pin.name)
        stamp.touch()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
