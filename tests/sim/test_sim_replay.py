"""Roles sharing a host's cores (ClusterSpec.shared_cores), and the replay of this
machine's presets benchmark (fnrl.sim.repro.replay)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fnrl.sim import costs
from fnrl.sim.cluster import Simulation
from fnrl.sim.repro import reproduce
from fnrl.sim.repro import replay

from toy import TOY, toy_cfg


def shared(cfg, cores):
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, shared_cores=cores))


def events(sim):
    return [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]


def test_sync_never_shares_a_core():
    """Sync's trainer and rollout take turns: one core is enough for the hand-worked
    schedule of tests/sim/test_sim.py to stand unchanged."""
    sim = Simulation(shared(toy_cfg(), 1), table=TOY)
    assert sim.run()["train_wall_s"] == pytest.approx(10.5)
    assert events(sim) == [("train", 3.8, 5.0), ("pull", 5.0, 5.5), ("train", 9.3, 10.5)]


def test_one_core_shared_by_trainer_and_rollout_by_hand():
    """one_step, 3 steps, everything on one core (own devices: trains end at 5.8, 7.0, 11.3).

    t=5.8  Consume v1 (1.2 s alone); the rollout pulls v1 (not busy) until 6.3
    t=6.3  groups 4, 5 queue on the rollout: 2 busy roles on 1 core, each at half speed:
           the step's 0.7 s left takes 1.4 s (ends 7.7); prefill 8 × 0.1 × 2 = 1.6 s (7.9)
    t=7.7  the trainer is done: the rollout alone, 3 steps of 1 s from 7.9: 10.9
    t=10.9 Consume v2 and a pull (to 11.4); then groups 6, 7 queue: 0.7 s left → 12.8."""
    cfg = dataclasses.replace(toy_cfg("one_step"), steps=3)
    sim = Simulation(shared(cfg, 1), table=TOY)
    summary = sim.run()
    assert events(sim) == [("train", 4.6, 5.8), ("pull", 5.8, 6.3), ("train", 5.8, 7.7),
                           ("pull", 10.9, 11.4), ("train", 10.9, 12.8)]
    assert summary["train_wall_s"] == pytest.approx(12.8)
    own = Simulation(cfg, table=TOY).run()
    assert own["train_wall_s"] == pytest.approx(11.3)
    assert Simulation(shared(cfg, 2), table=TOY).run()["train_wall_s"] == pytest.approx(11.3)


def test_replay_inputs_from_the_measured_table():
    assert replay.train_call_s() == pytest.approx((1 - 0.44) * 29 / 8)
    assert replay.LEN_SIGMA == pytest.approx(0.778, abs=1e-3)
    spec = replay.workload()
    generate = 29 / 8 - replay.train_call_s()
    longest = replay.expected_longest(spec)
    assert 100 < longest <= replay.LEN_MAX
    assert replay.decode_step_s(spec) * longest == pytest.approx(generate - replay.PULL_S - replay.TICK_S)
    d = costs.load_profiled(replay.cost_file(spec))
    assert (d.cost.k1, d.cost.k2, d.cost.k3) == (0.0, 0.0, 0.0)
    assert d.cost.k4 == pytest.approx(replay.decode_step_s(spec))


def test_replay_quick_runs(tmp_path):
    res = reproduce("replay", seeds=(0,), quick=True, out=tmp_path, log=lambda _: None)
    rows = {r["claim"]: r for r in res.rows()}
    assert set(rows) == {"fnrl × sync", "fnrl × sync, own cores", "sync, absolute",
                         "fnrl, absolute", "fnrl × sync, profiled decode",
                         "sync, absolute, profiled decode", "fnrl, absolute, profiled decode"}
    assert rows["fnrl × sync"]["paper"] == 1.22 and rows["sync, absolute"]["paper"] == 1.0
    assert all(r["tolerance"] == 0.15 for r in rows.values())
    s = res.summaries[0]
    assert s["sync"]["steps"] == 3 and s["fnrl"]["steps"] == 3
    # The profiled runs decode with the committed profile's coefficients.
    profile = costs.load_profiled(str(replay.PROFILE)).cost
    assert s["sync_profiled"]["cost_model"]["k4"] == pytest.approx(profile.k4)
    assert s["sync_profiled"]["steps"] == 3
    # Sharing cores only slows the overlapping preset; sync takes turns.
    assert s["sync"]["trained_tokens_per_s"] == pytest.approx(s["sync_own_cores"]["trained_tokens_per_s"])
    assert s["fnrl"]["trained_tokens_per_s"] < s["fnrl_own_cores"]["trained_tokens_per_s"]
    out = json.loads(Path(tmp_path / "replay" / "repro.json").read_text())
    assert len(out["rows"]) == 7
