"""Fit StaleFlow's decode cost model on the local vLLM engine (seed 001 §5.3, App. B).

    python -m fnrl.experiments.profile_cost                       # embedded model
    python -m fnrl.experiments.profile_cost --model-dir DIR --out FILE.json
    python -m fnrl.experiments.profile_cost --servers 2 --batches-from RUN_DIR ...

starts a vLLM server (fnrl.serving.server, as the main job does; `--servers N`: N side
by side, each timed on its own batch while all generate), streams batches of random
prompts over a grid of batch sizes and context lengths (or `--batches-from`: the batches
recorded runs trained, their prompts and response lengths), fits
L = k1·kv + max(k2, k3·n) + k4 (Eq. 11) by least squares ("offline profiling and linear
regression", §5.3; the pure fit is fnrl.policy.cost_model), checks the fit on held-out
batches measured in the same session, and writes JSON (default: `cost_model.json` in the
model directory). The job loads it with `--coord.cost-file PATH` (or `auto`: the model
directory's file) into CoordinatorConfig.cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np

from fnrl.config import CostModel, ModelConfig, TaskConfig, WarmStartConfig
from fnrl.control.metrics import generated_length, read_jsonl
from fnrl.experiments.warm_start import ensure_default_model
from fnrl.policy.cost_model import (Measurement, fit_cost_model, fit_quality,
                                    stored_cost_model)
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec, launch_server, serve, stop_server
from fnrl.shell.files import write_atomic
from fnrl.shell.net import free_port

COST_FILE_NAME = "cost_model.json"


def load_cost_model(path: str | Path) -> CostModel:
    """The CostModel stored by this command (or any JSON with k1..k5)."""
    return stored_cost_model(json.loads(Path(path).read_text()), path)


@dataclass(frozen=True, kw_only=True)
class ProfileArgs:
    """Profile the decode cost of one model on the local vLLM engine."""

    model_dir: str = ""
    """HF model directory; empty: the embedded default model (built if missing)."""
    out: str = ""
    """Where to write the JSON; empty: MODEL_DIR/cost_model.json (what `--coord.cost-file
    auto` loads)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    heldout_batch_sizes: tuple[int, ...] = (3, 12, 48)
    """Measured in the same session, interleaved with the fit runs, never fitted."""
    context_fractions: tuple[float, ...] = (0.25, 0.5, 1.0)
    """Context at the end of a run's longest request, as fractions of the model's
    context (max_position_embeddings, capped at max_context)."""
    max_context: int = 512
    repeats: int = 5
    """Runs per batch; each batch's median wall time is fitted."""
    max_num_seqs: int = 64
    servers: int = 1
    """Servers started side by side, each sent its batch at the same moment (the grid's:
    the same lengths, fresh prompts each); each server's time is one measurement, and the
    file records the count (engine.servers). 1 times one engine on a quiet host. N > 1
    times one server while N generate, as a job with N servers on this host runs them: on
    a shared CPU host they slow each other (lab/benchmarks/corun.py measures how much), and
    on one with a device each they do not."""
    batches_from: tuple[str, ...] = ()
    """Run directories of the main job: measure the batches they trained (their
    recorded prompts and response lengths, `batch_groups` groups a batch dealt to the
    servers group by group) instead of the random grid; the fit on the workload itself."""
    batch_groups: int = 4
    heldout_every: int = 4
    """With batches_from: every heldout_every-th batch is held out (0: none)."""
    kv_memory_fraction: float = 0.0
    """0: the server's KV sized from max_num_seqs x context (fnrl.serving.server)."""
    startup_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self):
        sizes = self.batch_sizes + self.heldout_batch_sizes
        if not self.batches_from and (not self.batch_sizes or min(sizes) <= 0
                                      or max(sizes) > self.max_num_seqs):
            raise ValueError(f"ProfileArgs.batch_sizes={self.batch_sizes!r} / heldout_batch_"
                             f"sizes={self.heldout_batch_sizes!r}: must be in 1..max_num_seqs="
                             f"{self.max_num_seqs}")
        if not self.context_fractions or not all(0 < f <= 1 for f in self.context_fractions):
            raise ValueError(f"ProfileArgs.context_fractions={self.context_fractions!r}: "
                             "must be in (0, 1]")
        for name in ("max_context", "repeats", "servers", "batch_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProfileArgs.{name}={getattr(self, name)!r}: must be > 0")
        if self.heldout_every < 0:
            raise ValueError(f"ProfileArgs.heldout_every={self.heldout_every!r}: must be >= 0")
        if not 0 <= self.kv_memory_fraction < 1:
            raise ValueError(f"ProfileArgs.kv_memory_fraction={self.kv_memory_fraction!r}: "
                             "must be in [0, 1) (0: sized from the run's need)")


@dataclass(frozen=True)
class RunSpec:
    """One server's batch to measure: each request's forced response length, and its
    prompt: recorded token ids, or (None) fresh random ones of prompt_len tokens."""

    prompt_len: int
    lengths: tuple[int, ...]
    heldout: bool
    prompts: tuple[tuple[int, ...], ...] | None = None


Run = tuple[RunSpec, ...]    # one batch a server, sent to all of them at the same moment


def plan_runs(args: ProfileArgs, context: int) -> list[RunSpec]:
    """The distinct batches of a session. For each batch size and context, the prompt
    takes 1/8 or 1/2 of the context in turn and the responses are spread over [1/4, 1]
    of the rest, so n_t falls during a run, and prefill tokens (B·P), decoded tokens
    (Σ n_t) and requests (B) vary apart from each other: the fit can tell them apart."""
    rng = np.random.default_rng(args.seed)
    specs = []
    for heldout, sizes in ((False, args.batch_sizes), (True, args.heldout_batch_sizes)):
        for i, batch in enumerate(sizes):
            for j, frac in enumerate(args.context_fractions):
                total = max(4, int(frac * context))
                prompt = max(1, total // (8 if (i + j) % 2 else 2))
                top = total - prompt
                lengths = rng.integers(max(1, top // 4), top + 1, size=batch)
                lengths[0] = top     # every run reaches its stated context
                specs.append(RunSpec(prompt, tuple(int(x) for x in lengths), heldout))
    return specs


def recorded_runs(run_dirs: tuple[str, ...], servers: int, batch_groups: int,
                  heldout_every: int) -> list[Run]:
    """Batches as recorded runs trained them: each run directory's consumed groups
    (trajectories.jsonl) in order, `batch_groups` groups a batch, dealt to the servers
    group by group as the router spreads a batch (group k to server k mod servers); every
    request its recorded prompt and response length. Every `heldout_every`-th batch is
    held out. Single-turn runs only: a multi-turn trajectory is several requests."""
    runs = []
    for run_dir in run_dirs:
        path = Path(run_dir).expanduser() / "trajectories.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"batches_from={run_dir!r}: {str(path)!r} does not exist "
                                    "(a run directory of the main job)")
        groups = []
        for i, line in enumerate(read_jsonl(path)):
            trajs = line["trajectories"]
            if any(len(t["segments"]) > 1 for t in trajs):
                raise ValueError(f"batches_from={run_dir!r}: {path.name} line {i + 1} holds a "
                                 "multi-turn trajectory; only single-turn runs can be replayed")
            groups.append([(tuple(t["prompt_ids"]), max(1, generated_length(t)))
                           for t in trajs])
        for b in range(len(groups) // batch_groups):
            batch = groups[b * batch_groups:(b + 1) * batch_groups]
            heldout = heldout_every > 0 and len(runs) % heldout_every == heldout_every - 1
            dealt = [[r for g in batch[k::servers] for r in g] for k in range(servers)]
            if not all(dealt):
                raise ValueError(f"batches_from: {batch_groups} groups a batch leave a server "
                                 f"of {servers} without work")
            runs.append(tuple(RunSpec(round(float(np.mean([len(p) for p, _ in reqs]))),
                                      tuple(n for _, n in reqs), heldout,
                                      tuple(p for p, _ in reqs)) for reqs in dealt))
    if not runs:
        raise ValueError(f"batches_from={run_dirs!r}: no batch of {batch_groups} groups")
    return runs


def run_order(n_specs: int, repeats: int, seed: int) -> list[int]:
    """Every spec `repeats` times, shuffled, so drift in the machine's load spreads over
    fit and held-out runs alike."""
    return np.random.default_rng(seed + 1).permutation(np.repeat(np.arange(n_specs), repeats)
                                                       ).tolist()


def median_runs(runs: list[Run], order: list[int], walls: list[tuple[float, ...]]
                ) -> list[tuple[Measurement, bool]]:
    """One Measurement a server's batch of each run, with the median of its repeats' wall
    times (and whether it is held out): on a shared machine a run now and then loses the
    core to another process, and the median ignores that where a mean would not."""
    by_run = _group(order, walls)
    return [(Measurement(s.prompt_len, s.lengths,
                         float(np.median([w[k] for w in by_run[i]]))), s.heldout)
            for i, run in enumerate(runs) for k, s in enumerate(run)]


async def measure(base_urls: list[str], runs: list[Run], order: list[int], *,
                  vocab: int, seed: int = 0) -> list[tuple[float, ...]]:
    """Runs runs[i] for i in `order`, each server its batch, all at once, streamed as the
    main job streams; each run's wall time on each server."""
    rng = np.random.default_rng(seed)

    async def one(client, spec: RunSpec) -> float:
        # Fresh random prompts each run, so the prefix cache never shortcuts prefill.
        prompts = spec.prompts or rng.integers(
            3, vocab, size=(len(spec.lengths), spec.prompt_len)).tolist()

        async def request(prompt, length) -> int:
            n = 0
            async for chunk in client.generate_stream(list(prompt), max_tokens=length,
                                                      temperature=1.0, seed=None,
                                                      ignore_eos=True):
                n += len(chunk.token_ids)
            return n

        t0 = time.perf_counter()
        got = await asyncio.gather(*(request(p, n) for p, n in zip(prompts, spec.lengths)))
        wall = time.perf_counter() - t0
        if tuple(got) != spec.lengths:
            raise RuntimeError(f"asked lengths {spec.lengths}, got {tuple(got)}")
        return wall

    async def together(clients, run: Run) -> tuple[float, ...]:
        return tuple(await asyncio.gather(*(one(c, s) for c, s in zip(clients, run))))

    async with aiohttp.ClientSession() as session:
        clients = [RolloutClient(url, session) for url in base_urls]
        # Warm-up: first requests allocate buffers and fill the allocator's caches.
        for run in sorted(runs, key=lambda r: sum(len(s.lengths) for s in r))[-3:]:
            await together(clients, run)
        return [await together(clients, runs[i]) for i in order]


def model_context(model_dir: Path, cap: int) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return min(int(config["max_position_embeddings"]), cap), int(config["vocab_size"])


def profile(args: ProfileArgs, model_dir: Path) -> dict:
    """Start the servers on `model_dir`, measure, fit, evaluate held-out; the JSON record."""
    context, vocab = model_context(model_dir, args.max_context)
    if args.batches_from:
        runs = recorded_runs(args.batches_from, args.servers, args.batch_groups,
                             args.heldout_every)
        too_long = [s.prompt_len + max(s.lengths) for r in runs for s in r
                    if s.prompt_len + max(s.lengths) > context]
        if too_long:
            raise ValueError(f"batches_from: a recorded request of {max(too_long)} tokens "
                             f"exceeds the profiled context {context} (--max-context)")
        widest = max(len(s.lengths) for r in runs for s in r)
        if widest > args.max_num_seqs:
            raise ValueError(f"batches_from: a server's batch of {widest} requests exceeds "
                             f"max_num_seqs={args.max_num_seqs} (--max-num-seqs)")
    else:
        runs = [(s,) * args.servers for s in plan_runs(args, context)]
    order = run_order(len(runs), args.repeats, args.seed)
    servers = [ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=context,
                          max_num_seqs=args.max_num_seqs,
                          kv_memory_fraction=args.kv_memory_fraction, seed=args.seed + i)
               for i in range(args.servers)]
    logs = Path(tempfile.mkdtemp(prefix="fnrl-profile-"))
    t0 = time.perf_counter()
    procs = []
    try:
        for i, spec in enumerate(servers):
            procs.append(launch_server(spec, logs / f"server{i}.log"))
        for i, (spec, proc) in enumerate(zip(servers, procs)):   # started side by side
            servers[i], procs[i] = serve(spec, logs / f"server{i}.log", args.startup_timeout_s,
                                         proc=proc)
        walls = asyncio.run(measure([s.base_url for s in servers], runs, order, vocab=vocab,
                                    seed=args.seed))
    except BaseException:
        print(f"profile_cost: the servers' logs are kept in {logs}", file=sys.stderr)
        raise
    finally:
        for proc in procs:
            stop_server(proc)
    shutil.rmtree(logs, ignore_errors=True)   # a profile that worked leaves nothing behind
    measured = median_runs(runs, order, walls)
    fit_runs = [m for m, heldout in measured if not heldout]
    held = [m for m, heldout in measured if heldout]
    try:
        fit = fit_cost_model(fit_runs, max_batch=max(len(s.lengths) for r in runs for s in r))
    except ValueError as err:   # noise the fit cannot see through: keep what was measured
        fit, fitted = None, {"fit": None, "heldout": None, "fit_error": str(err)}
    else:
        fitted = {**asdict(fit.cost),
                  "crossover": fit.crossover,
                  "overhead_s": fit.overhead_s,
                  "per_request_s": fit.per_request_s,
                  "prefill_s_per_token": fit.prefill_s_per_token,
                  "fit": fit_quality(fit, fit_runs),
                  "heldout": fit_quality(fit, held) if held else None}
    by_run = _group(order, walls)
    spread = [np.ptp(w) / np.median(w) for ws in by_run.values() if len(ws) > 1
              for w in np.array(ws).T]
    import vllm

    return {
        **fitted,
        # How much repeats of one batch differ, (max - min) / median: the noise floor.
        "repeat_spread_median": float(np.median(spread)) if spread else None,
        "engine": {"vllm": vllm.__version__, "model_dir": str(model_dir),
                   "max_model_len": context, "max_num_seqs": args.max_num_seqs,
                   "dtype": servers[0].dtype, "cpu_threads": servers[0].cpu_threads,
                   "servers": args.servers,
                   "host_cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                   "profile_s": time.perf_counter() - t0},
        "args": asdict(args),
        "runs": [{"servers": [{k: v for k, v in asdict(s).items() if k != "prompts"}
                              for s in run], "wall_s": by_run[i]}
                 for i, run in enumerate(runs)],
    }


def _group(order: list[int], walls: list) -> dict[int, list]:
    out: dict[int, list[float]] = {}
    for i, wall in zip(order, walls):
        out.setdefault(i, []).append(wall)
    return out


def resolve_cost_file(cost_file: str, model_dir: Path) -> Path | None:
    """The file `--coord.cost-file` names: None for "", the model's own for "auto"."""
    if not cost_file:
        return None
    path = model_dir / COST_FILE_NAME if cost_file == "auto" else Path(cost_file).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"coord.cost_file={cost_file!r}: {str(path)!r} does not exist; write it with "
            f"python -m fnrl.experiments.profile_cost --model-dir {model_dir} --out {path}")
    return path


def summary_line(record: dict) -> str:
    fit, held = record["fit"], record["heldout"]
    line = (f"k1={record['k1']:.3g} k2={record['k2']:.3g} k3={record['k3']:.3g} "
            f"k4={record['k4']:.3g} (roofline n={record['crossover']:.1f}); fit on "
            f"{fit['runs']} runs: R²={fit['r2']:.3f}, mean rel. err {fit['mean_relative_error']:.1%}")
    if held:
        line += (f"; held-out {held['runs']} runs: R²={held['r2']:.3f}, mean rel. err "
                 f"{held['mean_relative_error']:.1%}, max {held['max_relative_error']:.1%}")
    return line


def main(args: ProfileArgs) -> dict:
    if args.model_dir:
        model_dir = Path(args.model_dir).expanduser()
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"model_dir={args.model_dir!r} has no config.json")
    else:
        model_dir = ensure_default_model(ModelConfig(), TaskConfig(), WarmStartConfig())
    out = Path(args.out).expanduser() if args.out else model_dir / COST_FILE_NAME
    record = profile(args, model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(record, indent=1))  # a reader never sees half a file
    if record.get("fit_error"):
        spread = record["repeat_spread_median"]
        raise UnfittedProfile(f"{record['fit_error']}; the {len(record['runs'])} measured "
                              f"runs are kept in {out}" + (f" (repeats of one batch differ "
                              f"by {spread:.0%}, median)" if spread is not None else ""),
                              record)
    print(f"{summary_line(record)}\n-> {out}")
    return record


class UnfittedProfile(ValueError):
    """The servers were measured but no cost model fits the measurements (too noisy, or
    responses too short to separate the per-step cost): the record, fit left out, is
    written all the same, so the minutes of measuring are not lost."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


if __name__ == "__main__":
    import sys

    import tyro

    try:
        main(tyro.cli(ProfileArgs, description=__doc__))
    except (FileNotFoundError, ValueError) as err:
        print(f"profile_cost: {err}", file=sys.stderr)
        sys.exit(2)
