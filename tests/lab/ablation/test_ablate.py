"""The ablation runner: grid expansion and run order, every cell checked up front,
resumability, and the comparison table over run directories (fast: the cells' job is
a small script writing what a run writes); one tiny grid end to end on the real job."""

import csv
import io
import json
import sys
from collections import Counter

import pytest

from lab.ablation import ablate
from lab.ablation.ablate import cell_config, run_ablation, write_cell_file
from lab.ablation.grid import (AblationSpec, Cell, cell_finished, expand,
                                           parse_spec, read_spec)
from lab.ablation.report import (accuracy_at, collect, common_tokens,
                                              summarize, write_report)


def spec_of(tmp_path, **kw):
    data = {"name": "t", "output": str(tmp_path / "out"), "warm_compile": False,
            "base": {"steps": 2, "algo.groups_per_step": 4},
            "grid": {"preset": ["sync", "fnrl", "laminar"], "seed": [0, 1, 2, 3]}, **kw}
    return parse_spec(data)


def test_the_grid_is_the_product_and_every_round_holds_every_variant_once(tmp_path):
    spec = spec_of(tmp_path, grid={"preset": ["sync", "fnrl"], "coord.eta": [1, 3],
                                   "algo.learning_rate": [1e-4, 3e-4], "seed": [0, 1, 2]})
    cells = expand(spec)
    assert len(cells) == 2 * 2 * 2 * 3 and len({c.name for c in cells}) == len(cells)
    for r, seed in enumerate([0, 1, 2]):
        in_round = [c for c in cells if c.round == r]
        assert all(dict(c.values)["seed"] == seed for c in in_round)
        assert len({c.variant_name for c in in_round}) == 8
    # Rounds run one after another.
    assert [c.round for c in cells] == sorted(c.round for c in cells)
    # A cell's config: base, then the preset, then the axis over the preset (η).
    cfg = cell_config(spec, next(c for c in cells if dict(c.values) == {
        "preset": "sync", "coord.eta": 3, "algo.learning_rate": 3e-4, "seed": 2}))
    assert (cfg.preset, cfg.coord.eta, cfg.algo.learning_rate, cfg.seed, cfg.steps,
            cfg.algo.groups_per_step) == ("sync", 3, 3e-4, 2, 2, 4)
    assert cfg.coord.routing.sync == "greedy"            # the rest of sync's coordinator
    assert cfg.run_dir == str(spec.out_dir / cell_name(cells, "sync", 3, 3e-4, 2))


def cell_name(cells, preset, eta, lr, seed):
    return next(c.name for c in cells if dict(c.values) == {
        "preset": preset, "coord.eta": eta, "algo.learning_rate": lr, "seed": seed})


def test_orders_vary_between_rounds(tmp_path):
    def firsts(order, rounds=4):
        cells = expand(spec_of(tmp_path, order=order,
                               grid={"preset": ["sync", "fnrl", "laminar"],
                                     "seed": list(range(rounds))}))
        return [[dict(c.values)["preset"] for c in cells if c.round == r] for r in range(rounds)]

    balanced = firsts("balanced")
    assert balanced[1] == balanced[0][::-1] and balanced[3] == balanced[2][::-1]
    assert balanced[2] != balanced[0]
    # Over two rounds every preset's mean position is the same.
    pos = Counter()
    for order in balanced[:2]:
        for i, p in enumerate(order):
            pos[p] += i
    assert len(set(pos.values())) == 1
    rotate = firsts("rotate")
    assert [o[0] for o in rotate] == ["sync", "fnrl", "laminar", "sync"]
    assert firsts("listed") == [["sync", "fnrl", "laminar"]] * 4
    assert firsts("shuffle") == firsts("shuffle")        # the same on every resume
    assert all(sorted(o) == ["fnrl", "laminar", "sync"] for o in firsts("shuffle", 6))


@pytest.mark.parametrize("change, message", [
    ({"grdi": {}}, "unknown key(s) ['grdi']"),
    ({"order": "random"}, "order='random'"),
    ({"grid": {"preset": ["sync", "sync"]}}, "repeats a value"),
    ({"grid": {"preset": []}}, "has no values"),
    ({"reference": {"coord.eta": 1}}, "reference names 'coord.eta'"),
    ({"reference": {"preset": "staleflow"}}, "not among the axis's values"),
    ({"name": "a b"}, "name='a b'"),
    ({"grid": {}}, "grid names no axis"),
    ({"pin_model": "yes"}, "pin_model='yes' must be true or false"),
])
def test_bad_ablation_files_say_what_is_wrong(tmp_path, change, message):
    with pytest.raises(ValueError) as err:
        spec_of(tmp_path, **change)
    assert message in str(err.value)


def test_a_bad_cell_fails_before_any_cell_runs(tmp_path):
    spec = spec_of(tmp_path, grid={"preset": ["sync"], "algo.learnin_rate": [1e-4],
                                   "seed": [0]})
    with pytest.raises(ValueError, match=r"cell preset=sync__algo.learnin_rate=0.0001__seed=0.*"
                                         r"algo.learnin_rate"):
        run_ablation(spec)
    assert not (spec.out_dir / expand(spec)[0].name).exists()
    bad_value = spec_of(tmp_path, grid={"coord.eta": [-1]})
    with pytest.raises(ValueError, match="eta"):
        run_ablation(bad_value)


FAKE_JOB = r"""
import json, sys, yaml
from pathlib import Path
data = yaml.safe_load(Path(sys.argv[1]).read_text())
run_dir = Path(data["run_dir"])
with open(run_dir.parent / "ran.txt", "a") as f:
    f.write(run_dir.name + "\n")
(run_dir / "config.json").write_text(json.dumps(data))
if data.get("seed") == 99:
    sys.exit(3)
seed, preset = data.get("seed", 0), data["preset"]
speed = {"sync": 100.0, "fnrl": 200.0, "laminar": 150.0}[preset] * (1 + seed)
(run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
    {"kind": "eval", "step": 0, "accuracy": 0.1, "trained_tokens": 0},
    {"kind": "train", "step": 1, "staleness_hist": [30, 10]},
    {"kind": "train", "step": 2, "staleness_hist": [20, 0, 20]},
    {"kind": "eval", "step": 2, "accuracy": 0.5, "trained_tokens": 1000 * (2 + seed)},
]) + "\n")
(run_dir / "summary.json").write_text(json.dumps({
    "steps": data["steps"], "trained_tokens_per_s": speed, "generated_tokens": 2 * speed,
    "rl_wall_s": 1.0, "trainer_idle_frac": 0.5, "rollout_idle_frac": 0.25,
    "wall_s_all_attempts": 10.0, "trained_tokens": 1000}))
"""


@pytest.fixture
def fake_job(monkeypatch, tmp_path):
    """Cells run a script that writes what a finished run writes, from the cell file."""
    script = tmp_path / "fake_job.py"
    script.write_text(FAKE_JOB)
    monkeypatch.setattr(ablate, "cell_command",
                        lambda cell_file: [sys.executable, str(script), str(cell_file)])


def ran(spec):
    path = spec.out_dir / "ran.txt"
    return path.read_text().split() if path.exists() else []


def test_finished_cells_are_not_run_again_and_unfinished_ones_start_afresh(tmp_path, fake_job):
    spec = spec_of(tmp_path, grid={"preset": ["sync", "fnrl"], "seed": [0, 1]})
    cells = expand(spec)
    state = run_ablation(spec, max_cells=3)
    assert ran(spec) == [c.name for c in cells[:3]]
    assert list(state.values()) == ["ran"] * 3 + ["pending"]
    # An attempt that died: a config.json and no summary.
    (spec.out_dir / cells[1].name / "summary.json").unlink()
    state = run_ablation(spec)
    assert ran(spec)[3:] == [cells[1].name, cells[3].name]
    assert [state[c.name] for c in cells] == ["finished", "ran", "finished", "ran"]
    assert (spec.out_dir / f"{cells[1].name}.old" / "config.json").exists()
    assert all(cell_finished(spec, c) for c in cells)
    run_ablation(spec)
    assert len(ran(spec)) == 5                           # nothing left to run
    # A summary of fewer steps than the run asked for is not finished.
    summary = spec.out_dir / cells[0].name / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "steps": 1}))
    assert not cell_finished(spec, cells[0])
    # A cell of a changed file (another base) is not finished: it runs again.
    changed = parse_spec({"name": "t", "output": str(spec.out_dir), "warm_compile": False,
                          "base": {"steps": 2, "algo.groups_per_step": 2},
                          "grid": {"preset": ["sync", "fnrl"], "seed": [0, 1]}})
    assert not any(cell_finished(changed, c) for c in cells)
    run_ablation(changed, max_cells=1)
    assert ran(spec)[5:] == [cells[0].name]


def test_a_failing_cell_is_reported_and_the_rest_still_run(tmp_path, fake_job):
    spec = spec_of(tmp_path, grid={"preset": ["sync"], "seed": [99, 0]}, order="listed")
    state = run_ablation(spec)
    assert list(state.values()) == ["failed (exit 3)", "ran"]


def test_the_table_gives_the_spread_over_seeds_and_ratios_round_by_round(tmp_path, fake_job):
    spec = spec_of(tmp_path, grid={"preset": ["sync", "fnrl", "laminar"], "seed": [0, 1, 2]},
                   order="listed")
    cells = expand(spec)
    run_ablation(spec, max_cells=8)                     # one laminar cell left pending
    rows = collect(spec, cells)
    assert len(rows) == 8
    # acc at the tokens every cell reached (seed 0: 2000 at its last eval), linear.
    assert {r["acc_tokens"] for r in rows} == {2000}
    by = {(r["values"]["preset"], r["values"]["seed"]): r for r in rows}
    assert by[("sync", 0)]["acc_at_tokens"] == pytest.approx(0.5)
    assert by[("sync", 1)]["acc_at_tokens"] == pytest.approx(0.1 + 0.4 * 2000 / 3000)
    # staleness over both steps' tokens: (0·50 + 1·10 + 2·20) / 80
    assert by[("sync", 0)]["staleness_mean"] == pytest.approx(50 / 80)
    assert by[("sync", 0)]["staleness_max"] == 2
    assert by[("fnrl", 2)]["generated_tok_s"] == pytest.approx(2 * 600.0)
    summary = {e["variant_name"]: e for e in summarize(spec, rows)}
    assert list(summary) == ["preset=sync", "preset=fnrl", "preset=laminar"]  # grid order
    fnrl = summary["preset=fnrl"]
    assert fnrl["n"] == 3 and fnrl["trained_tok_s"]["median"] == 400.0
    assert (fnrl["trained_tok_s"]["min"], fnrl["trained_tok_s"]["max"]) == (200.0, 600.0)
    # Each round's ratio is 2.0 although the seeds' speeds differ threefold.
    assert fnrl["trained_tok_s_ratio"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}
    assert summary["preset=laminar"]["n"] == 2
    paths = write_report(spec, cells)
    md = (spec.out_dir / "ablation.md").read_text()
    assert "8 of 9 cells finished (1 pending)" in md
    assert "| preset=fnrl | 3 | 400.0 (200.0–600.0) | 2.00 (2.00–2.00) |" in md
    table = list(csv.DictReader(io.StringIO((spec.out_dir / "ablation.csv").read_text())))
    assert [r["preset"] for r in table] == ["sync", "fnrl", "laminar"]
    assert float(table[2]["trained_tok_s_ratio_median"]) == 1.5
    per_cell = list(csv.DictReader(io.StringIO((spec.out_dir / "cells.csv").read_text())))
    assert len(per_cell) == 8 and per_cell[0]["cell"] == cells[0].name
    assert (spec.out_dir / "ablation.png").stat().st_size > 10_000 and len(paths) == 4


def test_accuracy_at_equal_tokens_is_linear_and_never_extrapolated():
    curve = [(0, 0.0), (100, 0.5), (300, 0.7)]
    assert accuracy_at(curve, 50) == pytest.approx(0.25)
    assert accuracy_at(curve, 200) == pytest.approx(0.6)
    assert accuracy_at(curve, 301) != accuracy_at(curve, 301)   # nan past the last eval
    assert common_tokens([curve, [(0, 0.1), (250, 0.3)]]) == 250
    assert common_tokens([curve, []]) == 0


def test_print_commands_writes_the_cell_files_of_unfinished_cells(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text(f"name: p\noutput: {tmp_path / 'out'}\nwarm_compile: false\n"
                    "base: {steps: 2}\ngrid: {preset: [sync, fnrl], seed: [0]}\n")
    spec = read_spec(path)
    done = write_cell_file(spec, expand(spec)[0]).parent
    (done / "config.json").write_text(json.dumps({"steps": 2}))
    (done / "summary.json").write_text(json.dumps({"steps": 2}))
    assert ablate.main([str(path), "--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{expand(spec)[1].name}/cell.yaml")
    assert "fnrl.experiments.math_grpo --config" in lines[0]
    from fnrl.experiments.math_grpo import parse_config
    cfg = parse_config(["--config", lines[0].split()[-1]])
    assert (cfg.preset, cfg.steps, cfg.run_dir) == ("fnrl", 2, str(spec.out_dir / expand(spec)[1].name))
    assert ablate.main([str(tmp_path / "missing.yaml")]) == 2


def test_the_presets_benchmark_file_expands_to_every_preset_in_every_round():
    from pathlib import Path

    from fnrl.config.presets import PRESETS

    spec = read_spec(Path(__file__).parents[3] / "lab" / "benchmarks" / "ablations"
                     / "presets.yaml")
    cells = expand(spec)
    for r in {c.round for c in cells}:
        assert sorted(dict(c.values)["preset"] for c in cells if c.round == r) == sorted(PRESETS)
    assert [cell_config(spec, c).preset for c in cells[:1]]
    assert isinstance(cells[0], Cell) and isinstance(spec, AblationSpec)


@pytest.mark.parametrize("trainer", [{}, {"pack_rows": 16, "micro_batches": 2},
                                     {"length_buckets": (24, 100, 256)}])
def test_the_warm_up_builds_the_batch_the_controller_sends_in_every_bucket(tmp_path, trainer):
    """The warm-up compiles the trainer role's program only if its batches have the keys,
    dtypes and shapes of the controller's (make_batch and the gates' controls): one
    batch per length bucket, each the shape a real batch of that length has."""
    import dataclasses

    from fnrl.config import RunConfig, TrainerConfig
    from fnrl.control.gating import Gating
    from fnrl.trainer.batching import default_buckets, make_batch
    from fnrl.types import Group, Problem, Segment, Trajectory

    cfg = dataclasses.replace(RunConfig(), trainer=TrainerConfig(**trainer))
    buckets = cfg.trainer.length_buckets or default_buckets(256)
    warm = list(ablate.warm_batches(cfg, 256))
    assert [b["input_BxT"].shape[1] for b in warm] == list(buckets)
    controls = Gating(cfg, run_dir=tmp_path, journal=None, writer=False, log=print,
                      version=0).controls()
    for width, batch in zip(buckets, warm):
        # A batch of that length: one long response a group, the rest short.
        lengths = [[width - g % 2 if i == 0 else 1 + i % 2 for i in range(cfg.algo.group_size)]
                   for g in range(cfg.algo.groups_per_step)]
        groups = [Group(Problem(f"p{g}", "q", "a", 1), tuple(
            Trajectory(f"p{g}-{i}", (1,), (Segment(3, (4,) * n, (-0.5,) * n),), "stop",
                       reward=float(i % 3 == 0)) for i, n in enumerate(row)))
            for g, row in enumerate(lengths)]
        real, _ = make_batch(groups, 4, algo=cfg.algo, trainer=cfg.trainer, seq_len=256, pad_id=0)
        real |= controls
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == \
            {k: (v.shape, v.dtype) for k, v in real.items()}


@pytest.mark.slow
def test_a_two_cell_grid_runs_end_to_end_and_resumes(tmp_path, cache_dir, capsys, monkeypatch):
    from tests.experiments.e2e_args import SMALL

    flags = dict(zip(SMALL[::2], SMALL[1::2]))          # "--a.b-c": "1" -> "a.b_c": 1
    base = {k[2:].replace("-", "_"): v if v.isalpha() else json.loads(v)   # "rollout": text
            for k, v in flags.items()}
    base |= {"steps": 2, "eval.every": 1, "warm_start.cache_dir": cache_dir}
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({"name": "tiny", "output": str(tmp_path / "out"),
                                "warm_compile": True, "base": base,
                                "grid": {"preset": ["sync", "fnrl"], "seed": [0]}}))
    # The warm-up compiles the trainer role's very program: with a cache of its own, the
    # cells add no train step to it (one would be a compile the warm-up missed).
    jax_cache = tmp_path / "jax_cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_cache))
    spec = read_spec(path)
    cells = expand(spec)
    ablate.warm_compile_cache(cell_config(ablate.pinned(spec), cells[0]))
    compiled = {p.name for p in jax_cache.glob("jit_train_step*")}
    assert compiled
    assert ablate.main([str(path)]) == 0
    assert {p.name for p in jax_cache.glob("jit_train_step*")} == compiled
    for cell in cells:
        run_dir = spec.out_dir / cell.name
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["trained_tokens"] > 0
        cfg = json.loads((run_dir / "config.json").read_text())
        assert cfg["preset"] == dict(cell.values)["preset"] and cfg["steps"] == 2
        assert cfg["model"]["hidden_size"] == 64 and cfg["run_dir"] == str(run_dir)
    md = (spec.out_dir / "ablation.md").read_text()
    assert "2 of 2 cells finished" in md and "| preset=fnrl | 1 |" in md
    assert (spec.out_dir / "ablation.png").exists()
    # Again: both cells are finished, nothing runs, the summaries are untouched.
    before = [(spec.out_dir / c.name / "summary.json").stat().st_mtime_ns for c in cells]
    capsys.readouterr()
    assert ablate.main([str(path)]) == 0
    assert "2 finished, running 0" in capsys.readouterr().out
    assert before == [(spec.out_dir / c.name / "summary.json").stat().st_mtime_ns for c in cells]
