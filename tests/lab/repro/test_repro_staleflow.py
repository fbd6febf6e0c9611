"""StaleFlow's reproduction setup (lab/repro/staleflow.py): its structure, its
cluster against hand-computed figures, its averaged claim and its split tuning."""

from __future__ import annotations

import dataclasses

import pytest

import fnrl.sim.cluster
from fnrl.sim import costs
from fnrl.sim.layout import layout
from lab.repro import SETUPS, reproduce
from lab.repro import PairsClaim
from lab.repro.staleflow import config, setup, tune_split


def test_table4_reads_as_one_h20():
    # The reason for rollouts at TP 1: Table 4's k2 and k3 fit one H20.
    table = costs.load_table()
    gpu, model = costs.gpu_spec("h20", table), costs.model_spec("qwen3-30b-a3b", table)
    k = costs.named_decode("staleflow-qwen3-30b-a3b-h20", table)
    # 2 · 3.3e9 B of active weights / 1.72e-3 s = 3.84e12 B/s, 96% of 4.0e12
    assert 2 * model.active_params / k.k2 / gpu.hbm_bw == pytest.approx(0.959, abs=1e-3)
    # 2 · 3.3e9 FLOPs / 1.25e-4 s = 5.28e13 FLOP/s, 36% of 148e12
    assert 2 * model.active_params / k.k3 / gpu.peak_flops == pytest.approx(0.357, abs=1e-3)


def test_cluster_by_hand():
    lay = layout(config("staleflow", eta=1, train_gpus=48))
    assert (lay.train_gpus, lay.rollouts) == (48, 80)
    # (96e9 · 0.9 − 2 · 30.5e9) / 98,304 = 258,382 KV tokens on one H20
    assert lay.kv_capacity == 258_382
    assert lay.decode.cost == costs.named_decode("staleflow-qwen3-30b-a3b-h20")
    verl = layout(config("sync", placement="colocated"))
    assert (verl.train_gpus, verl.rollouts, verl.colocated) == (128, 128, True)
    # Colocated, the trainer's 16 · 30.5e9 / 128 = 3.8125 GB stay resident:
    # (96e9 · 0.9 − 3.8125e9 − 61e9) / 98,304 = 219,599 KV tokens. The pull is the reshard
    # (61e9 / 300e9) and the reload (0.3 s) plus the sleep: 61e9 / 50e9 out and back.
    assert verl.kv_capacity == 219_599
    assert verl.pull_s == pytest.approx(61 / 300 + 0.3 + 2 * 61 / 50)


def test_mean_claim_averages_the_pairs():
    c = PairsClaim(name="x", system="a1", baseline="b", paper=2.0,
                   pairs=(("a1", "b"), ("a2", "b"), ("a3", "c")))
    s = {"a1": {"trained_seq_tokens_per_s": 30.0}, "a2": {"trained_seq_tokens_per_s": 60.0},
         "a3": {"trained_seq_tokens_per_s": 10.0}, "b": {"trained_seq_tokens_per_s": 20.0},
         "c": {"trained_seq_tokens_per_s": 40.0}}
    assert c.ratio(s) == pytest.approx((1.5 + 3.0 + 0.25) / 3)


def test_tune_split_takes_the_fastest(monkeypatch):
    seen = []

    class Fake:
        def __init__(self, cfg):
            self.cfg = cfg
            seen.append((cfg.seed, cfg.steps, cfg.cluster.train_gpus))

        def run(self):
            return {"trained_seq_tokens_per_s": {16: 1.0, 32: 3.0, 48: 2.0}[self.cfg.cluster.train_gpus]}

    monkeypatch.setattr(fnrl.sim.cluster, "Simulation", Fake)
    base = config("staleflow", eta=2)
    tuned, found = tune_split(base, choices=(16, 32, 48))
    assert tuned.cluster.train_gpus == 32 and found == {16: 1.0, 32: 3.0, 48: 2.0}
    # Tuned on its own seed and shorter runs; the reported run keeps the rest.
    assert {(s, n) for s, n, _ in seen} == {(1000, 10)}
    assert dataclasses.replace(tuned, cluster=base.cluster) == base


def test_quick_setup_runs_and_bounds_staleness():
    assert "staleflow" in SETUPS
    s = setup(True)
    assert set(s.runs) == {"VeRL", "VeRL-Pipeline", "VeRL-Async-eta1", "StaleFlow-eta1", "fnrl"}
    assert s.runs["VeRL"].cluster.placement == "colocated" and s.runs["VeRL"].preset == "sync"
    assert s.runs["VeRL-Pipeline"].enable == ("global_sync", "dispatch")
    assert s.runs["VeRL"].enable == s.runs["VeRL-Async-eta1"].enable == ("dispatch",)
    assert [c.paper for c in s.claims] == [2.01, 1.52, 1.17]
    res = reproduce("staleflow", seeds=(0,), quick=True, log=lambda _: None)
    for label, summary in res.summaries[0].items():
        assert summary["steps"] == 3, label
        assert summary["staleness_checked_max"] <= summary["eta"], label
    assert res.summaries[0]["VeRL"]["eta"] == 0 and res.summaries[0]["StaleFlow-eta1"]["eta"] == 1
    for row in res.rows():
        assert row["simulated"] > 0 and row["min"] <= row["simulated"] <= row["max"]
