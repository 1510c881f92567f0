"""`moe-train synth`: the synthetic corpus written as a whole directory, or not at all."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from moe_train.data.synthetic import check_counts, generate_synthetic
from moe_train.errors import ConfigError
from moe_train.utils.atomic import atomic_dir, check_out_dir

_SIGNATURE = inspect.signature(generate_synthetic)


def check_options(**options: Any) -> None:
    """`generate_synthetic`'s checks of its counts and languages, made before anything is
    created: bad options must not leave even an empty parent directory."""
    bound = _SIGNATURE.bind(None, **options)
    bound.apply_defaults()
    args = bound.arguments
    check_counts(args["num_domains"], args["target_langs"],
                 {split: args[f"{split}_per_domain"] for split in ("train", "dev", "test")})


def write_synthetic(out_dir: str | os.PathLike, overwrite: bool = False,
                    **options: Any) -> dict[str, Any]:
    """`generate_synthetic(**options)` into a temporary directory renamed onto `out_dir` once
    complete, so a killed or failed run leaves nothing under the final name. An existing
    non-empty `out_dir` is replaced only when it is a synthetic corpus (has ``domains.json``)
    and `overwrite` is set; an empty one is replaced silently. The options are checked before
    anything is created, and the parent directories this call creates are removed again if
    it fails."""
    out = Path(out_dir)
    # a mount point, the working directory, a file, a directory of something else: refused
    check_out_dir(out, "synth --out", "domains.json", "synthetic corpus")
    replace = out.exists()  # empty, or an earlier corpus
    if replace and (out / "domains.json").is_file() and not overwrite:
        raise ConfigError(f"synth --out {out}: already holds a synthetic corpus; use "
                          "--overwrite to replace it")
    check_options(**options)
    missing = [p for p in out.absolute().parents if not p.exists()]  # deepest first
    try:
        with atomic_dir(out, overwrite=replace) as tmp:
            return generate_synthetic(tmp, **options)
    except BaseException:
        for parent in missing:  # only the ones made here, and only while empty
            try:
                parent.rmdir()
            except OSError:
                break
        raise
