"""The gates' I/O side (fnrl.control.gating): every firing is logged three ways, actions
ride with the next batch, a stop writes its report, and a lowered rate survives a
controller restart through the journal."""

import json

import numpy as np

from fnrl.config import GatesConfig, RunConfig
from fnrl.control.gating import STOP_REPORT, Gating
from fnrl.control.journal import Journal, replay
from fnrl.trainer.controls import split_controls
from fnrl.control.journal import records as journal_records

CLEAN = {"mismatch/kl_k3": 1e-4, "mismatch/is_p01": 0.95, "mismatch/is_p99": 1.05,
         "ppo_clip/clip_frac": 0.0, "grad_norm": 0.2, "update_ratio": 1e-3, "loss": 0.1,
         "update_skipped": 0.0, "gate_refused": 0.0}
STATS = {"reward_mean": 0.5, "response_len_mean": 60.0}


class Writer:
    def __init__(self):
        self.records = []

    def write(self, kind, step, values):
        self.records.append((kind, step, values))


def _gating(tmp_path, **gates):
    # As the loop does: the journal's replay says where an earlier attempt left the gates.
    replayed = replay(tmp_path / "journal.jsonl", trainer_version=0)
    journal = Journal(tmp_path / "journal.jsonl")
    lines, writer = [], Writer()
    g = Gating(RunConfig(gates=GatesConfig(**gates)), run_dir=tmp_path, journal=journal,
               writer=writer, log=lines.append, version=0, lr_scale=replayed.gate_lr_scale,
               rollbacks=replayed.gate_rollbacks)
    return g, journal, writer, lines


def _step(g, version, **metrics):
    controls = g.controls()
    rollback = g.sent()
    g.observe({**CLEAN, **metrics}, STATS, version=version, new_version=version + 1,
              rollback_sent=rollback)
    return split_controls(controls)


def test_a_firing_is_logged_three_ways_and_its_actions_ride_with_the_next_batch(tmp_path):
    g, journal, writer, lines = _gating(tmp_path)
    _, controls, rollback = _step(g, 0)
    assert controls["lr_scale"] == 1.0 and rollback == -1
    assert controls["max"]["mismatch/kl_k3"] == np.float32(0.05)
    _step(g, 1, update_ratio=0.5)
    assert [r[0] for r in writer.records] == ["gate"] and writer.records[0][1] == 2
    assert lines and "update_ratio fired at version 2" in lines[0]
    _, controls, rollback = _step(g, 2, **{"gate/rolled_back_to": 1.0})
    assert rollback == 1 and controls["lr_scale"] == np.float32(0.1)
    assert g.sent() == -1   # a rollback goes out once
    journal.close()
    gate = journal_records(tmp_path / "journal.jsonl")
    assert gate[0]["ev"] == "gate" and gate[0]["lr_scale"] == 0.1 and gate[0]["rollbacks"] == 1
    # A restarted controller resumes with the lowered rate.
    again, j2, _, _ = _gating(tmp_path)
    assert again.state.lr_scale == 0.1 and again.state.rollbacks == 1
    j2.close()


def test_a_stop_writes_its_report_and_ends_in_the_summary(tmp_path):
    g, journal, _, lines = _gating(tmp_path, max_rollbacks=0)
    assert g.stop_report is None
    _step(g, 0, update_ratio=0.5)
    report = json.loads((tmp_path / STOP_REPORT).read_text())
    assert report["rule"] == "update_ratio" and report["actions"] == [{"action": "stop"}]
    assert report["figures"]["update_ratio"] == 0.5
    assert g.summary()["gate_stopped"] == "update_ratio" and "stopping the run" in lines[-1]
    journal.close()


def test_a_failed_rollback_stops(tmp_path):
    g, journal, _, _ = _gating(tmp_path)
    _step(g, 0, update_ratio=0.5)
    _step(g, 1, **{"gate/rolled_back_to": -1.0})
    assert g.stop_report["rule"] == "rollback"
    journal.close()


def test_a_run_whose_every_update_was_refused_says_so_and_exits_4(monkeypatch, tmp_path, capsys):
    """The gates refused every update (the versions advanced, the weights never moved):
    the job does not end as a success reporting its steps, it names the rule and cause."""
    from fnrl.control.report import learned_nothing
    from fnrl.experiments import math_grpo

    summary = {"steps": 5, "train_records_all": 5, "refused_updates_all": 5,
               "refused_updates": 5, "gate_rules": {"mismatch_kl": 5}, "gate_stopped": None,
               "run_dir": str(tmp_path)}
    message = learned_nothing(summary)
    assert "every one of the run's 5 updates was refused" in message
    assert "mismatch_kl (5 firings)" in message and "log-probs disagree" in message
    assert learned_nothing({**summary, "refused_updates_all": 4}) is None
    assert learned_nothing({**summary, "train_records_all": 0, "steps": 0}) is None
    monkeypatch.setattr(math_grpo, "run", lambda cfg: summary)
    assert math_grpo.main([]) == 4
    assert "mismatch_kl" in capsys.readouterr().err
