"""Stop-the-world re-evaluation of a finished run's checkpoints, compared with its eval
records.

    python -m fnrl.experiments.evaluate RUN_DIR                 # every evaluated version
    python -m fnrl.experiments.evaluate RUN_DIR --versions 0 10

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
from fnrl.control.roles import Cluster
from fnrl.data.reward import checked_reward
from fnrl.relay.client import RelayClient
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec
from fnrl.shell.net import free_port


def restore_weights(cfg: RunConfig, model_dir: Path, run_dir: Path, versions: list[int]):
    """Yields (version, HF-layout weights in the servers' dtype) for each version in
    `versions` that can be restored: version 0 from the model directory, the others from
    the run's Orbax checkpoints, restored onto a state built as the trainer builds it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fnrl.models.hf_io import load_pretrained, params_to_hf
    from fnrl.models.decoder import logical_axes
    from fnrl.sharding.mesh import mesh_from_config, shardings_for
    from fnrl.trainer.checkpoint import Checkpointer
    from fnrl.trainer.step import (init_sharded_state, initial_critic, make_optimizer,
                                   place_params, state_shardings)

    tc = cfg.trainer
    # Only the parameters are used (no forward pass): compute dtype and kernels do not matter.
    model_cfg, _, host_params = load_pretrained(model_dir, param_dtype=jnp.dtype(tc.param_dtype))
    serve_dtype = np.dtype(jnp.dtype(cfg.rollout.dtype))
    mesh = mesh_from_config(tc.mesh)
    param_sh = shardings_for(logical_axes(model_cfg), host_params, mesh)
    optimizer = make_optimizer(cfg.algo, total_steps=cfg.steps)
    # Shardings first: place_params consumes the host copy.
    critic = initial_critic(cfg.algo, model_cfg.hidden_size)   # the checkpoints hold it too
    state_sh = state_shardings(optimizer, host_params, param_sh, critic)
    state = init_sharded_state(place_params(host_params, param_sh), optimizer, state_sh, critic)
    # Opened to read: a max_to_keep above any run's count, so nothing is ever pruned.
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=1 << 30, async_save=False)
    saved = set(ckpt.all_steps())
    try:
        for version in versions:
            if version == 0:
                params = state.params
            elif version in saved:
                params = ckpt.restore(state, step=version)[0].params
            else:
                print(f"version {version}: no checkpoint (kept: {sorted(saved)}); skipped",
                      flush=True)
                continue
            params = jax.tree.map(lambda x: x.astype(serve_dtype), params)
            yield version, params_to_hf(model_cfg, jax.device_get(params), dtype=serve_dtype)
    finally:
        ckpt.close()


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
                          seed=cfg.seed, dtype=cfg.rollout.dtype)
        cluster.start_server(0, spec)
        cluster.wait_relay_ready(relay)
        await asyncio.to_thread(cluster.wait_servers_ready, cfg.rollout.start_timeout_s)

        def reward(ids, gold):
            try:
                return checked_reward(task.reward_fn(task.response_text(ids), gold, len(ids)))
            except Exception:  # noqa: BLE001 - as in the run: a verifier failure scores 0
                return None

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


def main(argv: list[str] | None = None) -> int:
    from fnrl.experiments.math_grpo import load_task_io, resolve_model_dir

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
