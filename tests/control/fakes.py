"""The loop's tests' roles: the simulator's in-process roles (fnrl.sim.handles) on a
trivial cost model, with the faults and records only tests need. Nothing here
implements a role's behaviour: that is fnrl.sim.handles' alone.

A fake rollout decodes `tokens_per_turn` tokens per step, a step taking STEP_S whatever
the batch, and ends a response with EOS after `length` tokens; the fake trainer's step
takes TRAIN_S, then publishes the new version to the relays. So a loop step takes a few
virtual seconds, and an injected kill (within a second of generation) lands mid-run.
The clock is the event loop's virtual time (`run_virtual`, `LoopClock`): it jumps to the
next timer, so detection windows pass without waiting and a busy machine cannot change
what a test sees.
"""

from __future__ import annotations

import signal

from fnrl.config import CostModel
from fnrl.control.handles import RoleError, TrainResult
from fnrl.data.arith import PromptStream, eval_problems
from fnrl.sim.costs import DecodeCosts
from fnrl.sim.handles import EOS, SimRelays, SimRollout, SimTrainer

__all__ = ["EOS", "FakeRollout", "FakeTrainer", "fake_task"]

VOCAB = 50
STEP_S = 0.5   # binary fractions: virtual times add up exactly
TRAIN_S = 1.0
DECODE = DecodeCosts(cost=CostModel(k1=0.0, k2=0.0, k3=0.0, k4=STEP_S))


class FakeTrainer(SimTrainer):
    """A step takes TRAIN_S. `skip_steps`: versions whose step is skipped (a non-finite
    loss); `hang_steps` / `die_steps`: steps (the version they would make) during which
    it hangs (until killed) or its process dies, once each. `trained`: the versions
    trained from, in order; `batches`: their arrays."""

    def __init__(self, relays: SimRelays, *, skip_steps=(), hang_steps=(), die_steps=(),
                 checkpoint_before_death: bool = False):
        super().__init__(relays, train_s=TRAIN_S, publish_s=0.0)
        self.skip_steps, self.hang_steps, self.die_steps = set(skip_steps), set(hang_steps), set(die_steps)
        self.checkpoint_before_death = checkpoint_before_death
        self.trained: list[int] = []
        self.batches: list[dict] = []

    async def train(self, arrays) -> TrainResult:
        step, trained_from = self.version + 1, self.version
        if step in self.hang_steps:
            self.hang_steps.discard(step)
            self.kill(signal.SIGSTOP)          # the step never ends: until it is killed
        if step in self.die_steps:
            self.die_steps.discard(step)
            await self._busy(self.train_s)
            if self.checkpoint_before_death:
                self.version = step
            self.kill()
            raise RoleError(f"trainer {self.exit_reason()}")
        if step in self.skip_steps:
            self.skip_steps.discard(step)
            await self._busy(self.train_s)
            result = TrainResult(self.version, {"update_skipped": 1.0, "loss": float("nan")})
        else:
            result = await super().train(arrays)
        self.trained.append(trained_from)
        self.batches.append(dict(arrays))
        return result


class FakeRollout(SimRollout):
    """`length` tokens a response (then EOS), `tokens_per_turn` a step; its process dies
    once it has streamed `die_after_tokens`. A pull checks that the loop asks only for
    versions the trainer published."""

    def __init__(self, rid: int, relays: SimRelays, *, length: int = 6, tokens_per_turn: int = 2,
                 die_after_tokens: int | None = None):
        super().__init__(rid, relays, DECODE, kv_capacity=4096, pull_s=0.0,
                         tokens_per_step=tokens_per_turn, eos_after=length, start_s=0.5)
        self.die_after_tokens = die_after_tokens
        self.streamed = 0

    async def generate_stream(self, prompt_ids, **kw):
        async for chunk in super().generate_stream(prompt_ids, **kw):
            self.streamed += len(chunk.token_ids)
            if self.die_after_tokens is not None and self.streamed >= self.die_after_tokens:
                self.die_after_tokens = None
                self.kill()
            yield chunk

    async def pull(self, relay_address: str, *, min_version: int = -1,
                   relay_timeout_s: float = 30.0) -> int:
        assert min_version <= self.relays.published[-1], (min_version, self.relays.published)
        return await super().pull(relay_address, min_version=min_version,
                                  relay_timeout_s=relay_timeout_s)


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
