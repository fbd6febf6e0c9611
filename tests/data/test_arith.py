import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.data.arith import (ALPHABET, BOS, EOS, MAX_RESPONSE_CHARS, PAD, PromptStream,
                             build_tokenizer, eval_problems, solution, worked_steps)
from fnrl.data.reward import checked_reward, math_reward

_LINE = re.compile(r"^(\d+)([+\-*])(\d+) c(\d): (\d+)([+\-*])(\d)([+-])(\d)=(\d+), r=(\d+)$")


def test_tokenizer_round_trips_prompts_and_solutions():
    tok = build_tokenizer()
    assert [tok.token_to_id(t) for t in (PAD, EOS, BOS)] == [0, 1, 2]
    for p in eval_problems(0, 64, 1, 3):
        text = p.prompt + solution(p.prompt)
        assert tok.decode(tok.encode(text).ids) == text
        assert len(tok.encode(text).ids) == len(text)  # one token per character
    assert tok.decode(tok.encode(ALPHABET).ids) == ALPHABET  # newline and space included
    assert PAD not in [tok.id_to_token(i) for i in tok.encode(ALPHABET).ids]


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 10 ** 9 - 1), b=st.integers(0, 10 ** 9 - 1),
       op=st.sampled_from("+-*"))
def test_every_step_of_a_worked_solution_is_right(a, b, op):
    if op == "-":
        a, b = max(a, b), min(a, b)
    if op == "*":
        b = b % 8 + 2
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    lines, answer = worked_steps(f"{a}{op}{b}=")
    assert answer == str(value)
    carry, result = 0, ""
    left, right = str(a), str(b)
    for line in lines:
        m = _LINE.match(line)
        assert m, line
        ra, rop, rb, c, x, sop, y, cop, c2, s, r = m.groups()
        # The line restates what is left of the operands (0 once one runs out).
        assert (ra, rop, rb) == (left or "0", op, right if op == "*" else right or "0")
        assert int(c) == int(c2) == carry and sop == op
        digit_x = int(left[-1]) if left else 0
        digit_y = int(right) if op == "*" else (int(right[-1]) if right else 0)
        assert int(y) == digit_y
        if op == "-":   # the column is written 1x when it borrows
            assert int(x) in (digit_x, 10 + digit_x) and cop == "-"
            assert int(s) == int(x) - digit_y - carry and 0 <= int(s) <= 9
            carry = int(int(x) >= 10)
        else:
            assert int(x) == digit_x and cop == "+"
            assert int(s) == (digit_x * digit_y if op == "*" else digit_x + digit_y) + carry
            carry = int(s) // 10
        result = f"{int(s) % 10}{result}"
        assert r == result
        left = left[:-1]
        right = right if op == "*" else right[:-1]
    assert carry == 0 and int(result) == value
    text = solution(f"{a}{op}{b}=")
    assert text.endswith(f"\n#### {value}") and math_reward(text, str(value)) == 1.0


def test_the_teachers_slip_is_a_wrong_answer_with_the_same_steps():
    right, slipped = solution("4721+389="), solution("4721+389=", slip=True)
    assert slipped == right + "0"
    assert right.splitlines()[-1] == "#### 5110"
    assert math_reward(slipped, "5110") == 0.0


@pytest.mark.parametrize("max_level", [1, 2, 3])
def test_response_lengths_are_long_tailed_and_fit_the_budget(max_level):
    held = frozenset(p.prompt for p in eval_problems(0, 256, 1, max_level))
    stream = PromptStream(0, 1, max_level, held_out=held)
    lengths = np.array([len(solution(p.prompt)) + 1 for p in stream.take(4000)])
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert 20 <= median <= 100            # tens of tokens typically
    assert p99 >= 5 * median              # ... and a long tail
    assert np.mean(lengths >= 4 * median) > 0.03   # a tail, not a few outliers
    assert lengths.max() <= MAX_RESPONSE_CHARS + 1
    assert stream.cursor < 4000 * 1.05    # holding out eval prompts barely thins training
    longest = max((f"{'9' * 9}{op}{'9' * 9}=" for op in "+-"), key=lambda s: len(solution(s)))
    assert len(solution(longest)) == MAX_RESPONSE_CHARS


def test_problems_are_deterministic_and_cover_the_levels():
    assert eval_problems(5, 64, 1, 3) == eval_problems(5, 64, 1, 3)
    assert eval_problems(5, 64, 1, 3) != eval_problems(6, 64, 1, 3)
    assert {p.level for p in eval_problems(5, 64, 1, 3)} == {1, 2, 3}
    ev = eval_problems(5, 256, 1, 3)
    assert len({p.prompt for p in ev}) == 256 and min(len(p.answer) for p in ev) >= 1
    assert all(max(len(x) for x in re.split(r"[+\-*=]", p.prompt)) >= 2 for p in ev)
    assert all("-" in p.prompt and int(p.answer) >= 0 for p in eval_problems(5, 64, 2, 2))
    with pytest.raises(ValueError, match="not a problem"):
        worked_steps("2+2+2=")


def test_training_stream_never_yields_eval_prompts_and_resumes():
    ev = eval_problems(7, 256, 1, 3)
    held = frozenset(p.prompt for p in ev)
    s = PromptStream(7, 1, 3, held_out=held)
    first = s.take(500)
    assert not held & {p.prompt for p in first}
    assert s.cursor > 500   # the held-out set does filter some out
    resumed = PromptStream(7, 1, 3, held_out=held, cursor=s.cursor)
    s2 = PromptStream(7, 1, 3, held_out=held)
    s2.take(500)
    assert [p.uid for p in resumed.take(20)] == [p.uid for p in s2.take(20)]


def test_eval_split_is_stable_under_size_changes():
    assert eval_problems(3, 50, 1, 3) == eval_problems(3, 100, 1, 3)[:50]
    with pytest.raises(ValueError, match="num_eval"):
        eval_problems(3, 0, 1, 3)


def test_math_reward():
    assert math_reward("42", "42") == 1.0
    assert math_reward(" -7 ", "-7") == 1.0
    assert math_reward("41", "42") == 0.0
    assert math_reward("", "42") == 0.0
    assert math_reward("+*=", "42") == 0.0
    assert checked_reward(float("nan")) is None and checked_reward(1.0) == 1.0
