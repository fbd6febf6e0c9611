"""OrchestrRL's switch of parallelism within a run, against fixed deployments, on the
simulator (issue 13; docs/simulation.md, OrchestrRL, "The switch within a run").

    python -m lab.benchmarks.sim_switch [--groups 512] [--steps 4] [--seeds 0 1 2]
        [--model qwen2.5-14b] [--gpus 32] [--len-max 25600]

OrchestrRL's reproduction setup (lab/repro/orchestrrl.py: one-step asynchronous,
the balancer, verl's global sync and dispatch, half the GPUs for generation, TP all-reduces charged)
at `--groups` prompts × 8 a step (the reproduction's is 128). For each fixed TP degree,
and for runs that start on one degree and may switch (`ClusterSpec.rollout_modes`,
re-planned every 30 s, 14 s a switch), prints trained tokens per second (median and
range over the seeds), each run's ratio to the best fixed deployment of its seed, and
the switches made. Every figure is simulated; nothing here is timed.
"""

from __future__ import annotations

import argparse
import statistics

from fnrl.sim.cluster import Simulation
from fnrl.sim.config import ClusterSpec, SimConfig
from lab.repro.orchestrrl import REPLAN_S, SWITCH_S, modes, workload

FIXED = (2, 4, 8)
SWITCHING = (((2, 4, 8), 2), ((2, 8), 2), ((2, 4, 8), 8))   # (modes, the one it starts in)


def run(args, seed: int, tp: int, rollout_modes: tuple[int, ...] = ()) -> tuple[float, list]:
    cfg = SimConfig(preset="one_step", gpus=args.gpus, steps=args.steps, seed=seed, plots=False,
                    enable=("balance", "global_sync", "dispatch"),
                    cluster=ClusterSpec(model=args.model, gpu="h800", train_gpus=args.gpus // 2,
                                        rollout_tp=tp, tp_comm=True, rollout_modes=rollout_modes,
                                        replan_s=REPLAN_S, switch_s=SWITCH_S),
                    workload=workload(args.len_max, args.groups))
    sim = Simulation(cfg)
    summary = sim.run()
    switches = [(round(e["t"]), e["tp_to"]) for e in sim.timeline if e.get("event") == "reconfigure"]
    return summary["trained_seq_tokens_per_s"], switches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--len-max", type=int, default=25 * 1024)
    args = ap.parse_args()
    fits = {m.tp for m in modes(args.model, args.len_max)
            if m.kv_capacity > args.len_max + workload(args.len_max, 1).prompt_len}
    rows = [(f"fixed TP {tp}", tp, ()) for tp in FIXED if tp in fits]
    rows += [(f"modes {'/'.join(map(str, ms))}, from TP {tp}", tp, ms) for ms, tp in SWITCHING
             if set(ms) <= fits]
    results = {name: [run(args, seed, tp, ms) for seed in args.seeds] for name, tp, ms in rows}
    best = [max(results[name][i][0] for name, _, ms in rows if not ms) for i in range(len(args.seeds))]
    print(f"{args.model}, {args.gpus} GPUs, {args.groups} prompts x 8 a step, {args.steps} steps, "
          f"seeds {args.seeds}")
    print(f"{'deployment':<26} {'tokens/s median (min-max)':>30} {'x best fixed':>22}  switches (s, to TP)")
    for name, _, _ in rows:
        tps = [r[0] for r in results[name]]
        ratio = [t / b for t, b in zip(tps, best)]
        print(f"{name:<26} {statistics.median(tps):>12,.0f} ({min(tps):,.0f}-{max(tps):,.0f})"
              f" {statistics.median(ratio):>10.3f} ({min(ratio):.3f}-{max(ratio):.3f})"
              f"  {[r[1][:4] for r in results[name]]}")


if __name__ == "__main__":
    main()
