"""Chunked log-probs equal the unchunked ones: values, entropy, gradients, with packing
segments, micro-batches, the KL reference and the SFT step; and chunks really bound the
logits held."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.losses import build_objective
from fnrl.models.decoder import DecoderConfig, forward, init_model
from fnrl.trainer.batching import build_batch
from fnrl.trainer.logprobs import model_logprobs, positions_per_chunk
from fnrl.trainer.step import init_state, sft_step, train_step

from test_batching import _groups

V = 97   # prime: no chunk size divides it, and it is larger than a chunk


def _model(tied: bool):
    cfg = DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        max_position_embeddings=64, tie_word_embeddings=tied)
    return init_model(cfg, seed=3)


def _packed_batch(micro_batches=2):
    """A packed batch (segments, positions) of 8 rows; 4 groups of 4."""
    trainer = TrainerConfig(pack_rows=8, micro_batches=micro_batches, length_buckets=(24,))
    algo = AlgoConfig(group_size=4, groups_per_step=4, max_new_tokens=7)
    arrays, _ = build_batch(_groups(seed=1, max_response=7), algo=algo, trainer=trainer,
                            seq_len=24, pad_id=0)
    return {k: jnp.asarray(v) for k, v in arrays.items()}


def test_positions_per_chunk():
    assert positions_per_chunk(rows=8, length=1024, chunk_tokens=0) == 1024
    assert positions_per_chunk(rows=8, length=1024, chunk_tokens=8192) == 1024
    assert positions_per_chunk(rows=8, length=1024, chunk_tokens=1024) == 128
    assert positions_per_chunk(rows=8, length=1024, chunk_tokens=3) == 1   # at least one


# 40 // 8 rows = 5 positions a chunk: 24 positions are padded to 25; 1: one position.
@pytest.mark.parametrize("tied,chunk", [(True, 8), (False, 40), (True, 1)])
def test_chunked_values_and_gradients_match_unchunked(tied, chunk):
    graphdef, params = _model(tied)
    b = _packed_batch()
    args = (b["input_BxT"], b["target_BxT"], b["positions_BxT"], b["segment_ids_BxT"])
    w_BxT = jax.random.normal(jax.random.key(0), b["mask_BxT"].shape) * b["mask_BxT"]

    def objective(params, chunk_tokens):
        logp, ent = model_logprobs(graphdef, params, *args, chunk_tokens=chunk_tokens,
                                   with_entropy=True)
        return jnp.sum(logp * w_BxT) + 0.3 * jnp.sum(ent * b["mask_BxT"]), (logp, ent)

    grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=1)
    (ref, (logp0, ent0)), g0 = grad(params, 0)
    (val, (logp1, ent1)), g1 = grad(params, chunk)
    np.testing.assert_allclose(logp1, logp0, rtol=0, atol=2e-5)
    np.testing.assert_allclose(ent1, ent0, rtol=0, atol=2e-5)
    np.testing.assert_allclose(val, ref, rtol=1e-5)
    assert float(jnp.abs(logp0).min()) > 0          # log-probs of real tokens, not zeros
    flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(flat0) == len(flat1)
    for a, c in zip(flat0, flat1):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)
    assert sum(float(jnp.abs(a).sum()) for a in flat0) > 0


def test_train_step_with_chunks_equals_unchunked():
    """PPO + entropy + KL to a reference over 2 micro-batches: every log-prob the step
    takes is chunked. Plain SGD, so the update is the gradient itself (Adam would
    blow a near-zero gradient's last bits up to a full learning-rate step)."""
    micro_batches = 2
    graphdef, params = _model(tied=True)
    b = _packed_batch(micro_batches)
    b["behaviour_logp_BxT"] = model_logprobs(graphdef, params, b["input_BxT"], b["target_BxT"],
                                             b["positions_BxT"], b["segment_ids_BxT"])[0] * (
        b["mask_BxT"]) - 0.05 * b["mask_BxT"]
    algo = AlgoConfig(group_size=4, groups_per_step=4, max_new_tokens=7, learning_rate=1e-2,
                      entropy_coef=0.01, kl_coef=0.1)
    opt = optax.sgd(1.0)
    ref_params = jax.tree.map(lambda x: x * 1.01, params)   # differs from the policy

    def run(chunk):
        step = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=opt,
                                         loss_fn=build_objective(algo),
                                         micro_batches=micro_batches, logprob_chunk=chunk))
        return step(init_state(params, opt), b, ref_params)

    s0, m0 = run(0)
    s1, m1 = run(16)
    assert m0.keys() == m1.keys()
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert abs(float(m0["kl/loss"])) > 0 and abs(float(m0["entropy/loss"])) > 0
    jax.tree.map(lambda a, c: np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6),
                 s0.params, s1.params)


def test_sft_step_with_chunks_equals_unchunked():
    graphdef, params = _model(tied=False)
    b = _packed_batch()
    opt = optax.sgd(1.0)
    out = [jax.jit(functools.partial(sft_step, graphdef=graphdef, optimizer=opt,
                                     logprob_chunk=chunk))(init_state(params, opt), b)
           for chunk in (0, 24)]
    np.testing.assert_allclose(out[1][1]["loss"], out[0][1]["loss"], rtol=1e-6)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6),
                 out[0][0].params, out[1][0].params)


def _largest_logits(fn, *args) -> int:
    """Elements of the largest array ending in a vocabulary axis (logits, softmax and
    their cotangents) anywhere in the jaxpr of `fn`, inside scans and remats too."""
    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                shape = getattr(v.aval, "shape", ())
                if len(shape) >= 2 and shape[-1] == V:
                    largest = max(largest, int(np.prod(shape, dtype=np.int64)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return largest


def test_gradient_never_holds_more_than_a_chunk_of_logits():
    graphdef, params = _model(tied=True)
    b = _packed_batch()
    B, T = b["input_BxT"].shape

    def grad_of(chunk):
        def loss(p):
            return jnp.sum(model_logprobs(graphdef, p, b["input_BxT"], b["target_BxT"],
                                          chunk_tokens=chunk, with_entropy=True)[0])
        return jax.grad(loss)

    assert _largest_logits(grad_of(0), params) == B * T * V
    # 16 tokens: 8 rows x 2 positions, 16 x V logits at a time, forward and backward.
    assert _largest_logits(grad_of(16), params) == 16 * V


def test_bf16_chunked_gradients_match_unchunked_to_bf16_rounding():
    """bfloat16 compute over float32 params: the embedding's gradient (lookup plus the
    chunked projection) is float32 and within bfloat16 rounding of the unchunked one."""
    cfg = DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        max_position_embeddings=64, tie_word_embeddings=True)
    graphdef, params = init_model(cfg, seed=3, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    b = _packed_batch()

    def grad(chunk):
        return jax.jit(jax.grad(lambda p: jnp.sum(model_logprobs(
            graphdef, p, b["input_BxT"], b["target_BxT"], chunk_tokens=chunk)[0]
            * b["mask_BxT"])))(params)["embedding"]

    whole, chunked = grad(0), grad(8)
    assert chunked.dtype == jnp.float32
    scale = float(jnp.abs(whole).max())
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=scale * 2**-6)


@pytest.mark.parametrize("chunk", [0, 8])
def test_log_probs_are_those_of_the_sampling_temperature(chunk):
    """π = softmax(logits / T): what vLLM samples from at temperature T and whose
    log-probs it returns (--logprobs-mode processed_logprobs)."""
    cfg = DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    graphdef, params = init_model(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 48)
    logits = forward(graphdef, params, tokens[:, :-1]).astype(jnp.float32)
    for t in (1.0, 0.6):
        want = jnp.take_along_axis(jax.nn.log_softmax(logits / t, axis=-1),
                                   tokens[:, 1:, None], axis=-1)[..., 0]
        got, entropy = model_logprobs(graphdef, params, tokens[:, :-1], tokens[:, 1:],
                                      chunk_tokens=chunk, with_entropy=True, temperature=t)
        np.testing.assert_allclose(got, want, atol=2e-5)
        p = jax.nn.softmax(logits / t, axis=-1)
        np.testing.assert_allclose(entropy, -jnp.sum(p * jnp.log(p), -1), atol=2e-5)
