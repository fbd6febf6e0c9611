"""The correctness gates on the real job (trainer, relay and vLLM processes): each
injected fault is caught within a few steps with its action (a clean run that fires
nothing: test_relay_tier_e2e.py). Short runs of the small model (e2e_args.SMALL), in this
process; faults that do not interfere share a run."""

import json

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main
from fnrl.control.journal import records as journal_records

from tests.experiments.e2e_args import SMALL

pytestmark = pytest.mark.slow


def _run(run_dir, cache_dir, steps: int, *flags: str) -> int:
    return main(["--steps", str(steps), "--eval.every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, *flags, *SMALL])


def _gates(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "gate"]


def _train(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _actions(record) -> list[str]:
    return [a["action"] for a in record["actions"]]


def _trained_versions(run_dir) -> set[int]:
    """The policy versions of every consumed token."""
    return {v for r in read_jsonl(run_dir / "trajectories.jsonl")
            for t in r["trajectories"] for v, _ in t["segments"]}


def test_corrupted_weights_and_wrong_logprobs_are_each_skipped_at_their_step(tmp_path, cache_dir):
    """One run, two faults: version 2 is published with noise on every tensor, and the
    batch that trains version 5 records wrong behaviour log-probs. Each is caught by the
    step that trains on it and skipped (the corrupted weights flushed after it). With
    the sync preset (η = 0) the tokens of the corrupted version 2 are the ones trained at
    step 3; asynchronously a rollout may skip a version altogether (lazy sync), and then
    nothing trains on the corrupted weights for a gate to see."""
    assert _run(tmp_path, cache_dir, 6, "--preset", "sync", "--faults.inject.corrupt-publish",
                "2", "--faults.inject.bad-logprobs", "5") == 0
    assert 2 in _trained_versions(tmp_path)
    gates = _gates(tmp_path)
    assert gates, "no gate caught the corrupted weights"
    # Caught at step 3, the one that trains version 2's tokens, and at step 5.
    assert {g["version"] for g in gates} == {3, 5}
    assert all(_actions(g) == ["skip"] for g in gates)
    assert {g["rule"] for g in gates if g["version"] == 5} <= {"mismatch_kl", "is_weight",
                                                               "clip_frac"}
    refused = [r["step"] for r in _train(tmp_path) if r["gate_refused"] == 1.0]
    assert refused == [3, 5]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["refused_updates"] == summary["refused_updates_all"] == 2
    assert summary["skipped_updates"] == 0
    journal = journal_records(tmp_path / "journal.jsonl")
    assert {j["version"] for j in journal if j["ev"] == "gate"} == {3, 5}


def _first_learning_step(run_dir) -> int:
    """The first step whose batch moves the weights: before it every group had one
    reward for all its members (advantages 0, gradient 0), so a too-high rate changes
    nothing a gate could see. The tiny model's first rewards come by chance."""
    train, before = _train(run_dir), 0
    for r in train:   # consumed_groups counts up over the run; zero_variance_groups per step
        if r["zero_variance_groups"] < r["consumed_groups"] - before:
            return r["step"]
        before = r["consumed_groups"]
    raise AssertionError("no step had a group with differing rewards")


def test_a_learning_rate_100x_too_high_rolls_back_and_lowers_it(tmp_path, cache_dir):
    assert _run(tmp_path, cache_dir, 10, "--algo.learning-rate", "1e-2") == 0
    gates = _gates(tmp_path)
    assert gates and gates[0]["rule"] == "update_ratio"
    assert gates[0]["version"] <= _first_learning_step(tmp_path) + 1
    assert _actions(gates[0]) == ["rollback", "lowerlr"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gate_rollbacks"] >= 1 and summary["gate_lr_scale"] <= 0.1 + 1e-9
    assert summary["gate_stopped"] is None
    # The lowered rate cures what the rule saw: after the last rollback no applied update
    # is too large. Batches sampled on the rolled-back weights, or drifting at a rate
    # still 10x the default, may be skipped by the mismatch rules meanwhile (that is
    # those gates doing their job, and how many depends on timing).
    last = max(g["version"] for g in gates if "rollback" in _actions(g))
    assert last < 10
    assert all(_actions(g) == ["skip"] for g in gates if g["version"] > last)
    after = [r for r in _train(tmp_path) if r["step"] > last and r["gate_refused"] == 0.0]
    assert after, "no update was kept after the last rollback"
    assert all(r["update_ratio"] <= 0.01 for r in after)


def test_a_stop_ends_the_run_cleanly_with_a_report(tmp_path, cache_dir):
    """No rollback allowed: the too-large update stops the run, which winds down like a
    finished one (exit code 3) and names the rule and its figures."""
    code = _run(tmp_path, cache_dir, 10, "--algo.learning-rate", "1e-2",
                "--gates.max-rollbacks", "0")
    assert code == 3
    report = json.loads((tmp_path / "gates_stop.json").read_text())
    assert report["rule"] == "update_ratio" and _actions(report) == ["stop"]
    assert report["figures"]["update_ratio"] > report["figures"]["bound"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gate_stopped"] == "update_ratio"
    assert summary["steps"] == report["version"] < 10
    assert report["version"] <= _first_learning_step(tmp_path) + 1
