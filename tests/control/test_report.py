"""ETTR, the summary over attempts, and the staleness check, on hand-computed inputs."""

import json

import pytest

from fnrl.control.generation import RolloutState
from fnrl.control.book import Book
from fnrl.control.report import across_attempts, count_command, ettr, utilization
from fnrl.control.supervisor import Outage
from fnrl.control.training import StalenessViolation, check_bound
from fnrl.types import (Abort, DropGroups, Group, Interrupt, Migrate, Problem, Pull, Route, Segment,
                        Trajectory)


def test_ettr_counts_every_role_and_rollouts_idled_by_a_trainer_outage():
    rollouts = [RolloutState(handle=None), RolloutState(handle=None)]
    rollouts[1].blocked_s = 4.0                       # nothing to do while the trainer was down
    outages = [Outage("trainer", 10.0, 12.0, ready_s=20.0),
               Outage("relay1", 30.0, 31.0, ready_s=33.0),
               Outage("rollout0", 90.0, 95.0)]        # still down at the end (wall 100)
    e = ettr(outages, rollouts, num_relays=2, wall_s=100.0)
    assert e["ettr_units"] == 5
    assert e["role_down_s"] == pytest.approx(10 + 3 + 10 + 4)
    assert e["ettr"] == pytest.approx(1 - 27 / 500)
    assert e["trainer_recovery_s_max"] == 10 and e["relay_recovery_s_max"] == 3


def test_trainer_idle_share_counts_training_during_evaluation():
    """Evaluation runs beside training: a trainer busy the whole run is idle 0, not < 0."""
    book = Book(trainer_version=0, steps_done=0)
    book.time["train_call_s"], book.time["eval_s"] = 95.0, 30.0
    u = utilization(book, [RolloutState(handle=None)], wall_s=100.0)
    assert u["trainer_idle_frac"] == pytest.approx(0.05)
    assert u["rl_wall_s"] == pytest.approx(70.0)
    book.time["train_call_s"] = 40.0
    assert utilization(book, [RolloutState(handle=None)], wall_s=100.0)["trainer_idle_frac"] == pytest.approx(0.6)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_summary_covers_every_attempt_and_the_gaps_between(tmp_path):
    _write(tmp_path / "attempts.jsonl", [
        {"attempt": 0, "event": "start", "epoch": 100.0},
        {"attempt": 0, "event": "progress", "epoch": 140.0, "role_down_s": 6.0, "ettr_units": 4},
        # killed: no end record; the next attempt started 20 s after its last record
        {"attempt": 1, "event": "start", "epoch": 160.0},
        {"attempt": 1, "event": "end", "epoch": 200.0, "role_down_s": 2.0, "ettr_units": 4}])
    _write(tmp_path / "faults.jsonl", [{"event": "failure"}, {"event": "recovered"},
                                       {"event": "failure"}])
    _write(tmp_path / "trajectories.jsonl", [{"group": "a"}, {"group": "b"}, {"group": "c"}])
    _write(tmp_path / "metrics.jsonl", [{"kind": "train"}, {"kind": "eval"}, {"kind": "train"}])
    s = across_attempts(tmp_path)
    assert s["attempts"] == 2 and s["killed_attempts"] == 1
    assert s["wall_s_all_attempts"] == 100.0 and s["restart_gaps_s"] == [20.0]
    assert s["role_down_s_all"] == 6 + 2 + 4 * 20
    assert s["ettr"] == pytest.approx(1 - 88 / 400)
    assert (s["failures"], s["consumed_groups_all"], s["train_records_all"]) == (2, 3, 2)


def _group(*versions):
    trajs = tuple(Trajectory(f"p/{k}", (1,), (Segment(v, (5, 6), (-1.0, -1.0)),), "stop", 1.0)
                  for k, v in enumerate(versions))
    return Group(Problem("p", "1+1=", "2", 1), trajs)


def test_the_bound_is_checked_on_every_token():
    assert check_bound((_group(3, 4),), 5, eta=2) == (4, 2)
    with pytest.raises(StalenessViolation, match="group p has a token of version 2"):
        check_bound((_group(4, 2),), 5, eta=2)


def test_commands_are_counted_as_the_loop_and_the_simulator_count_them():
    """Balancing and repack both issue Migrate; `repacks` counts only repack's. Pulls and
    consumes are counted where they land, not here."""
    from collections import Counter

    counts = Counter()
    for cmd in (Migrate(0, 1, (4, 5)), Migrate(2, 1, (6,), reason="repack"), Migrate(3, 0, (7,)),
                Route(0, (1, 2)), Interrupt(1, (3,)), Abort(None, (8, 9)), DropGroups((2,)),
                Pull(0)):
        count_command(counts, cmd)
    assert counts == {"migrated": 4, "migrations": 3, "repacks": 1, "routed": 2,
                      "interrupted": 1, "aborted": 2, "dropped_groups": 1}
