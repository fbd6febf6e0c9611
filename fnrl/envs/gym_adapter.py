"""A gymnasium-style text environment as an fnrl environment.

Researchers' text games and tasks often follow gymnasium's API, synchronously:
`reset(seed=, options=) -> (observation, info)` and `step(action) -> (observation,
reward, terminated, truncated, info)`, with strings for observations and actions.
`GymTextEnv` wraps one: each call runs in a worker thread (`asyncio.to_thread`) so a
slow environment never blocks the event loop, per-step rewards are summed and given
when the episode ends, and a non-finite sum makes the reward None (an invalid
trajectory, fnrl.data.reward.checked_reward) instead of reaching the advantages.

Register a factory to choose it by name:

    register_env("my_game")(lambda **kw: GymTextEnv(MyGame(), stop=("\\n",), **kw))
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fnrl.data.reward import checked_reward
from fnrl.envs.base import Step, ToolSpec
from fnrl.types import Problem


def problem_options(problem: Problem) -> dict[str, Any]:
    """The default `options` passed to the wrapped reset: the problem's fields."""
    return {"uid": problem.uid, "prompt": problem.prompt, "answer": problem.answer,
            "level": problem.level}


class GymTextEnv:
    """fnrl's Env over a gymnasium-style text environment (see the module docstring)."""

    def __init__(self, env: Any, *, stop: tuple[str, ...] = (), tools: tuple[ToolSpec, ...] = (),
                 options: Callable[[Problem], dict] = problem_options, seed: int | None = None):
        for name in ("reset", "step"):
            if not callable(getattr(env, name, None)):
                raise TypeError(f"GymTextEnv needs an environment with {name}(); "
                                f"{type(env).__name__} has none")
        self._env, self.stop, self.tools = env, tuple(stop), tuple(tools)
        self._options, self._seed = options, seed
        self._total, self._turns = 0.0, 0

    async def reset(self, problem: Problem) -> str:
        self._total, self._turns = 0.0, 0
        obs, _ = await asyncio.to_thread(self._env.reset, seed=self._seed,
                                         options=self._options(problem))
        return str(obs)

    async def step(self, action: str, *, num_tokens: int = 0) -> Step:
        obs, reward, terminated, truncated, info = await asyncio.to_thread(self._env.step, action)
        self._turns += 1
        self._total += float(reward)
        info = {**dict(info or {}), "turns": self._turns, "truncated": bool(truncated)}
        if terminated or truncated:
            return Step(observation="", reward=checked_reward(self._total), done=True, info=info)
        return Step(observation=str(obs), reward=None, done=False, info=info)

    async def close(self) -> None:
        if callable(getattr(self._env, "close", None)):
            await asyncio.to_thread(self._env.close)
