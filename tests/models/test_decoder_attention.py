"""Blockwise attention and the scanned remat path against the plain decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fnrl.models.decoder import ATTENTION_BLOCK, DecoderConfig, forward, init_model
from fnrl.models.synthetic import SMALL_SHAPES, random_params

VOCAB = 211


def _cfg(family, **kw):
    return DecoderConfig(**{**SMALL_SHAPES[family], "model_type": family, "vocab_size": VOCAB,
                            **kw})


def _packed_batch(B=2, T=27, seed=0):
    """Two rows of packed sequences (segment ids 1, 2, ..., 0 for padding) whose positions
    restart at each segment, so a block boundary falls inside and between segments."""
    rng = np.random.default_rng(seed)
    tokens_BxT = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
    segment_ids_BxT = np.zeros((B, T), np.int32)
    positions_BxT = np.zeros((B, T), np.int32)
    cuts = [(0, 11, 20, 27), (0, 5, 23, 25)]   # the last row ends in 2 padding positions
    for b, row in enumerate(cuts):
        for s, (start, stop) in enumerate(zip(row[:-1], row[1:])):
            segment_ids_BxT[b, start:stop] = s + 1
            positions_BxT[b, start:stop] = np.arange(stop - start)
    segment_ids_BxT[1, 23:] = 0
    return tokens_BxT[:, :-1], tokens_BxT[:, 1:], positions_BxT, segment_ids_BxT


def _loss_and_grads(graphdef, params, batch):
    inputs_BxT, targets_BxT, positions_BxT, segment_ids_BxT = batch

    def loss(p):
        logits_BxTxV = forward(graphdef, p, inputs_BxT, positions_BxT, segment_ids_BxT)
        logp_BxT = jnp.take_along_axis(jax.nn.log_softmax(logits_BxTxV, -1),
                                       targets_BxT[..., None], -1)[..., 0]
        return jnp.mean(logp_BxT * (segment_ids_BxT > 0)), logits_BxTxV

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("block,remat", [(8, False), (7, False), (8, True), (0, True)])
def test_blockwise_attention_and_remat_match_the_plain_decoder(family, block, remat):
    """Logits, loss and every gradient of query blocks of `block` positions (27 = 3 × 8
    + 3 and 3 × 7 + 6: a short last block), rematerialised or not, equal the one-block
    decoder's to float32 rounding, with packed segments and restarting positions."""
    cfg = _cfg(family, num_hidden_layers=3)
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    batch = _packed_batch()
    plain, _ = init_model(cfg, 0, attention_block=0)
    other, _ = init_model(cfg, 0, attention_block=block, remat=remat)
    loss0, logits0, grads0 = _loss_and_grads(plain, params, batch)
    loss1, logits1, grads1 = _loss_and_grads(other, params, batch)
    # The same float32 ops over fewer (always masked) keys: only summation order differs.
    np.testing.assert_allclose(logits1, logits0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads1, grads0)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads0)) > 1e-3


def test_blocks_leave_out_later_keys_without_changing_attention():
    """A query block attends only to keys up to its last position: position t's output
    does not depend on any later token, with blocks as without."""
    cfg = _cfg("qwen2", num_hidden_layers=2)
    params = random_params(cfg, 3, init_std=0.1)
    graphdef, _ = init_model(cfg, 0, attention_block=4)
    tokens_BxT = np.random.default_rng(3).integers(0, VOCAB, (1, 16)).astype(np.int32)
    changed_BxT = tokens_BxT.copy()
    changed_BxT[0, 9:] = (changed_BxT[0, 9:] + 1) % VOCAB
    a, b = forward(graphdef, params, tokens_BxT), forward(graphdef, params, changed_BxT)
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert float(jnp.abs(a[:, 9:] - b[:, 9:]).max()) > 1e-3


def test_attention_block_is_checked_and_defaults_on():
    with pytest.raises(ValueError, match="attention_block"):
        init_model(_cfg("qwen2"), 0, attention_block=-1)
    model = nnx.merge(*init_model(_cfg("qwen2"), 0))
    assert ATTENTION_BLOCK > 0
    assert all(layer.attn.block == ATTENTION_BLOCK for layer in model.layers)


def _temp_bytes(graphdef, params, T):
    inputs_BxT = jnp.zeros((2, T), jnp.int32)
    loss = lambda p: forward(graphdef, p, inputs_BxT).mean()
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_remat_and_blocks_shrink_the_compiled_temporaries():
    """XLA's buffer plan of the gradient at 512 positions, where the float32 scores
    dominate: remat over 4 layers keeps well under all layers' activations, and query
    blocks of 64 shrink it further, with remat and without (measured: 137 MB plain,
    42 remat, 24 remat with blocks, 78 blocks alone)."""
    cfg = _cfg("qwen3", num_hidden_layers=4)
    _, params = init_model(cfg, 0)
    temp = lambda **kw: _temp_bytes(init_model(cfg, 0, **kw)[0], params, 512)
    plain, remat = temp(attention_block=0), temp(attention_block=0, remat=True)
    assert remat < 0.5 * plain
    assert temp(attention_block=64, remat=True) < 0.7 * remat
    assert temp(attention_block=64) < 0.7 * plain
