"""The profiling command on a real vLLM server: a short profile, its fit and held-out
figures written and consistent, and its file loaded by the main job. How well the fit
predicts is a timing claim: lab/benchmarks/profile_cost.py measures it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fnrl.config import CoordinatorConfig, RunConfig
from fnrl.experiments.profile_cost import ProfileArgs, UnfittedProfile, load_cost_model, main

from lab.benchmarks.profile_cost import heldout_quality

pytestmark = pytest.mark.slow


def test_short_profile_writes_a_fit_and_its_heldout_figures(tiny_model_dir, tmp_path):
    out = tmp_path / "cost.json"
    record = main(ProfileArgs(model_dir=str(tiny_model_dir), out=str(out),
                              batch_sizes=(1, 2, 4, 6, 8, 16), heldout_batch_sizes=(3, 12),
                              context_fractions=(0.5, 1.0), repeats=1, max_num_seqs=16))
    assert json.loads(out.read_text())["k3"] == record["k3"]
    cost = load_cost_model(out)
    fit, blind = heldout_quality(record, cost)
    # The record's held-out figures are the fit's own, recomputed from its measurements.
    assert fit == pytest.approx(record["heldout"])
    assert fit["runs"] == 2 * 2   # two held-out sizes at two context fractions
    for quality in (fit, blind):
        assert math.isfinite(quality["mean_relative_error"]) and quality["mean_relative_error"] >= 0
    assert all(np.isfinite([cost.k1, cost.k2, cost.k3, cost.k4]))

    # The main job loads the file into CoordinatorConfig.cost, keeping its path.
    from fnrl.experiments.math_grpo import with_cost_file

    cfg, path = with_cost_file(RunConfig(coord=CoordinatorConfig(cost_file=str(out))),
                               tiny_model_dir)
    assert path == out and cfg.coord.cost == cost and cfg.coord.cost_file == str(out)


def test_recorded_batches_on_two_servers(char_tokenizer_dir, tmp_path):
    """--batches-from on two servers side by side: a run directory's groups, dealt group
    by group, each server timed on its own batch; the file says it was two servers', and
    the simulator reads it so (fnrl.sim.costs.load_profiled)."""
    from fnrl.models.synthetic import write_checkpoint
    from fnrl.sim.costs import load_profiled

    # The tiny model with 256 positions, so responses run to 200 tokens: with the 32 of
    # `tiny_model_dir` they ran to 26 (0.07-0.15 s a batch), and beside other jobs the
    # fit put every second on the per-request overhead and refused, rightly (twice in
    # full-suite runs, with three repeats of each batch too).
    model_dir = write_checkpoint(tmp_path / "model", "qwen2", seed=0,
                                 tokenizer_dir=char_tokenizer_dir, vocab_multiple=16,
                                 rope_theta=10000.0, max_position_embeddings=256)
    rng = np.random.default_rng(0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    groups = [{"trajectories": [{"prompt_ids": prompt, "token_ids": [[5] * int(n)],
                                 "segments": [[0, int(n)]]}
                                for n in rng.integers(40, 201, size=2)]}
              for prompt in rng.integers(3, 60, size=(16, 6)).tolist()]
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    out = tmp_path / "served.json"
    args = ProfileArgs(model_dir=str(model_dir), out=str(out), servers=2,
                       batches_from=(str(run_dir),), batch_groups=2, repeats=2,
                       max_num_seqs=8, max_context=256)
    try:
        record = main(args)
    except UnfittedProfile as err:
        # Two servers timed side by side on two cores beside other jobs can be too noisy
        # to fit (CI once: a 100-token batch as slow as a 350-token one). The refusal
        # must keep the measurements, and the simulator must refuse the file by name.
        record = json.loads(out.read_text())
        assert str(out) in str(err) and record == err.record and record["fit"] is None
        with pytest.raises(ValueError, match="holds measurements but no fit: no fit of these"):
            load_profiled(out)
    else:
        assert (record["fit"]["runs"], record["heldout"]["runs"]) == (12, 4)
        assert load_profiled(out).servers == 2
    assert record["engine"]["servers"] == 2 and len(record["runs"]) == 8
    for r in record["runs"]:
        assert len(r["servers"]) == 2 and all(len(w) == 2 and min(w) > 0 for w in r["wall_s"])
    assert [list(s["lengths"]) for s in record["runs"][0]["servers"]] == [
        [len(t["token_ids"][0]) for t in groups[k]["trajectories"]] for k in (0, 1)]
