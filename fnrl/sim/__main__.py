"""python -m fnrl.sim --preset fnrl --gpus 1024 --steps 100 --eta 3 --workload.len-max 20480

Simulates one preset on a virtual cluster and writes its run directory (fnrl.sim.report).

    python -m fnrl.sim compare --presets fnrl,laminar,partial_rollout,sync --gpus 64 ...

simulates several presets on one cluster and workload, each at its own η unless --eta
pins one, and writes a table, compare.md and compare.png (fnrl.sim.compare). Both take
--costs FILE (your own GPUs, models and decode fits, merged over fnrl/sim/costs.toml)
and --workload-preset NAME (fnrl.sim.workload.WORKLOAD_PRESETS; --workload.* flags still
override its fields)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Annotated

import tyro

from fnrl.config.base import check
from fnrl.sim import costs
from fnrl.sim.compare import compare, compare_dir_for, format_table
from fnrl.sim.config import SimConfig
from fnrl.sim.report import run_dir_for, simulate
from fnrl.sim.workload import WORKLOAD_PRESETS, workload_preset

KEYS = ("steps", "train_wall_s", "trained_tokens_per_s", "trained_seq_tokens_per_s",
        "trainer_idle_frac", "rollout_idle_frac",
        "staleness_checked_max", "routed", "migrated", "pulls", "preemptions", "sim_events",
        "sim_wall_s", "sim_decide_s")


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    # The simulation's own flags keep their names (--preset, --cluster.gpu, ...).
    sim: Annotated[SimConfig, tyro.conf.arg(name="")] = field(default_factory=SimConfig)
    costs: str = ""
    """A TOML file of your own [gpu.NAME], [model.NAME], [decode.NAME] (or [roofline],
    [sync], ... fields) merged over fnrl/sim/costs.toml: new names are added, known ones
    overridden field by field ('': the built-in tables only)."""
    workload_preset: str = ""
    """A named workload of fnrl.sim.workload.WORKLOAD_PRESETS (gsm8k, math-long, agentic)
    as the --workload.* defaults ('': WorkloadSpec's own)."""

    def __post_init__(self):
        check(not self.workload_preset or self.workload_preset in WORKLOAD_PRESETS,
              type(self).__name__, "workload_preset", self.workload_preset,
              f"must be one of {sorted(WORKLOAD_PRESETS)}")


@dataclass(frozen=True, kw_only=True)
class CompareArgs(RunArgs):
    presets: tuple[str, ...] = ("fnrl", "laminar", "partial_rollout", "sync")
    """The presets compared (--preset is not used); each at its own η unless --eta pins one."""


def parse(cls: type[RunArgs], argv: list[str] | None) -> RunArgs:
    """`cls` from the command line; a --workload-preset supplies the --workload.* defaults,
    so a flag given beside it still wins."""
    args = tyro.cli(cls, args=argv, description=__doc__)
    if not args.workload_preset:
        return args
    sim = dataclasses.replace(SimConfig(), workload=workload_preset(args.workload_preset))
    # The second parse reads the same flags over the preset's defaults.
    return tyro.cli(cls, args=argv, description=__doc__, default=dataclasses.replace(args, sim=sim))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        return main_compare(argv[1:])
    args = parse(RunArgs, argv)
    cfg = args.sim
    summary = simulate(cfg, table=costs.load_table(user=args.costs) if args.costs else None)
    for k in KEYS + (("reconfigures", "mode_tp") if cfg.cluster.rollout_modes else ()):
        v = summary[k]
        print(f"{k:>24} {v:.4g}" if isinstance(v, float) else f"{k:>24} {v}")
    print(f"-> {run_dir_for(cfg)}")
    return summary


def main_compare(argv: list[str]) -> dict:
    if any(a == "--preset" or a.startswith("--preset=") for a in argv):
        raise ValueError("compare takes --presets NAME ..., not --preset")
    args = parse(CompareArgs, argv)
    cfg = args.sim
    # Both `--presets a b` and `--presets a,b`.
    presets = tuple(p for arg in args.presets for p in arg.split(",") if p)
    rows = compare(cfg, presets, table=costs.load_table(user=args.costs) if args.costs else None)
    print(format_table(rows))
    print("η: " + ", ".join(f"{r['preset']} ran at η = {r['eta']}"
                            + (" (pinned by --eta)" if r["eta_pinned"] else " (the preset's own)")
                            for r in rows))
    out = compare_dir_for(cfg)
    print(f"-> {out / 'compare.md'}, {out / 'compare.png'}")
    return {"rows": rows, "out": str(out)}


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"fnrl.sim: {err}", file=sys.stderr)
        sys.exit(2)
