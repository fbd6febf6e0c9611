"""Multi-turn trajectories with tool calls between their turns, on the toy cluster."""

from __future__ import annotations

import dataclasses

import pytest

from fnrl.sim.cluster import Simulation
from fnrl.sim.workload import WorkloadSpec, tool_latency, turn_ends

from tests.sim.toy import TOY, toy_cfg


def tool_cfg(*, hold: bool):
    """One group of 2, prompts of 4 tokens, responses of 4 in 2 turns, a 3 s call that
    adds a 1-token observation, KV for 9 tokens: one trajectory runs at a time."""
    cfg = dataclasses.replace(toy_cfg(), steps=1)
    workload = WorkloadSpec(groups_per_step=1, group_size=2, prompt_len=4, response="fixed",
                            len_median=4, len_max=4, turns=2, tool_latency_s=3.0, tool_tokens=1,
                            tool_holds_kv=hold)
    return dataclasses.replace(cfg, workload=workload,
                               cluster=dataclasses.replace(cfg.cluster, kv_capacity_tokens=9))


def events(sim):
    return [(e["event"], round(e["t0"], 9), round(e["t"], 9)) for e in sim.timeline if "event" in e]


def test_a_held_call_blocks_the_queue_by_hand():
    """Held KV (sync, 1 rollout, 1 s decode steps, 0.1 s a prefilled token).

    t=0    A admitted (4 + 0 + 1 ≤ 9), prefill 0.4 s; B waits (4 + 4 + 1 + 1 > 9)
    t=2.4  A's first turn ends after 2 steps: its call goes out, it holds its 6 tokens,
           so B still does not fit (4 + 1 > 9 − 6)
    t=5.4  A's call returns: first in the queue, it prefills its 1-token observation
    t=7.5  A finishes (2 steps); B is admitted (prefill 0.4 s)
    t=9.9  B's turn ends; its call returns at 12.9, prefill 0.1 s, 2 steps
    t=15.0 B finishes: Consume, 18 tokens (0.18 s) and the 1 s publish."""
    sim = Simulation(tool_cfg(hold=True), table=TOY)
    summary = sim.run()
    assert events(sim) == [("train", 15.0, 16.18)]
    assert summary["tool_calls"] == 2
    assert summary["engine_prefill_tokens"] == 4 + 1 + 4 + 1
    assert (summary["trained_tokens"], summary["trained_seq_tokens"]) == (8, 18)
    assert [sim.trajs.segments[t] for t in range(2)] == [[(0, 2), (0, 2)]] * 2
    assert sim.inst[0].held_kv == 0 and not sim.inst[0].held


def test_a_released_call_lets_the_next_one_run_by_hand():
    """Released KV: B runs while A's call is out, and each comes back to its blocks still
    in the prefix cache (nothing evicted them), prefilling only the observation.

    t=0    A admitted, prefill 0.4 s; 2 steps
    t=2.4  A's call goes out and frees its 6 tokens: B admitted, prefill 0.4 s; 2 steps
    t=4.8  B's call goes out (returns at 7.8); the engine idles
    t=5.4  A's call returns: 6 of its 7 tokens cached, prefill 0.1 s, 2 steps
    t=7.5  A finishes; t=7.8 B returns, prefill 0.1 s, 2 steps
    t=9.9  B finishes: Consume (0.18 s + 1 s)."""
    sim = Simulation(tool_cfg(hold=False), table=TOY)
    summary = sim.run()
    assert events(sim) == [("train", 9.9, 11.08)]
    assert summary["tool_calls"] == 2
    assert summary["engine_prefill_tokens"] == 10
    assert sim.inst[0].cache_hit_tokens == 12


def test_single_turn_is_unchanged():
    """turns = 1 (the default) makes no call, whatever the latency says."""
    base = toy_cfg()
    one = dataclasses.replace(base, workload=dataclasses.replace(base.workload, tool_latency_s=5.0,
                                                                  tool_tokens=3))
    a, b = Simulation(base, table=TOY).run(), Simulation(one, table=TOY).run()
    assert a["tool_calls"] == b["tool_calls"] == 0
    assert a["train_wall_s"] == b["train_wall_s"] == pytest.approx(10.5)


def test_turn_ends_and_latencies():
    assert turn_ends(4, 2) == [2, 4]
    assert turn_ends(5, 2) == [3, 5]
    assert turn_ends(10, 3) == [4, 7, 10]
    assert turn_ends(2, 3) == [1, 2]       # fewer turns than asked: a turn has a token
    assert turn_ends(7, 1) == [7]
    spec = WorkloadSpec(turns=3, tool_latency_s=2.0, tool_latency_sigma=1.0)
    draws = [tool_latency(spec, 0, tid, call) for tid in range(50) for call in (1, 2)]
    assert draws == [tool_latency(spec, 0, tid, call) for tid in range(50) for call in (1, 2)]
    assert min(draws) < 2.0 < max(draws) and len(set(draws)) == len(draws)
    assert tool_latency(dataclasses.replace(spec, tool_latency_sigma=0.0), 0, 3, 1) == 2.0
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec(turns=0)


@pytest.mark.parametrize("preset", ["fnrl", "staleflow", "partial_rollout"])
@pytest.mark.parametrize("hold", [True, False])
def test_interrupts_and_pulls_during_calls_keep_the_books(preset, hold):
    """Presets that interrupt, migrate and pull while calls are out: every trajectory
    finishes with its whole response, and no KV stays held at the end."""
    cfg = dataclasses.replace(toy_cfg(preset), steps=4)
    workload = WorkloadSpec(groups_per_step=2, group_size=4, prompt_len=2, response="lognormal",
                            len_median=6, len_sigma=0.8, len_max=24, turns=3, tool_latency_s=1.5,
                            tool_latency_sigma=0.5, tool_tokens=2, tool_holds_kv=hold)
    cfg = dataclasses.replace(cfg, gpus=3, workload=workload,
                              cluster=dataclasses.replace(cfg.cluster, kv_capacity_tokens=200))
    sim = Simulation(cfg, table=TOY)
    summary = sim.run()
    assert summary["steps"] == 4 and summary["tool_calls"] > 0
    tr = sim.trajs
    consumed = 4 * 2 * 4
    assert (tr.gen[:consumed] == tr.target[:consumed]).all()
    assert summary["trained_seq_tokens"] >= int((tr.target[:consumed] + 2).sum())
