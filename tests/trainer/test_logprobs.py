"""Chunked log-probs (the fused VJP) equal the unchunked ones: values, entropy,
gradients, with packing segments, micro-batches, sharding, remat, the KL reference and
the SFT step; and chunks really bound the logits held, in the jaxpr and in the compiled
buffers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.losses import build_objective
from fnrl.models.decoder import DecoderConfig, forward, init_model
from fnrl.trainer.batching import build_batch
from fnrl.sharding.mesh import make_mesh
from fnrl.trainer.logprobs import logprobs_from_hidden, model_logprobs, positions_per_chunk
from fnrl.trainer.step import init_state, sft_step, train_step

from tests.trainer.test_batching import _groups
from tests.tolerances import assert_close

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


@pytest.mark.slow   # compiles two full steps (the chunked log-prob paths: the tests above)
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


def _hidden_problem(tied: bool, B=2, T=13, E=16, V=V, dtype=jnp.float32):
    """Params whose hidden states and vocabulary kernel both carry gradient: tied, the
    kernel is also the input embedding; untied, a head apart. Logits of order 1."""
    k = jax.random.split(jax.random.key(7), 6)
    params = {"embedding": jax.random.normal(k[0], (V, E)) / E**0.5,
              "mix": jax.random.normal(k[1], (E, E)),
              "head": jax.random.normal(k[2], (V, E)) / E**0.5}
    tokens = jax.random.randint(k[3], (B, T + 1), 0, V)
    w_BxT, u_BxT = jax.random.normal(k[4], (B, T)), jax.random.normal(k[5], (B, T))

    def hidden_and_kernel(params):
        h_BxTxE = jnp.tanh(params["embedding"][tokens[:, :-1]] @ params["mix"]).astype(dtype)
        return h_BxTxE, params["embedding" if tied else "head"]

    return params, tokens[:, 1:], w_BxT, u_BxT, hidden_and_kernel


# T = 13 positions over 2 rows: 6 tokens = 3 positions a chunk, the last padded by 2;
# 1 token = 1 position (at least one); 26 tokens = every position in one fused chunk.
@pytest.mark.gpu
@pytest.mark.parametrize("tied,with_entropy,temperature,chunk", [
    (True, True, 0.7, 6), (False, True, 1.0, 6), (True, False, 1.3, 6), (False, False, 0.7, 1),
    (True, True, 1.0, 26)])
def test_fused_values_and_gradients_match_unchunked(tied, with_entropy, temperature, chunk):
    params, target_BxT, w_BxT, u_BxT, hidden_and_kernel = _hidden_problem(tied)

    def objective(params, h_delta_BxTxE, chunk_tokens):
        h_BxTxE, kernel_VxE = hidden_and_kernel(params)
        logp, ent = logprobs_from_hidden(h_BxTxE + h_delta_BxTxE, target_BxT, kernel_VxE,
                                         chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                         temperature=temperature)
        loss = jnp.sum(logp * w_BxT) + (jnp.sum(ent * u_BxT) if with_entropy else 0.0)
        return loss, (logp, ent)

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True),
                   static_argnums=2)
    h_delta = jnp.zeros(target_BxT.shape + (16,))
    # Full float32 matmuls on every platform (GPUs default to TF32): tolerances.tol.
    with jax.default_matmul_precision("highest"):
        (ref, (logp0, ent0)), g0 = grad(params, h_delta, 0)
        (val, (logp1, ent1)), g1 = grad(params, h_delta, chunk)
    assert_close(logp1, logp0)
    assert_close(val, ref)
    if with_entropy:
        assert_close(ent1, ent0)
        assert float(ent0.min()) > 0
    else:
        assert ent0 is None and ent1 is None
    (p0, dh0), (p1, dh1) = g0, g1
    assert_close(dh1, dh0)                                  # wrt the hidden states
    for name in p0:
        assert_close(p1[name], p0[name])
    # The projection reaches every vocabulary row; the trunk's gradient is live too.
    assert float(jnp.abs(p0["embedding" if tied else "head"]).min()) > 0
    assert float(jnp.abs(p0["mix"]).max()) > 0


@pytest.mark.gpu
def test_fused_backward_holds_a_fraction_of_the_logits():
    """The compiled backward's temporaries, not the jaxpr: B×T×V float32 is 64 MiB here,
    a chunk's logits 2 MiB; the fused path holds under a quarter of it, the unchunked
    path more than all of it (so the measure can fail)."""
    B, T, V_, E = 2, 1024, 8192, 64
    k = jax.random.split(jax.random.key(0), 3)
    h_BxTxE = jax.random.normal(k[0], (B, T, E))
    kernel_VxE = jax.random.normal(k[1], (V_, E)) / E**0.5
    target_BxT = jax.random.randint(k[2], (B, T), 0, V_)

    def temp_bytes(chunk):
        def loss(h, kernel):
            logp, ent = logprobs_from_hidden(h, target_BxT, kernel, chunk_tokens=chunk,
                                             with_entropy=True)
            return jnp.sum(logp) + jnp.sum(ent)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h_BxTxE, kernel_VxE).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = B * T * V_ * 4
    assert temp_bytes(0) > logits_bytes
    assert temp_bytes(64) < logits_bytes / 4


@pytest.mark.gpu
def test_fused_bf16_hidden_gradients_match_unchunked_to_bf16_rounding():
    """bfloat16 hidden states over a float32 kernel: the hidden states' gradient is
    bfloat16, the kernel's float32 (summed over chunks in float32), both within
    bfloat16 rounding of autodiff over the full logits."""
    params, target_BxT, w_BxT, u_BxT, hidden_and_kernel = _hidden_problem(
        tied=True, T=40, dtype=jnp.bfloat16)
    h_BxTxE, kernel_VxE = hidden_and_kernel(params)

    def grad(chunk):
        def loss(h, kernel):
            logp, ent = logprobs_from_hidden(h, target_BxT, kernel, chunk_tokens=chunk,
                                             with_entropy=True, temperature=0.7)
            return jnp.sum(logp * w_BxT) + jnp.sum(ent * u_BxT)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(h_BxTxE, kernel_VxE)

    (dh0, dk0), (dh1, dk1) = grad(0), grad(12)
    assert dh1.dtype == jnp.bfloat16 and dk1.dtype == jnp.float32
    assert_close(dh1, dh0, "bfloat16")
    assert_close(dk1, dk0, "bfloat16")


def test_fused_under_sharding_microbatch_scan_and_remat():
    """Rows over data×fsdp, the kernel over tensor×fsdp, two micro-batches in a
    `lax.scan`, each under the caller's `jax.checkpoint`: the same values and gradients
    as unsharded autodiff over the full logits. 96 = 97 - 1: the vocabulary splits."""
    params, target_BxT, w_BxT, u_BxT, hidden_and_kernel = _hidden_problem(
        tied=False, B=8, T=12, E=16, V=96)
    h_BxTxE, kernel_VxE = hidden_and_kernel(params)

    def loss(h_BxTxE, kernel_VxE, chunk):
        @jax.checkpoint
        def micro(h_MxTxE, t_MxT, w_MxT, u_MxT):
            logp, ent = logprobs_from_hidden(h_MxTxE, t_MxT, kernel_VxE, chunk_tokens=chunk,
                                             with_entropy=True, temperature=0.7)
            return jnp.sum(logp * w_MxT) + jnp.sum(ent * u_MxT)

        def body(total, mb):
            return total + micro(*mb), None

        split = lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:])  # noqa: E731
        mbs = tuple(split(x) for x in (h_BxTxE, target_BxT, w_BxT, u_BxT))
        return jax.lax.scan(body, jnp.zeros(()), mbs)[0]

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    h_sharded = jax.device_put(h_BxTxE, NamedSharding(mesh, P(("data", "fsdp"))))
    kernel_sharded = jax.device_put(kernel_VxE, NamedSharding(mesh, P("tensor", "fsdp")))
    with jax.default_matmul_precision("highest"):
        ref, (dh0, dk0) = jax.value_and_grad(loss, argnums=(0, 1))(h_BxTxE, kernel_VxE, 0)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2,
                       out_shardings=(None, (h_sharded.sharding, kernel_sharded.sharding)))
        val, (dh1, dk1) = step(h_sharded, kernel_sharded, 8)   # 4 rows x 2 positions
    assert_close(val, ref)
    assert_close(dh1, dh0)
    assert_close(dk1, dk0)
    assert dk1.sharding.spec == kernel_sharded.sharding.spec
