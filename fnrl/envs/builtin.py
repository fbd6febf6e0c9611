"""The built-in environments: single-turn math ("math") and calculator arithmetic
("tool_arith"). Both grade the final answer with fnrl.data.reward."""

from __future__ import annotations

import asyncio
from typing import Callable

from fnrl.data.reward import MathReward, math_reward
from fnrl.envs.base import CALCULATOR, InlineCalculator, Step, ToolResult, ToolRunner, register_env
from fnrl.envs.tool_calls import tool_format
from fnrl.types import Problem


class _OneProblem:
    """Holds the problem an environment was reset with."""

    _problem: Problem | None = None

    @property
    def problem(self) -> Problem:
        if self._problem is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        return self._problem

    async def close(self) -> None:
        self._problem = None


@register_env("math")
class MathEnv(_OneProblem):
    """Today's single-turn task as an environment: one sampled turn, graded, done."""

    tools = ()
    stop = ()

    def __init__(self, *, reward: MathReward | None = None):
        self._reward = reward or MathReward()

    async def reset(self, problem: Problem) -> str:
        self._problem = problem
        return problem.prompt

    async def step(self, action: str, *, num_tokens: int = 0) -> Step:
        terms = self._reward.terms(action, self.problem.answer, num_tokens)
        return Step(observation="", reward=sum(terms.values()), done=True, info={"terms": terms})


@register_env("tool_arith")
class ToolArithEnv(_OneProblem):
    """Multi-digit products with a calculator (fnrl.data.tool_arith).

    A turn that calls a tool gets the results back as the observation and the episode
    goes on; a turn without a call, or the `max_turns`-th turn, ends it, and the reward
    is 1 when the answer after "####" in the last turn is right. Malformed calls are
    answered with their error, so the model sees what went wrong.
    """

    tools = (CALCULATOR,)

    def __init__(self, *, runner: ToolRunner | None = None, max_turns: int = 3,
                 tool_format_name: str = "calc",
                 grade: Callable[[str, str], float] | None = None):
        if max_turns < 1:
            raise ValueError(f"ToolArithEnv max_turns={max_turns} must be >= 1")
        self._runner = runner or InlineCalculator()
        self._format = tool_format(tool_format_name)
        self.stop = self._format.stop
        self._max_turns = max_turns
        self._grade = grade or (lambda text, gold: math_reward(text, gold, number_fallback=False))
        self._turns, self._results = 0, []

    async def reset(self, problem: Problem) -> str:
        self._problem, self._turns, self._results = problem, 0, []
        return problem.prompt

    async def restore(self, problem: Problem, steps) -> None:
        """The state after `steps` (each step's info, in order) on `problem`: a resumed
        episode's (fnrl.envs.episode.Resume). Only the tool calls' outcomes are kept of
        them, so a restored episode counts its calls and successes like an unbroken one."""
        self._problem, self._turns = problem, len(steps)
        self._results = [ToolResult(text="", reason=r) for info in steps
                         for r in info.get("reasons", ())]

    async def step(self, action: str, *, num_tokens: int = 0) -> Step:
        problem = self.problem
        self._turns += 1
        parsed = self._format.parse(action)
        if parsed.wants_tools and self._turns < self._max_turns:
            # Calls of one turn run concurrently; the runner keeps them off the loop.
            results = await asyncio.gather(*(self._runner.call(c.name, c.arguments)
                                             for c in parsed.calls))
            results += [ToolResult(text=f"error: {e}", reason="bad_call") for e in parsed.errors]
            self._results.extend(results)
            return Step(observation="".join(self._format.render(r.text) for r in results),
                        reward=None, done=False,
                        info={"reasons": tuple(r.reason for r in results)})
        reward = float(self._grade(action, problem.answer))
        return Step(observation="", reward=reward, done=True, info={
            "turns": self._turns, "tool_calls": len(self._results),
            "tool_ok": sum(r.ok for r in self._results),
            "truncated": parsed.wants_tools})
