"""The presets benchmark's measured runs, as the replay's input (issue 13).

    python -m lab.repro.replay_data RUN_ROOT [--out lab/repro/presets_measured.json]

RUN_ROOT is the output of `lab/benchmarks/presets.py --out RUN_ROOT` (one run directory per
preset and round), or of another ablation over its setup (lab/benchmarks/ablations/
trainer_threads.yaml: a cell whose trainer ran on N CPU threads, `trainer.cpu_threads`,
is keyed "PRESET@Nthread"). Each cell's record keeps what the simulator needs to replay it and
what it is compared with, all read from the run's own logs:

- `trained_tokens_per_s`, `rl_wall_s`, idle shares: summary.json (the loop's figures);
- `train_call_s`: each train step's call, trainer round trip included (metrics.jsonl,
  the step-to-step difference of `time/train_call_s`), and `train_s`, the trainer's own
  step inside it; `publish_s` per step; `batch_length`, each step's length bucket (the
  padded row length its jitted step was compiled for);
- `pull_s`: the run's pull time over its pulls;
- `groups`: each consumed group's response lengths in tokens, by group index (the
  problem's `train-N`), and `prompt_len` per group (trajectories.jsonl).
- `coord_cost`: the decode cost model its coordinator planned with (config.json's
  `coord.cost`: the defaults, or the profile `--coord.cost-file` loaded).

With `lab/benchmarks/presets.py --profile-decode` each round's decode profile
(RUN_ROOT/decode_profiles/seed=S.json, profile_cost's JSON) is kept too, under `decode`.

The record is committed (PRESETS_MEASURED), so the replay runs without the run
directories; run this module again after a new benchmark to replace it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fnrl.control.metrics import generated_length, read_jsonl

PRESETS_MEASURED = Path(__file__).resolve().parent / "presets_measured.json"
THREADS_MEASURED = Path(__file__).resolve().parent / "trainer_threads_measured.json"
# lab/benchmarks/presets.py --profile-decode: rounds each after a profile of its servers
PRESETS_PROFILED = Path(__file__).resolve().parent / "presets_profiled_measured.json"
DECODE_PROFILES = "decode_profiles"   # RUN_ROOT/decode_profiles/seed=S.json, one a round
COST_KEYS = ("k1", "k2", "k3", "k4", "k5")
PROFILE_KEYS = (*COST_KEYS, "per_request_s", "prefill_s_per_token",
                "engine", "fit", "heldout")


def cell_record(run_dir: Path) -> dict:
    """One measured cell (a preset in one round) from its finished run directory."""
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    if len(steps) != config["steps"]:
        raise ValueError(f"{run_dir}: {len(steps)} train records for {config['steps']} steps")
    calls = [r["time/train_call_s"] for r in steps]
    groups, prompts = {}, {}
    for line in read_jsonl(run_dir / "trajectories.jsonl"):
        index = int(line["group"].rsplit("-", 1)[1])
        members = line["trajectories"]
        groups[index] = [generated_length(t) for t in members]
        prompts[index] = len(members[0]["prompt_ids"])
    last = steps[-1]
    threads = config.get("trainer", {}).get("cpu_threads", 0)
    return {
        "preset": config["preset"] + (f"@{threads}thread" if threads else ""),
        "trainer_threads": threads, "round": config["seed"], "steps": config["steps"],
        "trained_tokens_per_s": summary["trained_tokens_per_s"],
        "rl_wall_s": summary["rl_wall_s"], "trained_tokens": summary["trained_tokens"],
        "trainer_idle_frac": summary["trainer_idle_frac"],
        "rollout_idle_frac": summary["rollout_idle_frac"],
        "interrupted": summary["interrupted"], "reprefill_tokens": summary["reprefill_tokens"],
        "train_call_s": [b - a for a, b in zip([0.0] + calls[:-1], calls)],
        "train_s": [r["time/train_s"] for r in steps],
        "publish_s": [r["time/publish_s"] for r in steps],
        "batch_length": [int(r["batch_length"]) for r in steps],
        "pull_s": last["time/pull_s"] / max(last["pulls"], 1),
        "groups": {str(k): groups[k] for k in sorted(groups)},
        "prompt_len": {str(k): prompts[k] for k in sorted(prompts)},
        "coord_cost": {k: config["coord"]["cost"][k] for k in COST_KEYS},
    }


def extract(root: Path, log=print) -> dict:
    """Every finished cell under `root`, keyed "preset/round" (unfinished ones are named
    and left out)."""
    cells = {}
    for run_dir in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        if not (run_dir / "summary.json").exists():
            log(f"left out {run_dir.name}: no summary.json (the cell did not finish)")
            continue
        record = cell_record(run_dir)
        cells[f"{record['preset']}/{record['round']}"] = record
    if not cells:
        raise ValueError(f"{root}: no finished run directories under it")
    data = {"source": f"the run directories of {root.name}", "cells": cells}
    # The decode profiled before each round (lab/benchmarks/presets.py --profile-decode).
    profiles = {int(path.stem.split("=")[1]): json.loads(path.read_text())
                for path in sorted((root / DECODE_PROFILES).glob("seed=*.json"))}
    if profiles:
        measured = rounds(data)
        missing = sorted(set(measured) - set(profiles))
        if missing:
            raise ValueError(f"{root / DECODE_PROFILES}: no profile for rounds {missing}")
        data["decode"] = {str(r): {k: profiles[r][k] for k in PROFILE_KEYS if k in profiles[r]}
                          for r in measured}
    return data


def load(path: Path = PRESETS_MEASURED) -> dict:
    return json.loads(path.read_text())


def ratios_to(data: dict, preset: str, reference: str = "sync") -> list[float]:
    """`preset`'s measured throughput over the reference's, round by round."""
    cells = data["cells"]
    return [cells[f"{preset}/{r}"]["trained_tokens_per_s"]
            / cells[f"{reference}/{r}"]["trained_tokens_per_s"]
            for r in rounds(data) if f"{preset}/{r}" in cells and f"{reference}/{r}" in cells]


def rounds(data: dict) -> list[int]:
    return sorted({c["round"] for c in data["cells"].values()})


def median_of(data: dict, preset: str, key: str) -> float:
    """The median over `preset`'s rounds of a per-step figure's mean (or a scalar's value)."""
    values = []
    for cell in data["cells"].values():
        if cell["preset"] == preset:
            v = cell[key]
            values.append(statistics.fmean(v) if isinstance(v, list) else v)
    return statistics.median(values)


def bucket_calls(data: dict, preset: str) -> tuple[tuple[int, float, float], ...]:
    """(length bucket, steady call, first call) for each bucket `preset` trained: the mean
    over its rounds of the call of a step whose bucket the process had trained before
    (steady), and of one it had not (first: the step's executable is loaded from the
    compilation cache, and its first run allocates), the first at least the steady. A
    bucket only ever trained first takes the nearest shorter bucket's steady call, scaled
    by length."""
    steady, first = {}, {}
    for cell in data["cells"].values():
        if cell["preset"] != preset:
            continue
        seen = set()
        for length, call in zip(cell["batch_length"], cell["train_call_s"]):
            (first if length not in seen else steady).setdefault(length, []).append(call)
            seen.add(length)
    out = []
    for length in sorted(first):
        if length in steady:
            s = statistics.fmean(steady[length])
        else:
            shorter = max((b for b in steady if b < length), default=min(steady))
            s = statistics.fmean(steady[shorter]) * length / shorter
        out.append((length, s, max(s, statistics.fmean(first[length]))))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path, default=PRESETS_MEASURED)
    args = parser.parse_args(argv)
    data = extract(args.root)
    args.out.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    presets = sorted({c["preset"] for c in data["cells"].values()})
    for p in presets:
        print(f"{p:16s} {median_of(data, p, 'trained_tokens_per_s'):8.1f} tok/s  "
              f"train call {median_of(data, p, 'train_call_s'):.2f} s  "
              f"x sync {[round(x, 2) for x in ratios_to(data, p)]}")
    print(f"wrote {args.out} ({len(data['cells'])} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
