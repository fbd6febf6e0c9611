"""Re-trains a finished run from its records and checks the parameters bit for bit.

    python -m fnrl.experiments.replay RUN_DIR [--steps N] [--model-dir DIR]
    python -m fnrl.experiments.replay RUN_DIR --against OTHER_RUN_DIR [--steps N]

Nothing is generated again. The controller's durable records hold every batch: the
journal (`journal.jsonl`) names the groups of each trained step in the order they were
batched, and `trajectories.jsonl` holds each consumed group's prompt ids, response
tokens, behaviour log-probs and rewards (fnrl.control.recovery.ConsumedLog). The
batches are rebuilt from them with the run's config (`make_batch`: advantages,
packing, micro-batches), then trained from the initial model through the trainer's
own jitted step (fnrl.trainer.role.Trainer), and the state at version N (default: the
run's newest checkpoint) is compared leaf by leaf with the run's checkpoint of that
version. Prints the largest absolute difference of every leaf and exits 1 if any
differs at all (2: the records cannot reproduce it). `--against` compares two runs'
checkpoints of one version instead (the default version: the run's last step).

Bit-identical needs the trainer's numerics: the same devices (XLA_FLAGS, e.g. a forced
host device count, as the run's trainer had: it inherited the launching shell's) and
the same CPU threads (`trainer.cpu_threads`, applied here as the trainer does).
A run whose gates rolled back, or whose controller logged a batch it did not see
return (a recovery), cannot be replayed past that step: it is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from fnrl.config import RunConfig, load_json
from fnrl.control import journal
from fnrl.control.metrics import read_jsonl
from fnrl.control.training import corrupt_logprobs
from fnrl.data.tokenizer import ChatTokenizer
from fnrl.experiments.math_grpo import context_len, resolve_model_dir
from fnrl.trainer.batching import make_batch
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.controls import PREFIX
from fnrl.trainer.role import Trainer, enable_compilation_cache
from fnrl.trainer.xla_flags import set_cpu_threads, use_memory_scheduler
from fnrl.types import Group, Problem, Segment, Trajectory


class ReplayError(ValueError):
    """The run's records cannot reproduce the asked version."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One trained batch: the version it trains, its groups in batch order, and the
    gates' controls it carried (empty: none)."""
    version: int
    groups: tuple[Group, ...]
    controls: dict


def _trajectory(rec: dict, where: str) -> Trajectory:
    if "token_ids" not in rec or "reward" not in rec:
        raise ReplayError(f"{where}: trajectory {rec.get('uid')!r} has no "
                          f"{'token ids' if 'token_ids' not in rec else 'reward'} (a run "
                          "from before replay records, or a group logged by a recovery)")
    fed = rec.get("fed") or [False] * len(rec["segments"])   # multi-turn: tool results
    segments = tuple(Segment(v, tuple(ids), tuple(lps), bool(f)) for (v, _), ids, lps, f
                     in zip(rec["segments"], rec["token_ids"], rec["logprobs"], fed))
    return Trajectory(uid=rec["uid"], prompt_ids=tuple(rec["prompt_ids"]), segments=segments,
                      finish_reason=rec["finish_reason"], reward=rec["reward"],
                      tool_calls=rec.get("tool_calls", 0), tool_ok=rec.get("tool_ok", 0))


def read_steps(run_dir: Path) -> list[Step]:
    """Every step the run's trainer took, in order, rebuilt from the journal (which
    groups, in which order, and the controls) and trajectories.jsonl (their tokens)."""
    run_dir = Path(run_dir)
    records = {}
    for n, rec in enumerate(read_jsonl(run_dir / "trajectories.jsonl"), 1):
        records[rec["group"]] = (rec, f"trajectories.jsonl record {n}")
    problems, pending, steps = {}, {}, []
    for r in journal.records(run_dir / "journal.jsonl"):
        if r["ev"] == "fill":
            problems[r["problem"]["uid"]] = Problem(**r["problem"])
        elif r["ev"] == "consume":
            pending[r["version"]] = tuple(r["groups"])
        elif r["ev"] == "trained" and r["version"] in pending:
            groups = []
            for name in pending.pop(r["version"]):
                if name not in records:
                    raise ReplayError(f"group {name!r} trained version {r['version']} but has "
                                      "no line in trajectories.jsonl")
                rec, where = records[name]
                groups.append(Group(problems[name], tuple(_trajectory(t, where)
                                                           for t in rec["trajectories"])))
            steps.append(Step(r["version"], tuple(groups), dict(r.get("controls") or {})))
    return steps


def rebuild_batch(step: Step, cfg: RunConfig, *, seq_len: int, pad_id: int) -> dict:
    """The arrays the controller sent for `step`: the same function on the same groups
    in the same order, with the same injected fault and controls."""
    arrays, _ = make_batch(step.groups, step.version, algo=cfg.algo, trainer=cfg.trainer,
                           seq_len=seq_len, pad_id=pad_id)
    if step.version + 1 == cfg.faults.inject.bad_logprobs:
        arrays = corrupt_logprobs(arrays, cfg.faults.inject.logprob_shift, seed=cfg.seed)
    for key, value in step.controls.items():
        if not key.startswith(PREFIX):
            raise ReplayError(f"version {step.version}: unknown control {key!r}")
        arrays[key] = np.asarray(value, np.int64 if key.endswith("rollback_to") else np.float32)
    return arrays


def leaf_differences(state, reference) -> dict[str, float]:
    """Largest absolute difference of every leaf of two TrainStates (inf: shapes or
    dtypes differ), by path."""
    ours = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    theirs = jax.tree.leaves(jax.device_get(reference))
    if len(ours) != len(theirs):
        raise ReplayError(f"the replayed state has {len(ours)} leaves, the checkpoint "
                          f"{len(theirs)}")
    out = {}
    for (path, a), b in zip(ours, theirs):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            out[jax.tree_util.keystr(path)] = float("inf")
        elif a.tobytes() == b.tobytes():   # bitwise: NaN matches NaN, -0.0 not 0.0
            out[jax.tree_util.keystr(path)] = 0.0
        else:
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            worst = float(np.nanmax(diff)) if np.isfinite(diff).any() else np.inf
            # Bits differ though the values compare equal (NaNs moved, signed zeros).
            out[jax.tree_util.keystr(path)] = worst if worst > 0 else np.inf
    return out


def saved_state(run_dir: Path, version: int) -> dict:
    """The TrainState a run checkpointed at `version`, as a plain nested dict of arrays
    (read-only: nothing of the run is changed)."""
    directory = Path(run_dir).absolute() / "checkpoints"
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True))
    try:
        if version not in manager.all_steps():
            raise ReplayError(f"no checkpoint of version {version} in {directory} (kept: "
                              f"{sorted(manager.all_steps())})")
        restored = manager.restore(version, args=ocp.args.Composite(
            state=ocp.args.StandardRestore()))
        return restored["state"]
    finally:
        manager.close()


def compare_runs(run_a: Path, run_b: Path, version: int) -> dict[str, float]:
    """Largest absolute difference of every leaf of two runs' states at `version`."""
    return leaf_differences(saved_state(run_a, version), saved_state(run_b, version))


def replay(run_dir: Path, *, steps: int | None = None, model_dir: Path | None = None,
           log=print) -> dict:
    """Trains the run's recorded batches up to version `steps` (default: its newest
    checkpoint) and compares with the checkpoint of that version. Returns
    {"version", "batches", "seconds", "diffs": {leaf: max abs diff}}."""
    run_dir = Path(run_dir).absolute()
    cfg = load_json(RunConfig, run_dir / "config.json")
    model_dir = Path(model_dir) if model_dir else resolve_model_dir(cfg)
    seq_len = context_len(cfg, model_dir)
    pad_id = ChatTokenizer.for_task(model_dir, cfg.task).pad_id
    saved = Checkpointer(run_dir / "checkpoints", max_to_keep=1 << 30, async_save=False)
    available = saved.all_steps()
    target = steps if steps is not None else (available[-1] if available else None)
    if target is None or target not in available:
        raise ReplayError(f"no checkpoint of version {target} in {run_dir / 'checkpoints'} "
                          f"(kept: {available}; --trainer.checkpoint-keep keeps more)")
    todo = [s for s in read_steps(run_dir) if s.version < target]
    for s in todo:
        if s.controls.get("gate.rollback_to", -1) != -1:
            raise ReplayError(f"the gates rolled back at version {s.version}: the replay "
                              f"cannot pass it (ask for --steps {s.version} or less)")
    enable_compilation_cache()
    with tempfile.TemporaryDirectory(prefix="fnrl-replay-") as scratch:
        # The trainer's own construction and jitted step; nothing of the run is written.
        trainer = Trainer(dataclasses.replace(cfg, resume=False), model_dir, Path(scratch))
        t0 = time.perf_counter()
        for s in todo:
            trainer.apply(rebuild_batch(s, cfg, seq_len=seq_len, pad_id=pad_id))
        version = trainer.version
        seconds = time.perf_counter() - t0
        if version != target:
            raise ReplayError(f"{len(todo)} recorded batches reach version {version}, not "
                              f"{target}: the records are incomplete")
        reference, _ = saved.restore(trainer.state, step=target)
        diffs = leaf_differences(trainer.state, reference)
        trainer.checkpoints.close()
    saved.close()
    log(f"replayed {len(todo)} batches to version {target} in {seconds:.1f}s")
    return {"version": target, "batches": len(todo), "seconds": seconds, "diffs": diffs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=None,
                        help="the version to reproduce (a checkpoint the run kept); "
                             "default: its newest")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the run's initial model (default: as the run resolved it)")
    parser.add_argument("--against", type=Path, default=None,
                        help="compare with this other run's checkpoint instead of re-training "
                             "(two runs of one seed: fnrl.policy.seeding)")
    args = parser.parse_args(argv)
    cfg = json.loads((args.run_dir / "config.json").read_text())
    # As the trainer process does, before JAX starts its backend (fnrl.trainer.role).
    use_memory_scheduler()
    set_cpu_threads(int(cfg.get("trainer", {}).get("cpu_threads", 0)))
    try:
        if args.against is not None:
            version = args.steps if args.steps is not None else cfg["steps"]
            out = {"version": version,
                   "diffs": compare_runs(args.run_dir, args.against, version)}
        else:
            out = replay(args.run_dir, steps=args.steps, model_dir=args.model_dir)
    except ReplayError as err:
        print(f"replay: {err}", file=sys.stderr)
        return 2
    width = max(map(len, out["diffs"]))
    for leaf, diff in out["diffs"].items():
        print(f"{leaf:<{width}}  {diff:.3g}")
    bad = [k for k, v in out["diffs"].items() if v != 0.0]
    print(f"version {out['version']}: {len(out['diffs']) - len(bad)} of {len(out['diffs'])} "
          f"leaves bit-identical" + (f"; {len(bad)} differ" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
