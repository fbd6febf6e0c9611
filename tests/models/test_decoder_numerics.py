"""Rematerialisation and mixed precision: what the trainer relies on for memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.models.decoder import (DecoderConfig, forward, hidden_states, init_model,
                                 vocab_kernel_VxE)
from fnrl.models.synthetic import SMALL_SHAPES, random_params
from tests.tolerances import assert_close

VOCAB = 211


def _cfg(family, **kw):
    return DecoderConfig(**{**SMALL_SHAPES[family], "model_type": family, "vocab_size": VOCAB,
                            **kw})


def _batch(B=2, T=24, seed=0):
    rng = np.random.default_rng(seed)
    tokens_BxT = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    return tokens_BxT[:, :-1], tokens_BxT[:, 1:]


def _mean_logp(graphdef, params, inputs_BxT, targets_BxT):
    logits_BxTxV = forward(graphdef, params, inputs_BxT)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1).mean()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_loss_and_gradients(family, policy):
    cfg = _cfg(family, num_hidden_layers=3)
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    plain, _ = init_model(cfg, 0)
    remat, _ = init_model(cfg, 0, remat=policy)
    inputs_BxT, targets_BxT = _batch()
    grad = lambda g: jax.jit(jax.value_and_grad(lambda p: _mean_logp(g, p, inputs_BxT,
                                                                      targets_BxT)))(params)
    # Float32 at full precision on every platform: on a GPU the default is TF32, under
    # which the two paths differed by 1.4e-4 (an H200).
    with jax.default_matmul_precision("highest"):
        (loss0, grads0), (loss1, grads1) = grad(plain), grad(remat)
    # Recomputation repeats the same float32 ops; XLA may fuse them differently, so allow
    # rounding-level differences only (tests/tolerances.py: wider on a GPU).
    assert_close(loss1, loss0, "float32")
    jax.tree.map(lambda a, b: assert_close(a, b, "float32"), grads1, grads0)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads0)) > 1e-3


def test_remat_recomputes_in_the_backward_pass():
    """The compiled gradient of the remat model runs each layer's matmuls twice. One
    layer: remat scans the layers, so its program holds one layer's body whatever
    their number, where the plain model's repeats it per layer."""
    cfg = _cfg("qwen2", num_hidden_layers=1)
    params = random_params(cfg, 0)
    inputs_BxT, targets_BxT = _batch()

    def count_dots(graphdef):
        loss = lambda p: _mean_logp(graphdef, p, inputs_BxT, targets_BxT)
        return str(jax.jit(jax.grad(loss)).lower(params).as_text()).count("dot_general")

    plain, remat = init_model(cfg, 0)[0], init_model(cfg, 0, remat=True)[0]
    assert count_dots(remat) > count_dots(plain)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_bfloat16_compute_over_float32_params_tracks_float32(family):
    """bf16 activations with fp32 master weights: token log-probs within 0.05 nats on
    average of float32's (bf16 has 8 mantissa bits: ~0.4% per op), never NaN, and the
    gradients point the same way (cosine > 0.99)."""
    cfg = _cfg(family)
    params = random_params(cfg, 1, init_std=0.1, perturb_std=0.2)
    g32, _ = init_model(cfg, 0)
    g16, _ = init_model(cfg, 0, dtype=jnp.bfloat16)
    inputs_BxT, targets_BxT = _batch(seed=1)

    def logp(graphdef, p):
        logits_BxTxV = forward(graphdef, p, inputs_BxT)
        assert logits_BxTxV.dtype == jnp.float32  # the projection accumulates in fp32
        return jnp.take_along_axis(jax.nn.log_softmax(logits_BxTxV, -1),
                                   targets_BxT[..., None], -1)[..., 0]

    ref_BxT, low_BxT = np.asarray(logp(g32, params)), np.asarray(logp(g16, params))
    assert np.isfinite(low_BxT).all() and ref_BxT.std() > 0.5
    assert np.abs(low_BxT - ref_BxT).mean() < 0.05
    grad = lambda g: jax.grad(lambda p: logp(g, p).mean())(params)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
    a, b = flat(grad(g32)), flat(grad(g16))
    assert flat(grad(g16)).dtype == np.float32  # gradients land on the fp32 master weights
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_states_and_vocab_kernel_rebuild_the_logits(tied):
    """What chunked log-probs use: hidden states × the V×E kernel, any vocab slice."""
    cfg = _cfg("qwen3", tie_word_embeddings=tied)
    params = random_params(cfg, 2, init_std=0.1)
    for dtype in (jnp.float32, jnp.bfloat16):
        graphdef, _ = init_model(cfg, 0, dtype=dtype)
        inputs_BxT, _ = _batch(T=7)
        h_BxTxE = hidden_states(graphdef, params, inputs_BxT)
        kernel_VxE = vocab_kernel_VxE(graphdef, params)
        assert h_BxTxE.dtype == kernel_VxE.dtype == dtype
        assert kernel_VxE.shape == (VOCAB, cfg.hidden_size)
        logits_BxTxV = forward(graphdef, params, inputs_BxT)
        chunk_BxTxC = jnp.einsum("bte,ve->btv", h_BxTxE, kernel_VxE[100:150],
                                 preferred_element_type=jnp.float32)
        # Same products, possibly another summation order: equal to float32 rounding.
        np.testing.assert_allclose(chunk_BxTxC, logits_BxTxV[..., 100:150], rtol=0, atol=1e-4)
    expected = params["embedding"] if tied else params["lm_head"].T
    np.testing.assert_array_equal(vocab_kernel_VxE(init_model(cfg, 0)[0], params), expected)
