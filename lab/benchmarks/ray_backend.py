"""The Ray backend beside the local one: start-up time, the trainer's publish stall and
the rollouts' pull time, side by side in rounds of one invocation.

    python -m lab.benchmarks.ray_backend                 # 6 rounds of 16 steps, 2 rollouts
    python -m lab.benchmarks.ray_backend --rounds 3 --steps 6

Each round runs the main job (small model, real vLLM, relays, trainer) once per backend,
in the order `round_orders` gives:
  local   every role a child process of the controller, three relays in a chain
          (`--relay.num-relays 3`, as many as the Ray run has: one per node);
  ray     fnrl.experiments.ray_local: a three-node Ray cluster on this machine (trainer
          on a, rollouts on b and c, a relay on each node), confined to loopback.
Start-up is from the job's start (for Ray: once its cluster is up, which a real cluster
already is) to the loop's first observation (the run's attempts.jsonl); the stall is
the median `time/publish_s` of the run's steps; the pull is the median of the rollouts'
`fnrl_pull ... in X ms` lines. Ratios are ray / local within a round.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fnrl.control.metrics import read_jsonl

from lab.benchmarks.rounds import Spread, environment, load, round_orders

SMALL = ["--warm-start.steps", "20", "--model.hidden-size", "64", "--model.intermediate-size",
         "128", "--model.num-hidden-layers", "2", "--model.num-attention-heads", "2",
         "--model.num-key-value-heads", "1", "--model.max-position-embeddings", "128",
         "--algo.max-new-tokens", "96", "--algo.groups-per-step", "4",
         "--rollout.queued-groups", "4", "--rollout.num-servers", "2", "--eval.server", "off"]


def run_once(backend: str, run_dir: Path, steps: int, cache_dir: str) -> dict:
    """One job on `backend`; its start-up seconds, median stall and median pull (ms)."""
    job = ["--steps", str(steps), "--run-dir", str(run_dir), "--warm-start.cache-dir",
           cache_dir, *SMALL]
    if backend == "local":
        argv = [sys.executable, "-m", "fnrl.experiments.math_grpo", "--relay.num-relays", "3",
                *job]
    else:
        argv = [sys.executable, "-m", "fnrl.experiments.ray_local", "--nodes", "a,b,c", "--",
                *job]
    started = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    up = re.search(r"cluster up at epoch ([\d.]+)", proc.stdout)
    origin = float(up.group(1)) if up else started
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    loop_start = next(a["epoch"] for a in attempts if a["event"] == "start")
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    pulls = [float(ms) for log in sorted((run_dir / "logs").glob("rollout*.log"))
             for ms in re.findall(r"fnrl_pull: version \d+ from relay \S+ in ([\d.]+) ms",
                                  log.read_text())]
    return {"startup_s": loop_start - origin,
            "stall_s": statistics.median(r["time/publish_s"] for r in train),
            "pull_ms": statistics.median(pulls) if pulls else float("nan"),
            "cluster_s": origin - started if up else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16,
                        help="steps a run; the stall and pull are medians over them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    print(environment(), flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="fnrl-ray-bench-"))
    cache = str(out / "model_cache")
    # Untimed: builds the warm-started model cache (and the compilation cache), which
    # the first timed run would otherwise pay alone.
    run_once("local", out / "warm-up", 1, cache)
    results: dict[str, list[dict]] = {"local": [], "ray": []}
    for r, order in enumerate(round_orders(("local", "ray"), args.rounds, args.seed)):
        print(f"round {r}: {' then '.join(order)}; load {load()}", flush=True)
        for backend in order:
            res = run_once(backend, out / f"r{r}-{backend}", args.steps, cache)
            results[backend].append(res)
            print(f"  {backend:5s} start-up {res['startup_s']:.1f} s"
                  + (f" (cluster up in {res['cluster_s']:.1f} s before)" if res["cluster_s"]
                     else "")
                  + f", stall {res['stall_s'] * 1e3:.1f} ms, pull {res['pull_ms']:.1f} ms",
                  flush=True)
        print(f"  load at end {load()}", flush=True)
    for key, name in (("startup_s", "start-up"), ("stall_s", "publish stall"),
                      ("pull_ms", "pull")):
        ratios = [ray[key] / local[key] for ray, local in zip(results["ray"], results["local"])]
        print(f"{name} ray / local: {Spread.of(ratios).line()}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
