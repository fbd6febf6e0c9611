"""The environment registry, single-turn math as an environment, and the calculator task."""

import asyncio

import pytest

from fnrl.config import TaskConfig
from fnrl.config.run import ENV_NAMES
from fnrl.envs.base import ENVS, CALCULATOR, InlineCalculator, ToolResult, register_env
from fnrl.envs.builtin import MathEnv, ToolArithEnv
from fnrl.envs.registry import make_env
from fnrl.types import Problem

PROBLEM = Problem(uid="p0", prompt="4721*389=", answer="1836469", level=4)


def run(coro):
    return asyncio.run(coro)


def test_config_names_are_the_registry():
    import fnrl.envs.registry  # noqa: F401  (registers the built-ins)
    builtin = {k for k in ENVS if k != "test_only_game"}
    assert set(ENV_NAMES) == builtin >= {"math", "tool_arith"}
    assert TaskConfig(env="tool_arith").env == "tool_arith"
    with pytest.raises(ValueError, match="TaskConfig.env='chess'"):
        TaskConfig(env="chess")


def test_a_registered_env_becomes_a_valid_task_env():
    with pytest.raises(ValueError, match="TaskConfig.env='test_only_game'"):
        TaskConfig(env="test_only_game")
    register_env("test_only_game")(MathEnv)
    try:
        assert TaskConfig(env="test_only_game").env == "test_only_game"
        assert isinstance(make_env("test_only_game"), MathEnv)
    finally:
        ENVS.pop("test_only_game")


def test_make_env_by_name_and_unknown_name():
    assert isinstance(make_env("math"), MathEnv)
    assert isinstance(make_env("tool_arith", max_turns=2), ToolArithEnv)
    with pytest.raises(ValueError, match="invalid task.env='chess'.*'math'"):
        make_env("chess")
    with pytest.raises(ValueError, match="already registered"):
        register_env("math")(MathEnv)


def test_math_env_is_single_turn():
    async def episode():
        env = make_env("math")
        assert await env.reset(PROBLEM) == "4721*389="
        right = await env.step("#### 1836469", num_tokens=12)
        await env.reset(PROBLEM)
        wrong = await env.step("#### 1836470")
        return right, wrong
    right, wrong = run(episode())
    assert (right.reward, right.done, wrong.reward, wrong.done) == (1.0, True, 0.0, True)


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="before reset"):
        run(make_env("math").step("#### 1"))


def test_tool_arith_calls_then_answers():
    async def episode():
        env = make_env("tool_arith")
        await env.reset(PROBLEM)
        first = await env.step("<calc>4721*389</calc>")
        second = await env.step("\n#### 1836469")
        return first, second
    first, second = run(episode())
    assert (first.observation, first.reward, first.done) == ("<result>1836469</result>", None, False)
    assert first.info["reasons"] == ("ok",)
    assert (second.reward, second.done) == (1.0, True)
    assert second.info == {"turns": 2, "tool_calls": 1, "tool_ok": 1, "truncated": False}


def test_tool_arith_bad_calls_are_answered_and_max_turns_ends_it():
    async def episode():
        env = make_env("tool_arith", max_turns=2)
        await env.reset(PROBLEM)
        bad = await env.step("<calc>x*2</calc><calc></calc>")
        last = await env.step("<calc>1+1</calc>")   # the max_turns-th turn: no more tools
        return bad, last
    bad, last = run(episode())
    assert bad.observation == ("<result>error: not arithmetic: Name(id='x', ctx=Load())</result>"
                               "<result>error: empty <calc></calc></result>")
    assert bad.info["reasons"] == ("error", "bad_call")
    assert (last.done, last.reward, last.info["truncated"], last.info["tool_ok"]) == (True, 0.0, True, 0)


def test_answer_only_counts_after_the_marker():
    async def episode():
        env = make_env("tool_arith")
        await env.reset(PROBLEM)
        return await env.step("1836469")   # no "####": the number fallback is off
    assert run(episode()).reward == 0.0


def test_inline_calculator_and_schema():
    res = run(InlineCalculator().call("calculator", {"expression": "2*3"}))
    assert res == ToolResult(text="6") and res.ok
    assert run(InlineCalculator().call("python", {"code": "1"})).reason == "bad_call"
    assert CALCULATOR.schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="reason='fine'"):
        ToolResult(text="", reason="fine")


def test_the_loop_takes_the_tool_task_prompts_and_an_observation_encoder(tmp_path,
                                                                          tiny_model_dir):
    # A run on "tool_arith" trains on its own problems (not arith's), and the loop can
    # encode tool results as bare ids (no template, no BOS) to feed them verbatim.
    from fnrl.config import AlgoConfig, RunConfig
    from fnrl.data.arith import build_tokenizer
    from fnrl.experiments.math_grpo import load_task_io

    cfg = RunConfig(task=TaskConfig(env="tool_arith", num_eval=8),
                    algo=AlgoConfig(max_new_tokens=16))
    task = load_task_io(cfg, tiny_model_dir, tmp_path)
    problems = task.prompts.take(3)
    assert all(p.level == 4 and p.uid.startswith("tool-train-") for p in problems)
    assert all(p.level == 4 for p in task.eval_set) and len(task.eval_set) == 8
    text = "<result>1836469</result>"
    assert list(task.encode_text(text)) == build_tokenizer().encode(
        text, add_special_tokens=False).ids
    plain = load_task_io(RunConfig(task=TaskConfig(num_eval=8), algo=AlgoConfig(
        max_new_tokens=16)), tiny_model_dir, tmp_path)
    assert all(p.level <= 3 for p in plain.prompts.take(3))
