"""In-process fakes of the role handles (fnrl.control.handles) and a virtual clock, so
the controller loop, the supervisor and recovery run in tests without processes.

The fake rollout decodes a few tokens per event-loop turn at the version it serves; the
fake trainer trains in one turn and publishes the new version to the fake relays; the
clock is virtual: `sleep(s)` moves it forward by s at once, so detection windows pass
without waiting and a busy machine cannot change what a test sees.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

from fnrl.control.handles import RelayEvent, RoleError, ServerError, TrainResult
from fnrl.data.arith import PromptStream, eval_problems
from fnrl.types import Completion, StreamChunk

VOCAB = 50
EOS = 1


class VirtualClock:
    def __init__(self, start: float = 1000.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def epoch(self) -> float:
        return 1.7e9 + self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        await asyncio.sleep(0)


@dataclass
class FakeRelays:
    names: tuple[str, ...] = ("relay0",)
    published: list[int] = field(default_factory=lambda: [0])
    repairs: list[RelayEvent] = field(default_factory=list)
    dead: set = field(default_factory=set)
    replaced: list[str] = field(default_factory=list)

    def address_for(self, rid: int) -> str:
        live = [n for n in self.names if n not in self.dead]
        return live[rid % len(live)]

    def check(self) -> None:
        if set(self.names) <= self.dead:
            raise RoleError("no relay left")

    def events(self) -> tuple[RelayEvent, ...]:
        return tuple(self.repairs)

    async def replace(self, name: str) -> dict:
        self.dead.discard(name)
        self.replaced.append(name)
        return {"address": name, "version": self.published[-1]}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.dead.add(name)


class FakeTrainer:
    """Trains in one event-loop turn. `skip_steps`: versions whose step is skipped (a
    non-finite loss); `hang_steps` / `die_steps`: steps (the version they would make)
    during which it hangs or its process dies, once each."""

    name = "trainer"

    def __init__(self, relays: FakeRelays, *, version: int = 0, skip_steps=(), hang_steps=(),
                 die_steps=(), checkpoint_before_death: bool = False):
        self.relays, self.version = relays, version
        self.skip_steps, self.hang_steps, self.die_steps = set(skip_steps), set(hang_steps), set(die_steps)
        self.checkpoint_before_death = checkpoint_before_death
        self.code: int | None = None
        self.trained: list[int] = []          # versions trained from, in order
        self.batches: list[dict] = []
        self.restarts = 0
        self._hang = asyncio.Event()

    def exit_code(self) -> int | None:
        return self.code

    def exit_reason(self) -> str | None:
        return None if self.code is None else f"exited with code {self.code}"

    async def init(self):
        return self.version, None

    async def train(self, arrays) -> TrainResult:
        await asyncio.sleep(0)
        step = self.version + 1
        if step in self.hang_steps:
            self.hang_steps.discard(step)
            await self._hang.wait()           # until killed
            raise RoleError("trainer was killed")
        if step in self.die_steps:
            self.die_steps.discard(step)
            if self.checkpoint_before_death:
                self.version = step
            self.code = -9
            raise RoleError("trainer exited with code -9")
        self.trained.append(self.version)
        self.batches.append(dict(arrays))
        if step in self.skip_steps:
            self.skip_steps.discard(step)
            return TrainResult(self.version, {"update_skipped": 1.0, "loss": float("nan")})
        self.version = step
        self.relays.published.append(step)
        return TrainResult(step, {"update_skipped": 0.0, "loss": 0.5})

    async def restart(self) -> int:
        self.kill()
        await asyncio.sleep(0)
        self.code, self._hang = None, asyncio.Event()
        self.restarts += 1
        return self.version        # the newest checkpoint

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self._hang.set()
        if sig == signal.SIGKILL:
            self.code = -9

    async def shutdown(self) -> None:
        pass


class FakeRollout:
    """Decodes `tokens_per_turn` tokens per event-loop turn; a response ends with EOS
    after `length` tokens (or at its forced budget). A killed rollout's requests fail."""

    def __init__(self, rid: int, relays: FakeRelays, *, length: int = 6, tokens_per_turn: int = 2,
                 die_after_tokens: int | None = None):
        self.name, self.relays = f"rollout{rid}", relays
        self.die_after_tokens = die_after_tokens    # its process dies once it sent this many
        self.length, self.tokens_per_turn = length, tokens_per_turn
        self.version, self.code = 0, None
        self.requests = self.streamed = 0
        self.restarts = 0

    def exit_code(self) -> int | None:
        return self.code

    def exit_reason(self) -> str | None:
        return None if self.code is None else f"exited with code {self.code}"

    def _alive(self) -> None:
        if self.code is not None:
            raise ServerError(f"{self.name}: connection refused")

    async def kv_capacity_tokens(self) -> int:
        return 4096

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, seed=None,
                       stop_token_ids=(), top_p=1.0, top_k=-1):
        self._alive()
        await asyncio.sleep(0)
        answer = [2 + (sum(prompt_ids) % 7), EOS][:max_tokens]
        return [Completion(token_ids=tuple(answer), logprobs=(-0.1,) * len(answer),
                           finish_reason="stop") for _ in range(n)]

    async def generate_stream(self, prompt_ids, *, max_tokens, temperature, seed=None,
                              stop_token_ids=(), ignore_eos=False, request_id=None,
                              top_p=1.0, top_k=-1):
        self.requests += 1
        sent = 0
        want = max_tokens if ignore_eos else min(self.length, max_tokens)
        while sent < want:
            await asyncio.sleep(0)
            self._alive()
            n = min(self.tokens_per_turn, want - sent)
            ids = [3 + (sent + k) % 5 for k in range(n)]
            if not ignore_eos and sent + n == self.length:
                ids[-1] = EOS
            sent += n
            self.streamed += n
            if self.die_after_tokens is not None and self.streamed >= self.die_after_tokens:
                self.die_after_tokens = None
                self.kill()
            done = sent == want
            yield StreamChunk(token_ids=tuple(ids), logprobs=(-0.5,) * n,
                              finish_reason=("stop" if ids[-1] == EOS else "length") if done else None)

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        self._alive()
        await asyncio.sleep(0)
        if relay_address in self.relays.dead:
            raise ServerError(f"{self.name}: relay {relay_address} does not answer")
        self.version = self.relays.published[-1]
        assert self.version >= min_version, (self.version, min_version)
        return self.version

    async def metrics(self):
        self._alive()
        return {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0,
                "vllm:kv_cache_usage_perc": 0.0}

    async def restart(self) -> float:
        self.kill()
        await asyncio.sleep(0)
        self.code, self.version = None, 0
        self.restarts += 1
        return 0.5

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.code = -9


def fake_task(seed: int = 0):
    """The arithmetic task over a toy tokenizer (one id per character)."""
    from fnrl.control.book import TaskIO

    def encode(text: str) -> list[int]:
        return [2 + ord(c) % (VOCAB - 2) for c in text]

    eval_set = tuple(eval_problems(seed, 4, 1, 2))
    return TaskIO(prompts=PromptStream(seed, 1, 2, held_out=frozenset(p.uid for p in eval_set)),
                  eval_set=eval_set,
                  encode=encode, decode=lambda ids: "".join(str(i % 10) for i in ids),
                  reward_fn=lambda text, gold, length: float(len(text) % 2), stop_ids=(EOS,), pad_id=0,
                  seq_len=64)
