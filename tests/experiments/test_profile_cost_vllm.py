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
    held = [Measurement(s["prompt_len"], tuple(s["lengths"]),
                        float(np.median([w[k] for w in r["wall_s"]])))
            for r in record["runs"] for k, s in enumerate(r["servers"]) if s["heldout"]]
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


def test_recorded_batches_on_two_servers(tiny_model_dir, tmp_path):
    """--batches-from on two servers side by side: a run directory's groups, dealt group
    by group, each server timed on its own batch; the file says it was two servers', and
    the simulator reads it so (fnrl.sim.costs.load_profiled)."""
    from fnrl.sim.costs import load_profiled

    rng = np.random.default_rng(0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    groups = [{"trajectories": [{"prompt_ids": prompt, "token_ids": [[5] * int(n)],
                                 "segments": [[0, int(n)]]}
                                for n in rng.integers(6, 26, size=2)]}
              for prompt in rng.integers(3, 60, size=(16, 6)).tolist()]
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    out = tmp_path / "served.json"
    record = main(ProfileArgs(model_dir=str(tiny_model_dir), out=str(out), servers=2,
                              batches_from=(str(run_dir),), batch_groups=2, repeats=1,
                              max_num_seqs=8, max_context=64))
    assert record["engine"]["servers"] == 2 and len(record["runs"]) == 8
    for r in record["runs"]:
        assert len(r["servers"]) == 2 and all(len(w) == 2 and min(w) > 0 for w in r["wall_s"])
    assert [list(s["lengths"]) for s in record["runs"][0]["servers"]] == [
        [len(t["token_ids"][0]) for t in groups[k]["trajectories"]] for k in (0, 1)]
    assert (record["fit"]["runs"], record["heldout"]["runs"]) == (12, 4)
    assert load_profiled(out).servers == 2
