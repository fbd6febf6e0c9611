"""LlamaRL's split planner: a case worked by hand, the memory limits as properties, and
a machine too small said with its figures."""

import pytest
from hypothesis import given, settings, strategies as st

from fnrl.policy.split import (SplitProblem, colocated_memory, generator_memory, plan_colocated,
                               plan_split, trainer_memory)


def eta_t(b, m):
    return 1.0 + 1.0 / b


def eta_g(b, m):
    return 2.0 + 8.0 / b


HAND = SplitProblem(gpus=8, batch=64, gpu_memory=80.0, weights=20.0, act_per_sample=5.0,
                    kv_per_sample=1.0, mp_sizes=(1, 2, 4, 8), train_batches=(1, 2, 4),
                    gen_batches=(8, 16, 32))


def test_a_case_worked_by_hand():
    # Colocated: m = 1 cannot hold 5W = 100; m = 2 holds b_t = 4, b_g = 32 (152 / 2 = 76):
    # (64·2/8)·(η_t(4) + η_g(32)) = 16·(1.25 + 2.25) = 56 s.
    sync = plan_colocated(HAND, eta_t, eta_g)
    assert (sync.step_s, sync.mp_train, sync.batch_train, sync.batch_gen) == (56.0, 2, 4, 32)
    # Split: the trainer needs m_t = 2 (4W + 5·4 = 100 over 2), the generator fits on one
    # GPU (20 + 32 = 52). On 4 + 4 GPUs: 64·max(1.25·2/4, 2.25·1/4) = 64·0.625 = 40 s.
    split = plan_split(HAND, eta_t, eta_g)
    assert (split.step_s, split.mp_train, split.mp_gen) == (40.0, 2, 1)
    assert (split.gpus_train, split.gpus_gen, split.batch_train, split.batch_gen) == (4, 4, 4, 32)
    assert split.train_s == 40.0 and split.gen_s == 36.0


def test_a_machine_too_small_is_refused_with_the_figures():
    tiny = SplitProblem(gpus=8, batch=64, gpu_memory=10e9, weights=140e9, act_per_sample=1e9,
                        kv_per_sample=1e8, mp_sizes=(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"no trainer fits: the smallest needs 70\.1 GB per GPU "
                                         r"at model-parallel degree 8 .* holds 10\.0 GB"):
        plan_split(tiny, eta_t, eta_g)
    with pytest.raises(ValueError, match="no colocated configuration fits"):
        plan_colocated(tiny, eta_t, eta_g)


decreasing = st.tuples(st.floats(0.01, 5.0), st.floats(0.0, 50.0))


@settings(max_examples=60, deadline=None)
@given(gpus=st.sampled_from([8, 16, 64, 256]), weights=st.floats(1.0, 60.0),
       act=st.floats(0.0, 8.0), kv=st.floats(0.0, 2.0), t=decreasing, g=decreasing)
def test_plans_keep_the_memory_limits_and_their_own_step_formula(gpus, weights, act, kv, t, g):
    p = SplitProblem(gpus=gpus, batch=512, gpu_memory=80.0, weights=weights,
                     act_per_sample=act, kv_per_sample=kv)
    et, eg = (lambda b, m: t[0] + t[1] / b), (lambda b, m: g[0] + g[1] / b)
    try:
        sync = plan_colocated(p, et, eg)
    except ValueError:
        return   # too big for 64-way model parallelism: nothing to compare
    split = plan_split(p, et, eg)
    assert colocated_memory(p, sync.batch_train, sync.batch_gen, sync.mp_train) <= 80.0
    assert trainer_memory(p, split.batch_train, split.mp_train) <= 80.0
    assert generator_memory(p, split.batch_gen, split.mp_gen) <= 80.0
    assert split.gpus_train + split.gpus_gen == gpus
    assert split.gpus_train % split.mp_train == 0 and split.gpus_gen % split.mp_gen == 0
    assert split.step_s == max(split.train_s, split.gen_s)
    assert sync.step_s == pytest.approx(512 * sync.mp_train / gpus
                                        * (et(sync.batch_train, sync.mp_train)
                                           + eg(sync.batch_gen, sync.mp_train)))
    # The proof of Theorem 7.5, discretely: the colocated optimum's degree and batch sizes
    # fit each side's own limit (each is part of the joint one), so running them on two
    # groups of whole model-parallel instances is a split candidate; the split plan is at
    # least as fast as the best such candidate.
    m = sync.mp_train
    as_split = [512 * m * max(et(sync.batch_train, m) / x, eg(sync.batch_gen, m) / (gpus - x))
                for x in range(m, gpus, m)]
    if as_split:
        assert split.step_s <= min(as_split) * (1 + 1e-12)


def test_a_quantized_generator_holds_its_own_weights():
    # fp8 halves the generator's replica: 10 + 32 = 42 on one GPU instead of 20 + 32 = 52;
    # the trainer and the colocated baseline keep W.
    fp8 = SplitProblem(gpus=8, batch=64, gpu_memory=80.0, weights=20.0, gen_weights=10.0,
                       act_per_sample=5.0, kv_per_sample=1.0)
    assert generator_memory(fp8, 32, 1) == 42.0 and generator_memory(HAND, 32, 1) == 52.0
    assert trainer_memory(fp8, 4, 2) == trainer_memory(HAND, 4, 2) == 50.0
    assert colocated_memory(fp8, 4, 32, 2) == colocated_memory(HAND, 4, 32, 2) == 76.0


def test_the_per_sample_time_sees_the_degree():
    # The paper's η ignores m, so the narrowest generator that fits wins (m_g = 1 above).
    # One whose wider instances are superlinearly faster, η·m = (2 + 8/b)/m, goes wide: with
    # a trainer of 0.01 s a sample on 2 GPUs, m_g = 4 on 4 GPUs makes 64·2.25/4/4 = 9 s,
    # against 64·2.25/2/6 = 12 s at m_g = 2 on 6 (8 needs all the GPUs).
    seen = []

    def superlinear(b, m):
        seen.append(m)
        return (2.0 + 8.0 / b) / m ** 2

    split = plan_split(HAND, lambda b, m: 0.01, superlinear)
    assert (split.mp_gen, split.gpus_gen, split.gen_s) == (4, 4, 9.0) and set(seen) == {1, 2, 4, 8}
