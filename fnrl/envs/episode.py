"""One multi-turn episode: generate, step the environment, feed its observation, repeat.

The driver is where exact token-in/token-out is kept. `generate(context_ids, stop)`
returns the ids the policy sampled after exactly `context_ids` (a SampledTurn);
the action text the environment reads is decoded from that turn's ids alone, and the
observation text is encoded once into a FedTurn. Earlier turns are never decoded or
encoded again, so each context is the previous one extended verbatim, and the trainer
trains on the ids the engine saw (fnrl.envs.turns.flatten_turns).

`generate`, `encode` and `decode` are injected, so the loop can pass its serving client
and tokenizer and tests a fake policy.
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


async def run_episode(env: Env, problem: Problem, *, generate: Generate,
                      encode_prompt: Callable[[str], Sequence[int]],
                      encode: Callable[[str], Sequence[int]],
                      decode: Callable[[Sequence[int]], str],
                      max_context: int) -> Episode:
    """Runs `env` on `problem` until it is done or the context reaches `max_context` ids.

    An episode whose next observation would not fit ends with reward 0.0 and
    finish_reason "max_tokens": counted as a failure, never silently skipped.
    """
    prompt_ids = tuple(encode_prompt(await env.reset(problem)))
    turns: list[Turn] = []
    while True:
        context = context_ids(prompt_ids, turns)
        sampled = await generate(context, tuple(env.stop))
        turns.append(sampled)
        step = await env.step(decode(sampled.token_ids), num_tokens=len(sampled.token_ids))
        if step.done:
            return Episode(prompt_ids=prompt_ids, turns=tuple(turns), reward=step.reward,
                           finish_reason="done", info=step.info)
        # The source is for metrics and the journal: tool results, or the env's reply.
        fed = FedTurn(token_ids=tuple(encode(step.observation)),
                      source="tool" if env.tools else "env")
        if len(context) + len(sampled.token_ids) + len(fed.token_ids) >= max_context:
            return Episode(prompt_ids=prompt_ids, turns=tuple(turns), reward=0.0,
                           finish_reason="max_tokens", info=step.info)
        turns.append(fed)
