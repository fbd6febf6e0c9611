"""The calculator task: products out of the column method's reach, a reproducible eval
split disjoint from training, and the imperfect teacher's demonstrations."""

import random

import pytest

from fnrl.data.reward import math_reward
from fnrl.data.tool_arith import (LEVEL, demonstration, make_tool_problem, tool_eval_problems,
                                  tool_train_problems)
from fnrl.envs.tool_calls import parse_calc


def test_problems_are_multi_digit_products():
    rng = random.Random(0)
    for i in range(200):
        p = make_tool_problem(rng, uid=str(i))
        a, b = p.prompt.rstrip("=").split("*")
        assert 3 <= len(a) <= 5 and 2 <= len(b) <= 4 and p.level == LEVEL
        assert int(p.answer) == int(a) * int(b)


def test_eval_split_is_reproducible_and_held_out_of_training():
    ev = tool_eval_problems(seed=7, count=64)
    assert [p.prompt for p in ev] == [p.prompt for p in tool_eval_problems(seed=7, count=64)]
    assert len({p.prompt for p in ev}) == 64
    assert tool_eval_problems(seed=7, count=8) == ev[:8]
    held = frozenset(p.prompt for p in ev)
    train, cursor = tool_train_problems(seed=7, cursor=0, count=50, held_out=held)
    assert len(train) == 50 and cursor >= 50 and not held & {p.prompt for p in train}
    again, _ = tool_train_problems(seed=7, cursor=10, count=5, held_out=held)
    assert [p.uid for p in again][0] == "tool-train-10"     # random access: resume by cursor
    with pytest.raises(ValueError, match="num_eval=0"):
        tool_eval_problems(seed=7, count=0)


def test_demonstrations():
    p = tool_eval_problems(seed=1, count=1)[0]
    tool = demonstration(p, "tool")
    text = "".join(t for t, _ in tool)
    assert math_reward(text, p.answer, number_fallback=False) == 1.0
    assert [s for _, s in tool] == [True, False, True]          # the result is fed, not sampled
    assert parse_calc(tool[0][0]).calls[0].arguments["expression"] == p.prompt.rstrip("=")
    guess = "".join(t for t, _ in demonstration(p, "guess"))
    assert math_reward(guess, p.answer, number_fallback=False) == 0.0
    bad = "".join(t for t, _ in demonstration(p, "bad_call"))
    assert parse_calc(bad).calls == () and parse_calc(bad).errors   # a call that failed
    with pytest.raises(ValueError, match="mode='oops'"):
        demonstration(p, "oops")
