"""Ablations from one file: a grid of main-job runs, resumable, with a comparison table.

    python -m lab.ablation.ablate lab/benchmarks/ablations/presets.yaml
    python -m lab.ablation.ablate FILE --max-cells 4       # a resumable piece
    python -m lab.ablation.ablate FILE --print-commands    # one job per cell, elsewhere
    python -m lab.ablation.ablate FILE --report-only       # table and plot of what ran

The file (YAML):

    name: presets
    output: runs/ablations/presets      # default runs/ablations/<name>
    base:                               # every cell: a partial RunConfig, dotted keys allowed
      steps: 8
      algo.groups_per_step: 4
    grid:                               # the product of these, each by dotted path
      preset: [sync, one_step, fnrl]
      coord.eta: [1, 2]                 # η (after the preset, so it overrides the preset's)
      seed: [0, 1, 2]                   # the rounds
    order: balanced                     # within a round: balanced, shuffle, rotate, listed
    reference: {preset: sync}           # ratios are to this variant (default: the first)
    warm_compile: true                  # compile the train step before any cell
    pin_model: true                     # every cell trains the default warm-started model

A cell is one point of the grid; a variant is a cell without its seed. Cells run one
after another, each as its own main-job process (`python -m fnrl.experiments.math_grpo
--config <out>/<cell>/cell.yaml`) in its own run directory `<out>/<cell>/`, round by
round (one round per seed), each round in its own order (lab.ablation.grid).

A cell whose run directory holds a summary of all its steps, run from the cell file it
would be given now, is finished and never runs again; a cell left unfinished (killed,
crashed) or run from an earlier version of the ablation file is moved to `<cell>.old`
and run afresh, so no cell's figures mix two attempts. Every cell's config is built and
validated before the first one starts. The report (lab.ablation.report)
goes to `<out>/ablation.md`, `ablation.csv`, `cells.csv` and `ablation.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fnrl.config import RunConfig, save_json, to_dict
from fnrl.config.files import merge
from lab.ablation.grid import (AblationSpec, Cell, cell_finished, cell_overrides,
                                           expand, read_spec)


def pinned(spec: AblationSpec) -> AblationSpec:
    """The spec with `model.model_dir` set in its base to the default warm-started model
    (built now if missing) when it asks for `pin_model`; else the spec unchanged."""
    if not spec.pin_model:
        return spec
    from fnrl.experiments.math_grpo import config_from_mapping
    from fnrl.experiments.warm_start import ensure_default_model

    base = config_from_mapping({k: v for k, v in spec.base.items()
                                if k in ("model", "warm_start")}, where="ablation base")
    model_dir = ensure_default_model(base.model, RunConfig().task, base.warm_start)
    return dataclasses.replace(spec, base=merge(spec.base,
                                                {"model": {"model_dir": str(model_dir)}}))


def cell_config(spec: AblationSpec, cell: Cell) -> RunConfig:
    """The resolved RunConfig the cell's main job will run (validated here)."""
    from fnrl.experiments.math_grpo import config_from_mapping

    return config_from_mapping(cell_overrides(spec, cell),
                               where=f"ablation {spec.name!r} cell {cell.name}")


def write_cell_file(spec: AblationSpec, cell: Cell) -> Path:
    """`<out>/<cell>/cell.yaml`: the file the cell's main job runs (`--config`)."""
    import yaml

    run_dir = spec.out_dir / cell.name
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "cell.yaml"
    path.write_text(f"# ablation {spec.name}, round {cell.round}: {cell.name}\n"
                    + yaml.safe_dump(cell_overrides(spec, cell), sort_keys=True))
    return path


def cell_command(cell_file: Path) -> list[str]:
    """The main job's command line that runs a cell file."""
    return [sys.executable, "-m", "fnrl.experiments.math_grpo", "--config", str(cell_file)]


# Started as the trainer role is (its XLA flag, CPUs and cache), so it compiles the same code.
_WARM = """
import sys
from pathlib import Path
from fnrl.config import RunConfig, load_json
from lab.ablation.ablate import warm_batches
from fnrl.trainer.role import Trainer, prepare_process
cfg = load_json(RunConfig, sys.argv[1])
prepare_process(cfg)
trainer = Trainer(cfg, Path(sys.argv[2]), Path(sys.argv[3]))
for arrays in warm_batches(cfg, int(sys.argv[4])):
    trainer.train(arrays)
"""


def warm_batches(cfg: RunConfig, seq_len: int):
    """One batch per length bucket, built as the controller builds a step's (make_batch,
    then the gates' controls), so what the warm-up compiles is the very program the
    trainer role runs: same keys, dtypes, shapes and controls, hence the same cache key.

    In each, one sequence is a position longer than the bucket below, the rest as short
    as a sequence can be, so the bucket chosen is that one, packed or not."""
    from fnrl.control.gating import batch_controls
    from fnrl.policy import gates
    from fnrl.trainer.batching import default_buckets, make_batch
    from fnrl.types import Group, Problem, Segment, Trajectory

    def trajectory(slots: int, reward: float) -> Trajectory:   # slots = prompt + response - 1
        return Trajectory(uid="warm", prompt_ids=(2,), finish_reason="stop", reward=reward,
                          segments=(Segment(0, (5,) * slots, (-1.0,) * slots),))

    controls = batch_controls(gates.initial_state(0), cfg)   # a run's first step's
    buckets = cfg.trainer.length_buckets or default_buckets(seq_len)
    for below, width in zip((0, *buckets), buckets):
        groups = [Group(Problem(f"warm-{g}", "", "", 0),
                        tuple(trajectory(below + 1 if g == i == 0 else 1, float(i % 2))
                              for i in range(cfg.algo.group_size)))
                  for g in range(cfg.algo.groups_per_step)]
        arrays, _ = make_batch(groups, 0, algo=cfg.algo, trainer=cfg.trainer, seq_len=seq_len,
                               pad_id=0, episodes=cfg.task.env != "math")
        if arrays["input_BxT"].shape[1] == width:
            yield {**arrays, **controls}


def warm_compile_cache(cfg: RunConfig) -> float:
    """Compiles the cell's train step, for every length bucket, into JAX's persistent
    cache (which every trainer process reads), so no cell's first step in a bucket pays
    a compile that later cells load; returns the seconds it took."""
    from fnrl.experiments.math_grpo import context_len, resolve_model_dir

    model_dir = resolve_model_dir(cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fnrl-ablate-warm-") as tmp:
        save_json(cfg, Path(tmp) / "config.json")
        subprocess.run([sys.executable, "-c", _WARM, str(Path(tmp) / "config.json"),
                        str(model_dir), tmp, str(context_len(cfg, model_dir))],
                       check=True, capture_output=True)
    return time.perf_counter() - t0


def compile_key(cfg: RunConfig) -> str:
    """What the train step's compiled code depends on: cells equal in it share it."""
    d = to_dict(cfg)
    return json.dumps({k: d[k] for k in ("model", "task", "warm_start", "algo", "trainer")},
                      sort_keys=True, default=str)


def run_cell(spec: AblationSpec, cell: Cell) -> int:
    """Runs the cell's main job to its end in its own process; its output goes to
    `<out>/<cell>/job.log`. A cell left unfinished before is moved aside first."""
    run_dir = spec.out_dir / cell.name
    # An earlier attempt that did not finish, or a run of another version of the file.
    if (run_dir / "config.json").exists():
        aside = run_dir.with_name(run_dir.name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        run_dir.rename(aside)
        print(f"[{cell.name}] an earlier run, unfinished or of another version of the "
              f"file: moved to {aside.name}, running afresh", flush=True)
    cell_file = write_cell_file(spec, cell)
    with open(run_dir / "job.log", "w") as log:
        job = subprocess.Popen(cell_command(cell_file), stdout=log, stderr=subprocess.STDOUT)
        try:
            return job.wait()
        except BaseException:
            # The runner is stopped: the job gets SIGTERM, on which it stops every role
            # (vLLM servers, relays, trainer) before exiting, instead of being orphaned.
            job.terminate()
            job.wait()
            raise


def run_ablation(spec: AblationSpec, *, max_cells: int | None = None) -> dict[str, str]:
    """Runs every unfinished cell in order (at most `max_cells` of them) and returns
    each cell's state: finished, ran, failed (exit status) or pending."""
    cells = expand(spec)
    configs = {c.name: cell_config(spec, c) for c in cells}   # every cell checked up front
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    state = {c.name: "finished" if cell_finished(spec, c) else "pending" for c in cells}
    todo = [c for c in cells if state[c.name] == "pending"][:max_cells]
    done = sum(s == "finished" for s in state.values())
    print(f"ablation {spec.name}: {len(cells)} cells, {done} finished, running {len(todo)} "
          f"under {spec.out_dir}", flush=True)
    if spec.warm_compile:
        for key in dict.fromkeys(compile_key(configs[c.name]) for c in todo):
            cfg = next(configs[c.name] for c in todo if compile_key(configs[c.name]) == key)
            print(f"train-step compile into the persistent cache: "
                  f"{warm_compile_cache(cfg):.0f}s", flush=True)
    for cell in todo:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        rc = run_cell(spec, cell)
        state[cell.name] = "ran" if rc == 0 else f"failed (exit {rc})"
        # The host's load beside each cell: on a shared machine, what moves a round's ratio.
        print(f"[{cell.name}] {state[cell.name]} in {time.perf_counter() - t0:.0f}s (1-minute "
              f"load {load0:.1f} at its start, {os.getloadavg()[0]:.1f} at its end); log "
              f"{spec.out_dir / cell.name / 'job.log'}", flush=True)
    return state


def raise_system_exit(signum, frame):
    """A signal handler that unwinds like Ctrl-C (a running cell's job is stopped)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="the ablation file (YAML)")
    parser.add_argument("--output", default="", help="overrides the file's output directory")
    parser.add_argument("--max-cells", type=int, default=None,
                        help="run at most this many unfinished cells, then report")
    parser.add_argument("--print-commands", action="store_true",
                        help="write every unfinished cell's file and print its command, "
                             "one line per cell, instead of running it")
    parser.add_argument("--report-only", action="store_true",
                        help="only write the table and plot of the finished cells")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a running cell's job is stopped with its roles.
    previous = signal.signal(signal.SIGTERM, raise_system_exit)
    try:
        spec = read_spec(args.file)
        if args.output:
            spec = dataclasses.replace(spec, output=args.output)
        spec = pinned(spec)   # (a cell is finished only under the file it would get now)
        if args.print_commands:
            for cell in expand(spec):
                cell_config(spec, cell)   # checked before any line is printed
                if not cell_finished(spec, cell):
                    print(shlex.join(cell_command(write_cell_file(spec, cell))))
            return 0
        state = ({} if args.report_only else
                 run_ablation(spec, max_cells=args.max_cells))
    except (FileNotFoundError, ValueError) as err:
        print(f"fnrl.ablate: {err}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    from lab.ablation.report import write_report

    outputs = write_report(spec, expand(spec))
    for path in outputs:
        print(f"wrote {path}")
    failed = [name for name, s in state.items() if s.startswith("failed")]
    if failed:
        print(f"fnrl.ablate: {len(failed)} cell(s) failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
