"""The one validation helper of every config dataclass, and config <-> JSON.

Every invalid value raises a ValueError that names the class, the field and the value,
so a bad command line fails before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from fnrl.config.renamed import upgrade


def check(cond: bool, owner: str, name: str, value: Any, why: str) -> None:
    """Raises `ValueError("invalid config Owner.name=value: why")` unless `cond`."""
    if not cond:
        raise ValueError(f"invalid config {owner}.{name}={value!r}: {why}")


def positive(obj: Any, *names: str) -> None:
    """`check` that each named field of `obj` is > 0."""
    for name in names:
        value = getattr(obj, name)
        check(value > 0, type(obj).__name__, name, value, "must be > 0")


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


SIMULATOR_ONLY = {
    "rollout_modes": "OrchestrRL's switch of tensor parallelism within a run is simulated "
                     "only (python -m fnrl.sim --cluster.rollout-modes 2 8): a vLLM server "
                     "cannot change its tensor-parallel size while it runs",
}
"""Keys a config file may carry from the simulator's configs, and why the real job refuses them."""


def from_dict(cls: type, data: dict, *, where: str = "config") -> Any:
    """Builds a config from a nested dict, naming any key the class does not have. Old
    spellings are read with a warning (fnrl.config.renamed)."""
    data = upgrade(cls.__name__, data, where=where)
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    for key in unknown:
        if key in SIMULATOR_ONLY:
            raise ValueError(f"config key {cls.__name__}.{key} is not for the real job: "
                             f"{SIMULATOR_ONLY[key]}")
    if unknown:
        raise ValueError(f"unknown config key(s) for {cls.__name__}: {', '.join(unknown)}")
    kwargs = {}
    for key, value in data.items():
        sub = section_type(cls, names[key]) if isinstance(value, dict) else None
        kwargs[key] = from_dict(sub, value, where=where) if sub is not None else value
    return cls(**kwargs)


def section_type(cls: type, f: dataclasses.Field) -> type | None:
    """The config class a field holds (a section, or an optional one: `X | None`)."""
    sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    if sub is not None and not isinstance(sub, type):
        sub = type(sub())   # a factory function with non-default values: its class
    if sub is not None and dataclasses.is_dataclass(sub):
        return sub
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return classes[0] if len(classes) == 1 else None
    return None


def save_json(cfg: Any, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True))


def load_json(cls: type, path: Path) -> Any:
    """A config `save_json` wrote (a run directory's config.json), as `cls`."""
    return from_dict(cls, json.loads(Path(path).read_text()), where=str(path))
