import pytest

from fnrl.data.arith import PromptStream, build_tokenizer, eval_problems
from fnrl.data.reward import checked_reward, math_reward


def test_tokenizer_round_trips_every_prompt():
    tok = build_tokenizer()
    for p in eval_problems(0, 64, 1, 5):
        text = p.prompt + p.answer
        assert tok.decode(tok.encode(text).ids) == text
        assert len(tok.encode(text).ids) == len(text)  # one token per character


def test_answers_are_correct():
    for p in eval_problems(0, 200, 1, 5):
        assert str(eval(p.prompt.rstrip("="))) == p.answer  # noqa: S307


def test_training_stream_never_yields_eval_prompts_and_resumes():
    ev = eval_problems(7, 256, 1, 4)
    held = frozenset(p.prompt for p in ev)
    s = PromptStream(7, 1, 4, held_out=held)
    first = s.take(500)
    assert not held & {p.prompt for p in first}
    resumed = PromptStream(7, 1, 4, held_out=held, cursor=s.cursor)
    s2 = PromptStream(7, 1, 4, held_out=held)
    s2.take(500)
    assert [p.uid for p in resumed.take(20)] == [p.uid for p in s2.take(20)]


def test_eval_split_is_stable_under_size_changes():
    assert eval_problems(3, 50, 1, 4) == eval_problems(3, 100, 1, 4)[:50]
    with pytest.raises(ValueError, match="num_eval"):
        eval_problems(3, 0, 1, 4)


def test_math_reward():
    assert math_reward("42", "42") == 1.0
    assert math_reward(" -7 ", "-7") == 1.0
    assert math_reward("41", "42") == 0.0
    assert math_reward("", "42") == 0.0
    assert math_reward("+*=", "42") == 0.0
    assert checked_reward(float("nan")) is None and checked_reward(1.0) == 1.0
