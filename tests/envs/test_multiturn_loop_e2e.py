"""Multi-turn episodes through the whole loop: real vLLM, relay, trainer and sandbox.

The embedded model was warm-started on worked arithmetic, not on tool calls, so it
seldom writes "<calc>": `tool_arith` runs but its episodes are mostly one turn. The
first test therefore puts, under the name "tool_arith" in the controller's registry
(the trainer process validates the name only), an environment whose turns end at each
comma (the warm-started model's worked lines read "2*34+0=68, r=8") and whose every
turn calls the calculator in the real sandbox, so episodes have several turns (the
embedded tokenizer's encoder drops whitespace, so the fed text has none); the second runs
`--task.env tool_arith` itself.
"""

import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.control.metrics import read_jsonl
from fnrl.data.reward import math_reward
from fnrl.envs.base import ENVS, Step
from fnrl.experiments.math_grpo import main
from fnrl.trainer.batching import build_batch
from fnrl.types import Segment, Trajectory

pytestmark = pytest.mark.slow

SMALL = ["--warm-start.steps", "20", "--model.hidden-size", "64", "--model.intermediate-size",
         "128", "--model.num-hidden-layers", "2", "--model.num-attention-heads", "2",
         "--model.num-key-value-heads", "1", "--model.max-position-embeddings", "128",
         "--algo.max-new-tokens", "96", "--task.num-eval", "8", "--eval-every", "100",
         "--algo.groups-per-step", "4", "--rollout.groups-per-batch", "4"]
MAX_TURNS = 3


class CommaCalcEnv:
    """A turn ends at a comma; after each of the first MAX_TURNS-1 turns the sandbox's
    calculator evaluates the prompt's expression and its value is fed back."""

    tools = ()
    stop = (",",)

    def __init__(self, *, runner):
        self.runner = runner

    async def reset(self, problem):
        self.problem, self.turns, self.calls, self.ok, self.text = problem, 0, 0, 0, ""
        return problem.prompt

    async def step(self, action, *, num_tokens=0):
        self.turns += 1
        self.text += action
        if self.turns < MAX_TURNS and action.endswith(","):
            result = await self.runner.call("calculator",
                                            {"expression": self.problem.prompt.rstrip("=")})
            self.calls, self.ok = self.calls + 1, self.ok + result.ok
            return Step(observation=f"[{result.text}]", reward=None, done=False)
        return Step(observation="", done=True,
                    reward=float(math_reward(self.text, self.problem.answer)),
                    info={"tool_calls": self.calls, "tool_ok": self.ok})

    async def close(self):
        pass


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One warm-started model cache for both runs."""
    return str(tmp_path_factory.mktemp("model_cache"))


def logged_trajectories(run_dir):
    out = {}
    for g in read_jsonl(run_dir / "trajectories.jsonl"):
        trajs = []
        for t in g["trajectories"]:
            fed = t.get("fed", [False] * len(t["segments"]))
            segs = tuple(Segment(v, tuple(ids), tuple(lps), f) for (v, _), ids, lps, f
                         in zip(t["segments"], t["token_ids"], t["logprobs"], fed))
            trajs.append(Trajectory(uid=t["uid"], prompt_ids=tuple(t["prompt_ids"]),
                                    segments=segs, finish_reason=t["finish_reason"],
                                    reward=t["reward"]))
        out.setdefault(g["consumed_version"], []).append(trajs)
    return out


def test_multi_turn_episodes_train_on_the_sampled_ids_with_tool_results_masked(
        tmp_path, cache_dir, monkeypatch):
    monkeypatch.setitem(ENVS, "tool_arith", CommaCalcEnv)
    run_dir = tmp_path / "run"
    assert main(["--steps", "3", "--run-dir", str(run_dir), "--task.env", "tool_arith",
                 "--warm-start.cache-dir", cache_dir, *SMALL]) == 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert max(r["turns_mean"] for r in train) > 1.0
    assert all(r["tool_success_rate"] == 1.0 for r in train if r["tool_calls_mean"] > 0)
    # The trainer's log-probs of the sampled tokens, over sequences with tool results in
    # their context, are vLLM's: the context it trained on is the one vLLM was given.
    fresh = [r for r in train if r["staleness_max"] == 0]
    assert fresh and all(r["logp_abs_diff"] < 1e-2 for r in fresh)
    by_version = logged_trajectories(run_dir)
    multi = 0
    for r in train:
        groups = by_version[r["step"] - 1]
        trajs = [t for g in groups for t in g]
        sampled = sum(sum(t.loss_mask) for t in trajs if t.reward is not None)
        # The trainer's token count is the sampled tokens alone: no fed id was trained.
        assert r["tokens"] == sampled
        assert sum(r["staleness_hist"]) == r["tokens"]   # every trained token has a version
        assert r["fed_tokens"] == sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
        arrays, _ = build_batch(groups, algo=AlgoConfig(), trainer=TrainerConfig(),
                                seq_len=128, pad_id=0)
        for i, t in enumerate(t for g in groups for t in g):
            ids = np.asarray(t.prompt_ids + t.response_ids)
            n, p = len(ids) - 1, len(t.prompt_ids)
            assert (arrays["input_BxT"][i, :n] == ids[:-1]).all()
            assert (arrays["target_BxT"][i, :n] == ids[1:]).all()
            if t.reward is not None:
                assert (arrays["mask_BxT"][i, p - 1:n] == np.asarray(t.loss_mask)).all()
            for s in t.segments:
                if s.fed:   # a calculator result: never sampled, log-prob 0
                    assert s.logprobs == (0.0,) * len(s.logprobs)
            multi += len(t.turn_starts) > 1
    assert multi > 0


def test_tool_arith_runs_through_the_loop(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    assert main(["--steps", "2", "--run-dir", str(run_dir), "--task.env", "tool_arith",
                 "--warm-start.cache-dir", cache_dir, *SMALL]) == 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["turns_mean"] >= 1.0 and "tool_success_rate" in r for r in train)
    names = [g["group"] for g in read_jsonl(run_dir / "trajectories.jsonl")]
    # The tool task's own prompts (fnrl.data.tool_arith) were trained on, not arith's.
    assert names and all(n.startswith("tool-train-") for n in names)
    for t in (t for gs in logged_trajectories(run_dir).values() for g in gs for t in g):
        assert t.response_ids and len(t.loss_mask) == len(t.response_ids)
