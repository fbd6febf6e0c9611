"""An ablation file's grid: the checked spec, its cells, their run order, each cell's
partial config and whether its run finished (lab.ablation.ablate runs the cells,
.ablation_report compares them).

A cell is one point of the grid; a variant is a cell without its seed. The cells of
one seed form a round, and every round runs its variants in a different order, so a
burst of load on a shared machine lands on different variants in different rounds
instead of always on the same one. The orders are lab.ablation.rounds.ORDERS (shared
with the benchmarks): `balanced` (the default): a seeded shuffle, run backwards in every
other round (two rounds give every variant the same mean position) and rotated by one
every two rounds; `blocks`: each variant in each place once per block of rounds;
`shuffle`: a fresh seeded shuffle per round; `rotate`: the listed order rotated by the
round; `listed`: the grid's order.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fnrl.config.files import merge, nest
from lab.ablation.rounds import ORDERS as _ORDERS
from lab.ablation.rounds import round_orders

ORDERS = tuple(_ORDERS)
ROUND_AXIS = "seed"
SPEC_KEYS = ("name", "output", "base", "grid", "order", "reference", "warm_compile",
             "pin_model")


@dataclass(frozen=True, kw_only=True)
class AblationSpec:
    """An ablation file, checked: the fixed overrides and the grid's axes in file order."""

    name: str
    output: str = ""
    """Where the cells' run directories go; empty: runs/ablations/<name>."""
    base: dict = field(default_factory=dict)
    grid: tuple[tuple[str, tuple], ...] = ()
    """(dotted path, values) per axis; the `seed` axis makes the rounds."""
    order: str = "balanced"
    reference: tuple[tuple[str, Any], ...] = ()
    """The variant ratios are taken to, as (axis, value); empty: each axis's first value."""
    warm_compile: bool = True
    pin_model: bool = False
    """Every cell trains the main job's default warm-started model (the base's model and
    warm-start fields, the default task's recipe), built once before any cell, so cells
    may change the task (a smaller held-out set: a prefix of the same one) without each
    warming up its own model."""

    def __post_init__(self):
        where = f"ablation {self.name!r}"
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name or ""):
            raise ValueError(f"{where}: name={self.name!r} must be letters, digits, '.', '_' "
                             f"or '-'")
        if self.order not in ORDERS:
            raise ValueError(f"{where}: order={self.order!r} must be one of {ORDERS}")
        paths = [p for p, _ in self.grid]
        if not paths:   # (each cell's run directory is named by its axis values)
            raise ValueError(f"{where}: grid names no axis; give at least one, e.g. seed: [0]")
        if len(set(paths)) != len(paths):
            raise ValueError(f"{where}: grid names an axis twice: {paths}")
        for path, values in self.grid:
            if not values:
                raise ValueError(f"{where}: grid axis {path} has no values")
            if len(set(map(_label, values))) != len(values):
                raise ValueError(f"{where}: grid axis {path} repeats a value: {list(values)}")
        axes = dict(self.grid)
        for path, value in self.reference:
            if path not in axes or path == ROUND_AXIS:
                raise ValueError(f"{where}: reference names {path!r}, not a grid axis other "
                                 f"than {ROUND_AXIS!r} (axes: {paths})")
            if value not in axes[path]:
                raise ValueError(f"{where}: reference {path}={value!r} is not among the "
                                 f"axis's values {list(axes[path])}")

    @property
    def out_dir(self) -> Path:
        return Path(self.output or f"runs/ablations/{self.name}").expanduser().absolute()


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One run of the grid: its axis values in grid order and its round."""

    values: tuple[tuple[str, Any], ...]
    round: int

    @property
    def name(self) -> str:
        return "__".join(f"{path}={_label(v)}" for path, v in self.values)

    @property
    def variant(self) -> tuple[tuple[str, Any], ...]:
        return tuple((p, v) for p, v in self.values if p != ROUND_AXIS)

    @property
    def variant_name(self) -> str:
        """The cell's name without its seed: equal for the cells of one variant."""
        return variant_name(self.variant)


def variant_name(variant: tuple[tuple[str, Any], ...]) -> str:
    return "__".join(f"{path}={_label(v)}" for path, v in variant)


def _label(value: Any) -> str:
    """A value as it appears in a cell's name: file-system safe, one per value."""
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def parse_spec(data: dict, *, default_name: str = "ablation") -> AblationSpec:
    """An AblationSpec from the file's mapping, naming any unknown key."""
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"ablation file: unknown key(s) {unknown}; known: {list(SPEC_KEYS)}")
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ValueError(f"ablation file: grid must map dotted config paths to lists, not "
                         f"{grid!r}")
    axes = []
    for path, values in grid.items():
        values = values if isinstance(values, list) else [values]
        axes.append((str(path).replace("-", "_"), tuple(values)))
    base, reference = data.get("base") or {}, data.get("reference") or {}
    for key, value in (("base", base), ("reference", reference)):
        if not isinstance(value, dict):
            raise ValueError(f"ablation file: {key} must be a mapping, not {value!r}")
    for key in ("warm_compile", "pin_model"):
        if not isinstance(data.get(key, False), bool):
            raise ValueError(f"ablation file: {key}={data[key]!r} must be true or false")
    return AblationSpec(name=str(data.get("name") or default_name),
                        output=str(data.get("output") or ""),
                        base=nest(base, where="ablation file base"),
                        grid=tuple(axes), order=str(data.get("order", "balanced")),
                        reference=tuple((str(k).replace("-", "_"), v)
                                        for k, v in reference.items()),
                        warm_compile=bool(data.get("warm_compile", True)),
                        pin_model=bool(data.get("pin_model", False)))


def read_spec(path: str | Path) -> AblationSpec:
    """The ablation file at `path` (YAML or JSON), checked."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ablation file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"ablation file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"ablation file {str(path)!r} must hold a mapping")
    try:
        return parse_spec(data, default_name=path.stem)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def expand(spec: AblationSpec) -> list[Cell]:
    """Every cell in run order: round by round (one per seed), each round's variants in
    the spec's order (module docstring; shuffles are seeded by the ablation's name, so
    the order is the same on every resume), so no variant always runs first."""
    rounds_axis = dict(spec.grid).get(ROUND_AXIS, (None,))
    variant_axes = [(p, vs) for p, vs in spec.grid if p != ROUND_AXIS]
    variants = list(itertools.product(*[[(p, v) for v in vs] for p, vs in variant_axes]))
    orders = round_orders(range(len(variants)), len(rounds_axis), seed=spec.name,
                          order=spec.order)
    cells = []
    for r, (seed, order) in enumerate(zip(rounds_axis, orders)):
        for i in order:
            # Axis values keep the grid's order whatever the run order.
            by_path = dict(variants[i]) | ({ROUND_AXIS: seed} if seed is not None else {})
            cells.append(Cell(values=tuple((p, by_path[p]) for p, _ in spec.grid), round=r))
    return cells


def cell_overrides(spec: AblationSpec, cell: Cell) -> dict:
    """The cell's partial config: the spec's base, its axis values, its run directory."""
    own = nest({path: value for path, value in cell.values}, where=f"cell {cell.name}")
    return merge(merge(spec.base, own), {"run_dir": str(spec.out_dir / cell.name)})


def is_finished(run_dir: Path) -> bool:
    """Whether `run_dir` holds the summary of a run that trained all the steps its
    config.json asked for."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = json.loads((run_dir / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return summary.get("steps", -1) >= config.get("steps", 1)


def cell_finished(spec: AblationSpec, cell: Cell) -> bool:
    """Whether the cell's run finished, from the cell file it would be given now (a
    run of an earlier version of the ablation file is not this cell's)."""
    import yaml

    run_dir = spec.out_dir / cell.name
    if not is_finished(run_dir) or not (run_dir / "cell.yaml").exists():
        return False
    return yaml.safe_load((run_dir / "cell.yaml").read_text()) == cell_overrides(spec, cell)
