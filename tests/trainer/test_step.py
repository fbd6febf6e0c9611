import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import AlgoConfig
from fnrl.losses.core import POLICY_LOSSES
from fnrl.models.hf_io import load_pretrained
from fnrl.trainer.step import (init_state, make_optimizer, pack_sequences, scatter_response,
                               token_logprobs, train_step)


def test_pack_sequences_aligns_targets_and_mask():
    out = pack_sequences([(2, 5, 6)], [(7, 8, 1)], seq_len=8, pad_id=0)
    np.testing.assert_array_equal(out["input_BxT"][0], [2, 5, 6, 7, 8, 1, 0, 0])
    np.testing.assert_array_equal(out["target_BxT"][0], [5, 6, 7, 8, 1, 0, 0, 0])
    np.testing.assert_array_equal(out["mask_BxT"][0], [0, 0, 1, 1, 1, 0, 0, 0])
    lp = scatter_response([(-0.1, -0.2, -0.3)], [3], seq_len=8)
    np.testing.assert_allclose(lp[0], [0, 0, -0.1, -0.2, -0.3, 0, 0, 0])
    with pytest.raises(ValueError, match="sequence 0 has 10 tokens"):
        pack_sequences([(1,) * 5], [(2,) * 5], seq_len=8, pad_id=0)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg, graphdef, params = load_pretrained(tiny_model_dir)
    algo = AlgoConfig(learning_rate=1e-3)
    opt = make_optimizer(algo)
    step = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=opt,
                                     loss_fn=POLICY_LOSSES["grpo"]))
    batch = pack_sequences([(2, 5, 6), (2, 7, 6)], [(7, 8, 1), (9, 1)], seq_len=8, pad_id=0)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    logp = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
    batch["behaviour_logp_BxT"] = logp * batch["mask_BxT"]
    batch["adv_B"] = jnp.array([1.0, -1.0])
    return graphdef, params, opt, step, batch


def test_step_ascends_advantage_weighted_likelihood(setup):
    graphdef, params, opt, step, batch = setup
    state, metrics = step(init_state(params, opt), batch)
    assert int(state.step) == 1 and float(metrics["update_skipped"]) == 0.0
    before = token_logprobs(graphdef, params, batch["input_BxT"], batch["target_BxT"])
    after = token_logprobs(graphdef, state.params, batch["input_BxT"], batch["target_BxT"])
    seq = lambda lp, i: float(jnp.sum(lp[i] * batch["mask_BxT"][i]))  # noqa: E731
    # The advantage-weighted log-likelihood (what GRPO ascends) goes up.
    assert seq(after, 0) - seq(after, 1) > seq(before, 0) - seq(before, 1)
    # On-policy: the behaviour log-probs equal the trainer's, so the ratio is exactly 1.
    assert float(metrics["logp_abs_diff"]) < 1e-5


def _bad_batches(batch):
    """Batches whose loss is NaN: a NaN advantage; a NaN behaviour log-prob on a trained
    token; a NaN behaviour log-prob on a masked token (NaN · 0 is still NaN)."""
    masked = np.asarray(batch["mask_BxT"]) == 0
    nan_on_mask = np.where(masked, np.nan, np.asarray(batch["behaviour_logp_BxT"]))
    return {"adv": dict(batch, adv_B=jnp.array([jnp.nan, 1.0])),
            "behaviour": dict(batch, behaviour_logp_BxT=batch["behaviour_logp_BxT"].at[0, 3].set(
                jnp.nan)),
            "behaviour_masked": dict(batch, behaviour_logp_BxT=jnp.asarray(nan_on_mask))}


@pytest.mark.parametrize("which", ["adv", "behaviour", "behaviour_masked"])
def test_non_finite_loss_skips_update_and_keeps_state_bit_identical(setup, which):
    graphdef, params, opt, step, batch = setup
    # One good step first, so the Adam moments are not all zero.
    state0, _ = step(init_state(params, opt), batch)
    before = jax.tree.map(np.array, state0)
    state, metrics = step(state0, _bad_batches(batch)[which])
    assert not np.isfinite(float(metrics["loss"]))
    assert float(metrics["update_skipped"]) == 1.0 and int(state.step) == 1
    # Parameters and every leaf of the optimizer state, bit for bit.
    changed = [jax.tree_util.keystr(path) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(state))
        if a.dtype != b.dtype or a.tobytes() != np.asarray(b).tobytes()]
    assert not changed, changed
    # The next good batch trains as if the bad one had never come.
    after_bad, _ = step(state, batch)
    direct, _ = step(jax.tree.map(jnp.asarray, before), batch)
    jax.tree.map(np.testing.assert_array_equal, after_bad, direct)
