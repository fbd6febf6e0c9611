"""The profiling command's run plan and its cost-file plumbing (the fit itself:
tests/policy/test_cost_model.py; on vLLM: test_profile_cost_vllm.py)."""

import json

import pytest

from fnrl.config import CostModel
from fnrl.experiments.profile_cost import (COST_FILE_NAME, ProfileArgs, load_cost_model,
                                           median_runs, plan_runs, resolve_cost_file,
                                           run_order)


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
