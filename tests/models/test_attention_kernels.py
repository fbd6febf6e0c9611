"""Attention kernels by name: packed rows equal the same sequences unpacked, through the
runs cuDNN is given (`segment_runs`), and the remat policies equal no remat.

The xla kernel runs everywhere; tests marked `gpu` also run the cudnn kernel where the
platform is a GPU (scripts/gpu_check.sh), with bfloat16 tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.models.attention import check_segment_count, segment_runs
from fnrl.models.decoder import DecoderConfig, Kernels, forward, init_model
from fnrl.models.synthetic import SMALL_SHAPES, random_params
from tests.tolerances import assert_close

VOCAB = 97
LENGTHS = ((9, 5, 11), (7, 14))   # sequences packed per row, then padding to T
T = 27


def _cfg(family="qwen2", **kw):
    return DecoderConfig(**{**SMALL_SHAPES[family], "model_type": family, "vocab_size": VOCAB,
                            **kw})


def test_segment_runs_is_cudnns_packed_layout():
    seg = jnp.array([[1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 0, 0, 0]])
    lengths, starts = segment_runs(seg, max_segments=5)
    np.testing.assert_array_equal(lengths, [[2, 3, 2, -1, -1], [7, -1, -1, -1, -1],
                                            [1, 1, 1, 1, 3]])
    np.testing.assert_array_equal(starts, [[0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1],
                                           [0, 1, 2, 3, 4, -1]])
    check_segment_count(np.asarray(seg), 5)
    with pytest.raises(ValueError, match="row 2 of the batch packs 5 runs.*max_segments=4"):
        check_segment_count(np.asarray(seg), 4)


def _sequences(seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, n + 1).astype(np.int32) for n in row] for row in LENGTHS]


def _packed(seqs):
    """Rows of packed sequences: tokens, targets, positions restarting, segment ids and
    the loss mask (0 on padding)."""
    B = len(seqs)
    arrays = {k: np.zeros((B, T), np.int32) for k in ("input", "target", "pos", "seg")}
    for b, row in enumerate(seqs):
        start = 0
        for s, tokens in enumerate(row):
            n = len(tokens) - 1
            span = slice(start, start + n)
            arrays["input"][b, span], arrays["target"][b, span] = tokens[:-1], tokens[1:]
            arrays["pos"][b, span], arrays["seg"][b, span] = np.arange(n), s + 1
            start += n
    return arrays


def _loss_and_grads(graphdef, params, inputs, targets, positions, segments, weights):
    def loss(p):
        logits = forward(graphdef, p, inputs, positions, segments).astype(jnp.float32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
        return jnp.sum(logp * weights) / jnp.sum(weights)
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss))(params)


def _packed_vs_unpacked(cfg, dtype, **kernels):
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    graphdef, _ = init_model(cfg, 0, dtype=dtype, max_segments=8, **kernels)
    seqs = _sequences()
    p = _packed(seqs)
    packed = _loss_and_grads(graphdef, params, p["input"], p["target"], p["pos"], p["seg"],
                             (p["seg"] > 0).astype(np.float32))
    # Every sequence alone in a right-padded row of its own, no segment ids.
    flat = [t for row in seqs for t in row]
    U = len(flat)
    inputs, targets = np.zeros((U, T), np.int32), np.zeros((U, T), np.int32)
    weights = np.zeros((U, T), np.float32)
    for u, tokens in enumerate(flat):
        inputs[u, :len(tokens) - 1], targets[u, :len(tokens) - 1] = tokens[:-1], tokens[1:]
        weights[u, :len(tokens) - 1] = 1.0
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (U, T))
    unpacked = _loss_and_grads(graphdef, params, inputs, targets, positions, None, weights)
    return packed, unpacked


def _assert_same(a, b, dtype):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    name = jnp.dtype(dtype).name
    assert_close(loss_a, loss_b, name)
    jax.tree.map(lambda x, y: assert_close(x, y, name), grads_a, grads_b)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_a)) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("remat", ["none", "dots"])
@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_packed_rows_equal_the_sequences_unpacked_xla(family, remat):
    """The xla kernel reads packed rows through segment_runs (cudnn's layout): each
    sequence sees only itself, and the padding tail changes nothing."""
    packed, unpacked = _packed_vs_unpacked(_cfg(family), jnp.float32, remat=remat,
                                           attention="xla", attention_block=8)
    _assert_same(packed, unpacked, jnp.float32)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_policies_equal_no_remat(remat):
    cfg = _cfg("qwen2", num_hidden_layers=3)
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    p = _packed(_sequences(1))
    weights = (p["seg"] > 0).astype(np.float32)
    runs = [_loss_and_grads(init_model(cfg, 0, remat=r, max_segments=8)[0], params, p["input"],
                            p["target"], p["pos"], p["seg"], weights) for r in ("none", remat)]
    _assert_same(*runs, jnp.float32)


@pytest.mark.slow   # compiles full steps: the whole suite's, not the inner loop's
def test_remat_policies_keep_what_they_name():
    """XLA's buffer plan of the gradient: full keeps less than dots, dots less than none."""
    cfg = _cfg("qwen2", num_hidden_layers=4, hidden_size=64, intermediate_size=256)
    params = random_params(cfg, 0)
    tokens = jnp.zeros((4, 128), jnp.int32)

    def temp(remat):
        graphdef, _ = init_model(cfg, 0, remat=remat)
        grad = jax.jit(jax.grad(lambda p: jnp.mean(forward(graphdef, p, tokens))))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    full, dots, none = temp("full"), temp("dots"), temp("none")
    assert full < dots < none, (full, dots, none)


def test_kernel_names_are_checked():
    with pytest.raises(ValueError, match="attention must be one of"):
        Kernels(attention="flash")
    with pytest.raises(ValueError, match="remat must be one of"):
        init_model(_cfg(), 0, remat="some")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the cudnn kernel needs a GPU")
@pytest.mark.parametrize("remat", ["none", "dots"])
def test_packed_rows_equal_the_sequences_unpacked_cudnn(remat):
    """cuDNN's packed layout: the trap of MaxText #4476 (attending across sequences)
    would change every packed sequence after the first."""
    cfg = _cfg("qwen2", head_dim=64)
    packed, unpacked = _packed_vs_unpacked(cfg, jnp.bfloat16, remat=remat, attention="cudnn")
    _assert_same(packed, unpacked, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the cudnn kernel needs a GPU")
def test_cudnn_matches_xla_in_bfloat16():
    cfg = _cfg("qwen2", head_dim=64)
    params = random_params(cfg, 0, init_std=0.1, perturb_std=0.2)
    p = _packed(_sequences(2))
    weights = (p["seg"] > 0).astype(np.float32)
    runs = [_loss_and_grads(init_model(cfg, 0, dtype=jnp.bfloat16, attention=k, max_segments=8)[0],
                            params, p["input"], p["target"], p["pos"], p["seg"], weights)
            for k in ("xla", "cudnn")]
    _assert_same(*runs, jnp.bfloat16)
