"""Evaluation outside a run: any model directory on any task file, or a finished run's
checkpoints again, stop-the-world, compared with its eval records.

    python -m fnrl.experiments.evaluate --model.model-dir D --task.dataset test.jsonl \
        --task.num-eval 500 --eval.samples 4 [--run-dir OUT]   # any model, any file
    python -m fnrl.experiments.evaluate RUN_DIR                 # every evaluated version
    python -m fnrl.experiments.evaluate RUN_DIR --versions 0 10

A model directory is scored as a run's evaluation server would score it: the task's
held-out set (`task.num_eval` rows of the file, chosen as a training run holds them out,
with the run's reading, prompt template and grading), one greedy response and
`eval.samples` seeded samples per problem at the model's sampling settings (its
generation_config.json, flags win), on one vLLM server. Every flag of the main job is
accepted. Writes OUT/evaluation.json (the scores, greedy accuracy by level, pass@1 and
pass@k, and what was evaluated) and OUT/evaluation.png.

For each version the run evaluated (its `eval` records in metrics.jsonl) whose Orbax
checkpoint is still in RUN_DIR/checkpoints (version 0: the model the run started from),
this restores the trainer's state, publishes its weights to a relay of its own, loads
them into a fresh vLLM server started as the run's evaluation server was (same model,
dtype, context and sequences) and scores the held-out set with the run's sampling
(fnrl.control.eval_lane.score_heldout: greedy, then `eval.samples` seeded samples per
problem). Nothing else runs meanwhile. Prints both records side by side and writes them
to RUN_DIR/eval_compare.json.

Keep the checkpoints a run needs: `--trainer.checkpoint-keep` at least its number of
versions (the default keeps 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

import aiohttp

from fnrl.config import RunConfig, load_json
from fnrl.control.eval_lane import score_heldout
from fnrl.control.metrics import read_jsonl
from fnrl.backends.roles import Cluster
from fnrl.experiments.export import restored_params
from fnrl.data.reward import checked_reward
from fnrl.relay.client import RelayClient
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec
from fnrl.shell.net import free_port


def restore_weights(cfg: RunConfig, model_dir: Path, run_dir: Path, versions: list[int]):
    """Yields (version, HF-layout weights in the servers' dtype) for each version in
    `versions` that can be restored (fnrl.experiments.export.restored_params), LoRA
    adapters merged into their base."""
    import jax.numpy as jnp
    import numpy as np

    from fnrl.models.hf_io import params_to_hf, read_config
    from fnrl.models.lora import merge

    model_cfg = read_config(model_dir)
    serve_dtype = np.dtype(jnp.dtype(cfg.rollout.serve_dtype))
    for version, params in restored_params(cfg, model_dir, run_dir, versions):
        yield version, params_to_hf(model_cfg, merge(params, cfg.trainer.lora), dtype=serve_dtype)


def compare(run_records: dict[int, dict], fresh: dict[int, dict], k: int) -> dict:
    """Per version, each compared score in the run and stop-the-world, and the largest
    absolute difference over every version and score."""
    keys = ["accuracy"] + (["pass@1", f"mean@{k}", f"pass@{k}"] if k else [])
    rows, worst = [], 0.0
    for version in sorted(fresh):
        row = {"version": version, "trained_tokens": run_records[version].get("trained_tokens")}
        for key in keys:
            a, b = run_records[version].get(key), fresh[version].get(key)
            row[key] = {"run": a, "stop_the_world": b}
            if a is not None and b is not None:
                worst = max(worst, abs(a - b))
        rows.append(row)
    return {"versions": rows, "max_abs_diff": worst, "scores": keys}


async def _evaluate_all(cfg: RunConfig, model_dir: Path, run_dir: Path, task, versions,
                        out_dir: Path) -> dict[int, dict]:
    cluster = Cluster(out_dir)
    restore_signals = cluster.stop_on_signals()
    try:
        relay = cluster.start_relay("relay0", cfg.relay)
        spec = ServerSpec(model_dir=str(model_dir), port=free_port(),
                          max_model_len=task.seq_len, max_num_seqs=cfg.eval.max_num_seqs,
                          seed=cfg.seed, dtype=cfg.rollout.serve_dtype)
        cluster.start_server(0, spec)
        cluster.wait_relay_ready(relay)
        await asyncio.to_thread(cluster.wait_servers_ready, cfg.rollout.start_timeout_s)

        reward = _reward(task)
        fresh: dict[int, dict] = {}
        async with aiohttp.ClientSession() as session:
            server = RolloutClient(spec.base_url, session, timeout_s=cfg.rollout.request_timeout_s)
            for version, weights in restore_weights(cfg, model_dir, run_dir, versions):
                # Version v+1 on the relay: version 0 must differ from what the server
                # started with (-1), and every publish must be newer than the last.
                with RelayClient(relay.address, timeout_s=60.0) as client:
                    client.publish(version + 1, weights)
                await server.pull(relay.address, version=version + 1)
                fresh[version] = await score_heldout(server.generate, task, cfg, reward)
                print(f"version {version}: greedy {100 * fresh[version]['accuracy']:.1f}%",
                      flush=True)
        return fresh
    finally:
        cluster.stop()
        restore_signals()


class _Progress:
    """Wraps a handle's `generate` to print how many of the evaluation's requests have
    returned, at every tenth of them (a held-out set can take minutes)."""

    def __init__(self, generate, total: int):
        self.generate, self.total, self.done, self.shown = generate, total, 0, 0

    async def __call__(self, *args, **kwargs):
        out = await self.generate(*args, **kwargs)
        self.done += 1
        if self.done * 10 // self.total > self.shown or self.done == self.total:
            self.shown = self.done * 10 // self.total
            print(f"evaluated {self.done}/{self.total} responses", flush=True)
        return out


async def evaluate_model_dir(cfg: RunConfig, model_dir: Path, task, out_dir: Path) -> dict:
    """The held-out record of `model_dir` as it is (fnrl.control.eval_lane.score_heldout
    on one fresh vLLM server started as a run's evaluation server is)."""
    cluster = Cluster(out_dir)
    restore_signals = cluster.stop_on_signals()
    try:
        spec = ServerSpec(model_dir=str(model_dir), port=free_port(),
                          max_model_len=task.seq_len, max_num_seqs=cfg.eval.max_num_seqs,
                          seed=cfg.seed, dtype=cfg.rollout.serve_dtype)
        cluster.start_server(0, spec)
        await asyncio.to_thread(cluster.wait_servers_ready, cfg.rollout.start_timeout_s)
        async with aiohttp.ClientSession() as session:
            server = RolloutClient(spec.base_url, session, timeout_s=cfg.rollout.request_timeout_s)
            progress = _Progress(server.generate,
                                 len(task.eval_set) * (1 + cfg.eval.samples))
            return await score_heldout(progress, task, cfg, _reward(task))
    finally:
        cluster.stop()
        restore_signals()


def _reward(task):
    def reward(ids, gold):
        try:
            return checked_reward(task.reward_fn(task.response_text(ids), gold, len(ids)))
        except Exception:  # noqa: BLE001 - as in the run: a verifier failure scores 0
            return None
    return reward


def plot_evaluation(record: dict, path: Path, title: str) -> None:
    """Bars of the scores and of the greedy accuracy by level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    scores = [k for k in ("accuracy", "pass@1", f"mean@{record['samples_per_problem']}",
                          f"pass@{record['samples_per_problem']}") if k in record]
    levels = sorted(k for k in record if k.startswith("accuracy_level"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=(len(scores), max(len(levels), 1)))
    axes[0].bar([("greedy" if k == "accuracy" else k) for k in scores],
                [100 * record[k] for k in scores], color="tab:blue")
    axes[0].set_ylabel("% of problems")
    axes[0].set_title(f"{record['num_problems']} held-out problems")
    axes[1].bar([k.removeprefix("accuracy_level") for k in levels],
                [100 * record[k] for k in levels], color="tab:green")
    axes[1].set_xlabel("level")
    axes[1].set_title("greedy accuracy by level")
    for ax in axes:
        ax.set_ylim(0, 100)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _main_model_dir(argv: list[str]) -> int:
    import dataclasses
    import time

    from fnrl.experiments.math_grpo import load_task_io, parse_config, resolve_model_dir

    try:
        cfg = parse_config(argv)
        if not cfg.model.model_dir:
            raise ValueError("name the model to evaluate with --model.model-dir DIR (or give "
                             "a run directory as the first argument)")
        out_dir = Path(cfg.run_dir or f"runs/evaluate-{time.strftime('%Y%m%d-%H%M%S')}")
        out_dir = out_dir.absolute()
        out_dir.mkdir(parents=True, exist_ok=True)
        model_dir = resolve_model_dir(cfg)
        task = load_task_io(cfg, model_dir, out_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"fnrl.experiments.evaluate: {err}", file=sys.stderr)
        return 2
    print(f"evaluating {model_dir} on {len(task.eval_set)} held-out problems of "
          f"{cfg.task.dataset or cfg.task.env} (greedy + {cfg.eval.samples} samples at "
          f"T {cfg.algo.temperature}, top-k {cfg.algo.top_k}, top-p {cfg.algo.top_p})", flush=True)
    record = asyncio.run(evaluate_model_dir(cfg, model_dir, task, out_dir))
    report = {"model_dir": str(model_dir), "dataset": cfg.task.dataset, "scores": record,
              "task": dataclasses.asdict(cfg.task), "sampling": {
                  k: getattr(cfg.algo, k) for k in ("temperature", "top_k", "top_p",
                                                    "max_new_tokens")},
              "eval": dataclasses.asdict(cfg.eval)}
    (out_dir / "evaluation.json").write_text(json.dumps(report, indent=2, default=str))
    plot_evaluation(record, out_dir / "evaluation.png", f"{model_dir.name}: "
                    f"{Path(cfg.task.dataset).name if cfg.task.dataset else cfg.task.env}")
    k = cfg.eval.samples
    print(f"greedy accuracy {_pct(record['accuracy'])}"
          + (f", pass@1 {_pct(record['pass@1'])}, pass@{k} {_pct(record[f'pass@{k}'])}"
             if k else "") + f" over {record['num_problems']} problems; "
          f"{out_dir / 'evaluation.json'}, {out_dir / 'evaluation.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from fnrl.experiments.math_grpo import load_task_io, resolve_model_dir

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):   # no run directory: a model on a task file
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        return _main_model_dir(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--versions", type=int, nargs="*", default=None,
                        help="versions to re-evaluate (default: every one the run evaluated)")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.absolute()
    try:
        cfg = load_json(RunConfig, run_dir / "config.json")
        records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")
                   if r["kind"] == "eval"}
        versions = sorted(records) if args.versions is None else args.versions
        missing = [v for v in versions if v not in records]
        if missing:
            raise ValueError(f"{run_dir} has no eval record of version(s) {missing}; "
                             f"it evaluated {sorted(records)}")
        model_dir = resolve_model_dir(cfg)
        out_dir = run_dir / "evaluate"
        out_dir.mkdir(exist_ok=True)
        task = load_task_io(cfg, model_dir, out_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"fnrl.experiments.evaluate: {err}", file=sys.stderr)
        return 2
    fresh = asyncio.run(_evaluate_all(cfg, model_dir, run_dir, task, versions, out_dir))
    result = compare(records, fresh, cfg.eval.samples)
    (run_dir / "eval_compare.json").write_text(json.dumps(result, indent=2))
    print(f"{'version':>7} {'tokens':>8} " + " ".join(f"{s + ' run/stw':>20}"
                                                   for s in result["scores"]))
    for row in result["versions"]:
        cells = []
        for s in result["scores"]:
            a, b = row[s]["run"], row[s]["stop_the_world"]
            cells.append(f"{_pct(a):>9} / {_pct(b):<8}")
        print(f"{row['version']:>7} {row['trained_tokens'] or 0:>8} " + " ".join(cells))
    print(f"largest difference: {100 * result['max_abs_diff']:.2f} points "
          f"(written to {run_dir / 'eval_compare.json'})")
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
