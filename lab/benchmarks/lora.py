"""LoRA RL beside full fine-tuning: the main job twice on the same seed, side by side.

    python -m lab.benchmarks.lora                        # default model, 16 steps, rank 8
    python -m lab.benchmarks.lora --steps 30 --rank 16 --rounds 2 -- --preset sync

Each round runs `python -m fnrl.experiments.math_grpo` with full fine-tuning and with
`--trainer.lora.rank R` (the order alternates between rounds), on the same seed and
flags, and prints, per arm:
  held-out greedy accuracy at version 0 and at the last version (the run's evaluations);
  bytes published per version (what the trainer hands the relay: the model, or the
    adapters and their scale);
  the trainer's stall per version after its step: the weights' conversion
    (`time/weights_s`), the checkpoint save (`time/checkpoint_s`, which includes it), and
    the hand-off to the relay (`time/publish_s`);
  a rollout's pull per version: the worker's load (`fnrl_pull ... in X ms` in its log: for
    LoRA the merge into the base and the load) and the controller's whole pull
    (`time/pull_s`, the RPC, the relay and the prefix-cache reset included);
  the trainer step (`time/train_s`) and the trainer process group's peak RSS (sampled
    twice a second, as lab/benchmarks/real_model.py does).
Medians over the versions of all rounds. LoRA's learning rate is `--lr-scale` times the
full run's: LoRA's best rate is about 10x full fine-tuning's (Schulman et al., "LoRA
Without Regret", 2025); this fills the issue's "same seed" with each arm at its own
rate. `--out FILE` also writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from lab.benchmarks.real_model import GIB, planned_peaks, run_sampled

from fnrl.config import AlgoConfig

PULL_LINE = re.compile(r"fnrl_pull: version (\d+) from relay \S+ in ([0-9.]+) ms")


def run_arm(name: str, argv: list[str], run_dir: Path) -> dict:
    """One main-job run; its figures from the run directory and the sampler."""
    t0 = time.perf_counter()
    code, sampler = run_sampled([sys.executable, "-m", "fnrl.experiments.math_grpo", *argv,
                                 "--run-dir", str(run_dir)], run_dir)
    if code != 0:
        raise SystemExit(f"{name}: the main job exited with {code} (run dir {run_dir})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = sorted((r["step"], r["accuracy"]) for r in records if r["kind"] == "eval")
    pulls = [float(m.group(2)) for m in PULL_LINE.finditer(
        (run_dir / "logs" / "rollout0.log").read_text(errors="replace"))
        if int(m.group(1)) > 0]   # version 0 at start is the same for both arms
    trainer = [peak for role, peak in sampler.peak.items() if role.startswith("trainer")]
    return {"arm": name, "wall_s": time.perf_counter() - t0,
            "accuracy_first": evals[0][1], "accuracy_last": evals[-1][1],
            "last_version": evals[-1][0],
            "publish_bytes": [r["publish_bytes"] for r in train if "publish_bytes" in r],
            "weights_s": [r["time/weights_s"] for r in train if "time/weights_s" in r],
            "checkpoint_s": [r["time/checkpoint_s"] for r in train if "time/checkpoint_s" in r],
            "publish_s": [r["time/publish_s"] for r in train if "time/publish_s" in r],
            "pull_s": [r["time/pull_s"] for r in train if "time/pull_s" in r],
            "worker_load_ms": pulls,
            "train_s": [r["time/train_s"] for r in train[1:]],   # the first compiles
            "trainer_peak_rss_bytes": max(trainer) if trainer else None,
            "peak_rss_bytes": dict(sampler.peak), "private_peak_bytes": dict(sampler.private_peak),
            "planned_gib": planned_peaks(run_dir / "memory_plan.txt")}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr-scale", type=float, default=10.0,
                        help="LoRA's learning rate over the full run's")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more flags for both runs (after --)")
    args = parser.parse_args()
    lr = AlgoConfig().learning_rate
    for i, flag in enumerate(args.extra[:-1]):
        if flag == "--algo.learning-rate":
            lr = float(args.extra[i + 1])
    common = ["--steps", str(args.steps), "--eval.every", str(args.steps), "--seed",
              str(args.seed), "--no-resume", *args.extra]
    arms = {"full": common,
            f"lora r{args.rank}": [*common, "--trainer.lora.rank", str(args.rank),
                                   "--trainer.lora.alpha", str(args.alpha),
                                   "--algo.learning-rate", str(lr * args.lr_scale)]}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="fnrl-lora-bench-") as work:
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                results[name].append(run_arm(name, arms[name],
                                             Path(work) / f"{name.replace(' ', '_')}-{r}"))
    rows = []
    for name, runs in results.items():
        pool = lambda key: [x for run in runs for x in run[key]]  # noqa: E731
        rows.append({"arm": name,
                     "accuracy": [(run["accuracy_first"], run["accuracy_last"]) for run in runs],
                     "publish_mb": _median(pool("publish_bytes")) / 2**20,
                     "weights_ms": 1e3 * _median(pool("weights_s")),
                     "checkpoint_ms": 1e3 * _median(pool("checkpoint_s")),
                     "publish_ms": 1e3 * _median(pool("publish_s")),
                     "worker_load_ms": _median(pool("worker_load_ms")),
                     "pull_ms": 1e3 * _median(pool("pull_s")),
                     "train_s": _median(pool("train_s")),
                     "trainer_peak_gib": max(run["trainer_peak_rss_bytes"] or 0
                                             for run in runs) / GIB})
    print(f"\n{'':<10}{'accuracy v0 -> last':>22}{'MB/version':>11}{'weights':>9}"
          f"{'ckpt':>8}{'publish':>9}{'load':>8}{'pull':>8}{'step':>8}{'trainer':>9}")
    print(f"{'':<10}{'':>22}{'':>11}{'ms':>9}{'ms':>8}{'ms':>9}{'ms':>8}{'ms':>8}{'s':>8}"
          f"{'GiB':>9}")
    for row in rows:
        acc = ", ".join(f"{100 * a:.1f}% -> {100 * b:.1f}%" for a, b in row["accuracy"])
        print(f"{row['arm']:<10}{acc:>22}{row['publish_mb']:>11.3f}{row['weights_ms']:>9.1f}"
              f"{row['checkpoint_ms']:>8.1f}{row['publish_ms']:>9.1f}{row['worker_load_ms']:>8.1f}"
              f"{row['pull_ms']:>8.1f}{row['train_s']:>8.2f}{row['trainer_peak_gib']:>9.2f}")
    full, lora = rows
    print(f"\nLoRA / full: bytes per version {lora['publish_mb'] / full['publish_mb']:.3f}, "
          f"checkpoint+publish stall {(lora['checkpoint_ms'] + lora['publish_ms']) / (full['checkpoint_ms'] + full['publish_ms']):.2f}, "
          f"worker load {lora['worker_load_ms'] / full['worker_load_ms']:.2f}, "
          f"trainer peak RSS {lora['trainer_peak_gib'] / full['trainer_peak_gib']:.2f}")
    # Every role's peak beside the memory plan the job printed (each arm's last run).
    for name, runs in results.items():
        run = runs[-1]
        print(f"\n{name}: {'role':<12}{'plan GiB':>10}{'peak RSS':>10}{'private':>10}")
        for role, peak in sorted(run["peak_rss_bytes"].items()):
            plan = run["planned_gib"].get(role.replace("rollout", "server"), float("nan"))
            print(f"{'':<{len(name) + 2}}{role:<12}{plan:>10.2f}{peak / GIB:>10.2f}"
                  f"{run['private_peak_bytes'][role] / GIB:>10.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
