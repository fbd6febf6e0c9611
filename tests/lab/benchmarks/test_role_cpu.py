"""lab/benchmarks/role_cpu.py: each role's CPU samples classed by the run's own timeline."""

import json

import pytest

from lab.benchmarks import role_cpu


def test_samples_are_classed_by_what_each_role_was_doing(tmp_path):
    t0 = 1000.0
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"event": "start", "epoch": t0}) + "\n")
    timeline = [{"t": 0.0, "running": [0, 0]}, {"t": 1.0, "running": [3, 0]},
                {"t": 2.0, "running": [0, 0]}, {"event": "train", "t0": 2.0, "t": 3.0},
                {"t": 4.0, "running": [0, 0]}]
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    # One sample a second: rollout0 burns 0.8 cores while generating (1-2 s), the
    # trainer 1.5 in its call (2-3 s); the controller 0.5 when a rollout generates.
    cum = {"rollout0": 0.0, "trainer": 0.0, "controller": 0.0}
    samples = [(t0 - 1.0, dict(cum)), (t0, dict(cum))]
    for k in range(4):   # the interval [k, k + 1] after t0
        cum["rollout0"] += 0.8 if k == 1 else 0.1
        cum["trainer"] += 1.5 if k == 2 else 0.0
        cum["controller"] += 0.5 if k == 1 else 0.2
        samples.append((t0 + k + 1.0, dict(cum)))
    out = role_cpu.classify(samples, tmp_path)
    assert out["rollout0"]["generating"] == pytest.approx([0.8])
    assert out["rollout0"]["idle"] == pytest.approx([0.1, 0.1, 0.1])
    assert out["trainer"]["in a train call"] == pytest.approx([1.5])
    assert out["trainer"]["idle"] == pytest.approx([0.0, 0.0, 0.0])
    assert out["controller"]["rollouts generating"] == pytest.approx([0.5])
    assert out["controller"]["rollouts idle"] == pytest.approx([0.2, 0.2, 0.2])
    # The interval before t0 is outside the RL wall: left out.
    assert sum(len(v) for v in out["controller"].values()) == 4
