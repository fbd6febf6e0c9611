"""The profiling command on a real vLLM server: a short profile whose fit must predict
batches it never saw, and whose file the main job loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fnrl.config import CoordinatorConfig, CostModel, RunConfig
from fnrl.experiments.profile_cost import ProfileArgs, load_cost_model, main
from fnrl.policy.cost_model import Measurement, RunCostFit, fit_quality, step_latency

pytestmark = pytest.mark.slow

# Stated tolerance for held-out batches (sizes between the fitted ones), on a shared
# 2-core box where repeats of one batch differ by ~50% (hence medians of 3 repeats).
HELDOUT_MEAN_REL_ERR = 0.30


def test_short_profile_predicts_heldout_batches(tiny_model_dir, tmp_path):
    out = tmp_path / "cost.json"
    record = main(ProfileArgs(model_dir=str(tiny_model_dir), out=str(out),
                              batch_sizes=(1, 2, 4, 8, 16, 32), heldout_batch_sizes=(3, 12, 24),
                              context_fractions=(0.25, 0.5, 1.0), repeats=3, max_num_seqs=32))
    assert json.loads(out.read_text())["k3"] == record["k3"]
    cost = load_cost_model(out)
    fit = RunCostFit(cost=cost, overhead_s=record["overhead_s"],
                     per_request_s=record["per_request_s"],
                     prefill_s_per_token=record["prefill_s_per_token"])
    held = [Measurement(r["prompt_len"], tuple(r["lengths"]), float(np.median(r["wall_s"])))
            for r in record["runs"] if r["heldout"]]
    quality = fit_quality(fit, held)
    assert quality == pytest.approx(record["heldout"])
    assert quality["runs"] == 9
    assert quality["mean_relative_error"] < HELDOUT_MEAN_REL_ERR, record["heldout"]
    # The fit sees the batch: a model blind to it (one stream's step latency, no
    # per-request cost) predicts the same held-out batches far worse.
    blind = RunCostFit(cost=CostModel(k1=0.0, k2=0.0, k3=0.0,
                                      k4=float(step_latency(cost, 16, 1))),
                       overhead_s=fit.overhead_s, per_request_s=0.0, prefill_s_per_token=0.0)
    assert quality["mean_relative_error"] < 0.5 * fit_quality(blind, held)["mean_relative_error"]

    # The main job loads the file into CoordinatorConfig.cost, keeping its path.
    from fnrl.experiments.math_grpo import with_cost_file

    cfg, path = with_cost_file(RunConfig(coord=CoordinatorConfig(cost_file=str(out))),
                               tiny_model_dir)
    assert path == out and cfg.coord.cost == cost and cfg.coord.cost_file == str(out)
