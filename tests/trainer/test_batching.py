"""Batch building: layouts, groups kept intact, packed == unpacked, micro == whole,
and at most one compilation per length bucket."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.losses import build_objective
from fnrl.models.hf_io import load_pretrained
from fnrl.types import Segment, Trajectory
from fnrl.trainer.batching import build_batch
from fnrl.trainer.step import (init_state, make_optimizer, pack_sequences, scatter_response,
                               train_step)


def Sample(prompt_ids, response_ids, logprobs, versions, reward) -> Trajectory:
    """A version-0 trajectory: what build_batch and the loop consume."""
    return Trajectory(uid="t", prompt_ids=tuple(prompt_ids),
                      segments=(Segment(versions[0] if versions else 0, tuple(response_ids),
                                        tuple(logprobs)),), finish_reason="stop", reward=reward)


def _groups(seed=0, num_groups=4, group_size=4, max_response=7, invalid=True):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = tuple(int(t) for t in rng.integers(3, 20, rng.integers(3, 6)))
        group = []
        for i in range(group_size):
            n = int(rng.integers(1, max_response + 1))
            reward = None if (invalid and g == 1 and i == 0) else float(rng.integers(0, 2))
            group.append(Sample(prompt, tuple(int(t) for t in rng.integers(3, 20, n)),
                                tuple(float(x) for x in -rng.random(n) * 3), (0,) * n, reward))
        groups.append(group)
    return groups


ALGO = AlgoConfig(group_size=4, groups_per_step=4, max_new_tokens=7, learning_rate=1e-2)


def test_default_layout_matches_pack_sequences():
    groups = _groups()
    arrays, info = build_batch(groups, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    samples = [s for g in groups for s in g]
    ref = {k: v.copy() for k, v in pack_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], 16, 0).items()}
    # pack_sequences also feeds the last token as an input (its target is padding);
    # build_batch leaves that position empty. Everything trained on is the same.
    for i, s in enumerate(samples):
        ref["input_BxT"][i, len(s.prompt_ids) + len(s.response_ids) - 1:] = 0
    for key in ("input_BxT", "target_BxT"):
        np.testing.assert_array_equal(arrays[key], ref[key])
    valid = np.array([s.reward is not None for s in samples], np.float32)
    np.testing.assert_array_equal(arrays["mask_BxT"], ref["mask_BxT"] * valid[:, None])
    # An invalid sample ships no log-probs: a NaN there would survive its mask of 0.
    np.testing.assert_allclose(arrays["behaviour_logp_BxT"], scatter_response(
        [s.logprobs if s.reward is not None else (0.0,) * len(s.logprobs) for s in samples],
        [len(s.prompt_ids) for s in samples], 16))
    assert arrays["adv_B"][4] == 0.0 and info["rows"] == 16 and info["length"] == 16


def test_packed_rows_keep_groups_inside_one_micro_batch():
    trainer = TrainerConfig(pack_rows=4, micro_batches=2, length_buckets=(16, 32, 48))
    arrays, info = build_batch(_groups(), algo=ALGO, trainer=trainer, seq_len=16, pad_id=0)
    assert arrays["input_BxT"].shape == (4, info["length"])
    # Each group's response tokens carry its advantages; find the rows of each group by
    # the behaviour log-probs it shipped.
    for group in _groups():
        rows = {r for s in group if s.reward is not None
                for r in np.nonzero(np.isin(arrays["behaviour_logp_BxT"],
                                            np.float32(s.logprobs)).any(axis=1))[0]}
        assert len({r % 2 for r in rows}) == 1, rows
    assert info["fill"] > 0.5


def test_too_long_for_every_bucket_is_named():
    with pytest.raises(ValueError, match="largest length bucket is 8"):
        build_batch(_groups(), algo=ALGO, trainer=TrainerConfig(length_buckets=(4, 8)),
                    seq_len=16, pad_id=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    _, graphdef, params = load_pretrained(tiny_model_dir)
    return graphdef, params


def _step(model, algo, micro_batches=1):
    graphdef, params = model
    # Plain SGD with step 1: the parameter change is the gradient itself, which Adam's
    # first step (≈ lr·sign(g)) would hide for near-zero gradients.
    opt = optax.sgd(1.0)
    fn = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=opt,
                                   loss_fn=build_objective(algo), micro_batches=micro_batches))
    return lambda batch: fn(init_state(params, opt), batch)


def _assert_same_update(a, b, rtol=1e-4):
    (state_a, m_a), (state_b, m_b) = a, b
    assert float(m_a["loss"]) == pytest.approx(float(m_b["loss"]), rel=1e-4, abs=1e-6)
    assert float(m_a["grad_norm"]) == pytest.approx(float(m_b["grad_norm"]), rel=1e-4)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6),
                 state_a.params, state_b.params)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_step_equals_unpacked_step(model, aggregation):
    algo = dataclasses.replace(ALGO, aggregation=aggregation, entropy_coef=0.01)
    groups = _groups()
    unpacked, _ = build_batch(groups, algo=algo, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    packed, info = build_batch(groups, algo=algo, trainer=TrainerConfig(pack_rows=4), seq_len=48,
                               pad_id=0)
    assert info["rows"] == 4 < 16
    step = _step(model, algo)
    _assert_same_update(step(unpacked), step(packed))


@pytest.mark.parametrize("pack_rows", [0, 4])
def test_micro_batched_step_equals_whole_step(model, pack_rows):
    algo = dataclasses.replace(ALGO, aggregation="seq_mean_token_mean", correction="token_tis")
    trainer = TrainerConfig(pack_rows=pack_rows, micro_batches=2)
    batch, _ = build_batch(_groups(), algo=algo, trainer=trainer, seq_len=48, pad_id=0)
    whole, micro = _step(model, algo)(batch), _step(model, algo, micro_batches=2)(batch)
    _assert_same_update(whole, micro)
    assert float(whole[1]["ppo_clip/clip_frac"]) == pytest.approx(
        float(micro[1]["ppo_clip/clip_frac"]), abs=1e-6)
    assert float(whole[1]["logp_abs_diff"]) == pytest.approx(float(micro[1]["logp_abs_diff"]))


def test_at_most_one_compilation_per_length_bucket(model):
    graphdef, params = model
    traces = []

    def counted(logp_BxT, batch):
        traces.append(logp_BxT.shape)  # runs only while tracing, i.e. once per compile
        return build_objective(ALGO)(logp_BxT, batch)

    opt = make_optimizer(ALGO)
    step = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=opt, loss_fn=counted))
    # Built under jit as the trainer role does, so every call sees the same state types.
    state = jax.jit(lambda p: init_state(p, opt))(params)
    trainer = TrainerConfig(pack_rows=8, length_buckets=(16, 32, 48, 64))
    lengths = []
    for seed in range(6):
        groups = _groups(seed=seed, max_response=1 + 3 * seed % 11)
        batch, info = build_batch(groups, algo=ALGO, trainer=trainer, seq_len=32, pad_id=0)
        lengths.append(info["length"])
        state, _ = step(state, batch)
    buckets = set(lengths)
    assert len(buckets) >= 2, lengths  # the test must exercise several buckets
    assert len(traces) == len(buckets) == step._cache_size(), (traces, lengths)


def _with_bad_samples(groups):
    """Group 2: a NaN reward, a NaN behaviour log-prob, then rewards 1 and 0.
    Group 3: an infinite reward first."""
    g2, g3 = list(groups[2]), list(groups[3])
    seg = g2[1].segments[0]
    g2 = [dataclasses.replace(g2[0], reward=float("nan")),
          dataclasses.replace(g2[1], segments=(dataclasses.replace(
              seg, logprobs=(float("nan"),) + seg.logprobs[1:]),)),
          dataclasses.replace(g2[2], reward=1.0), dataclasses.replace(g2[3], reward=0.0)]
    g3[0] = dataclasses.replace(g3[0], reward=float("inf"))
    return [*groups[:2], g2, g3]


def test_non_finite_reward_or_logprob_invalidates_only_that_sample(model):
    groups = _with_bad_samples(_groups(invalid=False))
    arrays, info = build_batch(groups, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    assert info["invalid_samples"] == 3 and np.isfinite(info["reward_mean"])
    bad = [8, 9, 12]   # one sample per row, in group order
    assert arrays["mask_BxT"][bad].sum() == 0 and not arrays["adv_B"][bad].any()
    assert np.isfinite(arrays["behaviour_logp_BxT"]).all()
    # The rest of group 2 still trains, on a baseline from its valid samples only.
    assert (arrays["mask_BxT"][[10, 11]].sum(axis=1) > 0).all()
    np.testing.assert_allclose(arrays["adv_B"][[10, 11]], [1.0, -1.0], rtol=1e-5)
    # The update equals the one from the batch without the bad samples: they add nothing.
    clean = [*groups[:2], groups[2][2:], groups[3][1:]]
    ref, ref_info = build_batch(clean, algo=ALGO, trainer=TrainerConfig(), seq_len=16, pad_id=0)
    assert ref_info["invalid_samples"] == 0 and ref_info["tokens"] == info["tokens"]
    state, metrics = _step(model, ALGO)(arrays)
    assert float(metrics["update_skipped"]) == 0.0
    _assert_same_update((state, metrics), _step(model, ALGO)(ref))
