"""Causal grouped-query attention by kernel name, with packed rows on every kernel.

    out_BxTxHxD = attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, kernel="cudnn",
                         segment_ids_BxT=seg, max_segments=64)

Kernels (`KERNELS`), one call site, chosen by platform (fnrl.trainer.platform) and
overridable (`--trainer.attention`):
  xla    the reference: einsum scores in float32 and a softmax, query blocks of
         `block` positions at a time (each block recomputed in the backward pass), on
         every platform. The CPU twin of `cudnn`: it reads packed rows the same way.
  cudnn  cuDNN's fused flash attention through JAX (GPU, bfloat16/float16 only): no
         T×S scores exist in HBM, the causal mask is not computed at all.

Packed rows are the trap. A row holds several sequences (segment ids 1, 2, ..., then 0
for padding) and attention must stay inside each. The public
`jax.nn.dot_product_attention(implementation="cudnn")` takes one length per row and no
segment ids, so a packed row would attend across its sequences (MaxText's cuDNN path
did exactly this, its issue #4476). Here a packed row is described to cuDNN as its runs
(`segment_runs`: each run's start and length, the padding tail a run of its own), the
"THD" packed layout of JAX's cuDNN binding (`q_offsets` / `q_seqlen`, Hopper or later).
The xla kernel builds its mask from the same runs, so the CPU tests of packed ==
unpacked go through the code that computes what cuDNN is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

KERNELS = ("xla", "cudnn")

ATTENTION_OUT = "attention_out"
"""The name the attention output carries for remat policies (`checkpoint_name`): the
"dots" policy saves it, so a fused kernel's forward is not run again in the backward."""


FUSED_ATTENTION_PRIMITIVES = frozenset({"dot_product_attention_fwd",
                                        "dot_product_attention_fwd_wrapper"})
"""JAX's cuDNN forward primitives, whose outputs include the softmax statistics the
backward kernel reads: a remat policy that saved only the attention output would run
the fused forward again in the backward pass to get them."""


def saves_fused_attention(prim, *_, **__) -> bool:
    """A remat policy (`jax.checkpoint_policies` form): keep the fused attention's outputs."""
    return prim.name in FUSED_ATTENTION_PRIMITIVES


def segment_runs(segment_ids_BxT: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Each row's runs of equal segment ids as (lengths_BxM, starts_BxM1), int32: run m
    of row b covers positions starts[b, m] .. starts[b, m] + lengths[b, m] - 1; unused
    entries are -1 (M = max_segments, starts has one more column, always ending in -1).
    This is the layout of JAX's cuDNN packed attention (`q_seqlen`, `q_offsets`).

    A row with more than `max_segments` runs cannot be described: its extra runs are
    merged into the last one, which `check_segment_count` (host side) rules out first.
    """
    B, T = segment_ids_BxT.shape
    starts_BxT = jnp.concatenate([jnp.ones((B, 1), bool),
                                  segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    # Run index of every position; positions of runs past the last slot join the last.
    run_BxT = jnp.minimum(jnp.cumsum(starts_BxT, axis=1) - 1, max_segments - 1)
    one_hot_BxTxM = run_BxT[:, :, None] == jnp.arange(max_segments)[None, None, :]
    lengths_BxM = jnp.sum(one_hot_BxTxM, axis=1, dtype=jnp.int32)
    first_BxM = jnp.argmax(one_hot_BxTxM, axis=1).astype(jnp.int32)
    lengths_BxM = jnp.where(lengths_BxM > 0, lengths_BxM, -1)
    starts_BxM = jnp.where(lengths_BxM > 0, first_BxM, -1)
    starts_BxM1 = jnp.concatenate([starts_BxM, jnp.full((B, 1), -1, jnp.int32)], axis=1)
    return lengths_BxM, starts_BxM1


def check_segment_count(segment_ids_BxT: np.ndarray, max_segments: int) -> None:
    """Host-side: ValueError naming the row when a row has more runs (sequences, and a
    padding tail) than the attention kernel is compiled for."""
    seg = np.asarray(segment_ids_BxT)
    runs_B = 1 + np.sum(seg[:, 1:] != seg[:, :-1], axis=1)
    worst = int(np.argmax(runs_B))
    if runs_B[worst] > max_segments:
        raise ValueError(f"row {worst} of the batch packs {int(runs_B[worst])} runs (sequences "
                         f"and its padding tail) but attention is built for at most "
                         f"max_segments={max_segments}")


def _run_mask(segment_ids_BxT, max_segments: int) -> jax.Array:
    """B×T×S: query t may see key s (causal, same run), from `segment_runs`'s layout."""
    lengths_BxM, starts_BxM1 = segment_runs(segment_ids_BxT, max_segments)
    T = segment_ids_BxT.shape[1]
    t = jnp.arange(T)
    starts_BxM = starts_BxM1[:, :-1]
    inside_BxMxT = ((t[None, None, :] >= starts_BxM[:, :, None])
                    & (t[None, None, :] < (starts_BxM + lengths_BxM)[:, :, None])
                    & (lengths_BxM[:, :, None] > 0))
    run_BxT = jnp.argmax(inside_BxMxT, axis=1)
    same_BxTxS = run_BxT[:, :, None] == run_BxT[:, None, :]
    return same_BxTxS & jnp.tril(jnp.ones((T, T), bool))[None]


def causal_mask(B: int, T: int, segment_ids_BxT=None, max_segments: int = 0) -> jax.Array:
    """B×T×T boolean mask of the xla kernel: causal, and inside one run when packed."""
    if segment_ids_BxT is None:
        return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    if max_segments <= 0:   # no bound given: as many runs as positions (exact, costlier)
        max_segments = T
    return _run_mask(segment_ids_BxT, max_segments)


def _attend_block(q_BxTxKxGxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    """Softmax attention of T queries over S keys, scores and softmax in float32."""
    D = q_BxTxKxGxD.shape[-1]
    scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                                  preferred_element_type=jnp.float32) * D**-0.5
    # finfo.min instead of -inf: the diagonal is always visible, so no row is all-masked.
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS,
                                 jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(q_BxTxKxGxD.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxS, v_BxSxKxD)


def _xla(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, block: int):
    # Query head h uses kv head h // G, as HF repeat_kv does; grouping avoids the copy.
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxSxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
    block = block if 0 < block < T else T
    outs = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        # Keys after a block's last query are masked (causal), so they are left out;
        # checkpointed, a block's scores live only while its output or its gradient
        # is being computed.
        attend = jax.checkpoint(_attend_block) if block < T else _attend_block
        outs.append(attend(q_BxTxKxGxD[:, start:stop], k_BxSxKxD[:, :stop],
                           v_BxSxKxD[:, :stop], mask_BxTxS[:, start:stop, :stop]))
    out_BxTxKxGxD = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out_BxTxKxGxD.reshape(B, T, H, D)


def _cudnn(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxT, max_segments: int):
    if segment_ids_BxT is None:
        return jax.nn.dot_product_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, is_causal=True,
                                            implementation="cudnn")
    # The packed layout is not in jax.nn's signature; JAX's own cuDNN binding has it.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    lengths_BxM, starts_BxM1 = segment_runs(segment_ids_BxT, max_segments)
    D = q_BxTxHxD.shape[-1]
    # Every position is in a run (the padding tail too): cuDNN leaves positions outside
    # every run undefined, and they would reach the loss as NaN times a zero mask.
    return dot_product_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD,
                                 q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
                                 q_offsets=starts_BxM1, kv_offsets=starts_BxM1,
                                 scale=float(D**-0.5), mask_type=MaskType.PADDING_CAUSAL)


def attend(q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array, *,
           kernel: str = "xla", mask_BxTxS: jax.Array | None = None,
           segment_ids_BxT: jax.Array | None = None, max_segments: int = 0,
           block: int = 0) -> jax.Array:
    """Causal attention of queries over keys at the same positions (self-attention),
    heads grouped (H a multiple of K), output B×T×H×D named `ATTENTION_OUT`.

    xla reads `mask_BxTxS` (from `causal_mask`, built once for all layers); cudnn reads
    `segment_ids_BxT` and `max_segments` (its runs, `segment_runs`)."""
    if kernel == "xla":
        if mask_BxTxS is None:
            B, T = q_BxTxHxD.shape[:2]
            mask_BxTxS = causal_mask(B, T, segment_ids_BxT, max_segments)
        out = _xla(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, block)
    elif kernel == "cudnn":
        out = _cudnn(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxT,
                     max_segments or q_BxTxHxD.shape[1])
    else:
        raise ValueError(f"attention kernel {kernel!r} is not one of {KERNELS}")
    return checkpoint_name(out, ATTENTION_OUT)


def cudnn_unsupported(*, dtype, head_dim: int, platform: str) -> str | None:
    """Why the cudnn kernel cannot run this model here (None: it can). The checks JAX's
    binding makes at trace time, made before anything is built."""
    if platform != "gpu":
        return f"cuDNN attention needs a GPU (platform is {platform})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16/float16, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"cuDNN flash attention needs a head dim that is a multiple of 8 up to 256 ({head_dim})"
    return None
