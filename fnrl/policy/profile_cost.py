"""Fit StaleFlow's decode cost model on the local vLLM engine (seed 001 §5.3, App. B).

    python -m fnrl.policy.profile_cost --model-dir DIR --out FILE

starts a server, runs batches of random prompts over a grid of batch sizes and prompt
lengths, and fits L = k1·kv + max(k2, k3·n) + k4 (Eq. 11) by least squares ("offline
profiling and linear regression", §5.3). The JSON it writes loads with
`load_cost_model` into a `CostModel` for `CycleConfig.cost`.

How a run becomes equations: we cannot time single decode steps over HTTP, so each run
(B requests of prompt length P, released together) gives one equation for its wall time

    wall ≈ c0 + c_pre·B·P + Σ_t [k1·kv_t + k3·max(c, n_t) + k4]

where step t has n_t = #{i : len_i > t} running requests holding kv_t = Σ (P + t) tokens,
known from the returned lengths (so early EOS is fine), c = k2/k3 is the roofline point,
c0 the HTTP and scheduling overhead, c_pre the prefill cost per token. For fixed c the
model is linear; we scan c and keep the best fit. Prefill is fitted but not part of the
cost model, which models decode only (App. B: decode is 89.9% of rollout time).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fnrl.policy.routing import CostModel


@dataclass(frozen=True)
class Measurement:
    prompt_len: int
    lengths: tuple[int, ...]     # generated tokens per request
    wall_s: float


def step_features(m: Measurement, crossover: float) -> np.ndarray:
    """[Σ kv_t, steps, Σ max(c, n_t), 1, B·P] for one run."""
    lengths = np.asarray(m.lengths)
    t = np.arange(int(lengths.max()) if lengths.size else 0)
    running = lengths[None, :] > t[:, None]                  # T × B
    n_t = running.sum(1)
    kv_t = (running * (m.prompt_len + t[:, None])).sum(1)
    return np.array([kv_t.sum(), len(t), np.maximum(crossover, n_t).sum(), 1.0,
                     len(lengths) * m.prompt_len], dtype=np.float64)


def fit_cost_model(runs: list[Measurement], *, max_batch: int | None = None
                   ) -> tuple[CostModel, dict]:
    """Least-squares fit of (k1, k2, k3, k4); returns the model and fit diagnostics."""
    if len(runs) < 6:
        raise ValueError(f"need at least 6 runs to fit 5 unknowns robustly, got {len(runs)}")
    y = np.array([m.wall_s for m in runs])
    top = max_batch or max(len(m.lengths) for m in runs)
    best = None
    for c in np.unique(np.concatenate([np.linspace(1, top, 64), np.arange(1, top + 1)])):
        x = np.stack([step_features(m, c) for m in runs])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        coef = np.maximum(coef, 0.0)     # latencies cannot be negative
        rel = np.abs(x @ coef - y) / y
        if best is None or rel.mean() < best[2]:
            best = (c, coef, rel.mean())
    c, (k1, k4, k3, c0, c_pre), err = best
    model = CostModel(k1=float(k1), k2=float(k3 * c), k3=float(k3), k4=float(k4), k5=1.0)
    return model, {"crossover": float(c), "overhead_s": float(c0),
                   "prefill_s_per_token": float(c_pre), "mean_relative_error": float(err)}


def load_cost_model(path: str | Path) -> CostModel:
    data = json.loads(Path(path).read_text())
    return CostModel(**{k: data[k] for k in ("k1", "k2", "k3", "k4", "k5")})


@dataclass(frozen=True, kw_only=True)
class ProfileArgs:
    model_dir: str
    out: str
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_lens: tuple[int, ...] = (8, 64)
    max_tokens: int = 48
    repeats: int = 2
    max_num_seqs: int = 64
    kv_memory_fraction: float = 0.2
    startup_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self):
        if min(self.batch_sizes) <= 0 or max(self.batch_sizes) > self.max_num_seqs:
            raise ValueError(f"ProfileArgs.batch_sizes={self.batch_sizes!r}: must be in "
                             f"1..max_num_seqs={self.max_num_seqs}")
        if self.max_tokens <= 0 or min(self.prompt_lens) <= 0:
            raise ValueError("ProfileArgs.max_tokens and prompt_lens must be > 0")


async def _measure(args: ProfileArgs, base_url: str, vocab: int) -> list[Measurement]:
    import aiohttp

    from fnrl.serving.client import RolloutClient

    rng = np.random.default_rng(args.seed)
    runs = []
    async with aiohttp.ClientSession() as session:
        client = RolloutClient(base_url, session)

        async def one_run(batch: int, prompt_len: int) -> Measurement:
            # Fresh random prompts each run, so the prefix cache never shortcuts prefill.
            prompts = rng.integers(3, vocab, size=(batch, prompt_len)).tolist()
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.generate(
                p, n=1, max_tokens=args.max_tokens, temperature=1.0,
                seed=int(rng.integers(1 << 30))) for p in prompts))
            wall = time.perf_counter() - t0
            return Measurement(prompt_len, tuple(len(o[0].token_ids) for o in outs), wall)

        await one_run(2, 8)  # warm-up (first requests compile / allocate)
        for _ in range(args.repeats):
            for batch in args.batch_sizes:
                for prompt_len in args.prompt_lens:
                    runs.append(await one_run(batch, prompt_len))
    return runs


def main(args: ProfileArgs) -> dict:
    from fnrl.serving.server import ServerSpec, free_port, launch_server, stop_server, wait_ready

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    max_len = max(args.prompt_lens) + args.max_tokens + 8
    spec = ServerSpec(model_dir=args.model_dir, port=free_port(), max_model_len=max_len,
                      max_num_seqs=args.max_num_seqs,
                      kv_memory_fraction=args.kv_memory_fraction, seed=args.seed)
    log = Path(tempfile.mkdtemp(prefix="fnrl-profile-")) / "server.log"
    proc = launch_server(spec, log)
    try:
        wait_ready(spec.base_url, proc, args.startup_timeout_s)
        runs = asyncio.run(_measure(args, spec.base_url, int(config["vocab_size"])))
    finally:
        stop_server(proc)
    model, diag = fit_cost_model(runs, max_batch=max(args.batch_sizes))
    record = {**asdict(model), **diag, "model_dir": str(args.model_dir),
              "measurements": [asdict(m) for m in runs]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    import tyro

    result = main(tyro.cli(ProfileArgs))
    print(json.dumps({k: result[k] for k in ("k1", "k2", "k3", "k4", "k5", "crossover",
                                               "mean_relative_error")}))
