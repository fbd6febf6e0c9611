"""One multi-turn episode: generate, step the environment, feed its observation, repeat.

The driver is where exact token-in/token-out is kept. `generate(context_ids, stop)`
returns the ids the policy sampled after exactly `context_ids` (a SampledTurn);
the action text the environment reads is decoded from that turn's ids alone, and the
observation text is encoded once into a FedTurn. Earlier turns are never decoded or
encoded again, so each context is the previous one extended verbatim, and the trainer
trains on the ids the engine saw (fnrl.envs.turns.flatten_turns).

`generate`, `encode` and `decode` are injected, so the loop can pass its serving client
and tokenizer and tests a fake policy.

Resuming (`Resume`): an episode cut off mid-way (an interrupt, a migration, a rollout
lost, a controller restart) continues from the turns its partial pool holds: the
environment is restored from the infos of the steps it took (`Env.restore`), an open
sampled turn is continued, and a turn whose environment step was pending (a tool call
in flight) is stepped again, so a tool call cut off is run again: tools should be
idempotent (the built-in ones are pure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from fnrl.envs.base import Env
from fnrl.envs.turns import FedTurn, SampledTurn, Turn, context_ids
from fnrl.types import Problem

Generate = Callable[[tuple[int, ...], tuple[str, ...]], Awaitable[SampledTurn]]


@dataclass(frozen=True, kw_only=True)
class Episode:
    """A finished multi-turn trajectory: prompt ids, turns, reward and why it ended."""

    prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    reward: float | None
    finish_reason: str
    """"done" (the environment ended it), "max_tokens" (the context budget ran out)."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sampled_turns(self) -> int:
        return sum(isinstance(t, SampledTurn) for t in self.turns)


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Where a cut-off episode stands: its turns so far, the info of each environment
    step taken (one per fed turn), and whether its last sampled turn ended (`closed`:
    the environment's step on it is due) or was cut off mid-turn (it is continued)."""

    turns: tuple[Turn, ...]
    steps: tuple[dict[str, Any], ...]
    closed: bool


def can_resume(env: Env) -> bool:
    """Whether `env` can be restored mid-episode (it has `restore`)."""
    return callable(getattr(env, "restore", None))


def _action_ids(turns: Sequence[Turn]) -> tuple[int, ...]:
    """The ids sampled since the last fed turn: one action, however many segments
    (versions) an interrupt split it into."""
    out: list[int] = []
    for t in reversed(turns):
        if isinstance(t, FedTurn):
            break
        out[:0] = t.token_ids
    return tuple(out)


async def run_episode(env: Env, problem: Problem, *, generate: Generate,
                      encode_prompt: Callable[[str], Sequence[int]],
                      encode: Callable[[str], Sequence[int]],
                      decode: Callable[[Sequence[int]], str],
                      max_context: int, resume: Resume | None = None,
                      on_turn_end: Callable[[], None] = lambda: None,
                      on_fed: Callable[[FedTurn, dict[str, Any]], None] = lambda fed, info: None,
                      ) -> Episode:
    """Runs `env` on `problem` until it is done or the context reaches `max_context` ids,
    from the start or from `resume`.

    `on_turn_end()` is called when a sampled turn ends, before the environment steps on
    it; `on_fed(fed, info)` when an observation is fed, before the next turn: what the
    partial pool records so a cut-off episode can resume. An episode whose next
    observation would not fit ends with reward 0.0 and finish_reason "max_tokens":
    counted as a failure, never silently skipped.
    """
    prompt_ids = tuple(encode_prompt(await env.reset(problem)))
    turns: list[Turn] = []
    closed = False
    if resume is not None and resume.turns:
        await env.restore(problem, resume.steps)   # type: ignore[attr-defined]
        turns, closed = list(resume.turns), resume.closed
    while True:
        context = context_ids(prompt_ids, turns)
        if not closed and len(context) < max_context:
            turns.append(await generate(context, tuple(env.stop)))
            on_turn_end()
        closed = False
        action = _action_ids(turns)
        step = await env.step(decode(action), num_tokens=len(action))
        if step.done:
            return Episode(prompt_ids=prompt_ids, turns=tuple(turns), reward=step.reward,
                           finish_reason="done", info=step.info)
        # The source is for metrics and the journal: tool results, or the env's reply.
        fed = FedTurn(token_ids=tuple(encode(step.observation)),
                      source="tool" if env.tools else "env")
        if len(context_ids(prompt_ids, turns)) + len(fed.token_ids) >= max_context:
            return Episode(prompt_ids=prompt_ids, turns=tuple(turns), reward=0.0,
                           finish_reason="max_tokens", info=step.info)
        on_fed(fed, dict(step.info))
        turns.append(fed)
