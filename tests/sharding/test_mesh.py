"""Sharded train steps equal the one-device step; a golden snapshot of partition specs."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fnrl.config import AlgoConfig, MeshConfig
from fnrl.models.decoder import DecoderConfig, init_model, logical_axes
from fnrl.sharding.mesh import batch_sharding, make_mesh, mesh_from_config, partition_specs, shardings_for
from fnrl.trainer.step import compile_train_step, init_state

GOLDEN = Path(__file__).with_name("golden_partition_specs.json")
# Every dimension divides the 2x2x2 mesh, so no rule is silently dropped.
CFG = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_partition_specs_match_golden_snapshot():
    """Regenerate with FNRL_UPDATE_GOLDEN=1 after a deliberate change to the rules."""
    _, params = init_model(CFG, seed=0)
    specs = partition_specs(logical_axes(CFG), params, make_mesh(2, 2, 2))
    if os.environ.get("FNRL_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(specs, indent=1, sort_keys=True) + "\n")
    assert specs == json.loads(GOLDEN.read_text())
    # Spot checks of the rules themselves: FSDP on embed, tensor on heads/MLP/vocab.
    assert specs["layers/0/attn/q_kernel"] == "P('fsdp', 'tensor', None)"
    assert specs["layers/0/mlp/down_kernel"] == "P('tensor', 'fsdp')"


def test_mesh_from_config_and_its_errors():
    assert dict(mesh_from_config(MeshConfig(fsdp=2, tensor=2)).shape) == {
        "data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="does not divide"):
        mesh_from_config(MeshConfig(fsdp=3))


def _batch(rows=8, length=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (rows, length + 1)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    for r in range(rows):
        mask[r, 3:3 + rng.integers(2, length - 3)] = 1.0
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:], "mask_BxT": mask,
            "behaviour_logp_BxT": (-4.0 - rng.random((rows, length)) * mask).astype(np.float32),
            "adv_B": rng.standard_normal(rows).astype(np.float32)}


def _run(mesh, micro_batches=1, remat="none", logprob_chunk=0):
    graphdef, params = init_model(CFG, seed=1, remat=remat)
    params = jax.device_put(params, shardings_for(logical_axes(CFG), params, mesh))
    opt = optax.sgd(1.0)  # the update is the gradient: compares gradients directly
    algo = AlgoConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01)
    state = jax.jit(lambda p: init_state(p, opt))(params)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    step = compile_train_step(graphdef, opt, algo, state_sh, batch_sharding(mesh),
                              micro_batches=micro_batches, logprob_chunk=logprob_chunk,
                              matmul_precision="highest")
    new_state, metrics = step(state, _batch(), None)
    return jax.device_get(new_state.params), jax.device_get(metrics), new_state


@pytest.fixture(scope="module")
def one_device():
    return _run(make_mesh(1, 1, 1, devices=jax.devices()[:1]))


@pytest.mark.parametrize("shape,micro_batches,kernels", [
    ((8, 1, 1), 1, {}), ((2, 2, 2), 2, {}), ((1, 2, 4), 1, {}),
    # FSDP alone over 8 devices with the GPU defaults' remat and chunked log-probs.
    ((1, 8, 1), 1, {"remat": "dots", "logprob_chunk": 24})])
def test_sharded_step_equals_one_device_step(one_device, shape, micro_batches, kernels):
    params0, metrics0, _ = one_device
    params, metrics, state = _run(make_mesh(*shape), micro_batches, **kernels)
    assert float(metrics["loss"]) == pytest.approx(float(metrics0["loss"]), rel=1e-5, abs=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, params0)
    # The state really is spread over the mesh (pure data parallelism replicates it).
    q = state.params["layers"][0]["attn"]["q_kernel"]
    assert len(q.sharding.device_set) == 8
    assert q.sharding.is_fully_replicated == (shape[1] * shape[2] == 1)
