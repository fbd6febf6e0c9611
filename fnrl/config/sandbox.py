"""Limits of the sandbox that runs tool calls (fnrl.sandbox.pool, docs/environments.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fnrl.config.base import check, positive


ISOLATION_MODES = ("kernel", "hook")   # strongest first


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Up to `workers` calls at once; each call gets `timeout_s` of wall time and `cpu_s`
    of CPU time, `memory_mb` of address space, `file_mb` per written file and a private
    tmpfs of `tmp_mb`; a call's printed output is cut at `max_output_chars`.

    `isolation`: "kernel" runs every call in a fresh bubblewrap sandbox (new user, pid,
    mount, IPC and network namespaces, a read-only view of the interpreter alone, a
    seccomp filter; fnrl.sandbox.kernel). "hook" is the weaker mode: persistent workers
    behind a Python audit hook and rlimits (fnrl.sandbox.hook; a worker is recycled
    after `recycle_after` calls). A mode weaker than `isolation` (bubblewrap or
    libseccomp missing, user namespaces refused) stops the run before it starts unless
    `allow_weaker`. `python`: the interpreter tools run in ("" = this one's base
    interpreter). `user`: when the pool runs as root, the uid the sandbox is started as
    (the kernel then sees tool code as that unprivileged user outside its namespaces
    too; the interpreter must be readable by it). None: the pool's own uid."""

    isolation: str = "kernel"
    allow_weaker: bool = False
    python: str = ""
    user: int | None = None
    tmp_mb: int = 64
    workers: int = 2
    timeout_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_mb: int = 16
    max_output_chars: int = 4096
    recycle_after: int = 100
    start_timeout_s: float = 30.0

    def __post_init__(self):
        positive(self, "workers", "timeout_s", "cpu_s", "file_mb", "tmp_mb", "max_output_chars",
                 "recycle_after", "start_timeout_s")
        check(self.isolation in ISOLATION_MODES, "SandboxConfig", "isolation", self.isolation,
              f"must be one of {ISOLATION_MODES}")
        check(self.user is None or self.user > 0, "SandboxConfig", "user", self.user,
              "must be an unprivileged uid (> 0), or None for the pool's own")
        # Below ~64 MiB of address space the interpreter cannot start.
        check(self.memory_mb >= 64, "SandboxConfig", "memory_mb", self.memory_mb,
              "must be >= 64 (the worker's interpreter needs about 30 MiB)")
