"""In-process role handles on a virtual-time event loop: the simulator's roles, and the
only fake roles there are (the loop's tests configure these: tests/control/fakes.py).

They implement the role-handle Protocols (fnrl.control.handles), so
`fnrl.control.loop.Controller` itself runs on them in virtual time. Over the simulator's
cost models they check the heap simulator's mirror of `act` event by event
(tests/sim/test_real_loop.py); over a trivial one (a decode step takes a fixed time)
the loop, supervisor and recovery tests run on them in seconds.

- `VirtualTimeLoop`: an asyncio event loop whose clock jumps to the next timer whenever
  no callback is ready, so `asyncio.sleep(600)` returns at once in real time.
- `SimRollout`: one engine task per rollout stepping decode steps of L(kv, n)
  (`tokens_per_step` tokens to every running stream per step, first-come first-served
  admission with prefill); a response ends at its budget, or with EOS after `eos_after`
  tokens. Pulls wait for the version at the relay and take `pull_s`; `pull_version`
  makes one an evaluation server too.
- `SimTrainer`: a step takes `train_s` plus the publish stall, then publishes.
- `SimRelays`: every published version, at once, from any live relay. A killed relay
  fails its pulls and `address_for` skips it; its chain repairs (`events`) are what
  `repairs` holds: nothing here plays the tier's monitor.

Faults are a process's: `kill()` (SIGKILL) ends a role, so its calls in flight fail and
later ones are refused (RoleError from the trainer, ServerError from a rollout) until
`restart()`, which takes `start_s`; `kill(signal.SIGSTOP)` stops it: nothing it does
finishes until it is killed.

Every step and token is an event here (no closed form, no preemption, no prefix
cache): meant for clusters of a few rollouts and short responses.
"""

from __future__ import annotations

import asyncio
import selectors
import signal
from dataclasses import dataclass, field

import numpy as np

from fnrl.control.handles import RelayEvent, TrainResult
from fnrl.types import Completion, RoleError, Routes, ServerError, StreamChunk
from fnrl.sim import costs
from fnrl.sim.costs import DecodeCosts

EOS = 1
POLL_S = 0.01   # how often a pull looks again for a version not published yet


class _JumpSelector(selectors.DefaultSelector):
    def __init__(self):
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time loop: no timer and nothing ready (a deadlock)")
        self.loop.virtual_now += timeout   # nothing can happen before the next timer
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_now = 0.0

    def time(self) -> float:
        return self.virtual_now


def run_virtual(coro):
    """Runs `coro` to completion in virtual time; tasks still pending at its end or when
    it raises (the engines, the supervisor's heartbeats) are cancelled, and async
    generators closed, before the loop closes (as `asyncio.run` does)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:   # (gather of nothing would make its future on another loop)
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


class LoopClock:
    """The Clock handle over the running loop's (virtual) time."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def epoch(self) -> float:
        return 1.7e9 + self.now()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


@dataclass
class SimRelays:
    names: tuple[str, ...] = ("relay0",)
    published: list[int] = field(default_factory=lambda: [0])   # versions, oldest first
    repairs: list[RelayEvent] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)
    replaced: list[str] = field(default_factory=list)
    start_s: float = 0.0              # a replacement serves this long after it is started

    def address_for(self, rid: int) -> str:
        live = [n for n in self.names if n not in self.dead]
        return live[rid % len(live)]

    def check(self) -> None:
        if set(self.names) <= self.dead:
            raise RoleError("no relay left")

    def events(self) -> tuple[RelayEvent, ...]:
        return tuple(self.repairs)

    async def replace(self, name: str) -> dict:
        await asyncio.sleep(self.start_s)
        self.dead.discard(name)
        self.replaced.append(name)
        return {"address": name, "version": self.published[-1]}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.dead.add(name)


class _Process:
    """A role's process as signals see it (the module docstring: Faults)."""

    name: str
    refused: type[Exception] = RoleError   # what its failed calls raise

    def __init__(self, start_s: float):
        self.start_s = start_s
        self.code: int | None = None
        self.stopped = False
        self.restarts = 0
        self._work: set[asyncio.Future] = set()

    def exit_code(self) -> int | None:
        return self.code

    def exit_reason(self) -> str | None:
        return None if self.code is None else f"exited with code {self.code}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if sig == signal.SIGSTOP:
            self.stopped = True
            return
        self.code, self.stopped = -int(sig), False
        for work in self._work:
            if not work.done():
                work.set_exception(self.refused(f"{self.name} {self.exit_reason()}"))

    def _alive(self) -> None:
        if self.code is not None:
            raise self.refused(f"{self.name}: connection refused")

    async def _busy(self, seconds: float) -> None:
        """`seconds` of the role's work: fails if it is killed meanwhile, and never ends
        while it is stopped."""
        self._alive()
        loop = asyncio.get_running_loop()
        work = loop.create_future()
        self._work.add(work)
        timer = loop.call_later(seconds, self._finish, work)
        try:
            await work
        finally:
            timer.cancel()
            self._work.discard(work)

    def _finish(self, work: asyncio.Future) -> None:
        if not (work.done() or self.stopped):
            work.set_result(None)

    async def _replaced(self) -> None:
        """A new process in the old one's place, `start_s` later."""
        self.kill()
        await asyncio.sleep(self.start_s)
        self.code, self.stopped = None, False
        self.restarts += 1


class SimTrainer(_Process):
    name = "trainer"

    def __init__(self, relays: SimRelays, *, train_s: float, publish_s: float,
                 start_s: float = 0.0):
        super().__init__(start_s)
        self.relays, self.train_s, self.publish_s = relays, train_s, publish_s
        self.version = 0

    async def init(self):
        return self.version, None

    async def train(self, arrays) -> TrainResult:
        await self._busy(self.train_s + self.publish_s)
        self.version += 1
        self.relays.published.append(self.version)
        return TrainResult(self.version, {"update_skipped": 0.0})

    async def restart(self) -> int:
        await self._replaced()
        # Restored from its newest checkpoint (every step it finished), which it publishes
        # if the relays lack it (it died between the two), as fnrl.trainer.role does.
        if self.relays.published[-1] < self.version:
            self.relays.published.append(self.version)
        return self.version

    async def shutdown(self) -> None:
        pass


class _Request:
    def __init__(self, ctx: int, budget: int, eos: bool, routes_from: int | None = None):
        self.ctx, self.left, self.sent, self.eos = ctx, budget, 0, eos
        self.routes_from = routes_from
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.lost: ServerError | None = None   # its server died


class SimRollout(_Process):
    refused = ServerError

    def __init__(self, rid: int, relays: SimRelays, decode: DecodeCosts, *, kv_capacity: int,
                 pull_s: float, max_num_seqs: int = 1024, tokens_per_step: int = 1,
                 eos_after: int | None = None, start_s: float = 0.0):
        super().__init__(start_s)
        self.name, self.relays, self.decode = f"rollout{rid}", relays, decode
        self.kv_capacity, self.pull_s, self.max_num_seqs = kv_capacity, pull_s, max_num_seqs
        self.tokens_per_step, self.eos_after = tokens_per_step, eos_after
        self.version = 0
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.pulling = False
        self._wake = asyncio.Event()
        self._engine: asyncio.Task | None = None

    async def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, seed=None,
                       stop_token_ids=(), top_p=1.0, top_k=-1):
        # Probes and evaluations: no time, so they stay out of the measured schedule.
        await self._busy(0.0)
        answer = (2 + sum(prompt_ids) % 7, EOS)[:max_tokens]
        return [Completion(token_ids=answer, logprobs=(-0.1,) * len(answer), finish_reason="stop")
                for _ in range(n)]

    async def generate_stream(self, prompt_ids, *, max_tokens, temperature, seed=None,
                              stop_token_ids=(), ignore_eos=False, request_id=None, top_p=1.0,
                              top_k=-1, routes_from=None):
        """`routes_from`: the last chunk reports routes as vLLM does, for every fed
        position from there (the last sampled token is never fed), each position p
        routed to experts (p, 1000 + the version serving): one MoE layer, top-2."""
        self._alive()
        if self._engine is None:
            self._engine = asyncio.get_running_loop().create_task(self._run())
        natural = self.eos_after is not None and not ignore_eos and self.eos_after <= max_tokens
        req = _Request(len(prompt_ids), self.eos_after if natural else max_tokens, natural,
                       routes_from)
        self.waiting.append(req)
        self._wake.set()
        try:
            while True:
                chunk = await req.chunks.get()
                if req.lost is not None:
                    raise req.lost
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:   # closed early: vLLM aborts the request
            for queue in (self.waiting, self.running):
                if req in queue:
                    queue.remove(req)

    async def _run(self) -> None:
        cost, per_step = self.decode.cost, self.tokens_per_step
        while True:
            if self.pulling or not (self.running or self.waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            kv = sum(r.ctx for r in self.running)
            prefill = 0.0
            while self.waiting and len(self.running) < self.max_num_seqs:
                head = self.waiting[0]
                if kv + head.ctx + (len(self.running) + 1) * per_step > self.kv_capacity:
                    break
                self.running.append(self.waiting.pop(0))
                kv += head.ctx
                prefill += self.decode.prefill_s_per_token * head.ctx + self.decode.per_request_s
            if prefill:
                await self._busy(prefill)
            if not self.running:
                continue
            await self._busy(costs.step_s(cost, kv, len(self.running)))
            for r in list(self.running):
                n = min(per_step, r.left)
                ids = [3 + (r.sent + k) % 5 for k in range(n)]
                r.ctx, r.sent, r.left = r.ctx + n, r.sent + n, r.left - n
                if r.left == 0 and r.eos:
                    ids[-1] = EOS
                reason = None if r.left else "stop" if r.eos else "length"
                r.chunks.put_nowait(StreamChunk(token_ids=tuple(ids), logprobs=(-0.5,) * n,
                                                finish_reason=reason,
                                                **self._routes(r) if reason else {}))
                if reason:
                    self.running.remove(r)

    def _routes(self, r: _Request) -> dict:
        if r.routes_from is None:
            return {}
        fed = np.arange(r.routes_from, r.ctx - 1)
        return {"routes": Routes.of(np.stack([fed, np.full_like(fed, 1000 + self.version)],
                                             -1)[:, None, :]), "routes_from": r.routes_from}

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        return await self._load(relay_address, min_version, relay_timeout_s, exact=False)

    async def pull_version(self, relay_address: str, version: int, *,
                           relay_timeout_s: float = 30.0) -> int:
        return await self._load(relay_address, version, relay_timeout_s, exact=True)

    async def _load(self, relay_address: str, version: int, timeout_s: float, *,
                    exact: bool) -> int:
        """Loads `version` (exact) or the newest, once the relay holds at least
        `version`; the engine decodes nothing meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.pulling = True
        try:
            while self.relays.published[-1] < version:
                if loop.time() >= deadline:
                    raise ServerError(f"{self.name}: the relay has no version {version} yet")
                await self._busy(POLL_S)
            if relay_address in self.relays.dead:
                raise ServerError(f"{self.name}: relay {relay_address} does not answer")
            if exact and version not in self.relays.published:
                raise ServerError(f"{self.name}: the relay holds no version {version}")
            load = version if exact else self.relays.published[-1]
            await self._busy(self.pull_s)
        finally:
            self.pulling = False
            self._wake.set()
        self.version = load
        return load

    async def metrics(self):
        await self._busy(0.0)
        return {"vllm:num_requests_waiting": float(len(self.waiting)),
                "vllm:num_requests_running": float(len(self.running)),
                "vllm:kv_cache_usage_perc": 0.0}

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if sig != signal.SIGSTOP and self._engine is not None:
            self._engine.cancel()
            self._engine = None
        super().kill(sig)
        if self.code is None:
            return
        for req in self.waiting + self.running:   # their streams fail
            req.lost = ServerError(f"{self.name}: connection reset")
            req.chunks.put_nowait(None)
        self.waiting, self.running = [], []

    async def restart(self) -> float:
        await self._replaced()
        self.version = 0
        return self.start_s
