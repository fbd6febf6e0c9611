"""The simulated job: a tiny cluster whose schedule is worked out by hand, the staleness
bound on every consumed batch, determinism, preemption."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from fnrl.config import CostModel
from fnrl.sim.cluster import Simulation, StalenessViolation
from fnrl.sim.layout import stream_schedule
from fnrl.sim.config import ClusterSpec, SimConfig
from fnrl.sim.costs import DecodeCosts
from fnrl.sim.engine import Instance, Trajectories
from fnrl.sim.report import simulate
from fnrl.sim.workload import WorkloadSpec, group_lengths

from tests.sim.toy import TOY, toy_cfg

def test_tiny_cluster_schedule_by_hand():
    """1 rollout, 1 trainer, 2 groups of 2 per step, responses of 3 tokens, η = 0.

    t=0    fill groups 0, 1; route their 4 trajectories (and fill groups 2, 3, which η = 0
           cannot admit yet); prefill 4 × 2 tokens × 0.1 s = 0.8 s
    t=3.8  3 decode steps of 1 s: all four finish; Consume v0 (20 tokens: 0.2 s + 1 s stall)
    t=5.0  version 1 published; the rollout pulls (0.5 s)
    t=5.5  route groups 2, 3: prefill 0.8 s, 3 steps
    t=9.3  they finish; Consume v1
    t=10.5 version 2: done."""
    sim = Simulation(toy_cfg(), table=TOY)
    summary = sim.run()
    events = [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]
    assert events == [("train", 3.8, 5.0), ("pull", 5.0, 5.5), ("train", 9.3, 10.5)]
    assert [round(r["wall_s"], 9) for r in sim.step_records] == [5.0, 10.5]
    assert summary["train_wall_s"] == pytest.approx(10.5)
    # The job's `tokens` are response tokens (24); the seeds count prompts too (40).
    assert (summary["trained_tokens"], summary["trained_seq_tokens"]) == (24, 40)
    assert summary["trained_seq_tokens_per_s"] == pytest.approx(40 / 10.5)
    assert [sim.trajs.segments[t] for t in range(8)] == [[(0, 3)]] * 4 + [[(1, 3)]] * 4
    assert summary["routed"] == 8 and summary["pulls"] == 1 and summary["preemptions"] == 0
    assert summary["engine_prefill_tokens"] == 16
    # The trainer is busy 2 × 1.2 s of 10.5 s.
    assert summary["trainer_idle_frac"] == pytest.approx(1 - 2.4 / 10.5)
    # Latency counts from being routed to finishing: groups 0, 1 at t = 0 to 3.8; groups
    # 2, 3 are routed at 5.0, behind the pull, and queue in the engine until 5.5: to 9.3.
    assert sim.trajs.latencies() == pytest.approx([3.8] * 4 + [4.3] * 4)
    assert summary["traj_latency_mean_s"] == pytest.approx(4.05)
    assert summary["traj_latency_max_s"] == pytest.approx(4.3)


def test_the_coordinator_plans_with_the_cost_model_it_is_given(tmp_path):
    """`coord_cost` sets what the coordinator's routing and lazy sync estimate with, and
    leaves the decode the engines pay alone (the real job's `coord.cost` is whatever
    `--coord.cost-file` loaded, or the defaults without one)."""
    engine = CostModel(k1=0.0, k2=0.0, k3=0.0, k4=1.0, k5=1.0)   # TOY's "toy" decode
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"k1": 1e-6, "k2": 2e-3, "k3": 3e-4, "k4": 4e-3, "k5": 1.0}))
    for spec, planned in (("engine", engine), ("default", CostModel()), ("toy", engine),
                          (str(profile), CostModel(k1=1e-6, k2=2e-3, k3=3e-4, k4=4e-3))):
        sim = Simulation(toy_cfg("staleflow", coord_cost=spec), table=TOY)
        assert sim.plan.cycle.cost == planned, spec
        assert sim.inst[0].decode.cost == engine, spec
    # Sync's by-hand schedule (above) stands on another plan: the engines set the times.
    planned = Simulation(toy_cfg(coord_cost=str(profile)), table=TOY)
    planned.run()
    assert [r["wall_s"] for r in planned.step_records] == pytest.approx([5.0, 10.5])
    for bad in ("nonesuch", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match=r"coord_cost=.*must be 'engine', 'default', one "
                                             r"of \['toy'\]"):
            Simulation(toy_cfg(coord_cost=bad), table=TOY)
    with pytest.raises(ValueError, match="coord_cost"):
        toy_cfg(coord_cost="")


def test_tiny_cluster_one_step_overlaps_by_hand():
    """Same cluster, η = 1 (one_step: pull only when idle). Groups 2, 3 are admitted on
    version 0 into buffer 1 at t=0, so all eight trajectories prefill at t=0 (1.6 s),
    decode 3 steps together and finish at 4.6; Consume v0 at 4.6 (done 5.8), then
    Consume v1 at 5.8 at once: its groups are rewarded and one version old (η = 1)."""
    sim = Simulation(toy_cfg("one_step"), table=TOY)
    summary = sim.run()
    events = [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]
    assert events[0] == ("train", 4.6, 5.8)
    assert events[-1] == ("train", 5.8, 7.0)
    assert summary["staleness_checked_max"] == 1
    assert summary["train_wall_s"] == pytest.approx(7.0)
    # All eight are routed at t = 0 and finish at 4.6, although half train a step later.
    assert sim.trajs.latencies() == pytest.approx([4.6] * 8)


def test_stream_schedule_by_hand():
    """Four mini-batches of 1 s over groups that finished at 9, 1, 5, 2 (sorted: 1, 2, 5,
    9), the batch handed over at 9. A free trainer starts the first at 1, the second at 2,
    the third at 5 (done at 6), and the last at 9: the step ends at 10, not 13. A trainer
    busy until 10 starts at 10 and runs them back to back (last at 13). With more
    mini-batches than groups, each waits for its share's last group."""
    assert stream_schedule([9, 1, 5, 2], 0.0, 9.0, 1.0, 4) == (1.0, 9.0)
    assert stream_schedule([9, 1, 5, 2], 10.0, 9.0, 1.0, 4) == (10.0, 13.0)
    assert stream_schedule([3.0], 0.0, 3.0, 0.5, 2) == (3.0, 3.5)


def test_stream_generation_trains_early_minibatches_while_the_batch_fills():
    """On the one_step toy, where every group finishes at once, streaming changes nothing
    (the first mini-batch waits for all: 4.6 → 4.7, the second 4.7 → 4.8, publish to 5.8).
    With lengths that differ, training starts before the batch is handed over, the
    trainer is busy its train time and publish only, and the bound still holds."""
    one_step = Simulation(toy_cfg("one_step"), table=TOY)
    base = one_step.run()
    cfg = toy_cfg("one_step")
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, stream_minibatches=2))
    sim = Simulation(cfg, table=TOY)
    summary = sim.run()
    events = [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]
    assert events[0] == ("train", 4.6, 5.8)
    assert summary["train_wall_s"] == pytest.approx(base["train_wall_s"])
    spread = dataclasses.replace(cfg, steps=4, workload=dataclasses.replace(
        cfg.workload, groups_per_step=4, response="lognormal", len_median=6, len_sigma=1.0,
        len_max=40))
    plain = dataclasses.replace(spread, cluster=dataclasses.replace(spread.cluster,
                                                                    stream_minibatches=1))
    streamed, whole = Simulation(spread, table=TOY), Simulation(plain, table=TOY)
    s, w = streamed.run(), whole.run()
    assert s["staleness_checked_max"] <= 1 and w["staleness_checked_max"] <= 1
    trains = [e for e in streamed.timeline if e.get("event") == "train"]
    assert all(e["t0"] <= e["handed"] for e in trains)
    assert any(e["t0"] < e["handed"] - 1e-9 for e in trains)
    assert all(e["t0"] == e["handed"] for e in whole.timeline if e.get("event") == "train")
    busy = sum(r["train_step_s"] + 1.0 for r in streamed.step_records)
    assert s["trainer_idle_frac"] == pytest.approx(1 - busy / s["train_wall_s"], rel=1e-6)
    with pytest.raises(ValueError, match="stream_minibatches"):
        ClusterSpec(stream_minibatches=2, placement="colocated")


def fnrl_cfg(preset="fnrl", seed=0, eta=-1, steps=6) -> SimConfig:
    workload = WorkloadSpec(groups_per_step=8, group_size=4, prompt_len=256, len_median=1500,
                            len_sigma=1.0, len_max=8192, group_corr=0.3)
    return SimConfig(preset=preset, gpus=32, steps=steps, seed=seed, eta=eta, plots=False,
                     workload=workload, cluster=ClusterSpec(train_gpus=8, rollout_tp=4,
                                                             kv_capacity_tokens=40_000))


@pytest.mark.parametrize("preset,eta", [("fnrl", 1), ("fnrl", 3), ("staleflow", 2),
                                        ("partial_rollout", 2), ("laminar", -1), ("sync", -1)])
def test_staleness_bound_on_every_consumed_batch(preset, eta):
    sim = Simulation(fnrl_cfg(preset, eta=eta), table=None)
    summary = sim.run()
    assert summary["steps"] == 6 and len(sim.consumed_log) == 6
    for batch in sim.consumed_log:
        assert batch["checked_tokens"] > 0
        assert 0 <= batch["staleness_max"] <= sim.eta
    # Every token of every consumed trajectory: V_traj + η ≥ V_buf, from the segments.
    for rec in sim.step_records:
        assert sum(rec["staleness_hist"]) == rec["staleness_checked_tokens"] > 0
        assert len(rec["staleness_hist"]) <= sim.eta + 1


def test_bound_violation_raises():
    """The check is live: with a bound tighter than the coordinator's, a stale batch raises."""
    sim = Simulation(fnrl_cfg("fnrl", eta=2), table=None)
    sim.eta = -1   # every token is now "too old"
    with pytest.raises(StalenessViolation, match="too old"):
        sim.run()


def test_determinism(tmp_path):
    a = simulate(fnrl_cfg(seed=3), tmp_path / "a")
    b = simulate(fnrl_cfg(seed=3), tmp_path / "b")
    c = simulate(fnrl_cfg(seed=4), tmp_path / "c")
    drop = ("sim_wall_s", "sim_decide_s", "sim_cpu_s", "sim_decide_cpu_s")
    same = lambda s: {k: v for k, v in s.items() if k not in drop}
    assert same(a) == same(b)
    assert same(a) != same(c)
    assert (tmp_path / "a" / "metrics.jsonl").read_text().count('"kind": "train"') == 6
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["steps"] == 6


def test_preemption_when_kv_overflows():
    """Two trajectories of prompt 4 in a 12-token cache, k4 = 1 s a step: both admitted
    (4 + 4 + 2 ≤ 12); after 2 steps they hold 12 tokens and the next step would need 14,
    so the newer one is preempted at t=2 and re-admitted (re-prefilled) when the first
    finishes at step 3 (t=3); it then needs 3 more steps (it keeps its 2 tokens)."""
    trajs = Trajectories()
    trajs.add(0, 4, [3, 5])
    inst = Instance(0, DecodeCosts(cost=CostModel(k1=0, k2=0, k3=0, k4=1.0)), trajs,
                    kv_capacity=12, max_num_seqs=8)
    inst.enqueue(0)
    inst.enqueue(1)
    inst.admit(0.0)
    assert inst.n == 2 and inst.kv == 8
    t, step = inst.next_event()
    assert (t, step) == (2.0, 2)                 # KV: (12 − 8) // 2 = 2 steps fit
    assert inst.on_event(t, step) == [] and inst.preemptions == 1
    assert list(inst.queue) == [1] and trajs.gen[1] == 2 and trajs.segments[1] == [(0, 2)]
    t, step = inst.next_event()
    assert (t, step) == (3.0, 3)                 # trajectory 0 finishes its 3rd token
    assert inst.on_event(t, step) == [0]
    inst.admit(t)
    assert inst.n == 1 and inst.kv == 6          # back with prompt 4 + its 2 tokens ...
    # ... from the prefix cache: since it left, 1 token was allocated of the 6 it freed.
    assert (inst.prefill_tokens, inst.cache_hit_tokens) == (8, 6)
    assert inst.next_event() == (6.0, 6)


def test_prefix_cache_is_evicted_and_reset():
    """A trajectory that left comes back to a cold cache once later allocations used up
    the free space it left, and after any pull."""
    trajs = Trajectories()
    trajs.add(0, 4, np.array([20, 3, 3]))
    trajs.add(1, 20, np.array([5]))
    inst = Instance(0, DecodeCosts(cost=CostModel(k1=0, k2=0, k3=0, k4=1.0)), trajs,
                    kv_capacity=30, max_num_seqs=8)
    for tid in (0, 1, 2):
        inst.enqueue(tid)
    inst.admit(0.0)                              # 12 tokens
    inst.next_event()
    inst.advance(1.0)                            # one step: 15 allocated
    inst.remove(0)                               # context 5 leaves 30 − 10 = 20 free
    t, step = inst.next_event()
    assert inst.on_event(t, step) == [1, 2]      # 2 steps more: 19 allocated
    inst.enqueue(3)
    inst.enqueue(0)
    inst.admit(t)                                # 20 for tid 3: 24 since 0 left > 20 free
    assert inst.n == 2 and inst.cache_hit_tokens == 0
    assert inst.prefill_tokens == 12 + 20 + 5
    inst.next_event()
    inst.advance(t + 1.0)
    inst.remove(0)
    inst.begin_pull()
    inst.end_pull(t + 2.0, 1)
    inst.enqueue(0)
    inst.admit(t + 2.0)
    assert inst.cache_hit_tokens == 0            # the pull reset the cache


def test_workload_lengths():
    spec = WorkloadSpec(group_size=1000, len_median=1000, len_sigma=1.0, len_max=20_000)
    lengths = group_lengths(spec, 0, 7, 0.0)
    assert (lengths == group_lengths(spec, 0, 7, 0.0)).all()
    assert 800 < float(sorted(lengths)[500]) < 1250 and lengths.max() <= 20_000
    grown = group_lengths(dataclasses.replace(spec, len_growth=1.0), 0, 7, 1.0)
    assert abs(float(sorted(grown)[500]) / float(sorted(lengths)[500]) - 2.0) < 0.05
    fixed = WorkloadSpec(response="fixed", len_median=30, len_max=20, group_size=3)
    assert group_lengths(fixed, 0, 0, 0.0).tolist() == [20, 20, 20]
