"""lab/benchmarks/corun.py: the co-run table from its rounds, in the form fnrl.sim reads."""

import json

import pytest

from lab.benchmarks import corun

from fnrl.sim import costs


def a_round(scale: float) -> dict:
    """A round whose trainer steps 0.1 s (bucket 128) and 0.2 s (256) alone, 2× and 3×
    that beside one and two servers; a server decodes 100 tok/s alone, 80 beside the
    other, 50 beside the trainer. `scale`: the whole round slower (a busier machine)."""
    def steps(factor):
        return {128: [0.1 * factor * scale] * 3, 256: [0.2 * factor * scale] * 3}
    return {"train": {"steps": steps(1)},
            "train+1": {"steps": steps(2), "tokens_per_s": [50 / scale]},
            "train+2": {"steps": steps(3), "tokens_per_s": [40 / scale, 40 / scale]},
            "gen1": {"tokens_per_s": [100 / scale]},
            "gen2": {"tokens_per_s": [80 / scale, 80 / scale]}}


def test_slowdowns_are_per_round_ratios(tmp_path):
    # Rounds on a busier or quieter machine give the same ratios: each is to its own round.
    summary = corun.summarise([a_round(1.0), a_round(1.5), a_round(0.8)], [128, 256])
    assert summary["trainer_slowdown"]["1"]["slowdown"] == pytest.approx(2.0)
    assert summary["trainer_slowdown"]["2"]["by_bucket"] == pytest.approx({"128": 3.0, "256": 3.0})
    assert summary["server_slowdown"]["1"]["slowdown"] == pytest.approx(1.0)
    assert summary["server_slowdown"]["2"]["slowdown"] == pytest.approx(1.25)
    assert summary["server_slowdown"]["1+trainer"]["slowdown"] == pytest.approx(2.0)
    assert summary["server_slowdown"]["2+trainer"]["slowdown"] == pytest.approx(2.5)
    assert summary["train_step_s"] == pytest.approx({"128": 0.1, "256": 0.2})
    # The simulator reads it.
    path = tmp_path / "corun.json"
    path.write_text(json.dumps(summary))
    table = costs.load_corun(path)
    assert table.trainer == pytest.approx({1: 2.0, 2: 3.0})
    assert table.server_factor(2, True) == pytest.approx(2.5)
    assert table.server_factor(1, False) == 1.0
