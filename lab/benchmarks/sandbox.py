"""What tool calls cost through the sandbox, and whether they block the event loop.

    python -m lab.benchmarks.sandbox                 # 200 calls of each kind, 2 workers
    python -m lab.benchmarks.sandbox --calls 500 --workers 4

Measured side by side in one run:
  inline      the calculator evaluated on the event loop (fnrl.envs.base.InlineCalculator);
  calc        the calculator through SandboxPool (a pipe round trip to a worker);
  python      a small Python tool call through the pool;
  respawn     a crashing call (os._exit): the reply plus a fresh worker started;
  loop lag    the event loop's worst delay (a 1 ms ticker) while `workers` calls burn
              their CPU limit at once (the busy loop SIGXCPU ends), against the same
              ticker with the loop idle.
Prints one JSON object: per kind, p50 and p99 milliseconds per call, and the lag ratio.
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


async def main(calls: int, workers: int) -> dict:
    inline = InlineCalculator()
    out = {"inline": await _timed(lambda i: inline.call("calculator", {"expression": f"{i}*389"}), calls)}
    async with SandboxPool(SandboxConfig(workers=workers, cpu_s=1, timeout_s=60.0)) as pool:
        out["calc"] = await _timed(lambda i: pool.call("calculator", {"expression": f"{i}*389"}), calls)
        out["python"] = await _timed(
            lambda i: pool.call("python", {"code": f"sum(range({i}))"}), calls)
        out["respawn"] = await _timed(
            lambda i: pool.call("python", {"code": "import os\nos._exit(1)"}), max(calls // 20, 5))

        async def burn():
            await asyncio.gather(*(pool.call("python", {"code": "while True:\n    pass"})
                                   for _ in range(workers)))
        idle = await _max_lag(lambda: asyncio.sleep(1.0))
        busy = await _max_lag(burn)
        out["loop_lag"] = {"idle_max_ms": round(idle, 2), "burning_max_ms": round(busy, 2),
                           "workers_burning": workers}
        out["reasons"] = pool.counts
        out["network_mode"], out["worker_user"] = pool.network_mode, pool.worker_user
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.calls, args.workers)), indent=1))
