"""End-to-end RL throughput of every preset on one long-tailed workload, side by side.

    python -m lab.benchmarks.presets [--steps 8] [--servers 2] [--presets sync,fnrl] [--seeds 0,1]
                                 [--len-dist natural | lognormal --len-median 16 --len-sigma 1]
                                 [--max-cells N | --profile-decode] [--out DIR]

The benchmark is the ablation file lab/benchmarks/ablations/presets.yaml run by
lab.ablation.ablate; this script lays its flags over the file and prints the
table. Each preset runs the real job (fnrl.experiments.math_grpo: vLLM servers, relays,
trainer process, the controller) for the same steps on the same model, task, seed and
workload, in its own process, once per seed; the seeds are rounds, each running the
presets in its own order (the file's `order`), and the ratios to `sync` are taken round
by round with their median and range. Resumable: a finished cell is not run again
(`--max-cells` runs a piece).

Trained tokens per second: tokens in consumed batches over the loop's RL time (wall
time less evaluations). Server start-up and trainer initialisation are outside it, and
the train step is compiled for every length bucket into JAX's persistent cache before
the first cell, so no preset's first step in a bucket pays a compile later ones load.

Workload (`--len-dist natural`, the default): the main job's own, each response ending
at its EOS, long-tailed by nature (a median near 50 tokens, a p99 above 250).
`--len-dist lognormal|pareto` forces every response's length (`ignore_eos`) to a
per-trajectory draw, the same for the same trajectory id in every preset
(fnrl.control.workload).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from fnrl.config.files import merge, nest
from lab.ablation.ablate import pinned, raise_system_exit, run_ablation
from lab.ablation.grid import cell_finished, expand, read_spec
from lab.ablation.report import write_report
from fnrl.config.presets import PRESETS
from lab.repro.replay_data import DECODE_PROFILES as PROFILES

SPEC = Path(__file__).resolve().parent / "ablations" / "presets.yaml"


def run_profiled_rounds(spec) -> dict[str, str]:
    """The rounds one at a time in the file's order, each after a profile of the decode
    of its servers, started as its cells start them and sent batches side by side
    (fnrl.experiments.profile_cost --servers N): the machine's speed drifts by tens of
    per cent between sessions, and a profile taken in the same round says what its
    cells ran at. A round's profile is kept on resume; a failed cell ends the run."""
    from lab.ablation.ablate import cell_config
    from fnrl.experiments.math_grpo import context_len, resolve_model_dir
    from fnrl.experiments.profile_cost import ProfileArgs
    from fnrl.experiments.profile_cost import main as profile

    cells, state = expand(spec), {}
    for r in sorted({c.round for c in cells}):
        todo = [c for c in cells if c.round == r and not cell_finished(spec, c)]
        if not todo:
            continue
        cfg = cell_config(spec, todo[0])
        out = spec.out_dir / PROFILES / f"seed={cfg.seed}.json"
        if not out.exists():
            model_dir = resolve_model_dir(cfg)      # the pinned model, as its cells run it
            print(f"round {r} (seed {cfg.seed}): profiling the decode of "
                  f"{cfg.rollout.num_servers} servers side by side", flush=True)
            profile(ProfileArgs(model_dir=str(model_dir), servers=cfg.rollout.num_servers,
                                max_context=context_len(cfg, model_dir),
                                max_num_seqs=cfg.rollout.max_num_seqs,
                                kv_memory_fraction=cfg.rollout.kv_memory_fraction,
                                repeats=3, out=str(out)))
        state = run_ablation(spec, max_cells=len(todo))
        if any(v.startswith("failed") for v in state.values()):
            break
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--groups", type=int, default=None, help="groups per step (8 samples each)")
    parser.add_argument("--servers", type=int, default=None)
    parser.add_argument("--num-eval", type=int, default=None)
    parser.add_argument("--len-dist", choices=("natural", "lognormal", "pareto"), default=None,
                        help="natural: each response ends at its EOS; else forced lengths")
    parser.add_argument("--len-median", type=float, default=None)
    parser.add_argument("--len-sigma", type=float, default=None,
                        help="lognormal: σ of log-length; pareto: shape α (smaller: heavier)")
    parser.add_argument("--len-max", type=int, default=None, help="forced lengths' cap")
    parser.add_argument("--cost-file", default=None,
                        help="fitted cost model for every preset ('auto': the model directory's)")
    parser.add_argument("--presets", default=None, help="comma-separated (default: the file's)")
    parser.add_argument("--seeds", default=None, help="comma-separated (default: the file's)")
    parser.add_argument("--max-cells", type=int, default=None)
    parser.add_argument("--out", default=None, help="output directory (default: the file's)")
    parser.add_argument("--profile-decode", action="store_true",
                        help="before each round, profile the servers' decode as the job runs "
                             f"them, side by side, into OUT/{PROFILES}/seed=S.json (the "
                             "replay's per-round served decode: lab.repro.replay)")
    args = parser.parse_args()
    spec = read_spec(SPEC)
    flags = {"steps": args.steps, "algo.groups_per_step": args.groups,
             "rollout.queued_groups": args.groups, "rollout.num_servers": args.servers,
             "task.num_eval": args.num_eval, "rollout.response_len": args.len_dist,
             "rollout.len_median": args.len_median, "rollout.len_sigma": args.len_sigma,
             "rollout.len_max": args.len_max, "coord.cost_file": args.cost_file}
    grid = dict(spec.grid)
    if args.presets:
        grid["preset"] = tuple(args.presets.split(","))
        unknown = [n for n in grid["preset"] if n not in PRESETS]
        if unknown:
            parser.error(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
    if args.seeds:
        grid["seed"] = tuple(int(s) for s in args.seeds.split(","))
    base = merge(spec.base, nest({k: v for k, v in flags.items() if v is not None}))
    # Ratios stay to sync while sync runs; else to the first preset listed.
    reference = tuple((p, v) for p, v in spec.reference if v in grid.get(p, ()))
    spec = dataclasses.replace(spec, base=base, grid=tuple(grid.items()), reference=reference,
                               output=args.out or spec.output)
    signal.signal(signal.SIGTERM, raise_system_exit)   # a running cell stops with its roles
    spec = pinned(spec)
    if args.profile_decode:
        if args.max_cells is not None:
            parser.error("--profile-decode runs whole rounds: drop --max-cells")
        state = run_profiled_rounds(spec)
    else:
        state = run_ablation(spec, max_cells=args.max_cells)
    write_report(spec, expand(spec))
    print((spec.out_dir / "ablation.md").read_text())
    return 1 if any(s.startswith("failed") for s in state.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
