"""Load YAML (or dicts) into the typed config, with ``a.b=value`` overrides.

Unknown keys and wrongly typed values fail with the dotted field path and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moe_train.config.schema import ExperimentConfig
from moe_train.errors import ConfigError


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp` (int/float/bool/str/tuple/dict/dataclass)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # `T | None`
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):  # no field means "unbounded" by inf; NaN passes no bound
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (arg,) = typing.get_args(tp)
        return [_coerce(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return value
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{path}: unknown field (allowed: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["optim.lr=1e-3", "model.d_model=256"]`` into a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `update` wins."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def config_from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from a nested dict."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    return _build(ExperimentConfig, data)


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last
    one silently, so a config could set a field twice and a reader see the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`, merged by SafeLoader
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}; expected each key once per mapping",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping; errors name the file (and line for syntax errors).

    A top-level ``extends: other.yaml`` (relative to this file) reads that config first and
    merges this one over it, so a variant states only what it changes.
    """
    path = Path(path)
    data, parent_path = _read_one(path)
    if parent_path is None:
        return data
    if parent_path in _seen or parent_path == path.resolve():
        raise ConfigError(f"{path}: extends: {parent_path.name} leads back to itself")
    if not parent_path.is_file():
        raise ConfigError(f"{path}: extends: {parent_path}: " + (
            "a directory; expected a YAML config file" if parent_path.is_dir()
            else "config file not found"))
    return merge(read_yaml(parent_path, (*_seen, path.resolve())), data)


def _read_one(path: Path) -> tuple[dict[str, Any], Path | None]:
    """One YAML file's own mapping (without its ``extends``) and the file it extends. A pipe
    (`--config <(...)`) or a device reads like a file."""
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    if path.is_dir():
        raise ConfigError(f"{path}: a directory; expected a YAML config file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: expected UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; expected a YAML config "
                          "mapping") from None
    except OSError as exc:  # e.g. no read permission
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}); expected a readable YAML "
                          "config file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parent = data.pop("extends", None)
    if parent is None:
        return data, None
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: extends: expected a YAML file name, got {parent!r}")
    return data, (path.parent / parent).resolve()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> ExperimentConfig:
    """YAML file (optional) + nested dict `base` + ``a.b=value`` overrides -> validated config."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = merge(data, read_yaml(path))
    if overrides:
        data = merge(data, parse_overrides(overrides))
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        item = _override_of(str(exc), overrides or [])
        if item is not None:  # name where the bad value came from: the command line
            raise ConfigError(f"override {item}: {exc}") from None
        source = _failing_file(Path(path), base or {}) if path is not None else None
        if source is None and overrides:  # the file validates: a combination with overrides
            raise ConfigError(f"overrides ({' '.join(overrides)}): {exc}") from None
        if source is not None:
            where = str(path) if source == Path(path) else f"{source} (extended by {path})"
            raise ConfigError(f"{where}: {exc}") from None
        raise


def _failing_file(path: Path, base: dict[str, Any]) -> Path | None:
    """The file of `path`'s ``extends`` chain that makes the config invalid: the first, from
    the chain's root down, whose config (it and what it extends) fails validation; None when
    `path`'s own config validates (the error comes from the overrides)."""
    chain, seen = [path], {path.resolve()}
    while True:
        _, parent = _read_one(chain[-1])
        if parent is None or parent in seen:
            break
        chain.append(parent)
        seen.add(parent)
    for current in reversed(chain):
        try:
            config_from_dict(merge(base, read_yaml(current)))
        except ConfigError:
            return current
    return None


def _override_of(message: str, overrides: list[str]) -> str | None:
    """The last override that set the field a config error names (``field: ...``), or one
    under it (``nosuch.x=1`` when ``nosuch`` is unknown), if any."""
    field = message.split(":", 1)[0]
    for item in reversed(overrides):
        key = item.split("=", 1)[0]
        if field == key or field.startswith((f"{key}.", f"{key}[")) or \
                key.startswith(f"{field}."):  # the override reaches under the bad field
            return item
    return None
