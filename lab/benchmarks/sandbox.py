"""What tool calls cost through the sandbox, in both modes side by side, and whether
they block the event loop.

    python -m lab.benchmarks.sandbox                 # 200 calls of each kind, 2 workers
    python -m lab.benchmarks.sandbox --calls 500 --workers 4

Measured in one run, for the kernel mode (a fresh bubblewrap sandbox per call,
fnrl.sandbox.kernel) and the audit-hook mode (persistent workers, fnrl.sandbox.hook):
  calc        the calculator, one call at a time (p50 and p99 ms per call);
  python      a small Python tool call, one at a time;
  crash       a crashing call (os._exit) and what replaces its process;
  throughput  calls per second with `workers` calls always in flight;
  loop lag    the event loop's worst delay (a 1 ms ticker) while `workers` calls burn
              their CPU limit at once, against the same ticker with the loop idle.
Also the calculator inline on the loop (fnrl.envs.base.InlineCalculator), and the ratios
kernel / hook. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from fnrl.config.sandbox import SandboxConfig
from fnrl.envs.base import InlineCalculator
from fnrl.sandbox.pool import SandboxPool


async def _timed(call, n: int) -> dict:
    ms = []
    for i in range(n):
        t = time.perf_counter()
        await call(i)
        ms.append(1e3 * (time.perf_counter() - t))
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "calls": n}


async def _max_lag(work) -> float:
    """The worst lateness of a 1 ms ticker, in ms, while `work` runs."""
    worst, done = 0.0, asyncio.Event()

    async def ticker():
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, 1e3 * (time.perf_counter() - t) - 1.0)
    tick = asyncio.create_task(ticker())
    await work()
    done.set()
    await tick
    return worst


async def _throughput(pool: SandboxPool, n: int, workers: int) -> float:
    """Calls per second with `workers` calls in flight."""
    t = time.perf_counter()

    async def stream(k: int):
        for i in range(k, n, workers):
            await pool.call("calculator", {"expression": f"{i}*389"})
    await asyncio.gather(*(stream(k) for k in range(workers)))
    return round(n / (time.perf_counter() - t), 1)


async def _mode(isolation: str, calls: int, workers: int) -> dict:
    cfg = SandboxConfig(isolation=isolation, workers=workers, cpu_s=1, timeout_s=60.0)
    async with SandboxPool(cfg) as pool:
        out = {"mode": pool.mode.describe()}
        out["calc"] = await _timed(lambda i: pool.call("calculator", {"expression": f"{i}*389"}), calls)
        out["python"] = await _timed(
            lambda i: pool.call("python", {"code": f"sum(range({i}))"}), calls)
        out["crash"] = await _timed(
            lambda i: pool.call("python", {"code": "import os\nos._exit(1)"}), max(calls // 20, 5))
        out["throughput_calls_per_s"] = await _throughput(pool, calls, workers)

        async def burn():
            await asyncio.gather(*(pool.call("python", {"code": "while True:\n    pass"})
                                   for _ in range(workers)))
        idle = await _max_lag(lambda: asyncio.sleep(1.0))
        busy = await _max_lag(burn)
        out["loop_lag"] = {"idle_max_ms": round(idle, 2), "burning_max_ms": round(busy, 2),
                           "workers_burning": workers}
        out["reasons"] = dict(pool.counts)
    return out


async def main(calls: int, workers: int) -> dict:
    inline = InlineCalculator()
    out = {"inline": await _timed(lambda i: inline.call("calculator", {"expression": f"{i}*389"}), calls)}
    for isolation in ("kernel", "hook"):
        out[isolation] = await _mode(isolation, calls, workers)
    k, h = out["kernel"], out["hook"]
    out["kernel_over_hook"] = {
        "calc_p50": round(k["calc"]["p50_ms"] / h["calc"]["p50_ms"], 2),
        "python_p50": round(k["python"]["p50_ms"] / h["python"]["p50_ms"], 2),
        "crash_p50": round(k["crash"]["p50_ms"] / h["crash"]["p50_ms"], 2),
        "throughput": round(k["throughput_calls_per_s"] / h["throughput_calls_per_s"], 2)}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.calls, args.workers)), indent=1))
