"""Multi-turn trajectories in the loop's data path: the per-token loss mask on
Trajectory, the partial pool's fed segments, the batch honouring the mask, and one
episode streamed into the pool over a rollout handle (fnrl.control.episodes)."""

import asyncio
import dataclasses

import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.control.episodes import stream_episode
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.envs.base import InlineCalculator
from fnrl.types import StreamChunk
from fnrl.trainer.batching import build_batch, make_batch
from fnrl.types import Group, Problem, Routes, Segment, Trajectory

EOS = 1
ALGO = AlgoConfig(group_size=2, groups_per_step=1, max_new_tokens=32)


def multi_turn(uid="a", reward=1.0, version=0):
    """prompt (3) | sampled 4 | fed 3 | sampled 2."""
    return Trajectory(uid=uid, prompt_ids=(5, 6, 7), segments=(
        Segment(version, (10, 11, 12, 13), (-0.1, -0.2, -0.3, -0.4)),
        Segment(version, (20, 21, 22), (0.0, 0.0, 0.0), fed=True),
        Segment(version + 1, (14, EOS), (-0.5, -0.6))), finish_reason="stop", reward=reward,
        tool_calls=1, tool_ok=1)


def single_turn(uid="b", reward=0.0):
    return Trajectory(uid=uid, prompt_ids=(5, 6, 7), segments=(
        Segment(0, (30, 31, EOS), (-1.0, -1.1, -1.2)),), finish_reason="stop", reward=reward)


def test_trajectory_mask_and_turn_boundaries():
    t = multi_turn()
    assert t.response_ids == (10, 11, 12, 13, 20, 21, 22, 14, EOS)
    assert t.loss_mask == (1, 1, 1, 1, 0, 0, 0, 1, 1)
    assert t.turn_starts == (0, 4, 7) and t.num_sampled_turns == 2
    assert t.version == 0
    s = single_turn()
    assert s.loss_mask == (1, 1, 1) and s.turn_starts == (0,) and s.num_sampled_turns == 1


@pytest.mark.parametrize("pack_rows", [0, 1])
def test_batch_trains_on_the_episode_ids_with_fed_tokens_masked(pack_rows):
    t, s = multi_turn(), single_turn()
    arrays, _ = build_batch([[t, s]], algo=ALGO, trainer=TrainerConfig(pack_rows=pack_rows),
                            seq_len=32, pad_id=0)
    n = len(t.prompt_ids) + len(t.response_ids) - 1
    ids = np.asarray(t.prompt_ids + t.response_ids)
    # Row 0 holds the multi-turn sequence from position 0 in both layouts (longest first).
    assert (arrays["input_BxT"][0, :n] == ids[:-1]).all()
    assert (arrays["target_BxT"][0, :n] == ids[1:]).all()
    response = slice(len(t.prompt_ids) - 1, n)
    assert arrays["mask_BxT"][0, response].tolist() == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert arrays["mask_BxT"][0, :response.start].sum() == 0
    assert arrays["behaviour_logp_BxT"][0, response].tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, 0, 0, 0, -0.5, -0.6])
    assert arrays["mask_BxT"].sum() == 6 + 3


def test_single_turn_batches_are_unchanged_by_the_mask():
    s = single_turn()
    old_style = Trajectory(uid="b", prompt_ids=s.prompt_ids, segments=s.segments,
                           finish_reason="stop", reward=0.0)
    a, _ = build_batch([[s, old_style]], algo=ALGO, trainer=TrainerConfig(), seq_len=32, pad_id=0)
    assert a["mask_BxT"][0].tolist() == a["mask_BxT"][1].tolist()
    assert a["mask_BxT"][0, 2:5].tolist() == [1, 1, 1]


def test_step_metrics_count_turns_and_tool_success_only_for_episodes():
    p = Problem(uid="p", prompt="x", answer="1", level=4)
    failed = Trajectory(uid="c", prompt_ids=(5,), segments=multi_turn().segments,
                        finish_reason="stop", reward=0.0, tool_calls=3, tool_ok=1)
    _, stats = make_batch([Group(p, (multi_turn(), failed))], 2, algo=ALGO,
                          trainer=TrainerConfig(), seq_len=32, pad_id=0)
    assert stats["turns_mean"] == 2.0
    assert stats["tool_success_rate"] == pytest.approx(2 / 4)
    assert stats["tool_calls_mean"] == 2.0 and stats["fed_tokens"] == 6
    # Staleness is of trained (sampled) tokens: versions 0 (4 tokens) and 1 (2) at step 2.
    assert stats["staleness_hist"] == [0, 4, 8] and sum(stats["staleness_hist"]) == stats["tokens"]
    _, plain = make_batch([Group(p, (single_turn(), single_turn("c")))], 1, algo=ALGO,
                          trainer=TrainerConfig(), seq_len=32, pad_id=0)
    assert "turns_mean" not in plain and "tool_success_rate" not in plain
    _, env_run = make_batch([Group(p, (single_turn(), single_turn("c")))], 1, algo=ALGO,
                            trainer=TrainerConfig(), seq_len=32, pad_id=0, episodes=True)
    assert env_run["turns_mean"] == 1.0 and np.isnan(env_run["tool_success_rate"])


def test_pool_keeps_fed_segments_through_replay_and_compaction(tmp_path):
    path = tmp_path / "pool.log"
    with PartialResponsePool(path) as pool:
        pool.start("u", (5, 6))
        pool.append("u", 0, (10, 11), (-0.1, -0.2))
        pool.append("u", 0, (20,), (0.0,), fed=True)    # same version: not merged
        pool.append("u", 0, (12,), (-0.3,))
        pool.start("s", (5,))
        pool.append("s", 0, (1,), (-0.5,))
        want = pool.get("u").segments
        assert [s.fed for s in want] == [False, True, False]
    assert b'"fed"' in path.read_bytes() and path.read_bytes().count(b'"fed"') == 1
    with PartialResponsePool(path) as pool:
        assert pool.get("u").segments == want
        pool.compact()
    with PartialResponsePool(path) as pool:
        assert pool.get("u").segments == want
        assert not any(s.fed for s in pool.get("s").segments)


class CharCodec:
    """Characters as ids (ord + 10), EOS = 1: the episode decodes and encodes with it."""

    @staticmethod
    def encode(text):
        return [ord(c) + 10 for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(i - 10) for i in ids if i != EOS)


class ScriptedRollout:
    """A rollout handle that samples a fixed script: each request streams the next
    turn's characters two at a time, ending at a stop string or EOS."""

    def __init__(self, turns):
        self.turns, self.requests = list(turns), []

    async def generate_stream(self, prompt_ids, *, max_tokens, temperature, seed=None,
                              stop_token_ids=(), ignore_eos=False, request_id=None,
                              top_p=1.0, top_k=-1, stop=()):
        self.requests.append((tuple(prompt_ids), tuple(stop), max_tokens))
        ids = CharCodec.encode(self.turns.pop(0))
        for i in range(0, len(ids), 2):
            await asyncio.sleep(0)
            chunk = ids[i:i + 2]
            text = CharCodec.decode(ids[:i + 2])
            end = any(text.endswith(s) for s in stop)
            yield StreamChunk(token_ids=tuple(chunk), logprobs=(-0.25,) * len(chunk),
                              finish_reason="stop" if end or i + 2 >= len(ids) else None)
            if end:
                return


def test_an_episode_streams_every_turn_into_the_pool_verbatim(tmp_path):
    problem = Problem(uid="q", prompt="12*34=", answer="408", level=4)
    prompt = tuple(CharCodec.encode(problem.prompt))
    rollout = ScriptedRollout(["<calc>12*34</calc>", "\n#### 408"])
    seen = []

    async def go(pool):
        return await stream_episode(
            env_name="tool_arith", runner=None, problem=problem, prompt_ids=prompt, uid="q/0",
            pool=pool, handle=rollout, version=lambda: 3, encode_text=CharCodec.encode,
            decode=CharCodec.decode, stop_ids=(EOS,), max_new_tokens=64,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, seed=None),
            request_id="q/0#1", on_tokens=seen.append)

    with PartialResponsePool(tmp_path / "pool.log") as pool:
        pool.start("q/0", prompt)
        out = asyncio.run(go(pool))
        item = pool.get("q/0")
    assert (out.reward, out.finish_reason, out.turns, out.tool_calls, out.tool_ok) == (
        1.0, "done", 2, 1, 1)
    call, fed, answer = (CharCodec.encode(x) for x in
                         ("<calc>12*34</calc>", "<result>408</result>", "\n#### 408"))
    assert [s.token_ids for s in item.segments] == [tuple(call), tuple(fed), tuple(answer)]
    assert [s.fed for s in item.segments] == [False, True, False]
    assert item.segments[1].logprobs == (0.0,) * len(fed)
    assert all(s.version == 3 for s in item.segments)
    # The second request continued from exactly the ids the first saw, sampled and fed.
    (p1, stop1, budget1), (p2, _, budget2) = rollout.requests
    assert p1 == prompt and stop1 == ("</calc>",) and budget1 == 64
    assert p2 == prompt + tuple(call) + tuple(fed) and budget2 == 64 - len(call) - len(fed)
    assert sum(seen) == len(call) + len(answer)


class CountingCalculator:
    """The inline calculator, counting calls; `block` makes calls wait until released
    (a tool call in flight when its trajectory is cut off)."""

    def __init__(self, block: bool = False):
        self.calls, self.block, self.entered = 0, block, asyncio.Event()

    async def call(self, name, arguments):
        self.calls += 1
        self.entered.set()
        if self.block:
            await asyncio.Event().wait()   # never released: cancelled with its episode
        return await InlineCalculator().call(name, arguments)


class DyingRollout(ScriptedRollout):
    """Streams `keep` chunks of its one turn, then fails like a lost server."""

    def __init__(self, turn, keep):
        super().__init__([turn])
        self.keep = keep

    async def generate_stream(self, prompt_ids, **kw):
        n = 0
        async for chunk in super().generate_stream(prompt_ids, **kw):
            if n == self.keep:
                raise ConnectionError("server lost")
            n += 1
            yield chunk


PROBLEM = Problem(uid="q", prompt="12*34=", answer="408", level=4)
PROMPT = tuple(CharCodec.encode(PROBLEM.prompt))
CALL, FED, ANSWER = (tuple(CharCodec.encode(x)) for x in
                     ("<calc>12*34</calc>", "<result>408</result>", "\n#### 408"))


def _episode(pool, rollout, runner, version):
    return stream_episode(
        env_name="tool_arith", runner=runner, problem=PROBLEM, prompt_ids=PROMPT, uid="q/0",
        pool=pool, handle=rollout, version=lambda: version, encode_text=CharCodec.encode,
        decode=CharCodec.decode, stop_ids=(EOS,), max_new_tokens=64,
        sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, seed=None),
        request_id=f"q/0#{version}", on_tokens=lambda n: None)


def test_a_pending_tool_call_survives_a_cut_and_a_controller_restart(tmp_path):
    """Cut off while its tool call runs, the episode resumes from the pool (reopened, as
    by a restarted controller): the sampled call is not sampled again, the call is run
    again, and the turns before it are intact."""
    blocked = CountingCalculator(block=True)

    async def cut_during_the_call(pool):
        task = asyncio.create_task(_episode(pool, ScriptedRollout(["<calc>12*34</calc>"]),
                                            blocked, version=3))
        await blocked.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with PartialResponsePool(tmp_path / "pool.log") as pool:
        asyncio.run(cut_during_the_call(pool))
        cut = pool.get("q/0")
    assert [s.token_ids for s in cut.segments] == [CALL]
    assert cut.turn_closed and cut.env_steps == () and cut.finish_reason is None

    calc, rollout = CountingCalculator(), ScriptedRollout(["\n#### 408"])
    resumed = []
    with PartialResponsePool(tmp_path / "pool.log") as pool:   # a restarted controller
        out = asyncio.run(stream_episode(
            env_name="tool_arith", runner=calc, problem=PROBLEM, prompt_ids=PROMPT, uid="q/0",
            pool=pool, handle=rollout, version=lambda: 4, encode_text=CharCodec.encode,
            decode=CharCodec.decode, stop_ids=(EOS,), max_new_tokens=64,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, seed=None),
            request_id="q/0#2", on_tokens=lambda n: None, on_resumed=resumed.append))
        item = pool.get("q/0")
    assert out.resumed and resumed == [len(CALL)]
    assert (out.reward, out.turns, out.tool_calls, out.tool_ok) == (1.0, 2, 1, 1)
    assert calc.calls == 1 and len(rollout.requests) == 1
    assert rollout.requests[0][0] == PROMPT + CALL + FED   # generation went on after the result
    assert [(s.version, s.token_ids, s.fed) for s in item.segments] == [
        (3, CALL, False), (3, FED, True), (4, ANSWER, False)]
    assert item.segments[0] == cut.segments[0]   # the first turn's ids and log-probs, intact


def test_a_turn_cut_off_mid_way_is_continued_on_the_next_rollout(tmp_path):
    """A rollout lost mid-turn: the next placement continues the same turn (its two
    pieces are one action for the environment) under its own version."""
    with PartialResponsePool(tmp_path / "pool.log") as pool:
        with pytest.raises(ConnectionError):
            asyncio.run(_episode(pool, DyingRollout("<calc>12*34</calc>", keep=3), None, 3))
        assert pool.get("q/0").segments[0].token_ids == CALL[:6]
        assert not pool.get("q/0").turn_closed
        rest = CharCodec.decode(CALL[6:])
        rollout = ScriptedRollout([rest, "\n#### 408"])
        out = asyncio.run(_episode(pool, rollout, None, 5))
        item = pool.get("q/0")
    assert out.resumed and (out.reward, out.tool_calls, out.tool_ok) == (1.0, 1, 1)
    assert rollout.requests[0][0] == PROMPT + CALL[:6]
    assert [(s.version, s.token_ids, s.fed) for s in item.segments] == [
        (3, CALL[:6], False), (5, CALL[6:], False), (5, FED, True), (5, ANSWER, False)]
    # One staleness unit: V_traj is the oldest sampled token's version.
    traj = Trajectory(uid="q/0", prompt_ids=PROMPT, segments=item.segments, finish_reason="stop")
    assert traj.version == 3 and traj.num_sampled_turns == 2


def test_an_environment_without_restore_runs_a_cut_episode_afresh(tmp_path, monkeypatch):
    from fnrl.envs.builtin import ToolArithEnv

    monkeypatch.delattr(ToolArithEnv, "restore")
    with PartialResponsePool(tmp_path / "pool.log") as pool:
        with pytest.raises(ConnectionError):
            asyncio.run(_episode(pool, DyingRollout("<calc>12*34</calc>", keep=3), None, 3))
        rollout = ScriptedRollout(["<calc>12*34</calc>", "\n#### 408"])
        out = asyncio.run(_episode(pool, rollout, None, 5))
        item = pool.get("q/0")
    assert not out.resumed and out.reward == 1.0
    assert rollout.requests[0][0] == PROMPT   # from the prompt: the cut turn is gone
    assert [(s.version, s.token_ids) for s in item.segments] == [(5, CALL), (5, FED), (5, ANSWER)]


def test_a_finished_episodes_grade_survives_a_controller_restart(tmp_path):
    """The environment's reward and tool facts go with the finish record (and through a
    compaction), so a restarted controller rewards the episode as it was graded."""
    from dataclasses import asdict

    from fnrl.control.episodes import EpisodeOutcome

    graded = EpisodeOutcome(reward=1.0, finish_reason="done", turns=2, tool_calls=1,
                            tool_ok=1, resumed=True)
    with PartialResponsePool(tmp_path / "pool.log") as pool:
        pool.start("q/0", PROMPT)
        pool.append("q/0", 3, CALL, (-0.5,) * len(CALL))
        pool.finish("q/0", "done", outcome=asdict(graded))
        pool.start("s", PROMPT)
        pool.finish("s", "stop")
    for compact in (False, True, False):   # the last reads the compacted log
        with PartialResponsePool(tmp_path / "pool.log") as pool:
            assert EpisodeOutcome(**pool.get("q/0").outcome) == graded
            assert pool.get("s").outcome is None
            if compact:
                pool.compact()


def test_held_out_evaluation_of_a_tool_task_runs_graded_episodes():
    """score_heldout on a multi-turn environment: each problem is an episode (the tool
    called at its stop string, its result fed), graded by the environment; a response
    without the call is wrong here, so the record is the episodes' accuracy."""
    from fnrl.config import EvalConfig, RunConfig, TaskConfig
    from fnrl.control.book import TaskIO
    from fnrl.control.eval_lane import score_heldout
    from fnrl.types import Completion

    wrong = Problem(uid="w", prompt="12*35=", answer="420", level=4)
    requests = []

    async def generate(prompt_ids, *, n, max_tokens, temperature, seed=None,
                       stop_token_ids=(), top_p=1.0, top_k=-1, stop=()):
        requests.append((tuple(prompt_ids), tuple(stop), temperature))
        text = CharCodec.decode(prompt_ids)
        if text.endswith("</result>"):
            reply = "\n#### " + text.split("<result>")[-1].split("</result>")[0]
        elif text.startswith("12*34"):
            reply = "<calc>12*34</calc>"
        else:
            reply = "#### 419"   # a guess, no call
        # A call ends at its stop string; an answer at EOS.
        ids = tuple(CharCodec.encode(reply)) + (() if reply.endswith("</calc>") else (EOS,))
        return [Completion(token_ids=ids, logprobs=(-0.1,) * len(ids), finish_reason="stop")]

    task = TaskIO(prompts=None, eval_set=(PROBLEM, wrong),
                  encode=lambda s: list(CharCodec.encode(s)), decode=CharCodec.decode,
                  reward_fn=None, stop_ids=(EOS,), pad_id=0, seq_len=64,
                  encode_text=CharCodec.encode)
    cfg = RunConfig(task=TaskConfig(env="tool_arith"), eval=EvalConfig(samples=0))
    record = asyncio.run(score_heldout(generate, task, cfg, reward=None))
    assert record["accuracy"] == 0.5
    # The called problem took two turns: the second went on from the fed result.
    assert (PROMPT + CALL + FED, ("</calc>",), 0.0) in requests
    assert len(requests) == 3


def test_a_failing_environment_is_tried_again_from_scratch_then_reported(tmp_path, monkeypatch):
    """An environment that raises is the environment's failure (EnvError, named), not the
    rollout's: the episode runs again from scratch, and after the second failure its
    outcome is "env_error" (the loop drops the group and counts it)."""
    from fnrl.control.episodes import ENV_ATTEMPTS
    from fnrl.envs.base import ENVS
    from fnrl.envs.builtin import ToolArithEnv

    failures = {"left": 1}

    class FlakyEnv(ToolArithEnv):
        async def step(self, action, *, num_tokens=0):
            if failures["left"] > 0:
                failures["left"] -= 1
                raise KeyError("lost its state")
            return await super().step(action, num_tokens=num_tokens)

    monkeypatch.setitem(ENVS, "tool_arith", FlakyEnv)
    errors = []

    def episode(pool, rollout):
        return stream_episode(
            env_name="tool_arith", runner=None, problem=PROBLEM, prompt_ids=PROMPT, uid="q/0",
            pool=pool, handle=rollout, version=lambda: 1, encode_text=CharCodec.encode,
            decode=CharCodec.decode, stop_ids=(EOS,), max_new_tokens=64,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, seed=None),
            request_id="q/0#1", on_tokens=lambda n: None, on_env_error=errors.append)

    with PartialResponsePool(tmp_path / "pool.log") as pool:
        rollout = ScriptedRollout(["<calc>12*34</calc>", "<calc>12*34</calc>", "\n#### 408"])
        out = asyncio.run(episode(pool, rollout))
        assert out.reward == 1.0 and len(errors) == 1
        assert "'tool_arith' step failed: KeyError" in str(errors[0])
        # The second attempt started from the prompt: the first one's turn is gone.
        assert [s.token_ids for s in pool.get("q/0").segments] == [CALL, FED, ANSWER]

        failures["left"], errors[:] = ENV_ATTEMPTS, []
        pool.drop("q/0")
        out = asyncio.run(episode(pool, ScriptedRollout(["<calc>12*34</calc>"] * ENV_ATTEMPTS)))
    assert (out.finish_reason, out.reward) == ("env_error", None) and len(errors) == ENV_ATTEMPTS
    assert "KeyError" in out.error


def test_a_held_out_episode_whose_environment_fails_scores_0_and_is_counted():
    """An observation the tokenizer cannot represent (an EnvError in the episode) fails
    that problem's episode alone: it scores 0 and the record counts it, naming it."""
    from fnrl.config import EvalConfig, RunConfig, TaskConfig
    from fnrl.control.book import TaskIO
    from fnrl.control.eval_lane import score_heldout
    from fnrl.types import Completion

    other = Problem(uid="o", prompt="12*35=", answer="420", level=4)

    async def generate(prompt_ids, *, n, max_tokens, temperature, seed=None,
                       stop_token_ids=(), top_p=1.0, top_k=-1, stop=()):
        text = CharCodec.decode(prompt_ids)
        reply = ("\n#### 408" if text.endswith("</result>") else
                 "<calc>12*34</calc>" if text.startswith("12*34") else "#### 420")
        ids = tuple(CharCodec.encode(reply)) + (() if reply.endswith("</calc>") else (EOS,))
        return [Completion(token_ids=ids, logprobs=(-0.1,) * len(ids), finish_reason="stop")]

    def encode_text(text):
        if "<result>" in text:
            raise ValueError("does not decode back to itself")
        return CharCodec.encode(text)

    task = TaskIO(prompts=None, eval_set=(PROBLEM, other),
                  encode=lambda s: list(CharCodec.encode(s)), decode=CharCodec.decode,
                  reward_fn=None, stop_ids=(EOS,), pad_id=0, seq_len=64,
                  encode_text=encode_text)
    cfg = RunConfig(task=TaskConfig(env="tool_arith"), eval=EvalConfig(samples=0))
    record = asyncio.run(score_heldout(generate, task, cfg, reward=None))
    assert record["accuracy"] == 0.5 and record["env_errors"] == 1
    assert "does not decode back to itself" in record["env_error_examples"][0]


class RoutedScriptedRollout(ScriptedRollout):
    """ScriptedRollout reporting routes as vLLM does on each request's last chunk: every
    fed position from `routes_from` (the last sampled token is never fed), position p of
    request k routed to experts (p, 1000 + k)."""

    async def generate_stream(self, prompt_ids, *, routes_from=None, **kw):
        k, sent = len(self.requests), 0
        async for chunk in super().generate_stream(prompt_ids, **kw):
            sent += len(chunk.token_ids)
            if chunk.finish_reason is not None and routes_from is not None:
                fed = np.arange(routes_from, len(prompt_ids) + sent - 1)
                chunk = dataclasses.replace(chunk, routes_from=routes_from, routes=Routes.of(
                    np.stack([fed, np.full_like(fed, 1000 + k)], -1)[:, None, :]))
            yield chunk


def test_an_episodes_routes_cover_its_sampled_and_fed_positions(tmp_path):
    """Routing replay over two turns: the second request reports from the first position
    the first left uncovered (the call's last token), through the fed tool result, and
    the episode ends with every position's routes but the answer's last token's."""
    rollout = RoutedScriptedRollout(["<calc>12*34</calc>", "\n#### 408"])
    with PartialResponsePool(tmp_path / "pool.log") as pool:
        pool.start("q/0", PROMPT)
        out = asyncio.run(stream_episode(
            env_name="tool_arith", runner=None, problem=PROBLEM, prompt_ids=PROMPT, uid="q/0",
            pool=pool, handle=rollout, version=lambda: 3, encode_text=CharCodec.encode,
            decode=CharCodec.decode, stop_ids=(EOS,), max_new_tokens=64,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=-1, seed=None),
            request_id="q/0#1", on_tokens=lambda n: None, replay=True))
        routes = pool.get("q/0").trajectory_routes()
    assert out.reward == 1.0 and len(rollout.requests) == 2   # no routes-only request
    positions = len(PROMPT + CALL + FED + ANSWER)
    got = routes.array()[:, 0]
    np.testing.assert_array_equal(got[:-1, 0], np.arange(positions - 1))
    first = len(PROMPT + CALL) - 1          # the call's last token: fed by request 2
    assert (got[:first, 1] == 1000).all() and (got[first:-1, 1] == 1001).all()
    assert tuple(got[-1]) == (0, 0)         # the answer's last token: only a target
