"""Deterministic runs and replay, on real processes (issue 15): with the `sync` preset
and `--deterministic`, two runs of one seed train bit-identical parameters (another seed
does not), and `fnrl.experiments.replay` re-trains a run from its records alone to the
same bits."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main
from fnrl.experiments.replay import compare_runs

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow

STEPS = 3
# A cost per response token: the 20-step warm start rarely answers right, and a batch of
# all-zero rewards trains nothing (every advantage 0), so any two runs would agree.
SIGNAL = ["--task.reward.length-cost", "0.01"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """Three short sync runs: seed 0 twice, seed 1 once; name -> (run dir, seconds)."""
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run_dir = tmp_path_factory.mktemp("replay") / name
        t0 = time.perf_counter()
        assert main(["--preset", "sync", "--deterministic", "--seed", str(seed),
                     "--steps", str(STEPS), "--eval.every", "100", "--run-dir", str(run_dir),
                     "--warm-start.cache-dir", cache_dir, *SMALL, *SIGNAL]) == 0
        out[name] = run_dir, time.perf_counter() - t0
    return out


def test_two_runs_of_one_seed_train_the_same_bits(runs):
    for run_dir, _ in runs.values():   # every step moved the parameters
        train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
        assert len(train) == STEPS and all(r["grad_norm"] > 0 for r in train)
    same = compare_runs(runs["a"][0], runs["b"][0], STEPS)
    assert same and all(d == 0.0 for d in same.values()), {k: d for k, d in same.items() if d}
    # Another seed samples other responses: the check can fail.
    other = compare_runs(runs["a"][0], runs["c"][0], STEPS)
    assert sum(d > 0 for d in other.values()) > len(other) // 2


def test_a_run_replayed_from_its_records_has_the_same_bits(runs):
    run_dir, run_s = runs["a"]
    # In its own process, as the trainer was: the same XLA flags (this session's forced
    # device count, inherited by the run's trainer too) and threads.
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fnrl.experiments.replay", str(run_dir)],
                          capture_output=True, text=True, env=dict(os.environ), timeout=600)
    replay_s = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"version {STEPS}: " in done.stdout and "differ" not in done.stdout
    print(f"run {run_s:.1f}s, replay {replay_s:.1f}s (process included)")
    # One behaviour log-prob changed in the records: the replay no longer matches.
    edited = run_dir.parent / "edited"
    shutil.copytree(run_dir, edited)
    lines = (edited / "trajectories.jsonl").read_text().splitlines()
    # A trajectory with an advantage (its reward off its group's mean), so its tokens
    # weigh in the gradient; a small change keeps the weight π_prox/μ under its cap.
    n, group = next((n, g) for n, g in enumerate(map(json.loads, lines))
                    if len({t["reward"] for t in g["trajectories"]}) > 1)
    mean = sum(t["reward"] for t in group["trajectories"]) / len(group["trajectories"])
    tr = next(t for t in group["trajectories"] if t["reward"] != mean)
    tr["logprobs"][0][0] -= 0.01
    lines[n] = json.dumps(group)
    (edited / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    changed = subprocess.run([sys.executable, "-m", "fnrl.experiments.replay", str(edited)],
                             capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert changed.returncode == 1 and "differ" in changed.stdout, changed.stderr[-3000:]
