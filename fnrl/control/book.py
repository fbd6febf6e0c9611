"""What the controller's parts share: the job's counters and the services of the loop.

`Book` is the controller's mutable bookkeeping (one thread, touched by the loop and the
tasks `act` starts). `Services` is what every part may call: the clock (time since
the loop started), spawning a task the loop watches, waking the loop, the timeline.
Each part (fnrl.control.generation, .training, .supervisor) owns its own state and
receives these two explicitly; none reaches into another's fields.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fnrl.control.handles import Clock


@dataclass
class Book:
    trainer_version: int
    steps_done: int
    trainer_busy: bool = False
    skipped_steps: int = 0            # skipped updates the schedule has not seen yet
    invalid_trajectories: int = 0
    generated_tokens: int = 0
    trained_tokens: int = 0
    checked_tokens: int = 0           # consumed tokens whose staleness was checked
    max_staleness: int = 0            # the largest trainer version − token version seen
    last_train_end_s: float = 0.0     # when the last step returned (since the loop started)
    counts: Counter = field(default_factory=Counter)
    time: Counter = field(default_factory=Counter)
    last_eval: dict | None = None
    evaluated_versions: list[int] = field(default_factory=list)
    tokens_at_version: dict[int, int] = field(default_factory=dict)   # trained_tokens then


@dataclass
class Services:
    clock: Clock
    t0: float = 0.0                   # clock.now() when the loop started
    t0_epoch: float = 0.0
    timeline: list[dict] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    wake_event: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        """Seconds since the loop started."""
        return self.clock.now() - self.t0

    def restart_clock(self) -> None:
        self.t0, self.t0_epoch = self.clock.now(), self.clock.epoch()

    def spawn(self, coro) -> asyncio.Task:
        """A task whose failure the loop re-raises (see `reap`)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        return task

    def reap(self) -> None:
        """Re-raises, in the loop, the failure of any finished task."""
        for t in [t for t in self.tasks if t.done()]:
            self.tasks.discard(t)
            if not t.cancelled():
                t.result()

    def wake(self) -> None:
        self.wake_event.set()

    def event(self, event: str, t0: float | None = None, **fields) -> None:
        """A timeline event (the timeline plot's intervals have a start `t0`)."""
        record = {"t": self.now(), "event": event, **fields}
        if t0 is not None:
            record["t0"] = t0 - self.t0
        self.timeline.append(record)


@dataclass(frozen=True)
class TaskIO:
    """The task as the loop uses it: prompts in, token ids to text, text to reward."""

    def response_text(self, ids) -> str:
        """The text graded: the response up to (without) its first stop token."""
        ids = list(ids)
        end = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.decode(ids[:end])

    prompts: object                   # fnrl.data.arith.PromptStream: take(n), skip(n)
    eval_set: tuple                   # held-out Problems
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    reward_fn: Callable[[str, str, int], float]   # (response text, gold, response tokens)
    stop_ids: tuple[int, ...]         # generation ends at any of these (EOS, <|im_end|>, ...)
    pad_id: int
    seq_len: int                      # the model's context: prompt + response ≤ seq_len
    encode_text: Callable[[str], list[int]] | None = None
    """A text's ids alone, no template or BOS: what a multi-turn environment's
    observations (tool results) are fed as. None: single-turn tasks never need it."""
