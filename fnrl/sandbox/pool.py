"""The tool sandbox's front door: `SandboxPool(cfg)` runs tool calls in the mode the
run asked for, or refuses to start.

Modes, strongest first: "kernel" (fnrl.sandbox.kernel: a fresh bubblewrap sandbox per
call, namespaces, a read-only view, a seccomp filter) and "hook" (fnrl.sandbox.hook:
persistent workers behind a Python audit hook and rlimits). `choose_mode` probes the
machine; a mode weaker than `cfg.isolation` raises `SandboxUnavailable`, naming what is
missing, unless `cfg.allow_weaker`. The mode in use is `pool.mode`, logged at start and
written to the run's run_info.json (fnrl.experiments.math_grpo).

`SandboxPool` implements fnrl.envs.base.ToolRunner: `await pool.call(name, arguments)`
never raises for what the tool does; `counts` tallies the calls by reason.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from fnrl.config.sandbox import SandboxConfig
from fnrl.envs.base import ToolResult
from fnrl.sandbox import kernel
from fnrl.sandbox.hook import HookPool

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot run on this machine (and weaker was not allowed)."""


@dataclass(frozen=True)
class Mode:
    name: str      # "kernel" or "hook"
    why: str       # what was found, in words

    def describe(self) -> str:
        return f"{self.name}: {self.why}"


def choose_mode(cfg: SandboxConfig) -> Mode:
    """The mode tool calls will run in here; raises SandboxUnavailable when it would be
    weaker than `cfg.isolation` and `cfg.allow_weaker` is off."""
    if cfg.isolation == "hook":
        return Mode("hook", "configured (sandbox.isolation=hook): a Python audit hook and "
                            "rlimits, not a kernel boundary")
    ok, why = kernel.probe(cfg)
    if ok:
        return Mode("kernel", why)
    if cfg.allow_weaker:
        return Mode("hook", f"the kernel mode cannot run here ({why}); the weaker audit-hook "
                            "mode was allowed (--sandbox.allow-weaker)")
    raise SandboxUnavailable(
        f"the tool sandbox cannot isolate tool calls by the kernel here: {why}. Fix that, "
        "or run with --sandbox.allow-weaker to accept the weaker audit-hook mode (a Python "
        "guard, not a boundary: docs/environments.md, 'The sandbox')")


class SandboxPool:
    """Tool calls in the configured mode (see the module docstring). Use as `async with`."""

    def __init__(self, cfg: SandboxConfig | None = None, *, mode: Mode | None = None):
        self.cfg = cfg or SandboxConfig()
        self.mode = mode
        self._impl: kernel.KernelPool | HookPool | None = None

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self.mode is None:
            self.mode = await asyncio.to_thread(choose_mode, self.cfg)
        impl = kernel.KernelPool(self.cfg) if self.mode.name == "kernel" else HookPool(self.cfg)
        await impl.start()
        self._impl = impl
        log.info("tool sandbox: %s", self.mode.describe())

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        if self._impl is None:
            raise RuntimeError("SandboxPool.call before start()")
        return await self._impl.call(name, arguments)

    async def close(self) -> None:
        if self._impl is not None:
            await self._impl.close()

    @property
    def counts(self) -> dict[str, int]:
        return self._impl.counts if self._impl is not None else {}

    @property
    def pids(self) -> tuple[int, ...]:
        return self._impl.pids if self._impl is not None else ()
