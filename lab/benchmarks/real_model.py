"""The main job on a real model's shape: peak memory of every role, and step time.

    python -m lab.benchmarks.real_model                      # Qwen2.5-0.5B-shaped, 3 steps
    python -m lab.benchmarks.real_model --steps 2 --max-new-tokens 1024 --dtype bfloat16

Builds a random checkpoint with Qwen2.5-0.5B's real config (vocab 151,936, 24 layers,
tied embeddings; `fnrl.models.synthetic.QWEN25_05B`) and a byte-level BPE tokenizer
with Qwen's chat template (no hub), writes a GSM8K-format JSONL, and runs
`python -m fnrl.experiments.math_grpo` on it as a user would. Meanwhile it samples, twice
a second, the resident memory of each role's whole process group (a vLLM server and its
engine core; the trainer; each relay) and the relays' shared-memory segments, and prints
the peak of each beside the memory plan the job printed at start, then the step times
from the run's metrics. Random weights rarely emit a stop token, so every response runs
to the token limit: the longest generation the limit allows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

from fnrl.models.synthetic import QWEN25_05B, build_bpe_tokenizer, write_checkpoint

GIB = 2**30


def gsm8k_rows(n: int) -> list[dict]:
    return [{"question": f"Tina has {10 + i} apples and buys {i % 7 + 2} more. How many "
                         "apples does she have now?",
             "answer": f"{10 + i} + {i % 7 + 2} = {12 + i + i % 7}\n#### {12 + i + i % 7}"}
            for i in range(n)]


class RoleSampler:
    """Peak memory per role, summed over its process group: RSS, and the private part
    (RSS less shared pages: file mappings and /dev/shm segments, which the relay's
    shared-memory peak counts once), and the peak of the relay's shared memory. The
    controller (the main job's own process, `watch`ed by pid) is sampled alone."""

    def __init__(self, run_dir: Path, period_s: float = 0.5):
        self.run_dir, self.period_s = run_dir, period_s
        self.controller_pid: int | None = None
        self.peak: dict[str, int] = {}
        self.private_peak: dict[str, int] = {}
        self.shm_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _roles(self) -> dict[str, int]:
        try:
            return {name: int(info["pid"]) for name, info in
                    json.loads((self.run_dir / "roles.json").read_text()).items()}
        except (OSError, ValueError):
            return {}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            roles = self._roles()
            rss: dict[int, int] = {}
            private: dict[int, int] = {}
            for p in psutil.process_iter(["pid"]):
                try:
                    pgid = os.getpgid(p.pid)
                    if pgid in roles.values():
                        mem = p.memory_info()
                        rss[pgid] = rss.get(pgid, 0) + mem.rss
                        private[pgid] = private.get(pgid, 0) + mem.rss - mem.shared
                except (psutil.Error, ProcessLookupError, PermissionError):
                    continue
            if self.controller_pid is not None:
                try:
                    mem = psutil.Process(self.controller_pid).memory_info()
                    rss["controller"], private["controller"] = mem.rss, mem.rss - mem.shared
                    roles = {**roles, "controller": "controller"}
                except psutil.Error:
                    pass
            for name, pid in roles.items():
                self.peak[name] = max(self.peak.get(name, 0), rss.get(pid, 0))
                self.private_peak[name] = max(self.private_peak.get(name, 0),
                                              private.get(pid, 0))
            relay_pids = {str(pid) for name, pid in roles.items() if name.startswith("relay")}
            shm = 0
            for entry in os.scandir("/dev/shm"):
                if any(pid in entry.name for pid in relay_pids):
                    try:
                        shm += entry.stat().st_size
                    except OSError:
                        pass
            self.shm_peak = max(self.shm_peak, shm)


def run_sampled(argv: list[str], run_dir: Path) -> tuple[int, RoleSampler]:
    """Runs the main job (`argv`) with every role's and the controller's memory sampled;
    (exit code, the sampler with its peaks)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with RoleSampler(run_dir) as sampler:
        proc = subprocess.Popen(argv, cwd=ROOT)
        sampler.controller_pid = proc.pid
        code = proc.wait()
    return code, sampler


def planned_peaks(plan_file: Path) -> dict[str, float]:
    """Each role's planned peak in GiB, read from the run's memory_plan.txt."""
    planned = {}
    for line in plan_file.read_text().splitlines() if plan_file.exists() else ():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "peak":
            planned[parts[0]] = float(parts[2])
    return planned


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"],
                        help="decoder layers (fewer for a quick check of the script)")
    parser.add_argument("--work-dir", default="", help="where the checkpoint and run go "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("extra", nargs="*", help="more flags for the main job (after --)")
    args = parser.parse_args()

    tmp = None if args.work_dir else tempfile.TemporaryDirectory(prefix="fnrl-real-model-")
    work = Path(args.work_dir or tmp.name)
    try:
        model_dir = work / f"qwen2.5-0.5b-shaped-{args.layers}l-{args.dtype}"
        if not (model_dir / "config.json").exists():
            t0 = time.perf_counter()
            tok = build_bpe_tokenizer(work / "tokenizer")
            write_checkpoint(model_dir, "qwen2", seed=0, dtype=args.dtype, tokenizer_dir=tok,
                             **{**QWEN25_05B, "num_hidden_layers": args.layers})
            print(f"wrote a random Qwen2.5-0.5B-shaped checkpoint ({args.dtype}) in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        data = work / "gsm8k.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(64)))
        run_dir = work / "run"
        argv = [sys.executable, "-m", "fnrl.experiments.math_grpo", "--preset", "laminar",
                "--steps", str(args.steps), "--eval.every", str(10 * args.steps),
                "--run-dir", str(run_dir), "--no-resume", "--model.model-dir", str(model_dir),
                "--task.dataset", str(data), "--task.prompt-key", "question",
                "--task.num-eval", "4", "--algo.group-size", str(args.group_size),
                "--algo.groups-per-step", str(args.groups_per_step),
                "--rollout.queued-groups", str(args.groups_per_step),
                "--algo.max-new-tokens", str(args.max_new_tokens),
                # The context the run needs (the prompts are under 128 tokens), not the
                # model's 32,768 positions, which would size every buffer for them.
                "--model.max-seq-len", str(args.max_new_tokens + 128), *args.extra]
        print("$ " + " ".join(argv[1:]), flush=True)
        t0 = time.perf_counter()
        code, sampler = run_sampled(argv, run_dir)
        wall = time.perf_counter() - t0
        print(f"\nmain job exited with {code} after {wall:.0f}s")
        planned = planned_peaks(run_dir / "memory_plan.txt")
        # Roles are named rollout<i> in roles.json and server<i> in the plan.
        plan_of = lambda name: planned.get(name.replace("rollout", "server"), float("nan"))
        print(f"{'role':<12}{'plan GiB':>10}{'peak RSS':>10}{'private':>10}")
        for name, peak in sorted(sampler.peak.items()):
            print(f"{name:<12}{plan_of(name):>10.2f}{peak / GIB:>10.2f}"
                  f"{sampler.private_peak[name] / GIB:>10.2f}")
        print(f"{'relay shm':<12}{'':>10}{sampler.shm_peak / GIB:>10.2f}  (segments under "
              "/dev/shm; a relay's plan holds them, its private column does not)")
        metrics = run_dir / "metrics.jsonl"
        train = [r for r in map(json.loads, metrics.read_text().splitlines())
                 if r.get("kind") == "train"] if metrics.exists() else []
        previous = 0.0
        for r in train:
            # time/train_s: the trainer's step (forward, backward, update, checkpoint hand-off);
            # wall: since the previous step ended (generation of the batch included).
            print(f"step {r['step']}: trainer {r.get('time/train_s', float('nan')):.1f}s, "
                  f"{r.get('tokens', 0)} tokens, mean response {r.get('response_len_mean', 0):.0f}"
                  f" tokens, wall {r['wall_s'] - previous:.1f}s")
            previous = r["wall_s"]
        return code
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
