"""The cost-model fit recovers known coefficients from synthetic runs."""

import json

import numpy as np
import pytest

from fnrl.policy.profile_cost import (Measurement, ProfileArgs, fit_cost_model, load_cost_model,
                                      step_features)
from fnrl.policy.routing import CostModel


def test_step_features_by_hand():
    # Two requests, prompt 3, lengths 2 and 1: step 0 runs both (kv 3+3), step 1 one (kv 4).
    f = step_features(Measurement(3, (2, 1), 0.0), crossover=1.5)
    np.testing.assert_allclose(f, [10, 2, 2 + 1.5, 1, 6])


def test_fit_recovers_coefficients():
    truth = CostModel(k1=2e-6, k2=8e-3, k3=1e-3, k4=4e-3)     # roofline at n = 8
    rng = np.random.default_rng(0)
    runs = []
    for batch in (1, 2, 4, 8, 16, 32):
        for prompt in (16, 128):
            lengths = tuple(rng.integers(10, 60, size=batch).tolist())
            lengths_a = np.asarray(lengths)
            wall = 0.02 + 1e-5 * batch * prompt
            for t in range(max(lengths)):
                n = int((lengths_a > t).sum())
                wall += float(truth.step_latency(n * (prompt + t) if n else 0, n))
            runs.append(Measurement(prompt, lengths, wall))
    model, diag = fit_cost_model(runs)
    assert diag["mean_relative_error"] < 0.01
    assert model.k3 == pytest.approx(truth.k3, rel=0.1)
    assert model.k2 / model.k3 == pytest.approx(8, rel=0.15)
    assert model.k4 == pytest.approx(truth.k4, rel=0.2)
    assert model.k1 == pytest.approx(truth.k1, rel=0.2)


def test_load_and_args(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"k1": 1e-7, "k2": 1e-3, "k3": 1e-4, "k4": 1e-2, "k5": 1.0,
                                "crossover": 10.0}))
    assert load_cost_model(path) == CostModel(k1=1e-7, k2=1e-3, k3=1e-4, k4=1e-2, k5=1.0)
    with pytest.raises(ValueError, match="batch_sizes"):
        ProfileArgs(model_dir="x", out="y", batch_sizes=(0,))
    with pytest.raises(ValueError, match="at least 6"):
        fit_cost_model([Measurement(1, (1,), 0.1)])
