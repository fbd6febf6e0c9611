"""The rollout side of a multi-turn environment (`--task.env` other than "math"): one
environment episode per trajectory placement (fnrl.envs.episode.run_episode).

Each sampled turn is one streaming request on the trajectory's rollout that stops at
the environment's stop strings (a tool call's closing tag) or a stop id; its ids and
log-probs go to the partial response pool as they stream. The environment's
observation (tool results, run by the sandbox pool off the event loop) is encoded once
and appended to the pool verbatim as a fed segment (`Segment.fed`: mask 0, log-prob 0),
so the pool holds exactly the ids the engine was given and sampled, and the trainer
trains on them (fnrl.trainer.batching honours `Trajectory.loss_mask`).

The pool also records each turn's end and each environment step's info
(fnrl.data.partial_pool), so an episode cut off mid-way (Interrupt, Migrate, a rollout
lost, a controller restart) resumes on its next placement with its earlier turns
intact (fnrl.envs.episode.Resume): an open turn is continued under the new rollout's
version, a pending tool call is run again. An environment that cannot be restored
(no `restore`) runs a cut-off episode afresh, and the pool's tokens of it are dropped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from fnrl.control.replay_routes import complete_routes, record_routes, routes_request
from fnrl.envs.base import ToolRunner
from fnrl.envs.episode import Episode, Resume, can_resume, run_episode
from fnrl.envs.registry import make_env
from fnrl.envs.turns import FedTurn, SampledTurn, Turn
from fnrl.types import Problem


@dataclass(frozen=True, kw_only=True)
class EpisodeOutcome:
    """What the group's reward step takes from a finished episode."""

    reward: float | None
    finish_reason: str
    turns: int          # sampled turns
    tool_calls: int
    tool_ok: int
    resumed: bool = False   # continued from turns a cut-off placement left in the pool
    error: str | None = None   # finish_reason "env_error": the environment's last failure


ENV_ATTEMPTS = 2
"""Attempts at an episode whose environment raises (the second from scratch); then
its group is dropped and counted (`env_failed_groups`)."""


class EnvError(RuntimeError):
    """An environment raised (reset, step, restore) or gave an observation the tokenizer
    cannot encode: the environment's failure, not the rollout's."""


class GuardedEnv:
    """An environment whose failures are EnvErrors naming it."""

    def __init__(self, env, name: str):
        self.env, self.name = env, name
        self.tools, self.stop = env.tools, env.stop
        if can_resume(env):
            self.restore = self.guard(env.restore, is_async=True)
        self.reset = self.guard(env.reset, is_async=True)
        self.step = self.guard(env.step, is_async=True)
        self.close = self.guard(env.close, is_async=True)

    def guard(self, fn, *, is_async: bool = False):
        def failed(err: Exception) -> EnvError:
            return EnvError(f"environment {self.name!r} {getattr(fn, '__name__', 'call')} "
                            f"failed: {type(err).__name__}: {err}")

        if is_async:
            async def call(*a, **kw):
                try:
                    return await fn(*a, **kw)
                except Exception as err:  # noqa: BLE001 - the environment's, named
                    raise failed(err) from err
        else:
            def call(*a, **kw):
                try:
                    return fn(*a, **kw)
                except Exception as err:  # noqa: BLE001 - the environment's, named
                    raise failed(err) from err
        return call


async def stream_episode(*, pool, uid: str, prompt_ids: tuple[int, ...],
                         on_env_error: Callable[[EnvError], None] = lambda err: None,
                         **kw) -> EpisodeOutcome:
    """`_episode_attempt` (below), again from scratch when the environment fails; after
    ENV_ATTEMPTS failures the outcome has finish_reason "env_error" (its group is
    dropped and counted, never trained on). `on_env_error(err)` hears of each failure."""
    for attempt in range(ENV_ATTEMPTS):
        try:
            return await _episode_attempt(pool=pool, uid=uid, prompt_ids=prompt_ids, **kw)
        except EnvError as err:
            on_env_error(err)
            error = str(err)
            if attempt + 1 < ENV_ATTEMPTS:   # from scratch: what it left may be the cause
                pool.drop(uid)
    return EpisodeOutcome(reward=None, finish_reason="env_error", turns=0, tool_calls=0,
                          tool_ok=0, error=error)


def env_kwargs(env_name: str, runner: ToolRunner | None) -> dict[str, Any]:
    """Factory arguments of a built-in environment: tool environments get the runner."""
    return {} if env_name == "math" or runner is None else {"runner": runner}


async def _episode_attempt(*, env_name: str, runner: ToolRunner | None, problem: Problem,
                         prompt_ids: tuple[int, ...], uid: str, pool, handle, version: Callable[[], int],
                         encode_text: Callable[[str], Any], decode: Callable[[Any], str],
                         stop_ids: tuple[int, ...], max_new_tokens: int,
                         sampling: dict[str, Any], request_id: str,
                         on_tokens: Callable[[int], None],
                         on_resumed: Callable[[int], None] = lambda n: None,
                         replay: bool = False) -> EpisodeOutcome:
    """Runs one episode of `env_name` on `problem` over rollout `handle`, writing every
    turn to `pool[uid]` (sampled turns as they stream, each turn's end, each environment
    step and its fed observation); returns the environment's reward and tool facts.
    What `pool[uid]` holds already (a cut-off placement's turns) is resumed when the
    environment can be restored, else dropped and the episode run afresh.

    `version()` is the version the rollout serves now (a turn's tokens carry it);
    `sampling`: temperature, top_p, top_k, seed (None or a base seed, offset per turn);
    `on_tokens(n)`: n more sampled tokens streamed (progress, counters);
    `on_resumed(n)`: the episode resumes with n sampled tokens already in the pool;
    `replay`: each turn asks the engine for its routes (fnrl.control.replay_routes), fed
    observations included, and the episode ends with every position's."""
    env = GuardedEnv(make_env(env_name, **env_kwargs(env_name, runner)), env_name)
    resume = (pooled_resume(pool.get(uid)) if uid in pool and can_resume(env)
              and pool.get(uid).prompt_ids == prompt_ids else None)
    if uid in pool and resume is None:   # nothing streamed yet, or not restorable: afresh
        pool.drop(uid)
    if uid not in pool:
        pool.start(uid, prompt_ids)
    if resume is not None:
        on_resumed(sum(len(t.token_ids) for t in resume.turns if isinstance(t, SampledTurn)))
    # The version of the last sampled turn: fed ids carry it.
    last_version = [next((t.version for t in reversed(resume.turns) if isinstance(t, SampledTurn)),
                         version()) if resume else version()]

    def on_fed(fed: FedTurn, info: dict) -> None:
        pool.env_step(uid, info)
        pool.append(uid, last_version[0], fed.token_ids, [0.0] * len(fed.token_ids), fed=True)

    async def generate(context: tuple[int, ...], stop: tuple[str, ...]) -> SampledTurn:
        if context[:len(prompt_ids)] != prompt_ids:
            raise RuntimeError(f"episode {uid}: the context does not start with the prompt")
        turn_version = last_version[0] = version()
        budget = max_new_tokens - (len(context) - len(prompt_ids))
        seed = sampling["seed"]
        ids, lps, reason = [], [], "length"
        stream = handle.generate_stream(
            context, max_tokens=budget, temperature=sampling["temperature"],
            top_p=sampling["top_p"], top_k=sampling["top_k"],
            seed=None if seed is None else seed + len(context), stop_token_ids=stop_ids,
            request_id=f"{request_id}:{len(context)}", stop=stop,
            **routes_request(pool, uid, replay))
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.token_ids:
                    # Durable before it counts, as on the single-turn path.
                    pool.append(uid, turn_version, chunk.token_ids, chunk.logprobs)
                    ids.extend(chunk.token_ids)
                    lps.extend(chunk.logprobs)
                    on_tokens(len(chunk.token_ids))
                record_routes(pool, uid, chunk)
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason
                    break
        return SampledTurn(version=turn_version, token_ids=tuple(ids), logprobs=tuple(lps),
                           finish_reason=reason)

    def encode_prompt(text: str) -> tuple[int, ...]:
        # The group's prompt ids were made by the task's encoder from the same prompt.
        return prompt_ids

    try:
        episode = await run_episode(env, problem, generate=generate, encode_prompt=encode_prompt,
                                    encode=env.guard(encode_text), decode=decode,
                                    max_context=len(prompt_ids) + max_new_tokens,
                                    resume=resume, on_turn_end=lambda: pool.end_turn(uid),
                                    on_fed=on_fed)
    finally:
        with contextlib.suppress(EnvError):
            await env.close()
    check_pool_matches(pool.get(uid), episode)
    if replay:
        await complete_routes(pool, uid, handle, request_id=request_id, sampling=sampling)
    info = episode.info
    return EpisodeOutcome(reward=episode.reward, finish_reason=episode.finish_reason,
                          turns=episode.num_sampled_turns,
                          tool_calls=int(info.get("tool_calls", 0)),
                          tool_ok=int(info.get("tool_ok", 0)), resumed=resume is not None)


def pooled_resume(item) -> Resume | None:
    """The Resume of a cut-off episode's pool item: its segments as turns (fed ones as
    FedTurns), its steps' infos, whether its last turn ended; None when it holds no
    turn yet (nothing to resume)."""
    if not item.segments or item.finish_reason is not None:
        return None
    turns: list[Turn] = [FedTurn(token_ids=s.token_ids) if s.fed else
                         SampledTurn(version=s.version, token_ids=s.token_ids,
                                     logprobs=s.logprobs) for s in item.segments]
    if sum(isinstance(t, FedTurn) for t in turns) != len(item.env_steps):
        return None   # a pool from before turn records: run it afresh
    return Resume(turns=tuple(turns), steps=item.env_steps, closed=item.turn_closed)


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
