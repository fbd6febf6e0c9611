"""A gymnasium-style text environment driven through fnrl's Env interface."""

import asyncio
import threading

import pytest

from fnrl.envs.episode import run_episode
from fnrl.envs.gym_adapter import GymTextEnv
from fnrl.envs.turns import SampledTurn
from fnrl.types import Problem

PROBLEM = Problem(uid="g0", prompt="guess", answer="3", level=1)


class GuessGame:
    """Guess the answer in at most three tries: -0.1 a wrong guess, +1 the right one.
    Records the threads it was called on and whether it was closed."""

    def __init__(self, reward_on_win=1.0):
        self.threads, self.closed, self.reward_on_win = set(), False, reward_on_win

    def reset(self, *, seed=None, options=None):
        self.threads.add(threading.get_ident())
        self.answer, self.tries = options["answer"], 0
        return f"{options['prompt']} a digit", {}

    def step(self, action):
        self.threads.add(threading.get_ident())
        self.tries += 1
        won = action.strip() == self.answer
        reward = self.reward_on_win if won else -0.1
        return ("higher" if not won else ""), reward, won, self.tries >= 3 and not won, {"tries": self.tries}

    def close(self):
        self.closed = True


def play(game, guesses):
    env = GymTextEnv(game, stop=("\n",))
    replies = [list(g.encode()) for g in guesses]

    async def generate(context, stop):
        ids = replies.pop(0)
        return SampledTurn(version=0, token_ids=ids, logprobs=[0.0] * len(ids))

    async def go():
        ep = await run_episode(env, PROBLEM, generate=generate,
                               encode_prompt=lambda s: list(s.encode()),
                               encode=lambda s: list(s.encode()),
                               decode=lambda ids: bytes(ids).decode(), max_context=1000)
        await env.close()
        return ep
    return asyncio.run(go())


def test_rewards_are_summed_and_calls_run_off_the_loop_thread():
    game = GuessGame()
    ep = play(game, ["1", "3"])
    assert ep.reward == pytest.approx(0.9) and ep.finish_reason == "done"
    assert ep.info == {"tries": 2, "turns": 2, "truncated": False}
    assert threading.get_ident() not in game.threads and game.closed
    assert bytes(ep.prompt_ids).decode() == "guess a digit"


def test_truncation_ends_the_episode():
    ep = play(GuessGame(), ["1", "2", "4"])
    assert ep.reward == pytest.approx(-0.3) and ep.info["truncated"] and ep.num_sampled_turns == 3


def test_non_finite_reward_makes_the_trajectory_invalid():
    assert play(GuessGame(reward_on_win=float("nan")), ["3"]).reward is None


def test_needs_reset_and_step():
    with pytest.raises(TypeError, match="needs an environment with step"):
        GymTextEnv(type("NoStep", (), {"reset": lambda self: None})())
