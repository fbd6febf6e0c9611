"""Multi-turn trajectories in the loop's data path: the per-token loss mask on
Trajectory, the partial pool's fed segments, the batch honouring the mask, and one
episode streamed into the pool over a rollout handle (fnrl.control.episodes)."""

import asyncio

import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.control.episodes import stream_episode
from fnrl.data.partial_pool import PartialResponsePool
from fnrl.serving.client import StreamChunk
from fnrl.trainer.batching import build_batch, make_batch
from fnrl.types import Group, Problem, Segment, Trajectory

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
