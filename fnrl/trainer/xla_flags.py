"""XLA options and CPU threads the trainer process sets before JAX starts its backend.

XLA's CPU compiler schedules a program for concurrency by default
(`xla_cpu_enable_concurrency_optimized_scheduler`), which runs independent work early
and keeps its results alive: every layer's recomputation is hoisted into the forward
pass, so rematerialisation saves nothing, and the attention matrices of all layers are
alive at once. Measured on an 8-layer decoder at 4 × 1,024 tokens (XLA's buffer plan,
RSS agreeing within 0.1 GB): 1,740 MB of temporaries with or without remat under the
concurrency scheduler; 775 MB without remat and 279 MB with it under the memory-minimising
one. Since remat runs the layers as one scan (fnrl.models.decoder), whose backward loop
cannot be hoisted, remat lowers the plan under either scheduler; the memory-minimising
one still lowers the step without remat (tests/trainer/test_xla_flags.py: 40 against
57 MB for a 6-layer model at 2 × 512 tokens). The flag names the CPU backend only; GPU
compilation ignores it.

CPU threads (`set_cpu_threads`, for the trainer and the benchmarks, which also run torch):
XLA's CPU client sizes its intra-op thread pool from the process's CPU affinity
when it is created (there is no flag for it in this jaxlib), and OpenMP-based
libraries read OMP_NUM_THREADS at load time; so the one way to give a process N
threads is to pin it to N CPUs before its first JAX computation.

Why it matters on a shared host: a parallel op finishes only when its last thread
does, so when other jobs (vLLM servers, relays) hold the cores, a pool with more
threads than the process can get waits on descheduled threads. Measured on the
2-core dev machine at load 6-9 (lab/benchmarks/train_step.py's cpu preset): fnrl's step
took 0.86-1.2 s with one thread and 0.86-3.8 s with two; torch's with two OpenMP
threads took 3.6-8.8 s against 0.56-1.2 s with one.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def use_memory_scheduler(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds MEMORY_SCHEDULER_FLAG to XLA_FLAGS unless the scheduler is already chosen
    there. Call before the first JAX computation: XLA reads its flags once, at backend
    start."""
    flags = environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        environ["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER_FLAG}".strip()

def compilation_cache_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """Where XLA's compiled programs persist across processes: JAX_COMPILATION_CACHE_DIR,
    else ~/.cache/fnrl/jax (fnrl.trainer.role.enable_compilation_cache)."""
    return environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.expanduser("~/.cache/fnrl/jax")


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def set_cpu_threads(threads: int) -> list[int]:
    """Pins this process to its first `threads` allowed CPUs; returns them.

    0 keeps every allowed CPU. Call before the first JAX computation (the CPU client
    reads the affinity once) and before importing torch or numpy's BLAS.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be a non-negative int, got {threads!r}")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:threads] if threads else allowed
    os.sched_setaffinity(0, cpus)
    for var in _THREAD_ENV:
        os.environ[var] = str(len(cpus))
    return cpus


def cpu_threads() -> int:
    """The number of CPUs this process may run on: XLA's intra-op pool size."""
    return len(os.sched_getaffinity(0))
