"""python -m fnrl.sim --preset fnrl --gpus 1024 --steps 100 --eta 3 --workload.len-max 20480

Simulates one preset on a virtual cluster and writes its run directory (fnrl.sim.report)."""

from __future__ import annotations

import sys

import tyro

from fnrl.sim.config import SimConfig
from fnrl.sim.report import run_dir_for, simulate

KEYS = ("steps", "train_wall_s", "trained_tokens_per_s", "trained_seq_tokens_per_s",
        "trainer_idle_frac", "rollout_idle_frac",
        "staleness_checked_max", "routed", "migrated", "pulls", "preemptions", "sim_events",
        "sim_wall_s", "sim_decide_s")


def main(argv=None) -> dict:
    cfg = tyro.cli(SimConfig, args=argv, description=__doc__)
    summary = simulate(cfg)
    for k in KEYS + (("reconfigures", "mode_tp") if cfg.cluster.rollout_modes else ()):
        v = summary[k]
        print(f"{k:>24} {v:.4g}" if isinstance(v, float) else f"{k:>24} {v}")
    print(f"-> {run_dir_for(cfg)}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"fnrl.sim: {err}", file=sys.stderr)
        sys.exit(2)
