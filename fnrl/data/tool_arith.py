"""A tool-using arithmetic task: multi-digit products the tiny model cannot work out in
its head but can with the calculator.

A problem multiplies a number of three to five digits by one of two to four ("4721*389=",
the prompt format of fnrl.data.arith, so the character-level tokenizer covers it). The
column method of fnrl.data.arith only multiplies by one digit, so the embedded model has
no worked route to these answers; with the "calc" tool format (fnrl.envs.tool_calls)
the solution is one call and the answer:

    <calc>4721*389</calc><result>1836469</result>
    #### 1836469

where `<result>...</result>` is fed by the environment, not sampled. The reward checks
the final `#### answer` only (fnrl.data.reward.math_reward), so a right answer without
the tool also counts; it is just unlikely. `demonstration` writes the warm start's
imperfect teacher: sometimes it guesses without calling, sometimes it mangles the call,
so RL has tool use left to improve. Problems are level 4 (after arith's levels 1-3).
"""

from __future__ import annotations

import random

from fnrl.types import Problem

LEVEL = 4
MIN_DIGITS, MAX_DIGITS = (3, 2), (5, 4)   # (first operand, second operand)
_EVAL_POOL = 1024
DEMO_MODES = ("tool", "guess", "bad_call")


def make_tool_problem(rng: random.Random, uid: str) -> Problem:
    """One product a*b, a of 3-5 digits and b of 2-4."""
    a = rng.randint(10 ** (MIN_DIGITS[0] - 1), 10 ** MAX_DIGITS[0] - 1)
    b = rng.randint(10 ** (MIN_DIGITS[1] - 1), 10 ** MAX_DIGITS[1] - 1)
    return Problem(uid=uid, prompt=f"{a}*{b}=", answer=str(a * b), level=LEVEL)


def tool_eval_problems(seed: int, count: int) -> list[Problem]:
    """The held-out split: `count` distinct problems, a prefix of a fixed seeded pool."""
    if not 0 < count <= _EVAL_POOL:
        raise ValueError(f"num_eval={count} must be in 1..{_EVAL_POOL}")
    rng = random.Random(f"{seed}:tool-eval")
    pool: dict[str, Problem] = {}
    while len(pool) < count:
        p = make_tool_problem(rng, uid=f"tool-eval-{len(pool)}")
        pool.setdefault(p.prompt, p)
    return list(pool.values())


def tool_train_problems(seed: int, cursor: int, count: int, *,
                        held_out: frozenset[str]) -> tuple[list[Problem], int]:
    """`count` training problems from position `cursor` of a seeded, random-access stream
    (held-out prompts skipped), and the cursor after them."""
    out = []
    while len(out) < count:
        # One RNG per position: resuming is setting the cursor.
        rng = random.Random(f"{seed}:tool-train:{cursor}")
        p = make_tool_problem(rng, uid=f"tool-train-{cursor}")
        cursor += 1
        if p.prompt not in held_out:
            out.append(p)
    return out, cursor


def demonstration(problem: Problem, mode: str = "tool", *,
                  rng: random.Random | None = None) -> tuple[tuple[str, bool], ...]:
    """The teacher's solution as (text, sampled) pieces; sampled=False marks what the
    environment feeds (the tool result), which a warm start must not train on.

    mode "tool": the call, its result, the answer. "guess": no call, an answer off in its
    low digits (what a model without the tool does). "bad_call": the call with its
    closing tag misspelt, then a guess (in the loop the environment answers the
    unclosed call with an error and the episode goes on).
    """
    if mode not in DEMO_MODES:
        raise ValueError(f"demonstration mode={mode!r} must be one of {DEMO_MODES}")
    expr, answer = problem.prompt.rstrip("="), problem.answer
    rng = rng or random.Random(problem.uid)
    guess = str(max(0, int(answer) + rng.choice((-1, 1)) * rng.randint(1, 999)))
    if mode == "tool":
        return ((f"<calc>{expr}</calc>", True), (f"<result>{answer}</result>", False),
                (f"\n#### {answer}", True))
    if mode == "guess":
        return ((f"#### {guess}", True),)
    return ((f"<calc>{expr}</cal>\n#### {guess}", True),)


class ToolPromptStream:
    """The training prompts of the tool task as the loop takes them (`take`, `skip`, a
    resumable `cursor`, like fnrl.data.arith.PromptStream)."""

    def __init__(self, seed: int, *, held_out: frozenset[str], cursor: int = 0):
        self._seed, self._held_out, self.cursor = seed, held_out, cursor

    def take(self, n: int) -> list[Problem]:
        out, self.cursor = tool_train_problems(self._seed, self.cursor, n, held_out=self._held_out)
        return out

    def skip(self, n: int) -> None:
        """Moves on as if `take(n)` had been called (a restarted controller catching up)."""
        self.take(n)
