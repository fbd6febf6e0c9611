"""lab/benchmarks/eval_lane.py's report from finished runs' result files (no job is run)."""

import json
import sys
from pathlib import Path

from lab.benchmarks import eval_lane


def _result(out: Path, r: int, side: str, idle: float) -> None:
    d = out / f"round{r}-{side}"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({
        "side": side, "elapsed_s": 100.0, "trainer_idle_frac": idle, "rl_wall_s": 90.0,
        "trained_tok_s": 800.0, "evals_skipped": 0,
        "versions_evaluated": [0, 5, 10, 15, 20] if side == "dedicated" else []}))


def test_report_gives_each_sides_spread_and_the_per_round_difference(tmp_path, capsys):
    _result(tmp_path, 1, "dedicated", 0.030)
    _result(tmp_path, 1, "off", 0.020)
    _result(tmp_path, 2, "dedicated", 0.050)
    _result(tmp_path, 2, "off", 0.060)
    _result(tmp_path, 3, "off", 0.040)                 # round 3 unpaired: no difference
    eval_lane.report(tmp_path, 3)
    text = capsys.readouterr().out
    assert "trainer idle, dedicated: median 0.040 over 2 rounds" in text
    assert "trainer idle, off: median 0.040 over 3 rounds (min 0.020, max 0.060" in text
    assert ("dedicated - off in the same round: median +0.000 over 2 rounds "
            "(min -0.010, max +0.010") in text
    assert "[0, 5, 10, 15, 20] (0)" in text and "none (0)" in text
