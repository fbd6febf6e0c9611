"""OrchestrRL's proactive planner: the forecast and the parallelism plan on cases worked
by hand, and their invariants as properties."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fnrl.config import CostModel
from fnrl.policy.orchestr import (Mode, ParallelismProblem, bucketize, deployment_makespan,
                                  forecast_quantiles, instance_makespan, plan_parallelism,
                                  remaining_lengths, remaining_work, remove_completed,
                                  step_distribution, step_quantiles)

# Two modes of one 16-GPU cluster: TP2 reads more weights per step and has less of the
# per-token cost split across GPUs; TP8 reads a quarter and pays more per token in
# all-reduces (the trade-off §6.3 shows: 8×TP2 early, 2×TP8 for the tail).
TP2 = Mode(tp=2, cost=CostModel(k1=0.0, k2=6e-3, k3=36e-6, k4=5e-3), kv_capacity=1e7)
TP8 = Mode(tp=8, cost=CostModel(k1=0.0, k2=1.6e-3, k3=18e-6, k4=5e-3), kv_capacity=1e7)
PROBLEM = ParallelismProblem(gpus=16, modes=(TP2, TP8), switch_s=14.0)


def test_the_forecast_worked_by_hand():
    # ARIMA(0,1,1) = smoothing of the level: 100 + 0.5·(200 − 100) = 150, 200 → 300.
    assert forecast_quantiles([[100, 200], [200, 400]], smoothing=0.5).tolist() == [150, 300]
    # Quantiles at ranks 0.25 and 0.75; four requests at ranks 1/8, 3/8, 5/8, 7/8.
    points = step_distribution([100, 300], 4)
    assert points.tolist() == [100, 150, 250, 300]
    # A request that finished at 140 removes the point nearest it (150).
    left = remove_completed(points, [140])
    assert left.tolist() == [100, 250, 300]
    # E[L − g | L > g]: (100+250+300)/3 − 0; (250+300)/2 − 120 = 155; 300 − 260 = 40;
    # past every point, half of what is left to len_max: (1000 − 400)/2 = 300.
    rem = remaining_lengths([0, 120, 260, 400], left, len_max=1000)
    assert rem == pytest.approx([650 / 3, 155, 40, 300])
    assert step_quantiles(np.arange(1, 101), 4) == pytest.approx(np.quantile(np.arange(1, 101),
                                                                             [1 / 8, 3 / 8, 5 / 8, 7 / 8]))


def test_remaining_work_is_the_conditional_distribution():
    # A fresh step's requests are the forecast itself.
    assert remaining_work([0, 0, 0], [300, 100, 250], len_max=1000).tolist() == [100, 250, 300]
    # Two requests 120 tokens in: the points above, 250 and 300, less 120.
    assert remaining_work([120, 120], [100, 250, 300], len_max=1000).tolist() == [130, 180]
    # Past every point: half of what is left, as remaining_lengths.
    assert remaining_work([400], [100, 250, 300], len_max=1000).tolist() == [300]


def test_buckets_stand_for_their_maximum():
    reps, counts = bucketize([1, 256, 257, 600])
    assert reps.tolist() == [256, 512, 768] and counts.tolist() == [2, 1, 1]


def test_instance_makespan_worked_by_hand():
    per_step = Mode(tp=1, cost=CostModel(k1=0.0, k2=0.0, k3=0.0, k4=1.0), kv_capacity=1e6)
    # Two requests, 3 and 1 tokens left: 3 steps of 1 s.
    assert instance_makespan(per_step, [1, 3], [0, 0]) == pytest.approx(3.0)
    per_seq = Mode(tp=1, cost=CostModel(k1=0.0, k2=0.0, k3=1.0, k4=0.0), kv_capacity=1e6)
    # One step with both (2 s), two with the longer alone (1 s each).
    assert instance_makespan(per_seq, [1, 3], [0, 0]) == pytest.approx(4.0)
    # One at a time (max_num_seqs = 1): 4 steps of 1 s, the shorter one waiting.
    one = Mode(tp=1, cost=per_step.cost, kv_capacity=1e6, max_num_seqs=1)
    assert instance_makespan(one, [1, 3], [0, 0]) == pytest.approx(4.0)
    # KV: k1 = 1 per token; 1 request of context 10 for 2 steps holds 10.5 on average,
    # plus k4 = 1: 2·(10.5 + 1) = 23.
    kv = Mode(tp=1, cost=CostModel(k1=1.0, k2=0.0, k3=0.0, k4=1.0), kv_capacity=1e6)
    assert instance_makespan(kv, [2], [10]) == pytest.approx(23.0)


def test_bulk_goes_to_many_small_instances_and_the_tail_to_few_large_ones():
    bulk = plan_parallelism(PROBLEM, np.full(1024, 1000), np.full(1024, 512))
    assert (bulk.tp, bulk.instances, bulk.switch) == (2, 8, False)
    # 1000 tokens = 4 buckets of 256: 1024 steps; TP2 holds 128 a instance:
    # max(6 ms, 36 µs·128) + 5 ms = 11 ms a step.
    assert dict(bulk.candidates)[2] == pytest.approx(1024 * 11e-3)
    # Four 10K-token stragglers: on TP2 one each at 11 ms a step, on TP8 two each at
    # 6.6 ms: 67.6 s + 14 s of switching beats 112.6 s.
    tail = plan_parallelism(PROBLEM, np.full(4, 10_000), np.full(4, 512), current_tp=2)
    assert (tail.tp, tail.instances, tail.switch) == (8, 2, True)
    assert tail.total_s == pytest.approx(10_240 * 6.6e-3 + 14.0)
    # A switch dearer than the gain keeps the current mode.
    dear = ParallelismProblem(gpus=16, modes=(TP2, TP8), switch_s=1_000.0)
    assert plan_parallelism(dear, np.full(4, 10_000), np.full(4, 512), current_tp=2).tp == 2


def test_modes_that_do_not_fit_are_not_candidates():
    small = Mode(tp=2, cost=TP2.cost, kv_capacity=5_000)
    p = ParallelismProblem(gpus=16, modes=(small, TP8))
    assert plan_parallelism(p, np.full(8, 100), np.full(8, 512)).candidates[0][0] == 2
    # A request of 10K does not fit TP2's 5K tokens; a node holds 4 GPUs: nothing fits.
    with pytest.raises(ValueError, match="no candidate mode fits 16 GPUs \\(4 a node\\)"):
        plan_parallelism(ParallelismProblem(gpus=16, modes=(small, TP8), gpus_per_node=4),
                         np.full(4, 10_000), np.full(4, 512))


lengths = st.lists(st.integers(1, 20_000), min_size=1, max_size=64)


@settings(max_examples=80, deadline=None)
@given(history=st.lists(st.lists(st.floats(1, 3e4), min_size=5, max_size=5), min_size=1,
                        max_size=6),
       smoothing=st.floats(0.05, 1.0), realized=lengths, generated=lengths)
def test_forecast_invariants(history, smoothing, realized, generated):
    q = forecast_quantiles(np.sort(history, axis=1), smoothing=smoothing)
    assert np.all(np.diff(q) >= 0) and q.min() >= 1.0
    assert q.min() >= np.min(history) - 1e-9 and q.max() <= np.max(history) + 1e-9
    points = step_distribution(q, 64)
    left = remove_completed(points, realized)
    assert len(left) == max(64 - len(realized), 0)
    assert np.all(np.isin(left, points))
    g = np.asarray(generated, float)
    for rem in (remaining_lengths(generated, left, len_max=20_000),
                remaining_work(generated, left, len_max=20_000)):
        assert rem.shape == g.shape
        assert np.all(rem >= 1.0) and np.all(rem <= np.maximum(20_000 - g, 1.0))


def test_a_constant_history_forecasts_itself():
    q = [100.0, 400.0, 900.0]
    assert forecast_quantiles([q, q, q], smoothing=0.3).tolist() == q


@settings(max_examples=60, deadline=None)
@given(rem=lengths, extra=st.integers(1, 20_000), instances=st.sampled_from([1, 2, 4]))
def test_more_work_never_finishes_sooner_and_more_instances_never_later(rem, extra, instances):
    ctx = np.full(len(rem), 512.0)
    base = instance_makespan(TP2, rem, ctx)
    assert instance_makespan(TP2, rem + [extra], np.append(ctx, 512.0)) >= base - 1e-9
    # Doubling the instances deals each one a subset of an old instance's requests.
    assert (deployment_makespan(TP8, 2 * instances, rem, ctx)
            <= deployment_makespan(TP8, instances, rem, ctx) + 1e-9)


@settings(max_examples=40, deadline=None)
@given(rem=lengths, current=st.sampled_from([None, 2, 8]), switch=st.floats(0, 200))
def test_the_plan_minimises_makespan_plus_switch(rem, current, switch):
    p = ParallelismProblem(gpus=16, modes=(TP2, TP8), switch_s=switch)
    plan = plan_parallelism(p, rem, np.full(len(rem), 512.0), current_tp=current)
    totals = {tp: span + (switch if current is not None and tp != current else 0.0)
              for tp, span in plan.candidates}
    assert plan.total_s == pytest.approx(min(totals.values()))
    assert plan.instances * plan.tp <= 16
