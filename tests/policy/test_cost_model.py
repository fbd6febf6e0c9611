"""The decode cost model: Eq. 11 and the gains by hand, and a fit that recovers known
coefficients from synthetic runs (tests/experiments/test_profile_cost_vllm.py fits it
on vLLM)."""

import numpy as np
import pytest

from fnrl.config import CostModel
from fnrl.policy.cost_model import (Measurement, RunCostFit, _nonnegative_lstsq, fit_cost_model,
                                    fit_quality, ideal_gain, marginal_gain, roofline_batch,
                                    step_features, step_latency, throughput)


def test_cost_model_table4_numbers():
    """Eq. 11 / Eq. 2 with Table 4's coefficients, by hand."""
    c = CostModel()
    # 64 running, 64k KV tokens: k3·64 = 8.0e-3 > k2, so compute-bound.
    lat = 7.28e-8 * 65536 + 1.25e-4 * 64 + 1.07e-2
    assert step_latency(c, 65536, 64) == pytest.approx(lat)
    assert throughput(c, 65536, 64) == pytest.approx(64 / lat)
    assert ideal_gain(c, 1000) == pytest.approx(1 / (7.28e-8 * 1000 + 1.72e-3 + 1.07e-2))
    assert roofline_batch(c) == 13          # k2/k3 = 13.76 (digest: "≈ 13.8")


def test_marginal_gain_is_zero_when_it_would_wait():
    c = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0)
    kv, n = np.array([0.0, 95.0, 0.0]), np.array([0.0, 1.0, 1.0])
    n_wait, cap = np.array([0.0, 0.0, 2.0]), np.full(3, 100.0)
    gain = marginal_gain(c, kv, n, n_wait, cap, throughput(c, kv, n), 10)
    np.testing.assert_allclose(gain, [1.0, 0.0, 0.0])  # KV full; a queue already waits


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
                wall += float(step_latency(fit.cost, n * (prompt + t), n))
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


def test_fit_needs_enough_runs():
    with pytest.raises(ValueError, match="at least 12"):
        fit_cost_model([Measurement(1, (1,), 0.1)])


def test_a_fit_without_a_step_cost_is_named():
    """Runs whose wall time is all per-request (no decode step costs anything) leave no
    model to fit: the error says so, rather than CostModel's k2+k3+k4 check."""
    rng = np.random.default_rng(0)
    runs = [Measurement(int(p), tuple(int(n) for n in rng.integers(1, 30, size=b)), 0.01 * b)
            for p, b in zip(rng.integers(4, 40, size=16), rng.integers(1, 9, size=16))]
    with pytest.raises(ValueError, match="no fit of these 16 runs has a per-step decode cost"):
        fit_cost_model(runs)


def test_a_stored_profile_without_a_fit_is_refused_with_its_reason():
    """profile_cost keeps its measurements when the fit refuses (`fit_error`); a reader of
    that file gets the reason, not a missing-key error, and a fitted file reads back."""
    from fnrl.policy.cost_model import stored_cost_model

    with pytest.raises(ValueError, match="'p.json' holds measurements but no fit: too noisy"):
        stored_cost_model({"fit": None, "fit_error": "too noisy", "runs": []}, "p.json")
    with pytest.raises(ValueError, match="lacks coefficient 'k4'"):
        stored_cost_model({"k1": 1, "k2": 1, "k3": 1, "k5": 1}, "p.json")
    assert stored_cost_model({"k1": 1e-9, "k2": 1e-3, "k3": 1e-4, "k4": 2e-3, "k5": 1.0},
                             "p.json") == CostModel(k1=1e-9, k2=1e-3, k3=1e-4, k4=2e-3, k5=1.0)
