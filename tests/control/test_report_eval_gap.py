"""A job restart's gap leaves out the held-out evaluation its next attempt runs before
the loop starts (a role restart never pays it), in the gaps and in the wall time."""

import json

import pytest

from fnrl.control.report import across_attempts


def test_evaluation_before_an_attempt_is_not_charged_to_its_restart_gap(tmp_path):
    records = [
        {"attempt": 0, "event": "start", "epoch": 100.0, "eval_before_s": 7.0},
        {"attempt": 0, "event": "end", "epoch": 140.0, "role_down_s": 6.0, "ettr_units": 4,
         "job_restart": True},
        # 30 s from the end of attempt 0 to attempt 1's loop, 12 s of it evaluation
        {"attempt": 1, "event": "start", "epoch": 170.0, "eval_before_s": 12.0},
        {"attempt": 1, "event": "end", "epoch": 210.0, "role_down_s": 2.0, "ettr_units": 4}]
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = across_attempts(tmp_path)
    assert s["restart_gaps_s"] == [18.0]
    assert s["eval_before_start_s"] == [7.0, 12.0]
    # The first attempt's evaluation precedes its start: never in the wall time.
    assert s["wall_s_all_attempts"] == 110.0 - 12.0
    assert s["role_down_s_all"] == 6 + 2 + 4 * 18
    assert s["ettr"] == pytest.approx(1 - 80 / (4 * 98))


def test_records_without_the_field_keep_the_whole_gap(tmp_path):
    records = [{"attempt": 0, "event": "start", "epoch": 0.0},
               {"attempt": 0, "event": "progress", "epoch": 10.0, "role_down_s": 0.0,
                "ettr_units": 3},
               {"attempt": 1, "event": "start", "epoch": 15.0},
               {"attempt": 1, "event": "end", "epoch": 25.0, "role_down_s": 0.0, "ettr_units": 3}]
    (tmp_path / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert across_attempts(tmp_path)["restart_gaps_s"] == [5.0]
