"""The profiling command's run plan and its cost-file plumbing (the fit itself:
tests/policy/test_cost_model.py; on vLLM: test_profile_cost_vllm.py)."""

import json

import pytest

from fnrl.config import CostModel
from fnrl.experiments.profile_cost import (COST_FILE_NAME, ProfileArgs, load_cost_model,
                                           median_runs, plan_runs, recorded_runs,
                                           resolve_cost_file, run_order)


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
    # Two servers a run, each its own wall time; one outlier.
    walls = [(float(i) + (9.0 if k == 0 else 0.0), 2.0 * i) for k, i in enumerate(order)]
    runs = median_runs([(s, s) for s in specs], order, walls)
    assert [m.wall_s for m, _ in runs] == [x for i in range(len(specs)) for x in (i, 2.0 * i)]
    assert [heldout for _, heldout in runs] == [s.heldout for s in specs for _ in (0, 1)]


def write_run(run_dir, groups):
    """A run directory's trajectories.jsonl: one line a group, (prompt, lengths)."""
    run_dir.mkdir()
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps({"group": f"g{i}", "trajectories": [
        {"prompt_ids": list(prompt), "token_ids": [[7] * n], "segments": [[0, n]]}
        for n in lengths]}) + "\n"
        for i, (prompt, lengths) in enumerate(groups)))


def test_recorded_batches_dealt_group_by_group(tmp_path):
    groups = [((1, 2, 3), (4, 0)), ((5, 6), (2, 3)), ((7,), (9, 1)), ((8, 9, 10), (5, 5)),
              ((11,), (1, 1))]                      # the fifth group makes no whole batch
    write_run(tmp_path / "a", groups)
    runs = recorded_runs((str(tmp_path / "a"),), servers=2, batch_groups=2, heldout_every=2)
    assert len(runs) == 2
    (s0, s1), (t0, t1) = runs
    assert (s0.lengths, s0.prompts, s0.heldout) == ((4, 1), ((1, 2, 3), (1, 2, 3)), False)
    assert (s1.lengths, s1.prompts, s1.prompt_len) == ((2, 3), ((5, 6), (5, 6)), 2)
    assert (t0.lengths, t1.lengths, t0.heldout) == ((9, 1), (5, 5), True)
    # One server takes every group of a batch, in order.
    (only,), _ = recorded_runs((str(tmp_path / "a"),), servers=1, batch_groups=2,
                               heldout_every=0)
    assert only.lengths == (4, 1, 2, 3) and not only.heldout
    with pytest.raises(ValueError, match="without work"):
        recorded_runs((str(tmp_path / "a"),), servers=3, batch_groups=2, heldout_every=0)
    with pytest.raises(FileNotFoundError, match="trajectories.jsonl"):
        recorded_runs((str(tmp_path / "missing"),), servers=1, batch_groups=1, heldout_every=0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "trajectories.jsonl").write_text(json.dumps({"trajectories": [
        {"prompt_ids": [1], "token_ids": [[2], [3]], "segments": [[0, 1], [2, 1]]}]}) + "\n")
    with pytest.raises(ValueError, match="line 1 holds a multi-turn trajectory"):
        recorded_runs((str(tmp_path / "b"),), servers=1, batch_groups=1, heldout_every=0)


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
    with pytest.raises(ValueError, match="servers"):
        ProfileArgs(servers=0)
    with pytest.raises(ValueError, match="heldout_every"):
        ProfileArgs(heldout_every=-1)
