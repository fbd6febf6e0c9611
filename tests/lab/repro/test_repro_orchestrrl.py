"""OrchestrRL's reproduction: its setup's structure, the planner's deployment in the
runs, and a quick run of the headline case."""

import dataclasses

import pytest

from fnrl.sim import costs
from fnrl.sim.cluster import Simulation
from fnrl.sim.config import ClusterSpec, SimConfig
from fnrl.sim.layout import layout
from fnrl.sim.coordinator import plan_for
from lab.repro import SETUPS, reproduce
from lab.repro import orchestrrl


def test_the_setup_has_every_case_and_system():
    s = SETUPS["orchestrrl"](True)
    for suffix, *_ in orchestrrl.CASES:
        for system in ("verl_to", "verl_lo", "pr", "orchestrrl", "fnrl"):
            assert f"{system}{suffix}" in s.runs
    assert [c.paper for c in s.claims] == [1.40, 1.31, 1.32, 1.34, 1.23, 1.19]
    assert all(c.baseline.startswith("verl_to") and c.system.startswith("orchestrrl")
               for c in s.claims[:4])
    # §6.2's ablation: the planner alone, at 25K, is OrchestrRL without the balancer.
    for suffix, claim in zip(orchestrrl.PLANNER_ALONE, s.claims[4:]):
        alone, full = s.runs[f"planner{suffix}"], s.runs[f"orchestrrl{suffix}"]
        assert (claim.system, claim.baseline) == (f"planner{suffix}", f"verl_to{suffix}")
        assert alone == dataclasses.replace(full, enable=("global_sync", "dispatch"))
    to, lo, pr, orch, fn = (s.runs[k] for k in ("verl_to", "verl_lo", "pr", "orchestrrl", "fnrl"))
    assert (to.cluster.rollout_tp, lo.cluster.rollout_tp) == (2, 8)
    assert (to.preset, pr.preset, orch.preset, fn.preset) == ("one_step", "partial_rollout",
                                                              "one_step", "fnrl")
    assert orch.enable == ("balance", "global_sync", "dispatch")
    assert to.enable == lo.enable == ("global_sync", "dispatch") and pr.enable == ("dispatch",)
    # `enable` switches the balancer on over one_step, and verl's global weight sync for
    # all three verl-built systems; `ablate` wins back nothing else.
    decode = layout(orch).decode
    assert plan_for(orch, decode).cycle.balance is not None
    assert plan_for(to, decode).cycle.balance is None
    assert {plan_for(r, decode).cycle.routing.sync for r in (to, lo, orch)} == {"global"}
    assert plan_for(pr, decode).cycle.routing.sync != "global"
    both = dataclasses.replace(orch, enable=("balance", "repack"), ablate=("migration",))
    cycle = plan_for(both, decode).cycle
    assert cycle.balance is not None and cycle.repack is not None and not cycle.routing.migrate
    with pytest.raises(ValueError, match="SimConfig.enable"):
        dataclasses.replace(orch, enable=("balance",), ablate=("balance",))
    # Equal halves (§6.1), and every system on the same workload and cluster model.
    assert all(r.cluster.train_gpus * 2 == r.gpus and r.cluster.tp_comm for r in s.runs.values())
    assert len({(r.workload, r.cluster.model, r.gpus) for k, r in s.runs.items()
                if "@" not in k}) == 1


def test_orchestrrl_runs_on_the_planners_deployment():
    s = SETUPS["orchestrrl"](False)
    for suffix, model, gpus, len_max, _ in orchestrrl.CASES:
        chosen = orchestrrl.plan(model, gpus, orchestrrl.workload(len_max, 128))
        assert s.runs[f"orchestrrl{suffix}"].cluster.rollout_tp == chosen.tp
        assert chosen.tp * chosen.instances <= gpus // 2
        # The plan's choice is the candidate of least makespan (no switch at a fresh step).
        assert chosen.makespan_s == min(span for _, span in chosen.candidates)


def test_all_reduces_make_tensor_parallelism_cost_per_gpu():
    # The trade-off of §6.3 needs them: per GPU, TP 8 pays more per sequence than TP 2
    # (bytes over NVLink), and reads fewer weights per step.
    table = costs.load_table()
    m, gpu = costs.model_spec("qwen2.5-14b", table), costs.gpu_spec("h800", table)
    roof, comm = costs.RooflineParams(**table["roofline"]), costs.tp_comm_params(table)
    tp2, tp8 = (costs.roofline_decode(m, gpu, tp, roof, costs.tp_allreduce_s(m, gpu, tp, 8, comm)).cost
                for tp in (2, 8))
    assert 8 * tp8.k3 > 2 * tp2.k3 and tp8.k2 < tp2.k2
    fixed, per_seq = costs.tp_allreduce_s(m, gpu, 8, 8, comm)
    # 96 all-reduces of 10 µs; 96 · 1.75 · 5120 · 2 B / (200 GB/s · 0.8).
    assert fixed == pytest.approx(96 * 10e-6)
    assert per_seq == pytest.approx(96 * 1.75 * 5120 * 2 / 160e9)
    off = costs.roofline_decode(m, gpu, 8, roof)
    assert off.cost.k4 == roof.step_overhead_s and costs.tp_allreduce_s(m, gpu, 1, 8, comm) == (0.0, 0.0)


def test_a_quick_run_of_the_headline_case(monkeypatch):
    quick = SETUPS["orchestrrl"](True)
    monkeypatch.setitem(SETUPS, "orchestrrl", lambda q: dataclasses.replace(
        quick, runs={k: v for k, v in quick.runs.items() if "@" not in k},
        claims=quick.claims[:1]))
    res = reproduce("orchestrrl", seeds=(0,), quick=True, log=lambda _: None)
    runs = res.summaries[0]
    assert set(runs) == {"verl_to", "verl_lo", "pr", "orchestrrl", "planner", "fnrl"}
    assert all(r["steps"] == 2 and r["trained_seq_tokens_per_s"] > 0 for r in runs.values())
    assert runs["verl_to"]["rollouts"] == 8 and runs["verl_lo"]["rollouts"] == 2
    # OrchestrRL carries every mode that fits (TP 1, 2, 4, 8 of 16 GPUs: 30 instances).
    assert runs["orchestrrl"]["rollouts"] == 30 and runs["orchestrrl"]["rollout_gpus"] == 16
    assert runs["verl_to"]["staleness_checked_max"] <= 1
    assert runs["verl_to"]["migrated"] == 0 and runs["pr"]["interrupted"] > 0
    assert runs["planner"]["rollouts"] == 30
    (row,) = res.rows()
    assert row["paper"] == 1.40 and row["simulated"] > 0


def test_verls_dispatch_hands_the_engines_every_request_at_once():
    """`enable=("dispatch",)`: the verl-built baselines route as verl does (each replica
    its share of the batch at once, the engine queueing), not by StaleFlow's admission,
    which withholds requests from a compute-bound instance. 14B, `sync`, 2×TP8, one
    batch of 1,024 requests (StaleFlow's routing also stops at 512 routes a cycle)."""
    def sim(enable):
        return Simulation(SimConfig(
            preset="sync", gpus=32, steps=1, enable=enable, plots=False,
            cluster=ClusterSpec(model="qwen2.5-14b", gpu="h800", train_gpus=16, rollout_tp=8,
                                tp_comm=True),
            workload=orchestrrl.workload(25 * 1024, 128)))

    first = {}
    for enable in ((), ("dispatch",)):
        s = sim(enable)
        s.cycle()
        s.cycle()
        first[enable] = s.book.counts["routed"]
        assert s.plan.cycle.routing.policy == (
            "fewest" if enable else "waterfall")
    assert first[("dispatch",)] == 1024 and first[()] < 1024
    ends = {}
    for enable in ((), ("dispatch",)):
        s = sim(enable)
        s.run()
        ends[enable] = next(e["t0"] for e in s.timeline if e.get("event") == "train")
    # Measured: 285 s against 323 s; the engine alone drains its share in 276 s.
    assert ends[("dispatch",)] < 0.95 * ends[()]
