"""PPO with a value head: GAE against a per-sequence reference, the value loss's golden
values, the critic inside the real jitted step, and the batch's per-token rewards."""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.losses import build_objective
from fnrl.losses.value import gae, value_loss
from fnrl.models.decoder import DecoderConfig, init_model
from fnrl.trainer.batching import build_batch
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.step import (init_state, initial_critic, make_critic_optimizer, make_optimizer,
                               token_logprobs, train_step)

PPO = dict(advantage="gae", loss_terms=(("ppo_clip", 1.0), ("value", 0.5)))


def reference_gae(reward, values, mask, segments, gamma, lam):
    """Textbook GAE, one sequence at a time over its trained tokens, in plain Python."""
    adv = np.zeros_like(values, dtype=np.float64)
    for b in range(mask.shape[0]):
        for seg in set(segments[b][mask[b] > 0].tolist()):
            idx = [t for t in range(mask.shape[1]) if mask[b, t] > 0 and segments[b, t] == seg]
            next_v = next_a = 0.0
            for t in reversed(idx):
                delta = reward[b, t] + gamma * next_v - values[b, t]
                next_a = delta + gamma * lam * next_a
                next_v = values[b, t]
                adv[b, t] = next_a
    return adv, np.where(mask > 0, adv + values, 0.0)


def test_gae_terminal_reward_with_gamma_lambda_one_is_reward_minus_value():
    values = jnp.array([[0.0, 0.5, 0.25, 0.75, 9.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0, 0.0]])       # prompt, 3 response tokens, pad
    reward = jnp.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(reward, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[0.0, 0.5, 0.75, 0.25, 0.0]], atol=1e-7)
    np.testing.assert_allclose(ret, [[0.0, 1.0, 1.0, 1.0, 0.0]], atol=1e-7)
    # λ = 0: one-step TD errors, r_t + γ·V_{t+1} − V_t.
    adv0, _ = gae(reward, values, mask, gamma=0.9, lam=0.0)
    np.testing.assert_allclose(adv0, [[0.0, 0.9 * 0.25 - 0.5, 0.9 * 0.75 - 0.25, 0.25, 0.0]],
                               atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0)])
def test_gae_matches_the_per_sequence_reference_on_packed_rows_with_gaps(gamma, lam):
    rng = np.random.default_rng(0)
    B, T = 3, 24
    segments = np.zeros((B, T), np.int32)
    segments[0, :10], segments[0, 10:21] = 1, 2            # two packed sequences, then pad
    segments[1, :24] = 1
    segments[2, :7], segments[2, 7:15], segments[2, 15:22] = 1, 2, 3
    mask = ((rng.random((B, T)) < 0.7) & (segments > 0)).astype(np.float32)
    mask[1, 8:12] = 0.0                                    # a tool's reply inside a sequence
    values = rng.standard_normal((B, T)).astype(np.float32)
    reward = np.where(mask > 0, rng.standard_normal((B, T)), 0.0).astype(np.float32)
    got_adv, got_ret = gae(jnp.asarray(reward), jnp.asarray(values), jnp.asarray(mask),
                           jnp.asarray(segments), gamma=gamma, lam=lam)
    want_adv, want_ret = reference_gae(reward, values, mask, segments, gamma, lam)
    np.testing.assert_allclose(got_adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ret, want_ret, rtol=1e-5, atol=1e-5)


def test_value_loss_golden_with_and_without_the_clip():
    batch = {"values_BxT": jnp.array([[0.5, 1.0]]), "old_values_BxT": jnp.array([[0.0, 0.9]]),
             "returns_BxT": jnp.array([[1.0, 0.0]]), "mask_BxT": jnp.ones((1, 2))}
    logp = jnp.zeros((1, 2))
    plain, _ = value_loss(logp, batch, value_clip=0.0)
    assert float(plain) == pytest.approx(0.5 * (0.25 + 1.0) / 2)
    # Token 0: V moved 0.5 from V_old = 0, clipped to 0.2 -> (0.2 − 1)² = 0.64 > 0.25.
    # Token 1: V moved 0.1, within the clip: (1 − 0)² = 1.
    clipped, metrics = value_loss(logp, batch, value_clip=0.2)
    assert float(clipped) == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)
    grad = jax.grad(lambda v: value_loss(logp, dict(batch, values_BxT=v), value_clip=0.2)[0])(
        batch["values_BxT"])
    # The clipped branch is constant in V (no gradient); the other is (V − R)/2 per token.
    np.testing.assert_allclose(grad, [[0.0, 0.5]], atol=1e-7)


def test_config_requires_gae_and_the_value_term_together():
    AlgoConfig(**PPO)
    with pytest.raises(ValueError, match="advantage='gae' and a 'value' loss term"):
        AlgoConfig(advantage="gae")
    with pytest.raises(ValueError, match="advantage='gae' and a 'value' loss term"):
        AlgoConfig(loss_terms=(("ppo_clip", 1.0), ("value", 1.0)))
    with pytest.raises(ValueError, match="KL in the reward"):
        AlgoConfig(**PPO, kl_coef=0.1, kl_in="reward")
    with pytest.raises(ValueError, match="gae_lambda"):
        AlgoConfig(**PPO, gae_lambda=1.5)


@pytest.fixture(scope="module")
def model():
    cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    return cfg, *init_model(cfg, seed=0)


def _ppo_batch(graphdef, params):
    # Four sequences of 3 response tokens after a 1-token prompt, μ = the model's own.
    tokens = jnp.array([[1, 2, 3, 4], [1, 5, 6, 7], [1, 2, 6, 4], [1, 5, 3, 7]])
    batch = {"input_BxT": tokens[:, :3], "target_BxT": tokens[:, 1:],
             "mask_BxT": jnp.ones((4, 3)), "adv_B": jnp.zeros(4),
             "reward_BxT": jnp.zeros((4, 3)).at[:, 2].set(jnp.array([1.0, 0.0, 1.0, 0.0]))}
    batch["behaviour_logp_BxT"] = token_logprobs(graphdef, params, batch["input_BxT"],
                                                 batch["target_BxT"])
    return batch


def _stepper(graphdef, algo, micro_batches=1):
    return jax.jit(functools.partial(
        train_step, graphdef=graphdef, optimizer=make_optimizer(algo), loss_fn=build_objective(algo),
        critic_optimizer=make_critic_optimizer(algo), value_trunk_grad=algo.value_trunk_grad,
        micro_batches=micro_batches))


def _state(cfg, params, algo):
    return init_state(params, make_optimizer(algo), initial_critic(algo, cfg.hidden_size))


def test_the_critic_learns_the_returns_in_the_jitted_step(model):
    cfg, graphdef, params = model
    algo = AlgoConfig(**PPO, learning_rate=1e-3, critic_lr=3e-2, gae_lambda=1.0)
    step, batch = _stepper(graphdef, algo), _ppo_batch(graphdef, params)
    state = _state(cfg, params, algo)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["value/loss"]))
        assert float(metrics["update_skipped"]) == 0.0
    assert int(state.step) == 30
    # At V = 0 the loss is ½·mean((R − 0)²) over the 6 tokens with return 1 of 12: 0.25.
    assert losses[0] == pytest.approx(0.25, rel=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(jnp.abs(state.critic.params["kernel_E"]).max()) > 0
    assert "gae/adv_mean" in metrics and "critic/grad_norm" in metrics


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_a_detached_critic_leaves_the_policy_update_alone(model):
    """Without value_trunk_grad the value weight changes nothing but the head's update;
    with it the value loss also reaches the trunk's gradient. The head is made nonzero
    first: the critic starts as a zero head, whose V has no gradient to pass to the
    trunk. (The test compared the parameters after one step of a zero head and passed
    only by rounding: the two programs' other sums differ in their last bits at XLA's
    default level, not at levels 0 and 2. It compares the policy's gradient norm now.)"""
    cfg, graphdef, params = model
    batch = _ppo_batch(graphdef, params)

    def step(weight, trunk):
        algo = AlgoConfig(advantage="gae", loss_terms=(("ppo_clip", 1.0), ("value", weight)),
                          value_trunk_grad=trunk, learning_rate=1e-2)
        state = _state(cfg, params, algo)
        head = {**state.critic.params, "kernel_E": jnp.full_like(state.critic.params["kernel_E"], 0.1)}
        state = dataclasses.replace(state, critic=dataclasses.replace(state.critic, params=head))
        state, metrics = _stepper(graphdef, algo)(state, batch)
        return state.params, float(metrics["grad_norm"])

    (base, base_norm), (heavier, heavier_norm) = step(0.5, False), step(5.0, False)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), base, heavier)
    assert all(jax.tree.leaves(same)) and heavier_norm == base_norm
    _, trunk_norm = step(5.0, True)
    assert abs(trunk_norm - base_norm) > 1e-3 * base_norm, (trunk_norm, base_norm)


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_micro_batches_give_the_unsplit_update_with_the_critic(model):
    cfg, graphdef, params = model
    algo = AlgoConfig(**PPO, learning_rate=1e-2, critic_lr=1e-2)
    batch = _ppo_batch(graphdef, params)
    whole, _ = _stepper(graphdef, algo)(_state(cfg, params, algo), batch)
    split, _ = _stepper(graphdef, algo, micro_batches=2)(_state(cfg, params, algo), batch)
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64)
                                                         - np.asarray(b, np.float64)))),
                        whole, split)
    assert max(jax.tree.leaves(diff)) < 1e-5


def test_a_nonfinite_reward_keeps_the_critic_too(model):
    cfg, graphdef, params = model
    algo = AlgoConfig(**PPO)
    batch = _ppo_batch(graphdef, params)
    batch["reward_BxT"] = batch["reward_BxT"].at[0, 2].set(jnp.nan)
    state = _state(cfg, params, algo)
    after, metrics = _stepper(graphdef, algo)(state, batch)
    assert float(metrics["update_skipped"]) == 1.0 and int(after.step) == 0
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), after.critic, state.critic)
    assert all(jax.tree.leaves(same))


def test_the_step_refuses_a_state_without_a_critic(model):
    cfg, graphdef, params = model
    algo = AlgoConfig(**PPO)
    with pytest.raises(ValueError, match="no critic"):
        _stepper(graphdef, algo)(init_state(params, make_optimizer(algo)),
                                 _ppo_batch(graphdef, params))


def test_the_critic_is_checkpointed_with_the_state(model, tmp_path):
    cfg, graphdef, params = model
    algo = AlgoConfig(**PPO, critic_lr=1e-2)
    state, _ = _stepper(graphdef, algo)(_state(cfg, params, algo), _ppo_batch(graphdef, params))
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(1, state)
    restored, _ = ckpt.restore(_state(cfg, params, algo), step=1)
    ckpt.close()
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), restored.critic, state.critic)
    assert all(jax.tree.leaves(same))


def _traj(prompt, response, reward):
    # A batching sample (fnrl.trainer.batching): a Trajectory's fields, flat.
    return SimpleNamespace(prompt_ids=tuple(prompt), response_ids=tuple(response),
                           logprobs=(-1.0,) * len(response), versions=(0,) * len(response),
                           reward=reward)


@pytest.mark.parametrize("pack_rows", [0, 2])
def test_the_batch_puts_each_reward_at_its_last_trained_token(pack_rows):
    groups = [[_traj([1, 2], [3, 4, 5], 1.0), _traj([1, 2], [6, 7], 0.0)],
              [_traj([1], [8, 9], 0.5), _traj([1], [3], float("nan"))]]
    arrays, _ = build_batch(groups, algo=AlgoConfig(**PPO, group_size=2),
                            trainer=TrainerConfig(pack_rows=pack_rows), seq_len=16, pad_id=0)
    reward, mask = arrays["reward_BxT"], arrays["mask_BxT"]
    # Every trained sequence ends on exactly one rewarded position; the invalid one trains
    # nothing and is rewarded nowhere.
    assert sorted(reward[reward != 0].tolist()) == [0.5, 1.0]
    for r, row in zip(*np.nonzero(reward)):
        assert mask[r, row] == 1.0 and (row + 1 == mask.shape[1] or mask[r, row + 1] == 0.0
                                        or arrays.get("segment_ids_BxT", mask)[r, row + 1]
                                        != arrays.get("segment_ids_BxT", mask)[r, row])
    plain, _ = build_batch(groups, algo=AlgoConfig(group_size=2),
                           trainer=TrainerConfig(pack_rows=pack_rows), seq_len=16, pad_id=0)
    assert "reward_BxT" not in plain
