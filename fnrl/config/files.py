"""Config files: a run directory's `config.json` or a YAML file, laid over a config.

    python -m fnrl.experiments.math_grpo --config runs/math_grpo-.../config.json
    python -m fnrl.experiments.math_grpo --config my_ablation.yaml --steps 10

A file is a nested mapping of RunConfig's fields (`algo: {learning_rate: 3.0e-4}`);
a key may also be a dotted path (`algo.learning_rate: 3.0e-4`) and may use the
command line's hyphens (`groups-per-step`). A partial file changes only what it names.
Every key is checked against the dataclasses and every value against the field's type
before any dataclass is built, so a typo or a value of the wrong kind fails with the
key's full path and the file's name, and the dataclasses' own checks name the field.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from fnrl.config.base import section_type
from fnrl.config.renamed import upgrade


def read_config_file(path: str | Path) -> dict:
    """The nested mapping a `.json`, `.yaml` or `.yml` file holds (dotted keys expanded)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: {err}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml   # only for YAML files: JSON ones need nothing beyond the standard library

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        data = {} if data is None else data   # an empty file changes nothing
    else:
        raise ValueError(f"config file {str(path)!r}: expected a .json, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of config fields, "
                         f"not a {type(data).__name__}")
    return nest(data, where=str(path))


def nest(data: dict, *, where: str = "config") -> dict:
    """`data` with dotted keys ("algo.learning_rate") expanded into nested mappings and
    hyphens turned into underscores; a key given twice (nested and dotted) is an error."""
    out: dict = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: config key {key!r} is not a string")
        parts = key.replace("-", "_").split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{where}: {'.'.join(parts[:i + 1])} is given both as a value "
                                 f"and as a section")
        value = nest(value, where=where) if isinstance(value, dict) else value
        leaf = parts[-1]
        if leaf in node and (not isinstance(node[leaf], dict) or not isinstance(value, dict)):
            raise ValueError(f"{where}: config key {'.'.join(parts)} is given twice")
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = _merge_once(node[leaf], value, where=where, prefix=".".join(parts))
        else:
            node[leaf] = value
    return out


def _merge_once(base: dict, over: dict, *, where: str, prefix: str) -> dict:
    """Nested mappings merged where no leaf is given in both (a key written twice)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_once(out[key], value, where=where, prefix=f"{prefix}.{key}")
        elif key in out:
            raise ValueError(f"{where}: config key {prefix}.{key} is given twice")
        else:
            out[key] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """Nested mappings merged, `over` winning on each leaf."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def overlay(cfg: Any, data: dict, *, where: str = "config", prefix: str = "") -> Any:
    """`cfg` (a config dataclass) with every field `data` names replaced, recursively.

    Raises ValueError naming `where` and the key's dotted path for an unknown key or a
    value of the wrong type; the dataclasses' own validation names the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a mapping of "
                         f"fields, not {data!r}")
    data = upgrade(type(cfg).__name__, data, where=where, prefix=prefix)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown config key(s) {', '.join(prefix + k for k in unknown)}"
                         f" (known in {prefix.rstrip('.') or type(cfg).__name__}: "
                         f"{', '.join(sorted(fields))})")
    changes = {}
    for key, value in data.items():
        current, path = getattr(cfg, key), prefix + key
        section = section_type(type(cfg), fields[key])
        if section is None:
            changes[key] = coerce(value, hints[key], where=where, path=path)
        elif isinstance(value, dict):
            # An optional section that is off (None) is turned on with these fields.
            base = current if current is not None else section()
            try:
                changes[key] = overlay(base, value, where=where, prefix=path + ".")
            except ValueError as err:   # a section's own check, named with the file once
                if str(err).startswith(where):
                    raise
                raise ValueError(f"{where}: {err}") from None
        elif value is None and type(None) in typing.get_args(hints[key]):
            changes[key] = None   # an optional section switched off
        else:
            off = " (or null for off)" if type(None) in typing.get_args(hints[key]) else ""
            raise ValueError(f"{where}: {path} is a section; give it a mapping of fields{off}, "
                             f"not {value!r}")
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as err:
        if str(err).startswith(where):
            raise
        raise ValueError(f"{where}: {err}") from None


def coerce(value: Any, tp: Any, *, where: str, path: str) -> Any:
    """`value` (as JSON or YAML wrote it) as the annotation `tp` wants it: lists become
    tuples, ints become floats, and a float written as a string ("1e-4", which YAML 1.1
    reads as text) is read as a number; anything else of the wrong kind is an error."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"{where}: {path}={value!r}: expected {expected}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return coerce(value, rest[0], where=where, path=path)
        return value
    if origin is Literal:
        if value not in args:
            raise bad(f"one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], where=where, path=f"{path}[{i}]")
                         for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise bad(f"a list of {len(args)} items")
        return tuple(coerce(v, a, where=where, path=f"{path}[{i}]")
                     for i, (v, a) in enumerate(zip(value, args))) if args else tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string (quote it in YAML)")
        return value
    return value   # an annotation this reader does not know: the dataclass checks it
