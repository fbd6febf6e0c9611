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


def test_non_finite_loss_skips_update_and_keeps_params(setup):
    graphdef, params, opt, step, batch = setup
    bad = dict(batch, adv_B=jnp.array([jnp.nan, 1.0]))
    state0 = init_state(params, opt)
    state, metrics = step(state0, bad)
    assert float(metrics["update_skipped"]) == 1.0 and int(state.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state.params, params)
