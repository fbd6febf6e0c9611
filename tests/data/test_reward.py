"""The reward: the extracted answer graded with math-verify, the optional format, length and
length terms, and a reward that is not a finite real number marking its trajectory
invalid (None)."""

import json
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config.run import RewardConfig
from fnrl.data.reward import (MathReward, answers_match, checked_reward, make_reward,
                               math_reward)


@pytest.mark.parametrize("value, expected", [
    (1.0, 1.0), (0, 0.0), (-2.5, -2.5), (True, 1.0), (np.float32(0.5), 0.5),
    (np.int64(3), 3.0), (np.array(1.0), 1.0), (jnp.asarray(2.0), 2.0),
])
def test_finite_real_rewards_pass_as_floats(value, expected):
    reward = checked_reward(value)
    assert type(reward) is float and reward == expected


@pytest.mark.parametrize("value", [
    float("nan"), float("inf"), -float("inf"), np.float32("nan"), jnp.asarray(jnp.inf),
    None, "1.0", b"1", [1.0], np.array([1.0, 0.0]), {"reward": 1.0}, 1 + 1j, object(),
])
def test_non_finite_or_non_scalar_rewards_are_invalid(value):
    assert checked_reward(value) is None


@pytest.mark.parametrize("response, gold, expected", [
    # math-verify on the whole text reads the 5: extraction first reads the 72.
    ("#### 72\nLet me know if you need 5 more", "72", 1.0),
    ("She sold 72 clips.\n#### 72", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("so $x = \\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("In total it is 1,000 dollars.", "1000", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("it drops to -3", "-3", 1.0),
    ("it drops to 3", "-3", 0.0),
    ("", "72", 0.0),
    ("no idea", "72", 0.0),
])
def test_math_reward_grades_the_extracted_answer(response, gold, expected):
    assert math_reward(response, gold) == expected


def test_answers_math_verify_cannot_read_are_compared_as_text():
    assert answers_match("\\text{Monday}", "\\text{Monday}")
    assert not answers_match("\\text{Monday}", "\\text{Tuesday}")


def test_math_reward_works_off_the_main_thread():
    # math-verify's timeouts need SIGALRM (main thread only); elsewhere they are off.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, "#### 72\nthanks", "72").result() == 1.0


def test_optional_terms_each_off_by_default_and_summed():
    plain = MathReward()
    assert plain.terms("#### 72", "72", 5) == {"correct": 1.0}
    assert plain("#### 72", "72", 5) == math_reward("#### 72", "72") == 1.0
    reward = MathReward(format_weight=0.25, length_cost=0.01)
    # The format term pays a marked answer, right or wrong, never the number fallback.
    assert reward.terms("#### 71", "72", 10) == {"correct": 0.0, "format": 0.25,
                                                 "length": -0.1}
    assert reward.terms("it is 72", "72", 10)["format"] == 0.0
    assert reward("\\boxed{72}", "72", 90) == pytest.approx(1.0 + 0.25 - 0.9)
    assert checked_reward(reward("\\boxed{72}", "72", 90)) == pytest.approx(0.35)
    assert MathReward(number_fallback=False)("it is 72", "72", 3) == 0.0


def test_reward_config_and_flags():
    from fnrl.experiments.math_grpo import parse_config
    cfg = parse_config(["--task.reward.format-weight", "0.1", "--task.reward.length-cost",
                        "0.001", "--task.reward.no-number-fallback"])
    # The run directory's config.json gives the same reward back.
    from fnrl.config import RunConfig, from_dict, to_dict
    assert from_dict(RunConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    reward = make_reward(cfg.task.reward)
    assert (reward.format_weight, reward.length_cost, reward.number_fallback) == \
        (0.1, 0.001, False)
    for kwargs in ({"format_weight": -1.0}, {"length_cost": float("nan")},
                   {"length_cost": float("inf")}):
        with pytest.raises(ValueError, match=f"RewardConfig.{next(iter(kwargs))}"):
            RewardConfig(**kwargs)
