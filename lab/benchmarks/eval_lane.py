"""Does the eval lane make the trainer wait? The main job with held-out evaluation on its
dedicated server against evaluation off, in rounds (issue 15: "trainer idle unchanged
within noise against evaluation off").

    python -m lab.benchmarks.eval_lane --out DIR                   # 6 rounds of both sides
    python -m lab.benchmarks.eval_lane --out DIR --only 1          # round 1 only, then
    python -m lab.benchmarks.eval_lane --out DIR --only 2          # round 2; the report covers
                                                               # every round found in DIR

Every run is `python -m fnrl.experiments.math_grpo --steps 20 --eval.every 5
--trainer.checkpoint-keep 30 --eval.server dedicated|off` (plus anything after `--`), the
same job seed in every run. Method (lab/benchmarks/rounds.py): each round runs both sides once,
in an order that alternates within every pair of rounds; per side, the trainer's idle
share (summary.json's `trainer_idle_frac`) is printed per run with its median and spread
over rounds, and per round the difference dedicated − off. `--only` runs some rounds of
the same seeded order and leaves the rest, so a shared machine's lock can be released
between rounds; a run already in DIR is not run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from fnrl.control.metrics import read_jsonl

from lab.benchmarks.rounds import Spread, environment, load, round_orders

SIDES = ("dedicated", "off")
JOB = ["--steps", "20", "--eval.every", "5", "--trainer.checkpoint-keep", "30"]


def run_side(side: str, run_dir: Path, extra: list[str]) -> dict:
    """One run of the main job with `--eval.server side` in run_dir; its figures."""
    if not (run_dir / "result.json").exists():
        cmd = [sys.executable, "-m", "fnrl.experiments.math_grpo", "--run-dir", str(run_dir),
               *JOB, "--eval.server", side, *extra]
        print(f"[{run_dir.name}] {' '.join(cmd[1:])}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(run_dir.with_suffix(".log"), "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = run_dir.with_suffix(".log").read_text()[-3000:]
            raise SystemExit(f"[{run_dir.name}] failed with code {proc.returncode}:\n{tail}")
        summary = json.loads((run_dir / "summary.json").read_text())
        evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
        result = {"side": side, "elapsed_s": time.perf_counter() - t0,
                  "trainer_idle_frac": summary["trainer_idle_frac"],
                  "rl_wall_s": summary.get("rl_wall_s"),
                  "trained_tok_s": summary.get("trained_tokens_per_s"),
                  "evals_skipped": summary.get("evals_skipped", 0),
                  "versions_evaluated": sorted(int(r["version"]) for r in evals)}
        # Written last: a run killed part-way is run again, not reported.
        (run_dir / "result.json").write_text(json.dumps(result))
    return json.loads((run_dir / "result.json").read_text())


def report(out: Path, rounds: int) -> None:
    """Every finished run in out, per side and per round."""
    done = {}
    for r in range(1, rounds + 1):
        for side in SIDES:
            path = out / f"round{r}-{side}" / "result.json"
            if path.exists():
                done[(r, side)] = json.loads(path.read_text())
    print(f"\n{'run':<22}{'trainer idle':>14}{'loop wall s':>13}{'trained tok/s':>15}"
          f"  versions evaluated (skipped)")
    for (r, side), x in sorted(done.items()):
        print(f"{f'round {r} {side}':<22}{x['trainer_idle_frac']:>14.3f}{x['rl_wall_s']:>13.0f}"
              f"{x['trained_tok_s']:>15.0f}  {x['versions_evaluated'] or 'none'} "
              f"({x['evals_skipped']})")
    for side in SIDES:
        idle = [x["trainer_idle_frac"] for (_, s), x in sorted(done.items()) if s == side]
        if idle:
            print(f"trainer idle, {side}: {Spread.of(idle).line('.3f')}")
    paired = [r for r in range(1, rounds + 1) if all((r, s) in done for s in SIDES)]
    if paired:
        diff = Spread.of([done[(r, "dedicated")]["trainer_idle_frac"]
                          - done[(r, "off")]["trainer_idle_frac"] for r in paired])
        print(f"trainer idle, dedicated - off in the same round: {diff.line('+.3f')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory of the runs (kept for re-reporting)")
    p.add_argument("--rounds", type=int, default=6, help="rounds of both sides, order varying")
    p.add_argument("--only", type=int, nargs="*", default=None,
                   help="run only these rounds (1-based) of the order; default all")
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' side order")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for every run")
    a = p.parse_args()
    extra = a.extra[1:] if a.extra[:1] == ["--"] else a.extra
    only = set(a.only or range(1, a.rounds + 1))
    if not only <= set(range(1, a.rounds + 1)):
        raise SystemExit(f"--only {sorted(only)}: rounds are 1..{a.rounds}")
    out = Path(a.out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    print(environment())
    for r, order in enumerate(round_orders(SIDES, a.rounds, seed=a.seed), start=1):
        if r not in only:
            continue
        start = load()
        for side in order:
            run_side(side, out / f"round{r}-{side}", extra)
        print(f"round {r}/{a.rounds} ({' > '.join(order)}): load {start} at start, {load()} "
              f"at end", flush=True)
    report(out, a.rounds)


if __name__ == "__main__":
    main()
