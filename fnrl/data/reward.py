"""Verifiable reward: is the response's final answer the gold answer? Plus optional terms.

The answer is extracted first (fnrl.data.answers: `#### x`, the last `\\boxed{x}`, else
the last number), then math-verify compares it with the gold answer symbolically, so
"\\boxed{0.5}" matches "\\frac{1}{2}" and "1,000" matches "1000". Its timeouts use
SIGALRM, which only works in the main thread, so they are switched off elsewhere.

`MathReward` adds the optional terms of `task.reward` (each off by default):
- format: `format_weight` when the response states its answer with a marker;
- length: `length_cost` per response token.
DAPO's soft overlong punishment is not here: `algo.overlong_buffer` applies it where the
batch is built (fnrl.trainer.batching), so it shapes every task's reward alike.
The reward is a pure function of (response text, gold answer, response length in
tokens); `checked_reward` turns anything non-finite into None (an invalid trajectory).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from math_verify import parse, verify

from fnrl.config.run import RewardConfig
from fnrl.data.answers import extract_answer


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str) -> list:
    # Boxing the bare answer makes math-verify read it whole as LaTeX ("\frac{1}{2}",
    # "1,000", "x^2+1"), instead of hunting for a number inside it.
    return (parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout(2))
            or parse(answer, parsing_timeout=_timeout(2)))


def answers_match(answer: str, gold: str) -> bool:
    """Whether an extracted answer equals the gold answer: math-verify when it can read
    both, else the two texts with whitespace removed."""
    got, want = _parse(answer), _parse(gold)
    if got and want:
        return bool(verify(want, got, timeout_seconds=_timeout(2)))
    return "".join(answer.split()) == "".join(gold.split())


def math_reward(response: str, gold: str, *, number_fallback: bool = True) -> float:
    """1.0 when the response's extracted final answer matches `gold`, else 0.0."""
    found = extract_answer(response, number_fallback=number_fallback)
    if found.answer is None:
        return 0.0
    return 1.0 if answers_match(found.answer, gold) else 0.0


@dataclass(frozen=True, kw_only=True)
class MathReward:
    """Correctness plus the optional format and length terms (see the module docstring).
    Call it as `reward(response, gold, length)`."""

    format_weight: float = 0.0
    number_fallback: bool = True
    length_cost: float = 0.0

    def terms(self, response: str, gold: str, length: int) -> dict[str, float]:
        """Each term of the reward by name; the reward is their sum."""
        found = extract_answer(response, number_fallback=self.number_fallback)
        correct = found.answer is not None and answers_match(found.answer, gold)
        out = {"correct": 1.0 if correct else 0.0}
        if self.format_weight:
            out["format"] = self.format_weight if found.marked else 0.0
        if self.length_cost:
            out["length"] = -self.length_cost * length
        return out

    def __call__(self, response: str, gold: str, length: int) -> float:
        return sum(self.terms(response, gold, length).values())


def make_reward(cfg: RewardConfig) -> MathReward:
    """The reward `task.reward` describes."""
    return MathReward(format_weight=cfg.format_weight, number_fallback=cfg.number_fallback,
                      length_cost=cfg.length_cost)


def checked_reward(value: Any) -> float | None:
    """The reward as a float if it is a finite real number, else None.

    None marks the trajectory invalid: it trains nothing and the rest of its group
    still does. A reward function that returns NaN, ±inf, None or a non-scalar says
    it could not score the response; that must not reach the advantages.
    """
    if isinstance(value, (str, bytes)):
        return None   # numpy would parse "1.0"; a string is not a score
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if array.shape != ():
        return None
    reward = float(array)
    return reward if math.isfinite(reward) else None
