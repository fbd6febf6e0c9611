"""The correctness gates on the real job (trainer, relay and vLLM processes): each
injected fault is caught within a few steps with its action, and a clean run fires
nothing. Short runs of the small model (e2e_args.SMALL), in this process."""

import json

import pytest

from fnrl.control.metrics import read_jsonl
from fnrl.experiments.math_grpo import main

from e2e_args import SMALL

pytestmark = pytest.mark.slow


def _run(run_dir, cache_dir, steps: int, *flags: str) -> int:
    return main(["--steps", str(steps), "--eval-every", "100", "--run-dir", str(run_dir),
                 "--warm-start.cache-dir", cache_dir, *flags, *SMALL])


def _gates(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "gate"]


def _train(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _actions(record) -> list[str]:
    return [a["action"] for a in record["actions"]]


def test_a_clean_run_fires_no_gate(tmp_path, cache_dir):
    assert _run(tmp_path, cache_dir, 8) == 0
    assert _gates(tmp_path) == []
    train = _train(tmp_path)
    assert len(train) == 8 and all(r["gate_refused"] == 0.0 for r in train)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gate_firings"] == 0 and summary["gate_stopped"] is None
    assert not (tmp_path / "gates_stop.json").exists()


def test_wrong_behaviour_logprobs_are_skipped_at_their_step(tmp_path, cache_dir):
    assert _run(tmp_path, cache_dir, 6, "--faults.inject-bad-logprobs", "3") == 0
    gates = _gates(tmp_path)
    assert gates and {g["version"] for g in gates} == {3}
    assert {g["rule"] for g in gates} <= {"mismatch_kl", "is_weight", "clip_frac"}
    assert all(_actions(g) == ["skip"] for g in gates)
    refused = [r["step"] for r in _train(tmp_path) if r["gate_refused"] == 1.0]
    assert refused == [3]
    journal = [json.loads(l) for l in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert any(j["ev"] == "gate" and j["version"] == 3 for j in journal)


def test_a_corrupted_publish_is_caught_and_flushed(tmp_path, cache_dir):
    assert _run(tmp_path, cache_dir, 8, "--faults.inject-corrupt-publish", "2") == 0
    gates = _gates(tmp_path)
    assert gates, "no gate caught the corrupted weights"
    # Tokens of version 2 are trained at versions 2..2+η (η = 2): caught in that span.
    assert min(g["version"] for g in gates) <= 2 + 2 + 1
    assert all(_actions(g) == ["skip"] for g in gates)
    assert max(g["version"] for g in gates) <= 2 + 2 + 1   # flushed: later steps are clean


def test_a_learning_rate_100x_too_high_rolls_back_and_lowers_it(tmp_path, cache_dir):
    assert _run(tmp_path, cache_dir, 6, "--algo.learning-rate", "1e-2") == 0
    gates = _gates(tmp_path)
    assert gates and gates[0]["rule"] == "update_ratio" and gates[0]["version"] <= 2
    assert _actions(gates[0]) == ["rollback", "lowerlr"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gate_rollbacks"] >= 1 and summary["gate_lr_scale"] <= 0.1 + 1e-9
    # After the last rollback the run is clean at the lowered rate.
    assert gates[-1]["version"] < 6


def test_a_stop_ends_the_run_cleanly_with_a_report(tmp_path, cache_dir):
    """No rollback allowed: the too-large update stops the run, which winds down like a
    finished one (exit code 3) and names the rule and its figures."""
    code = _run(tmp_path, cache_dir, 6, "--algo.learning-rate", "1e-2",
                "--gates.max-rollbacks", "0")
    assert code == 3
    report = json.loads((tmp_path / "gates_stop.json").read_text())
    assert report["rule"] == "update_ratio" and _actions(report) == ["stop"]
    assert report["figures"]["update_ratio"] > report["figures"]["bound"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gate_stopped"] == "update_ratio"
    assert summary["steps"] == report["version"] < 6
