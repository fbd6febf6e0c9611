"""The `fnrl` preset's mechanisms switched one at a time on a seed's setup (issue 13).

    python -m lab.repro.ablate SETUP|all [--seeds 0 1 2] [--quick] [--out runs/repro]

Takes the run labelled "fnrl" of a registered setup (lab.repro.SETUPS), runs it
once per simulation seed as it is, with each of fnrl.sim.config.ABLATIONS switched in
turn: off where the preset runs it (through `SimConfig.ablate`, which changes the real
coordinator config in fnrl.sim.coordinator.plan_for), on where the preset leaves it out and it
can be (`SimConfig.enable`, config.ENABLES; the row is labelled "+name"), and with all of
them off. Writes out/SETUP/ablation.{md,json,png}:
per variant, the seeds' metric (trained prompt + response tokens per second) as the median
and spread over seeds, its change against full fnrl (the median of the per-seed ratios),
and the counts that say why (interrupts, migrations, repacks, preemptions, staleness).

A variant whose coordinator config equals full fnrl's (say, the sampler off on a setup
whose fnrl run already samples as the protocol does) is not run again: its row repeats
fnrl's, marked "same config". Importing this module registers no setup.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from pathlib import Path
from typing import Callable

import numpy as np

from fnrl.control.metrics import staleness_histogram
from fnrl.sim.cluster import Simulation
from fnrl.sim.layout import layout
from fnrl.sim.coordinator import plan_for
from fnrl.sim.config import ABLATIONS, ENABLES, SimConfig
from lab.repro import SETUPS

METRIC = "trained_seq_tokens_per_s"
COUNTS = ("interrupted", "migrated", "migrations", "preemptions", "pulls")
SHARES = ("staleness_mean", "rollout_idle_frac", "trainer_idle_frac")

OFF = {
    "repack": "Laminar's repack of long tails",
    "balance": "OrchestrRL's balancer",
    "migration": "StaleFlow's migration (Alg. 5)",
    "lazy_sync": "lazy sync (Alg. 4) → pull whenever behind (§6.5's vanilla sync)",
    "routing": "waterfall routing (Alg. 3) → the fewest trajectories (§6.5's vanilla routing)",
    "sampler": "the sampler → the head buffer as the protocol filled it",
    "eta": "η → 1 (one_step's bound)",
}
"""What each ablation switches off, for the table."""


def _off(cfg: SimConfig, names: tuple[str, ...]) -> SimConfig:
    return dataclasses.replace(cfg, ablate=tuple(dict.fromkeys(cfg.ablate + names)),
                               enable=tuple(n for n in cfg.enable if n not in names))


def variants(base: SimConfig) -> list[tuple[str, SimConfig]]:
    """(label, config): full fnrl; each mechanism switched off alone where `base` runs it,
    or on alone ("+name") where it does not and config.ENABLES can add it; all of them
    off. A mechanism that neither changes keeps its off row (run as "same config")."""
    full = coordinator(base)
    out = [("fnrl", base)]
    for name in ABLATIONS:
        off = _off(base, (name,))
        if coordinator(off) == full and name in ENABLES:
            on = dataclasses.replace(base, enable=base.enable + (name,))
            if coordinator(on) != full:
                out.append((f"+{name}", on))
                continue
        out.append((name, off))
    return out + [("all", _off(base, ABLATIONS))]


def label_of(variant: str) -> str:
    if variant == "fnrl":
        return "fnrl"
    return f"fnrl with {variant[1:]}" if variant.startswith("+") else f"fnrl without {variant}"


def describe(variant: str) -> str:
    if variant == "all":
        return "everything above that the preset runs, off"
    if variant.startswith("+"):
        return f"switched on: {OFF[variant[1:]]}"
    return OFF.get(variant, "")


@functools.cache
def coordinator(cfg: SimConfig):
    """The CycleConfig the simulation of `cfg` runs (its cost model included); cached, as
    `variants` and `ablate` both compare each variant's with full fnrl's."""
    return plan_for(cfg, layout(cfg).decode).cycle


def run_once(cfg: SimConfig) -> dict:
    """One simulation's summary, with the trained tokens' mean staleness (in versions)."""
    sim = Simulation(cfg)
    s = sim.run()
    hist = staleness_histogram(sim.step_records)
    s["staleness_mean"] = float(hist @ np.arange(len(hist)) / max(hist.sum(), 1.0))
    return s


def ablate(setup_name: str, *, seeds=(0, 1, 2), quick: bool = False, out: Path | None = None,
           log: Callable[[str], None] = print) -> dict:
    """Runs the setup's "fnrl" run under every variant and seed; returns the table as data
    ({"setup", "paper", "rows", "summaries"}) and writes it under out/SETUP when given."""
    if setup_name not in SETUPS:
        raise ValueError(f"no setup {setup_name!r}; known: {sorted(SETUPS)}")
    setup = SETUPS[setup_name](quick)
    base = setup.runs.get("fnrl")
    if not isinstance(base, SimConfig):
        raise ValueError(f"setup {setup_name!r} has no simulated run "
                         f"labelled 'fnrl' (runs: {sorted(setup.runs)})")
    full = coordinator(base)
    summaries: dict[str, dict[int, dict]] = {}
    same: dict[str, bool] = {}
    for label, cfg in variants(base):
        same[label] = label != "fnrl" and coordinator(cfg) == full
        if same[label]:
            summaries[label] = summaries["fnrl"]
            log(f"{setup_name} {label}: same coordinator config as fnrl, not run again")
            continue
        summaries[label] = {}
        for seed in seeds:
            s = run_once(dataclasses.replace(cfg, seed=seed, plots=False, out=""))
            summaries[label][seed] = s
            log(f"{setup_name} seed {seed} {label_of(label)}: {METRIC} {s[METRIC]:.4g}, "
                f"interrupted {s['interrupted']}, migrated {s['migrated']}")
    res = {"setup": setup_name, "paper": setup.paper, "seeds": list(seeds),
           "rows": rows(summaries, same), "summaries": summaries}
    if out is not None:
        write(res, Path(out) / setup_name)
    return res


def rows(summaries: dict[str, dict[int, dict]], same: dict[str, bool]) -> list[dict]:
    full = summaries["fnrl"]
    out = []
    for label, runs in summaries.items():
        seeds = sorted(runs)
        vals = [runs[k][METRIC] for k in seeds]
        # Within a seed both runs see the same workload group by group: compare there.
        deltas = [runs[k][METRIC] / full[k][METRIC] - 1.0 for k in seeds]
        out.append({"variant": label, "off": describe(label),
                    "same_config": same[label], "median": statistics.median(vals),
                    "min": min(vals), "max": max(vals), "per_seed": vals,
                    "delta": statistics.median(deltas),
                    **{k: statistics.median(runs[s][k] for s in seeds)
                       for k in COUNTS + SHARES}})
    return out


def table(res: dict) -> str:
    n = len(res["seeds"])
    lines = [f"| fnrl without (+: with) | tokens/s, median (min–max over {n} seeds) | Δ vs fnrl | "
             "interrupted | moved (migration + repack) | Migrate commands | preemptions | "
             "pulls | staleness mean | "
             "rollouts idle | trainer idle |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        name = "(nothing)" if r["variant"] == "fnrl" else f"{r['variant']}: {r['off']}"
        if r["same_config"]:
            name += " (same config)"
        delta = "—" if r["variant"] == "fnrl" else f"{r['delta']:+.1%}"
        lines.append(f"| {name} | {r['median']:,.0f} ({r['min']:,.0f}–{r['max']:,.0f}) | {delta} | "
                     + " | ".join(f"{r[k]:,.0f}" for k in COUNTS)
                     + f" | {r['staleness_mean']:.2f} | {r['rollout_idle_frac']:.2f} | "
                     f"{r['trainer_idle_frac']:.2f} |")
    return "\n".join(lines)


def write(res: dict, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "ablation.json").write_text(json.dumps(
        {**res, "summaries": {label: {str(k): v for k, v in runs.items()}
                              for label, runs in res["summaries"].items()}},
        indent=1, default=float))
    (d / "ablation.md").write_text(f"## fnrl's mechanisms on {res['setup']} ({res['paper']})\n\n"
                                   f"{table(res)}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = res["rows"]
    fig, ax = plt.subplots(figsize=(1.6 + 0.9 * len(rs), 3.5))
    x = range(len(rs))
    ax.bar(list(x), [r["median"] for r in rs], 0.6,
           yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
           color=["tab:green"] + ["tab:gray" if r["same_config"] else "tab:blue" for r in rs[1:]])
    ax.axhline(rs[0]["median"], color="tab:green", lw=0.8, ls="--")
    ax.set_xticks(list(x), ["fnrl"] + [r["variant"] if r["variant"].startswith("+")
                                        else f"−{r['variant']}" for r in rs[1:]],
                  fontsize=8, rotation=15)
    ax.set(ylabel="trained tokens/s (prompt + response)", title=f"fnrl ablation: {res['setup']}")
    fig.tight_layout()
    fig.savefig(d / "ablation.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from lab.repro.__main__ import load_all, setup_parser
    load_all()
    args = setup_parser(__doc__, f"one of {sorted(SETUPS)} or 'all' (those with an "
                                 "'fnrl' run)").parse_args(argv)
    names = [args.setup] if args.setup != "all" else [
        n for n in sorted(SETUPS) if isinstance(SETUPS[n](args.quick).runs.get("fnrl"), SimConfig)]
    for name in names:
        res = ablate(name, seeds=tuple(args.seeds), quick=args.quick, out=Path(args.out))
        print(f"\n## fnrl's mechanisms on {name}\n\n{table(res)}\n")
    return 0


if __name__ == "__main__":
    from lab.repro.__main__ import exit_with
    exit_with(main, "lab.repro.ablate")
