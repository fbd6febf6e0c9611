"""The train step with LoRA adapters: only the adapters move, version 0 is the base
exactly (ratio 1, KL 0 against the base as reference), and the sharded step equals the
one-device step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import AlgoConfig, LoraConfig
from fnrl.models.decoder import logical_axes
from fnrl.models.hf_io import load_pretrained
from fnrl.models.lora import delta_change_norm, split_adapters
from fnrl.sharding.mesh import batch_sharding, make_mesh, shardings_for
from fnrl.trainer.step import (compile_train_step, init_state, make_optimizer, place_params,
                               state_shardings)
from tests.tolerances import assert_close
from tests.trainer.toy_batch import on_policy_batch

LORA = LoraConfig(rank=4, alpha=8.0)


def _batch(graphdef, params):
    return on_policy_batch(graphdef, params, rows=8, vocab=40, seed=1)


def _run(model_dir, algo, mesh_shape, steps=2, controls=None):
    _, graphdef, params = load_pretrained(model_dir, lora=LORA, adapter_seed=0)
    model_cfg = load_pretrained(model_dir)[0]
    batch = _batch(graphdef, params)
    mesh = make_mesh(*mesh_shape)
    (adapters, base), (adapter_sh, base_sh) = (
        split_adapters(params), split_adapters(shardings_for(
            logical_axes(model_cfg, LORA), params, mesh)))
    opt = make_optimizer(algo)
    frozen = place_params(jax.tree.map(np.copy, base), base_sh)   # it empties its input
    state = jax.device_put(init_state(adapters, opt), state_shardings(opt, adapters, adapter_sh))
    step = compile_train_step(graphdef, opt, algo, state_shardings(opt, adapters, adapter_sh),
                              batch_sharding(mesh), frozen_sharding=base_sh,
                              lora_scaling=LORA.scaling)
    metrics = []
    for _ in range(steps):
        state, m = step(state, batch, None, controls, frozen)
        metrics.append(jax.device_get(m))
    return base, frozen, state, metrics


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_lora_step_trains_the_adapters_and_starts_at_the_base(tiny_model_dir, kl):
    algo = AlgoConfig(learning_rate=1e-2, kl_coef=kl)
    base, frozen, state, metrics = _run(tiny_model_dir, algo, (1, 1, 1))
    # Version 0 is the base: the behaviour log-probs (the base's) are the trainer's.
    assert metrics[0]["logp_abs_diff"] < 1e-6
    if kl:
        assert abs(metrics[0]["kl/loss"]) < 1e-7 and abs(metrics[1]["kl/loss"]) > 1e-9
    assert int(state.step) == 2 and metrics[1]["logp_abs_diff"] > 1e-4
    # The frozen base went in and came out untouched (not donated, not updated).
    assert len(jax.tree.leaves(frozen)) == len(jax.tree.leaves(base)) > 10
    for got, want in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(got), want)
    bs = [np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
          if str(p[-1].key).endswith("_lora_b")]
    assert all(np.abs(b).max() > 0 for b in bs)   # B left zero: every adapter moved


def test_lora_step_sharded_equals_one_device(tiny_model_dir):
    algo = AlgoConfig(learning_rate=1e-2)
    *_, one, m1 = _run(tiny_model_dir, algo, (1, 1, 1))
    *_, eight, m8 = _run(tiny_model_dir, algo, (2, 2, 2))
    # Adam divides by the gradient's own scale: an element whose gradient is near zero
    # turns a summation-order difference into a visible one, so compare absolutely.
    for got, want in zip(jax.tree.leaves(eight.params), jax.tree.leaves(one.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-5)
    assert_close(m8[1]["loss"], m1[1]["loss"])


def test_lora_update_ratio_is_the_models_not_the_adapters(tiny_model_dir):
    """The update_ratio gate bounds how far a step moves the model: with adapters, the
    merged weights' change over the base's norm (the adapters' own relative change is
    large at the start, B = 0: the gate rolled every LoRA run back at version 1)."""
    algo = AlgoConfig(learning_rate=1e-4)
    controls = {"lr_scale": np.float32(1.0), "max": {}, "min": {}}
    base, _, state, metrics = _run(tiny_model_dir, algo, (1, 1, 1), steps=1, controls=controls)
    _, _, fresh = load_pretrained(tiny_model_dir, lora=LORA, adapter_seed=0)
    want = float(delta_change_norm(split_adapters(fresh)[0], jax.device_get(state.params),
                                   LORA.scaling)) / np.sqrt(sum(
                                       np.sum(np.square(x.astype(np.float64)))
                                       for x in jax.tree.leaves(base)))
    assert want > 0
    np.testing.assert_allclose(metrics[0]["update_ratio"], want, rtol=1e-4)
