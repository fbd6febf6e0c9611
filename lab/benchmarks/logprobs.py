"""Log-probs and entropy with their gradient, three ways, side by side in one run.

    python -m lab.benchmarks.logprobs [--rows 2 --length 1024 --vocab 16384 --embed 256
                                   --chunk 512 --repeats 5 --dtype float32]

For the loss Σ w·log p + Σ u·H over B×T tokens it prints, for the value and gradient
(wrt the hidden states and the vocabulary kernel) compiled once: the median step time,
the compiled buffers' temp bytes, and both as ratios to the unchunked path. The ways:
`fused` is fnrl's chunked path (a hand-written VJP, fnrl.trainer.logprobs), `remat` the
chunked path it replaced (each chunk under `jax.checkpoint` in a `lax.map`, autodiff
through it), `unchunked` the full B×T×V logits through autodiff.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


from fnrl.trainer.logprobs import _project, logprobs_from_hidden, positions_per_chunk


def remat_logprobs(h_BxTxE, target_BxT, kernel_VxE, *, chunk_tokens, with_entropy,
                   temperature=1.0):
    """The chunked path before the fused VJP: autodiff through rematerialised chunks."""
    B, T, E = h_BxTxE.shape
    c = positions_per_chunk(B, T, chunk_tokens)
    n = -(-T // c)
    pad = n * c - T
    h_NxBxCxE = jnp.pad(h_BxTxE, ((0, 0), (0, pad), (0, 0))).reshape(B, n, c, E).swapaxes(0, 1)
    t_NxBxC = jnp.pad(target_BxT, ((0, 0), (0, pad))).reshape(B, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(args):
        logp_BxC, entropy_BxC = _project(*args, kernel_VxE, with_entropy, temperature)
        return logp_BxC, (entropy_BxC if with_entropy else jnp.zeros_like(logp_BxC))

    logp_NxBxC, entropy_NxBxC = jax.lax.map(chunk, (h_NxBxCxE, t_NxBxC))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * c)[:, :T]  # noqa: E731
    return unchunk(logp_NxBxC), unchunk(entropy_NxBxC)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per chunk")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the hidden states' dtype")
    args = ap.parse_args()
    B, T, V, E = args.rows, args.length, args.vocab, args.embed
    keys = jax.random.split(jax.random.key(0), 5)
    h_BxTxE = jax.random.normal(keys[0], (B, T, E)).astype(args.dtype)
    kernel_VxE = jax.random.normal(keys[1], (V, E)) / E ** 0.5
    target_BxT = jax.random.randint(keys[2], (B, T), 0, V)
    w_BxT, u_BxT = jax.random.normal(keys[3], (B, T)), jax.random.normal(keys[4], (B, T))
    ways = {
        "fused": lambda h, k: logprobs_from_hidden(h, target_BxT, k, chunk_tokens=args.chunk,
                                                   with_entropy=True),
        "remat": lambda h, k: remat_logprobs(h, target_BxT, k, chunk_tokens=args.chunk,
                                             with_entropy=True),
        "unchunked": lambda h, k: logprobs_from_hidden(h, target_BxT, k, chunk_tokens=0,
                                                       with_entropy=True),
    }
    print(f"B={B} T={T} V={V} E={E} chunk={args.chunk} tokens, h {args.dtype}, "
          f"{jax.devices()[0].device_kind}; B×T×V float32 = {B * T * V * 4 / 2**20:.1f} MiB")
    rows = {}
    for name, way in ways.items():
        def loss(h, k, way=way):
            logp_BxT, entropy_BxT = way(h, k)
            return jnp.sum(logp_BxT * w_BxT) + jnp.sum(entropy_BxT * u_BxT)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = step.lower(h_BxTxE, kernel_VxE).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(compiled(h_BxTxE, kernel_VxE))   # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(h_BxTxE, kernel_VxE))
            times.append(time.perf_counter() - start)
        rows[name] = (statistics.median(times), temp)
    base_time, base_temp = rows["unchunked"]
    print(f"{'way':<10} {'step ms':>9} {'x unchunked':>12} {'temp MiB':>9} {'x unchunked':>12}")
    for name, (seconds, temp) in rows.items():
        print(f"{name:<10} {seconds * 1e3:9.1f} {seconds / base_time:12.2f} "
              f"{temp / 2**20:9.1f} {temp / base_temp:12.3f}")


if __name__ == "__main__":
    main()
