"""The eval lane end to end: a real evaluation server loads exactly the versions due
from the real relay while the job trains, and a stop-the-world re-evaluation of the
run's checkpoints gives the same records."""

import json
import re

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments import evaluate
from fnrl.experiments.math_grpo import main

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow


def test_dedicated_lane_scores_pinned_versions_and_matches_stop_the_world(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    assert main(["--steps", "5", "--eval.every", "2", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, "--trainer.checkpoint-keep", "10",
                 "--eval.samples", "2", *SMALL, "--eval.server", "dedicated"]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    evals = [r for r in records if r["kind"] == "eval"]
    # Version 0, every 2nd version while training, and the last one.
    assert [r["version"] for r in evals] == [r["step"] for r in evals] == [0, 2, 4, 5]
    for r in evals:
        tokens = sum(train[v]["tokens"] for v in range(1, r["version"] + 1))
        assert r["trained_tokens"] == tokens
        assert r["lane"] == "dedicated" and r["num_problems"] == 16
        assert {"accuracy", "pass@1", "pass@2", "mean@2"} <= set(r)
    # The evaluation server loaded exactly those versions, each once, from the relay.
    log = (run_dir / "logs" / "eval.log").read_text()
    assert [int(v) for v in re.findall(r"fnrl_pull: version (\d+)", log)] == [0, 2, 4, 5]
    # No rollout evaluated, so no rollout's pull waited on an evaluation.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_server"] == "dedicated" and summary["evals_skipped"] == 0
    assert summary["evaluated_versions"] == [0, 2, 4, 5]
    # The same checkpoints, evaluated with nothing else running, give the same scores.
    assert evaluate.main([str(run_dir)]) == 0
    compared = json.loads((run_dir / "eval_compare.json").read_text())
    assert [row["version"] for row in compared["versions"]] == [0, 2, 4, 5]
    assert compared["max_abs_diff"] <= 1 / 16   # at most one problem of 16 flips
