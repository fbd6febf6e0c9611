"""End-to-end RL throughput of every preset on one long-tailed workload, side by side.

    python benchmarks/presets.py [--steps 8] [--servers 2] [--presets sync,fnrl]
                                 [--len-dist natural | lognormal --len-median 16 --len-sigma 1]

Each preset runs the real job (fnrl.experiments.math_grpo: vLLM servers, relay, trainer
process, the controller) for the same number of steps on the same model, task, seed
and workload, one after the other, and the table reports trained tokens per second
(tokens in consumed batches over the time from the first cycle to the last step's
return, evaluations excluded) with its ratio to `sync`.

Workload (`--len-dist natural`, the default): the main job's own, the embedded model
(the same cached warm start) writing worked solutions of the reasoning task
(fnrl.data.arith); each response ends at its EOS, and the lengths are long-tailed by
nature (a median near 50 tokens, a p99 above 250), so a synchronous batch waits for its
slowest few while most of the rollout capacity idles. The table's header gives the
median and p99 of the trained responses. `--len-dist lognormal|pareto` instead forces
every response's length (`ignore_eos`) to a per-trajectory draw, the same for the same
trajectory id in every preset (fnrl.control.workload), and grades the text before the
first EOS.

Fairness: server start-up and trainer initialisation are outside the measured window.
The trainer's jitted step is compiled before the first preset, for every length bucket
a batch can take, into JAX's persistent compilation cache (the trainer processes
inherit its directory), so no preset's first step in a bucket pays the compile while
later presets load it (warming the longest bucket alone once cost `sync` an 8.5 s
compile of the 64-token bucket inside its measured window).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fnrl.config import CoordinatorConfig, RolloutConfig, RunConfig, save_json
from fnrl.control.metrics import length_stats, response_lengths
from fnrl.experiments.presets import PRESETS, apply_preset

ORDER = ("sync", "one_step", "partial_rollout", "laminar", "staleflow", "fnrl")


def base_config(args) -> RunConfig:
    """The main job's defaults (model, warm start, task, algorithm) at the benchmark's
    scale: steps, groups, servers, held-out set and the length workload."""
    default = RunConfig()
    forced = args.len_dist != "natural"
    return RunConfig(
        steps=args.steps, eval_every=10_000, seed=0,
        task=dataclasses.replace(default.task, num_eval=args.num_eval),
        algo=dataclasses.replace(default.algo, groups_per_step=args.groups),
        # 5% of RAM for KV per server (the default 20% is 4.8 GB here): plenty for this
        # model, and two servers plus other jobs on a 24 GB box stay clear of the OOM killer.
        rollout=RolloutConfig(num_servers=args.servers, groups_per_batch=args.groups,
                              kv_memory_fraction=0.05, response_len=args.len_dist,
                              len_median=args.len_median, len_sigma=args.len_sigma,
                              len_max=min(args.len_max, default.algo.max_new_tokens) if forced
                              else RolloutConfig().len_max),
        # Every preset keeps the engine's cost model (fnrl.experiments.presets._coord).
        coord=CoordinatorConfig(cost_file=args.cost_file))


_WARM = """
import json, sys
from pathlib import Path
import numpy as np
from fnrl.config import RunConfig, from_dict
from fnrl.trainer.batching import default_buckets
from fnrl.trainer.role import Trainer
from fnrl.trainer.step import pack_sequences
cfg = from_dict(RunConfig, json.loads(Path(sys.argv[1]).read_text()))
model_dir, run_dir, seq_len = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
trainer = Trainer(cfg, model_dir, run_dir)
rows = cfg.algo.groups_per_step * cfg.algo.group_size
for width in cfg.trainer.length_buckets or default_buckets(seq_len):
    arrays = pack_sequences([(2, 5, 6)] * rows, [(5, 1)] * rows, width, 0)
    arrays["behaviour_logp_BxT"] = np.zeros((rows, width), np.float32)
    arrays["adv_B"] = np.zeros(rows, np.float32)
    trainer.train(arrays)
"""


def warm_compile_cache(cfg: RunConfig, model_dir: Path) -> float:
    """Compiles the train step for this config, every length bucket, into the
    persistent cache."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        save_json(cfg, Path(tmp) / "config.json")
        subprocess.run([sys.executable, "-c", _WARM, str(Path(tmp) / "config.json"),
                        str(model_dir), tmp, str(cfg.model.max_position_embeddings)],
                       check=True, capture_output=True)
    return time.perf_counter() - t0


def staleness_stats(run_dir: Path) -> tuple[float, int]:
    hist = np.zeros(1)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            h = np.asarray(r["staleness_hist"], float)
            hist = np.pad(hist, (0, max(0, len(h) - len(hist))))
            hist[:len(h)] += h
    ks = np.arange(len(hist))
    return float((ks * hist).sum() / max(hist.sum(), 1)), int(ks[hist > 0].max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="groups per step (8 samples each)")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--len-dist", choices=("natural", "lognormal", "pareto"),
                        default="natural", help="natural: each response ends at its EOS; "
                        "else forced lengths from this distribution")
    parser.add_argument("--len-median", type=float, default=16.0)
    parser.add_argument("--len-sigma", type=float, default=1.0,
                        help="lognormal: σ of log-length; pareto: shape α (smaller: heavier)")
    parser.add_argument("--len-max", type=int, default=96, help="forced lengths' cap")
    parser.add_argument("--cost-file", default="",
                        help="fitted cost model for every preset (fnrl.experiments.profile_cost; "
                             "'auto': the model directory's)")
    parser.add_argument("--presets", default=",".join(ORDER))
    parser.add_argument("--out", default=f"runs/bench_presets-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    names = args.presets.split(",")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path("~/.cache/fnrl/jax").expanduser()))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    from fnrl.experiments.math_grpo import resolve_model_dir, run

    # The main job's warm-started model, cached under the default task's recipe (a
    # smaller --num-eval takes a prefix of the same held-out set, so it stays held out).
    model_dir = resolve_model_dir(RunConfig())
    base = base_config(args)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model,
                                                               model_dir=str(model_dir)))
    print(f"train-step compile into the persistent cache: {warm_compile_cache(base, model_dir):.0f}s",
          flush=True)
    results = {}
    t_all = time.perf_counter()
    for name in names:
        cfg = dataclasses.replace(apply_preset(name, base), run_dir=str(out / name))
        t0 = time.perf_counter()
        summary = run(cfg)
        mean_stale, max_stale = staleness_stats(out / name)
        results[name] = {**summary, "staleness_mean": mean_stale, "staleness_max": max_stale,
                         "total_s": time.perf_counter() - t0,
                         **length_stats(response_lengths(out / name))}
        print(f"[{name}] {summary['trained_tokens_per_s']:.1f} trained tokens/s, "
              f"{time.perf_counter() - t0:.0f}s in all", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    ref = results.get("sync", {}).get("trained_tokens_per_s")
    head = (f"{'preset':<16}{'tok/s':>8}{'× sync':>8}{'stale':>7}{'max':>5}{'tr idle':>9}"
            f"{'ro idle':>9}{'KV util':>9}{'repack':>8}{'migr':>6}{'intr':>6}{'reprefill':>10}"
            f"{'tokens':>8}{'acc':>7}")
    lengths = np.concatenate([response_lengths(out / name) for name in results])
    stats = length_stats(lengths)
    workload = (f"forced {args.len_dist} lengths (median {args.len_median:g}, "
                f"{'σ' if args.len_dist == 'lognormal' else 'α'} {args.len_sigma:g}, max "
                f"{base.rollout.len_max})" if args.len_dist != "natural" else "natural lengths")
    print(f"\n{args.steps} steps × {args.groups} groups × {base.algo.group_size} samples, "
          f"{args.servers} vLLM server(s), {workload}: trained responses median "
          f"{stats.get('response_len_median', 0):.0f}, p99 {stats.get('response_len_p99', 0):.0f} "
          f"tokens (p99/median {stats.get('response_len_p99_over_median', 0):.1f}); run dirs "
          f"under {out}")
    print(head)
    for name, r in results.items():
        ratio = r["trained_tokens_per_s"] / ref if ref else float("nan")
        acc = r["last_eval"]["accuracy"] if r["last_eval"] else float("nan")
        print(f"{name:<16}{r['trained_tokens_per_s']:>8.1f}{ratio:>8.2f}{r['staleness_mean']:>7.2f}"
              f"{r['staleness_max']:>5d}{r['trainer_idle_frac']:>9.2f}{r['rollout_idle_frac']:>9.2f}"
              f"{r['kv_util']:>9.1e}{r['repacks']:>8d}{r['migrated']:>6d}{r['interrupted']:>6d}"
              f"{r['reprefill_tokens']:>10d}{r['trained_tokens']:>8d}{100 * acc:>6.1f}%")
    print(f"(whole benchmark: {time.perf_counter() - t_all:.0f}s; columns: staleness mean/max of "
          f"trained tokens; trainer/rollout idle fractions; repack = Migrate commands; migr = "
          f"trajectories moved by them; intr = trajectories interrupted (sync, migration); "
          f"reprefill = context tokens re-prefilled on continuation; acc = held-out greedy "
          f"accuracy after the last step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
