"""The method every side-by-side benchmark shares, and the host it ran on.

The method (rounds of all sides in varying order, a ratio per round, the median with its
min–max spread, whether a second run agrees) lives in lab.ablation.rounds, shared with
the ablation grid; it is re-exported here so a benchmark script (run from this folder)
imports it beside `environment` and `load`, the benchmark-only lines that say what load
and software a figure was measured under. The pure helpers are unit-tested in
tests/lab/ablation/test_round_method.py.
"""

from __future__ import annotations

import importlib.metadata
import os

from lab.ablation.rounds import Spread, ratios_agree, round_orders

__all__ = ["Spread", "environment", "load", "mem_available_mb", "ratios_agree", "round_orders"]


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def mem_available_mb() -> float:
    """MemAvailable from /proc/meminfo, in MB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_PACKAGES = ("numpy", "jax", "jaxlib", "torch", "transformers", "vllm", "ucxx")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS")


def environment() -> str:
    """One line: CPUs (all and allowed), load, MemAvailable, thread variables, versions.
    Versions come from package metadata, so nothing heavy is imported to print them."""
    versions = []
    for name in _PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    threads = " ".join(f"{k}={os.environ[k]!r}" for k in _THREAD_VARS if k in os.environ)
    return (f"env: {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} allowed), load {load()}, "
            f"MemAvailable {mem_available_mb():.0f} MB, {threads or 'no thread variables set'}; "
            f"{', '.join(versions)}")
