"""The trainer's π on the sampler's support: with top-k, top-p or both, vLLM reports the
log-probs of the truncated, renormalised distribution (`processed_logprobs`); the
trainer's log-probs at the same weights must be those, so the importance ratio is 1.

The reference is vLLM's own top-k/top-p op (vllm.v1.sample.ops.topk_topp_sampler), run
on the same logits in torch: before this, the ratio was the kept mass on every token
(0.90 under top-p 0.9)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.trainer.logprobs import logprobs_from_hidden, support_threshold
from tests.tolerances import assert_close

B, T, E, V = 2, 12, 16, 64
SETTINGS = [(8, 1.0), (-1, 0.9), (20, 0.8), (1, 1.0), (-1, 1.0)]


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((B, T, E)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((V, E)) * 0.6, jnp.float32)
    return h, kernel


def _vllm_processed_logprobs(z_BxTxV: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    z = torch.from_numpy(np.asarray(z_BxTxV, np.float32).reshape(-1, V).copy())
    k = None if top_k <= 0 else torch.full((z.shape[0],), top_k, dtype=torch.long)
    p = None if top_p >= 1.0 else torch.full((z.shape[0],), top_p, dtype=torch.float32)
    out = ops.apply_top_k_top_p_pytorch(z, k, p)
    return torch.log_softmax(out, -1).numpy().reshape(z_BxTxV.shape)


def _sample(logp_BxTxV: np.ndarray, seed=1) -> np.ndarray:
    """Tokens drawn from the truncated distribution, as vLLM would draw them."""
    rng = np.random.default_rng(seed)
    probs = np.exp(logp_BxTxV.astype(np.float64))
    probs /= probs.sum(-1, keepdims=True)
    flat = probs.reshape(-1, V)
    return np.array([rng.choice(V, p=row) for row in flat], np.int32).reshape(B, T)


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", SETTINGS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_ratio_is_one_under_top_k_top_p_and_both(top_k, top_p, temperature):
    h, kernel = _inputs()
    with jax.default_matmul_precision("highest"):
        z = np.asarray(jnp.einsum("bte,ve->btv", h, kernel)) / temperature
    mu = _vllm_processed_logprobs(z, top_k, top_p)
    target = _sample(mu)
    mu_target = np.take_along_axis(mu, target[..., None], -1)[..., 0]
    for chunk in (0, 8):   # the autodiff reference and the fused chunked path
        with jax.default_matmul_precision("highest"):
            logp, _ = logprobs_from_hidden(h, jnp.asarray(target), kernel, chunk_tokens=chunk,
                                           with_entropy=False, temperature=temperature,
                                           top_k=top_k, top_p=top_p)
        ratio = np.exp(np.asarray(logp) - mu_target)
        np.testing.assert_allclose(ratio, 1.0, rtol=0, atol=2e-5)
    # Without the support the ratio would be the kept mass: truncation really happened.
    if top_k > 0 or top_p < 1.0:
        full, _ = logprobs_from_hidden(h, jnp.asarray(target), kernel, chunk_tokens=0,
                                       with_entropy=False, temperature=temperature)
        assert np.max(np.asarray(logp) - np.asarray(full)) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", SETTINGS[:3])
def test_fused_gradients_equal_autodiff_on_the_support(top_k, top_p):
    """The fused backward (p zero off the support, entropy of the truncated
    distribution) equals autodiff of the unchunked reference."""
    h, kernel = _inputs(2)
    target = jnp.asarray(np.random.default_rng(3).integers(0, V, (B, T)), jnp.int32)
    z = jnp.einsum("bte,ve->btv", h, kernel) / 0.8
    # Targets on the support (a sampled token always is).
    threshold = support_threshold(z, top_k, top_p)
    target = jnp.where(jnp.take_along_axis(z, target[..., None], -1)[..., 0] >= threshold,
                       target, jnp.argmax(z, -1))
    w_logp = jnp.asarray(np.random.default_rng(4).standard_normal((B, T)), jnp.float32)

    def loss(chunk):
        def f(h, kernel):
            logp, entropy = logprobs_from_hidden(h, target, kernel, chunk_tokens=chunk,
                                                 with_entropy=True, temperature=0.8,
                                                 top_k=top_k, top_p=top_p)
            return jnp.sum(logp * w_logp) + 0.3 * jnp.sum(entropy)
        with jax.default_matmul_precision("highest"):
            return jax.value_and_grad(f, argnums=(0, 1))(h, kernel)

    (v0, g0), (v1, g1) = loss(0), loss(5)
    assert np.isfinite(float(v0))
    assert_close(v1, v0)
    jax.tree.map(lambda a, b: assert_close(a, b), g1, g0)
