"""Role handles: what the controller loop needs of a trainer, a rollout, the relay tier
and the clock, as typed interfaces.

The loop (fnrl.control.loop) talks only to these. Local processes implement them
(fnrl.backends.local: a ZeroMQ trainer process, vLLM HTTP servers, the relay tier),
simulated roles on virtual time implement them in process (fnrl.sim.handles: the
simulator's, and the tests' fakes), and a Ray-placed implementation plugs in the same
way: build a `Roles` and hand it to `Controller`. A handle never decides anything; the
loop's pure policies do, and `act` calls the handle. Failures surface as `RoleError` (a
role died or answered with an error) or `ServerError` (a rollout's request failed), and
`exit_code()` says whether the role's process is gone.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fnrl.envs.base import ToolResult
from fnrl.types import ClusterLost, Completion, NodeLost, RoleError, ServerError, StreamChunk

__all__ = ["Clock", "MonotonicClock", "TrainerHandle", "RolloutHandle", "EvalServerHandle",
           "RelayTierHandle", "ToolsHandle",
           "ClusterLost", "NodeLost", "RelayEvent", "Roles", "RoleError", "ServerError", "TrainResult"]


@runtime_checkable
class Clock(Protocol):
    """Where the loop reads time and waits: real time, or a simulator's virtual time."""

    def now(self) -> float:
        """Seconds on a monotonic clock (arbitrary origin)."""

    def epoch(self) -> float:
        """Seconds since 1970: comparable across processes and controller restarts."""

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock."""

    def now(self) -> float:
        return time.perf_counter()

    def epoch(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True)
class TrainResult:
    version: int                      # the trainer's version after the step
    metrics: Mapping[str, float]      # the step's metrics (update_skipped = 1.0: no update)


@runtime_checkable
class TrainerHandle(Protocol):
    """The trainer role (one process, or a group of processes on one mesh)."""

    name: str

    def exit_code(self) -> int | None:
        """The process's exit code, or None while it runs."""

    def exit_reason(self) -> str | None:
        """How the process ended, in words with the evidence ("was killed by the kernel's
        out-of-memory killer (...)"), or None while it runs."""

    async def init(self) -> tuple[int, int | None]:
        """Builds (or restores) the train state and publishes it: (version, resumed_from)."""

    async def train(self, arrays: Mapping[str, np.ndarray]) -> TrainResult:
        """One step on `arrays`; the new version is published before it returns."""

    async def restart(self) -> int:
        """Replaces a failed trainer (a warm standby when there is one) restored from its
        newest checkpoint; returns the version restored."""

    def kill(self, sig: int = signal.SIGKILL) -> None: ...

    async def shutdown(self) -> None: ...


@runtime_checkable
class RolloutHandle(Protocol):
    """One generation server (vLLM with fnrl's worker extension)."""

    name: str

    def exit_code(self) -> int | None: ...

    def exit_reason(self) -> str | None: ...

    async def kv_capacity_tokens(self) -> int: ...

    async def generate(self, prompt_ids: Sequence[int], *, n: int, max_tokens: int,
                       temperature: float, seed: int | None = None,
                       stop_token_ids: Sequence[int] = (), top_p: float = 1.0,
                       top_k: int = -1, stop: Sequence[str] = ()) -> list[Completion]: ...

    def generate_stream(self, prompt_ids: Sequence[int], *, max_tokens: int,
                        temperature: float, seed: int | None = None,
                        stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                        request_id: str | None = None, top_p: float = 1.0,
                        top_k: int = -1, stop: Sequence[str] = (),
                        routes_from: int | None = None) -> AsyncIterator[StreamChunk]:
        """Streams the tokens and log-probs of one sample (log μ: the distribution it
        is sampled from, top_k and top_p applied); closing it aborts the request.
        `stop` strings end it too (multi-turn turns only). `routes_from` (routing
        replay): the last chunk carries the engine's routes of every position of prompt
        + sample from there on (StreamChunk.routes)."""

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        """Loads the relay's newest weights (at least `min_version`); the version served."""

    async def metrics(self) -> Mapping[str, float]:
        """The heartbeat: vLLM's load gauges (`vllm:num_requests_waiting`, ...)."""

    async def restart(self) -> float:
        """Replaces a failed server with a new one (no weights pulled yet); returns the
        seconds the new server took to start."""

    def kill(self, sig: int = signal.SIGKILL) -> None: ...


@runtime_checkable
class EvalServerHandle(Protocol):
    """A generation server kept for held-out evaluation (fnrl.control.eval_lane): never
    routed training work, it loads the exact version it is asked to score."""

    name: str

    def exit_code(self) -> int | None: ...

    def exit_reason(self) -> str | None: ...

    async def generate(self, prompt_ids: Sequence[int], *, n: int, max_tokens: int,
                       temperature: float, seed: int | None = None,
                       stop_token_ids: Sequence[int] = (), top_p: float = 1.0,
                       top_k: int = -1, stop: Sequence[str] = ()) -> list[Completion]: ...

    async def pull_version(self, relay_address: str, version: int, *,
                           relay_timeout_s: float = 30.0) -> int:
        """Loads exactly `version` from the relay (waiting until it holds it); the version
        served. Raises ServerError when the relay no longer holds it."""

    def kill(self, sig: int = signal.SIGKILL) -> None: ...


@dataclass(frozen=True)
class RelayEvent:
    """The relay tier repaired its chain: `relay` was spliced out (or a master elected)."""

    relay: str
    cause: str            # "exited", "hung", ...
    failed_at: float      # epoch seconds: the relay stopped serving (as the tier saw it)
    repaired_at: float    # epoch seconds: the survivors hold their new places
    master: str | None    # the master after the repair
    was_master: bool = False


@runtime_checkable
class RelayTierHandle(Protocol):
    """The relays that hand each new version from the trainer to the rollouts."""

    names: tuple[str, ...]

    def address_for(self, rid: int) -> str:
        """The relay rollout `rid` pulls from (a survivor once its own is spliced out, its
        own again once a replacement has caught up)."""

    def check(self) -> None:
        """Raises RoleError when no relay is left to serve weights, ClusterLost when the
        cluster the roles run on is gone."""

    def events(self) -> tuple[RelayEvent, ...]:
        """Every chain repair since the tier started, oldest first."""

    async def replace(self, name: str) -> Mapping[str, object]:
        """Starts a new relay in the place of `name`, which exited, and returns once it
        serves (what to record: its address, the version it started from). Raises
        NodeLost when its node is gone (no later try can succeed), RoleError or
        RuntimeError when it did not start."""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None: ...


@runtime_checkable
class ToolsHandle(Protocol):
    """Runs the tool calls of multi-turn environments (fnrl.sandbox.pool.SandboxPool; in
    tests, an in-process runner): a ToolRunner (fnrl.envs.base) with a lifetime."""

    async def start(self) -> None: ...

    async def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult: ...

    async def close(self) -> None: ...


@dataclass
class Roles:
    """Every role of one job, as the loop sees them."""

    trainer: TrainerHandle
    rollouts: list[RolloutHandle]
    relays: RelayTierHandle
    evaluator: EvalServerHandle | None = None
    """The dedicated evaluation server; None: held-out evaluation runs on idle rollouts
    (or is off, `eval.server`)."""
    tools: ToolsHandle | None = None
    """What runs a multi-turn environment's tool calls; None for a single-turn task."""

    def names(self) -> tuple[str, ...]:
        return ("trainer", *(r.name for r in self.rollouts), *self.relays.names,
                *((self.evaluator.name,) if self.evaluator is not None else ()))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signals the role called `name` (fault injection)."""
        if name == "trainer":
            self.trainer.kill(sig)
        elif name in self.relays.names:
            self.relays.kill(name, sig)
        elif self.evaluator is not None and name == self.evaluator.name:
            self.evaluator.kill(sig)
        else:
            by_name = {r.name: r for r in self.rollouts}
            if name not in by_name:
                raise KeyError(f"no role named {name!r}; roles are {', '.join(self.names())}")
            by_name[name].kill(sig)
