"""Limits of the sandbox that runs tool calls (fnrl.sandbox.pool, docs/environments.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fnrl.config.base import check, positive


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """A pool of `workers` processes; each call gets `timeout_s` of wall time and
    `cpu_s` of CPU time, in a worker limited to `memory_mb` of address space and
    `file_mb` per written file; a call's printed output is cut at `max_output_chars`.
    A worker is replaced when a call kills it, and recycled after `recycle_after` calls
    (tool code can leave state behind in a worker: 1 gives every call a fresh one)."""

    workers: int = 2
    timeout_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_mb: int = 16
    max_output_chars: int = 4096
    recycle_after: int = 100
    start_timeout_s: float = 30.0

    def __post_init__(self):
        positive(self, "workers", "timeout_s", "cpu_s", "file_mb", "max_output_chars",
                 "recycle_after", "start_timeout_s")
        # Below ~64 MiB of address space the interpreter cannot start.
        check(self.memory_mb >= 64, "SandboxConfig", "memory_mb", self.memory_mb,
              "must be >= 64 (the worker's interpreter needs about 30 MiB)")
