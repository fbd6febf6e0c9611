"""The cost-model fit recovers known coefficients from synthetic runs; the run plan and
the cost-file plumbing (tests/policy/test_profile_cost_vllm.py runs it on vLLM)."""

import json

import numpy as np
import pytest

from fnrl.policy.profile_cost import (COST_FILE_NAME, Measurement, ProfileArgs, RunCostFit,
                                      _nonnegative_lstsq, fit_cost_model, fit_quality,
                                      load_cost_model, median_runs, plan_runs,
                                      resolve_cost_file, run_order, step_features)
from fnrl.policy.routing import CostModel

TRUTH = RunCostFit(cost=CostModel(k1=2e-6, k2=8e-3, k3=1e-3, k4=4e-3),   # roofline n = 8
                   overhead_s=0.02, per_request_s=1e-3, prefill_s_per_token=1e-5)


def synthetic_runs(fit: RunCostFit, batches, prompts, rng, noise=0.0) -> list[Measurement]:
    """Wall times summed step by step from the cost model itself (not via step_features),
    times log-normal noise of the given σ."""
    runs = []
    for batch in batches:
        for prompt in prompts:
            lengths = rng.integers(10, 60, size=batch)
            wall = fit.overhead_s + batch * (fit.per_request_s + fit.prefill_s_per_token * prompt)
            for t in range(int(lengths.max())):
                n = int((lengths > t).sum())
                wall += float(fit.cost.step_latency(n * (prompt + t), n))
            runs.append(Measurement(prompt, tuple(lengths.tolist()),
                                    wall * float(np.exp(noise * rng.standard_normal()))))
    return runs


def test_step_features_by_hand():
    # Two requests, prompt 3, lengths 2 and 1: step 0 runs both (kv 3+3), step 1 one (kv 4).
    f = step_features(Measurement(3, (2, 1), 0.0), crossover=1.5)
    np.testing.assert_allclose(f, [10, 2, 2 + 1.5, 1, 2, 6])


def test_fit_recovers_coefficients():
    runs = synthetic_runs(TRUTH, (1, 2, 4, 8, 16, 32), (16, 128), np.random.default_rng(0))
    fit = fit_cost_model(runs)
    assert fit_quality(fit, runs)["mean_relative_error"] < 0.01
    assert fit.cost.k3 == pytest.approx(TRUTH.cost.k3, rel=0.1)
    assert fit.crossover == pytest.approx(8, rel=0.15)
    assert fit.cost.k4 == pytest.approx(TRUTH.cost.k4, rel=0.2)
    assert fit.cost.k1 == pytest.approx(TRUTH.cost.k1, rel=0.2)
    assert fit.per_request_s == pytest.approx(TRUTH.per_request_s, rel=0.2)


def test_noisy_fit_predicts_heldout_batches():
    # 10% multiplicative noise; held-out batch sizes lie between the fitted ones.
    rng = np.random.default_rng(1)
    runs = synthetic_runs(TRUTH, (1, 2, 4, 8, 16, 32), (16, 64, 128), rng, noise=0.1)
    held = synthetic_runs(TRUTH, (3, 12, 24), (32, 96), rng)
    q = fit_quality(fit_cost_model(runs), held)
    assert q["mean_relative_error"] < 0.08 and q["r2"] > 0.95
    # A model that ignores the batch (one decode stream's latency) is far off.
    alone = RunCostFit(cost=CostModel(k1=0, k2=0, k3=0, k4=5e-3), overhead_s=0.02,
                       per_request_s=0, prefill_s_per_token=0)
    assert fit_quality(alone, held)["mean_relative_error"] > 0.3


def test_nonnegative_lstsq_drops_negative_columns():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, -1.0, 0.0])            # unconstrained: (1, -1)
    np.testing.assert_allclose(_nonnegative_lstsq(a, b), [0.5, 0.0], atol=1e-12)


def test_plan_and_medians():
    args = ProfileArgs(model_dir="m", batch_sizes=(1, 4), heldout_batch_sizes=(2,),
                       context_fractions=(0.5, 1.0), repeats=3)
    specs = plan_runs(args, context=32)
    assert [s.heldout for s in specs] == [False] * 4 + [True] * 2
    for s in specs:
        assert s.prompt_len + max(s.lengths) <= 32 and min(s.lengths) >= 1
    assert {s.prompt_len + max(s.lengths) for s in specs} == {16, 32}
    assert {s.prompt_len for s in specs} == {2, 4, 8, 16}   # prompts 1/8 or 1/2 in turn
    order = run_order(len(specs), args.repeats, args.seed)
    assert sorted(order) == sorted(list(range(len(specs))) * 3)
    walls = [float(i) + (9.0 if k == 0 else 0.0) for k, i in enumerate(order)]  # one outlier
    runs = median_runs(specs, order, walls)
    assert [m.wall_s for m in runs] == [float(i) for i in range(len(specs))]


def test_load_resolve_and_args(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"k1": 1e-7, "k2": 1e-3, "k3": 1e-4, "k4": 1e-2, "k5": 1.0,
                                "crossover": 10.0}))
    assert load_cost_model(path) == CostModel(k1=1e-7, k2=1e-3, k3=1e-4, k4=1e-2, k5=1.0)
    path.write_text(json.dumps({"k1": 1e-7}))
    with pytest.raises(ValueError, match="lacks coefficient 'k2'"):
        load_cost_model(path)
    assert resolve_cost_file("", tmp_path) is None
    assert resolve_cost_file(str(path), tmp_path) == path
    with pytest.raises(FileNotFoundError, match="profile_cost"):
        resolve_cost_file("auto", tmp_path)
    (tmp_path / COST_FILE_NAME).write_text("{}")
    assert resolve_cost_file("auto", tmp_path) == tmp_path / COST_FILE_NAME
    with pytest.raises(ValueError, match="batch_sizes"):
        ProfileArgs(batch_sizes=(0,))
    with pytest.raises(ValueError, match="context_fractions"):
        ProfileArgs(context_fractions=(1.5,))
    with pytest.raises(ValueError, match="at least 12"):
        fit_cost_model([Measurement(1, (1,), 0.1)])
