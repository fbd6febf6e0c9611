"""Simulated role handles for the *real* controller loop, on a virtual-time event loop.

The scale simulator (fnrl.sim.cluster) mirrors the loop's `act` on an event heap. These
handles check that mirror: they implement the role-handle Protocols
(fnrl.control.handles) over the same cost models, so `fnrl.control.loop.Controller`
itself runs a small cluster in virtual time, and its schedule can be compared event
by event with the heap's (tests/sim/test_real_loop.py).

- `VirtualTimeLoop`: an asyncio event loop whose clock jumps to the next timer whenever
  no callback is ready, so `asyncio.sleep(600)` returns at once in real time.
- `SimRollout`: one engine task per rollout stepping decode steps of L(kv, n) (one
  token to every running stream per step, first-come first-served admission with
  prefill); pulls wait for the version at the relay and take `pull_s`.
- `SimTrainer`: a step takes `train_s` plus the publish stall, then publishes.

Every step and token is an event here (no closed form, no preemption, no prefix
cache): meant for clusters of a few rollouts and short responses.
"""

from __future__ import annotations

import asyncio
import selectors
import signal
from dataclasses import dataclass, field

from fnrl.control.handles import RelayEvent, TrainResult
from fnrl.types import Completion, StreamChunk
from fnrl.sim import costs
from fnrl.sim.costs import DecodeCosts

EOS = 1


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
    """Runs `coro` to completion in virtual time; tasks still pending at its end (the
    engines, the supervisor's heartbeats) are cancelled before the loop closes."""
    loop = VirtualTimeLoop()
    try:
        result = loop.run_until_complete(coro)
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        return result
    finally:
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
    published: dict[int, float] = field(default_factory=lambda: {0: 0.0})   # version -> time
    arrival_s: float = 0.0            # a version reaches a relay this long after the master

    def address_for(self, rid: int) -> str:
        return self.names[rid % len(self.names)]

    def check(self) -> None:
        pass

    def events(self) -> tuple[RelayEvent, ...]:
        return ()

    async def replace(self, name: str) -> dict:
        raise NotImplementedError("the simulated relays do not fail")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        raise NotImplementedError("the simulated relays do not fail")


class SimTrainer:
    name = "trainer"

    def __init__(self, relays: SimRelays, *, train_s: float, publish_s: float):
        self.relays, self.train_s, self.publish_s = relays, train_s, publish_s
        self.version = 0

    def exit_code(self):
        return None

    def exit_reason(self):
        return None

    async def init(self):
        return self.version, None

    async def train(self, arrays) -> TrainResult:
        await asyncio.sleep(self.train_s + self.publish_s)
        self.version += 1
        self.relays.published[self.version] = asyncio.get_running_loop().time()
        return TrainResult(self.version, {"update_skipped": 0.0})

    async def restart(self) -> int:
        return self.version

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise NotImplementedError("the simulated trainer does not fail")

    async def shutdown(self) -> None:
        pass


class _Request:
    def __init__(self, ctx: int, budget: int):
        self.ctx, self.left = ctx, budget
        self.chunks: asyncio.Queue = asyncio.Queue()


class SimRollout:
    def __init__(self, rid: int, relays: SimRelays, decode: DecodeCosts, *, kv_capacity: int,
                 pull_s: float, max_num_seqs: int = 1024):
        self.name, self.relays, self.decode = f"rollout{rid}", relays, decode
        self.kv_capacity, self.pull_s, self.max_num_seqs = kv_capacity, pull_s, max_num_seqs
        self.version = 0
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.pulling = False
        self._wake = asyncio.Event()
        self._engine: asyncio.Task | None = None

    def exit_code(self):
        return None

    def exit_reason(self):
        return None

    async def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, seed=None,
                       stop_token_ids=(), top_p=1.0, top_k=-1):
        # Probes and evaluations: instant, so they stay out of the measured schedule.
        answer = (3, EOS)[:max_tokens]
        return [Completion(token_ids=answer, logprobs=(-0.1,) * len(answer), finish_reason="stop")
                for _ in range(n)]

    async def generate_stream(self, prompt_ids, *, max_tokens, temperature, seed=None,
                              stop_token_ids=(), ignore_eos=False, request_id=None, top_p=1.0,
                              top_k=-1):
        if self._engine is None:
            self._engine = asyncio.get_running_loop().create_task(self._run())
        req = _Request(len(prompt_ids), max_tokens)
        self.waiting.append(req)
        self._wake.set()
        try:
            while True:
                chunk = await req.chunks.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:   # closed early: vLLM aborts the request
            for queue in (self.waiting, self.running):
                if req in queue:
                    queue.remove(req)

    async def _run(self) -> None:
        cost = self.decode.cost
        while True:
            if self.pulling or not (self.running or self.waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            kv = sum(r.ctx for r in self.running)
            prefill = 0.0
            while self.waiting and len(self.running) < self.max_num_seqs:
                head = self.waiting[0]
                if kv + head.ctx + len(self.running) + 1 > self.kv_capacity:
                    break
                self.running.append(self.waiting.pop(0))
                kv += head.ctx
                prefill += self.decode.prefill_s_per_token * head.ctx + self.decode.per_request_s
            if prefill:
                await asyncio.sleep(prefill)
            if not self.running:
                continue
            await asyncio.sleep(costs.step_s(cost, kv, len(self.running)))
            for r in list(self.running):
                r.ctx += 1
                r.left -= 1
                done = r.left == 0
                r.chunks.put_nowait(StreamChunk(token_ids=(3,), logprobs=(-0.5,),
                                                finish_reason="length" if done else None))
                if done:
                    self.running.remove(r)

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        loop = asyncio.get_running_loop()
        self.pulling = True
        while max(self.relays.published) < min_version:
            await asyncio.sleep(0.01)
        version = max(self.relays.published)
        ready = self.relays.published[version] + self.relays.arrival_s
        await asyncio.sleep(max(ready - loop.time(), 0.0) + self.pull_s)
        self.version, self.pulling = version, False
        self._wake.set()
        return version

    async def metrics(self):
        return {"vllm:num_requests_waiting": float(len(self.waiting)),
                "vllm:num_requests_running": float(len(self.running)),
                "vllm:kv_cache_usage_perc": 0.0}

    async def restart(self) -> float:
        raise NotImplementedError("the simulated rollouts do not fail")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise NotImplementedError("the simulated rollouts do not fail")
