"""The rollout side of a multi-turn environment (`--task.env` other than "math"): one
environment episode per trajectory placement (fnrl.envs.episode.run_episode).

Each sampled turn is one streaming request on the trajectory's rollout that stops at
the environment's stop strings (a tool call's closing tag) or a stop id; its ids and
log-probs go to the partial response pool as they stream. The environment's
observation (tool results, run by the sandbox pool off the event loop) is encoded once
and appended to the pool verbatim as a fed segment (`Segment.fed`: mask 0, log-prob 0),
so the pool holds exactly the ids the engine was given and sampled, and the trainer
trains on them (fnrl.trainer.batching honours `Trajectory.loss_mask`).

An episode interrupted mid-way (Interrupt, Migrate, a rollout lost) is not resumed:
the environment's state lives in this process and is not journalled, so the next
placement drops what was streamed and runs the episode afresh (`episodes_restarted`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from fnrl.envs.base import ToolRunner
from fnrl.envs.episode import Episode, run_episode
from fnrl.envs.registry import make_env
from fnrl.envs.turns import SampledTurn
from fnrl.types import Problem


@dataclass(frozen=True, kw_only=True)
class EpisodeOutcome:
    """What the group's reward step takes from a finished episode."""

    reward: float | None
    finish_reason: str
    turns: int          # sampled turns
    tool_calls: int
    tool_ok: int


def env_kwargs(env_name: str, runner: ToolRunner | None) -> dict[str, Any]:
    """Factory arguments of a built-in environment: tool environments get the runner."""
    return {} if env_name == "math" or runner is None else {"runner": runner}


async def stream_episode(*, env_name: str, runner: ToolRunner | None, problem: Problem,
                         prompt_ids: tuple[int, ...], uid: str, pool, handle, version: Callable[[], int],
                         encode_text: Callable[[str], Any], decode: Callable[[Any], str],
                         stop_ids: tuple[int, ...], max_new_tokens: int,
                         sampling: dict[str, Any], request_id: str,
                         on_tokens: Callable[[int], None]) -> EpisodeOutcome:
    """Runs one episode of `env_name` on `problem` over rollout `handle`, writing every
    turn to `pool[uid]` (sampled turns as they stream, fed turns before the next
    generation); returns the environment's reward and tool facts.

    `version()` is the version the rollout serves now (a turn's tokens carry it);
    `sampling`: temperature, top_p, top_k, seed (None or a base seed, offset per turn);
    `on_tokens(n)`: n more sampled tokens streamed (progress, counters)."""
    env = make_env(env_name, **env_kwargs(env_name, runner))
    written = [len(prompt_ids)]   # ids of the context already in the pool (prompt included)
    last_version = [version()]    # the version of the last sampled turn: fed ids carry it

    async def generate(context: tuple[int, ...], stop: tuple[str, ...]) -> SampledTurn:
        if context[:len(prompt_ids)] != prompt_ids:
            raise RuntimeError(f"episode {uid}: the context does not start with the prompt")
        fed = context[written[0]:]
        if fed:   # the observation run_episode appended after the last sampled turn
            pool.append(uid, last_version[0], fed, [0.0] * len(fed), fed=True)
            written[0] = len(context)
        turn_version = last_version[0] = version()
        budget = max_new_tokens - (len(context) - len(prompt_ids))
        seed = sampling["seed"]
        ids, lps, reason = [], [], "length"
        stream = handle.generate_stream(
            context, max_tokens=budget, temperature=sampling["temperature"],
            top_p=sampling["top_p"], top_k=sampling["top_k"],
            seed=None if seed is None else seed + len(context), stop_token_ids=stop_ids,
            request_id=f"{request_id}:{len(context)}", stop=stop)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.token_ids:
                    # Durable before it counts, as on the single-turn path.
                    pool.append(uid, turn_version, chunk.token_ids, chunk.logprobs)
                    ids.extend(chunk.token_ids)
                    lps.extend(chunk.logprobs)
                    on_tokens(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason
                    break
        written[0] = len(context) + len(ids)
        return SampledTurn(version=turn_version, token_ids=tuple(ids), logprobs=tuple(lps),
                           finish_reason=reason)

    def encode_prompt(text: str) -> tuple[int, ...]:
        # The group's prompt ids were made by the task's encoder from the same prompt.
        return prompt_ids

    try:
        episode = await run_episode(env, problem, generate=generate, encode_prompt=encode_prompt,
                                    encode=encode_text, decode=decode,
                                    max_context=len(prompt_ids) + max_new_tokens)
    finally:
        await env.close()
    check_pool_matches(pool.get(uid), episode)
    info = episode.info
    return EpisodeOutcome(reward=episode.reward, finish_reason=episode.finish_reason,
                          turns=episode.num_sampled_turns,
                          tool_calls=int(info.get("tool_calls", 0)),
                          tool_ok=int(info.get("tool_ok", 0)))


def check_pool_matches(item, episode: Episode) -> None:
    """The pool's ids and mask are the episode's turns, verbatim: anything else would
    train on ids the engine never saw."""
    pooled = tuple(t for s in item.segments for t in s.token_ids)
    mask = tuple(0 if s.fed else 1 for s in item.segments for _ in s.token_ids)
    ids = tuple(t for turn in episode.turns for t in turn.token_ids)
    want = tuple(int(isinstance(turn, SampledTurn)) for turn in episode.turns
                 for _ in turn.token_ids)
    if item.prompt_ids != episode.prompt_ids or pooled != ids or mask != want:
        raise RuntimeError(f"trajectory {item.uid}: the partial pool's ids differ from the "
                           f"episode's ({len(pooled)} pooled, {len(ids)} in its turns)")
