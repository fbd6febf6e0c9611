"""LlamaRL's trainer/generator split under GPU memory limits (arXiv 2505.24034, §7 and
Appendix B): a pure planner over the paper's memory model.

Per GPU (LlamaRL Table 2), with W the bytes of one model replica, m a model-parallel
degree and b a batch size:
    trainer    (4W + A_t·b_t) / m_t     weights, two Adam moments, gradients, activations
    generator  (W + K_g·b_g) / m_g      weights, KV cache of b_g concurrent sequences
    colocated  (5W + A_t·b_t + K_g·b_g) / m   both on every GPU (the synchronous baseline)
Step time for a global batch of B samples on G GPUs, from the per-sample times
η_t(b) = τ_t(b)/b and η_g(b) = τ_g(b)/b of one model instance (Eqs. 2, 3):
    colocated  (B·m/G)·(η_t(b_t) + η_g(b_g))              the phases add
    split      B·max(η_t(b_t)·m_t / G_t, η_g(b_g)·m_g / G_g),  G_t + G_g = G
`plan_colocated` and `plan_split` minimise these over model-parallel degrees, batch
sizes and (split) the trainer's GPU count. Theorem 7.5: with per-sample times falling
in the batch size, the split is strictly faster, because the two memory constraints
apart admit smaller m and larger b than the one they share.

Gaps the paper leaves, filled here:
  - m is continuous in the paper; here it is a listed integer degree (`mp_sizes`) and
    each side's GPU count a multiple of its degree, so the balance T_t/θ = T_g/(1 − θ)
    (Eq. 16) holds only up to that rounding.
  - The paper drops integrality of the micro-steps B·m/(G·b); so does this.
  - Table 2's "free-able" column is unused, as in the paper: the colocated baseline
    holds the trainer's state and a generator copy at once.
  - The paper's τ does not depend on m (Remark 7.1 assumes no form); here η is called
    with the degree too, η(b, m), so a caller with a cost model (the simulator's
    roofline, where an instance of m GPUs is faster but pays m-way communication) can
    say so. A function that ignores m is the paper's model.
  - A quantized generator (LlamaRL's fp8, §4.3) holds `gen_weights` bytes rather than W.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

PerSample = Callable[[int, int], float]   # (batch size, model-parallel degree) -> seconds per sample (η)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitProblem:
    gpus: int                        # G: GPUs of the job
    batch: int                       # B: samples (trajectories) per RL step
    gpu_memory: float                # M: usable bytes per GPU
    weights: float                   # W: bytes of one model replica
    act_per_sample: float            # A_t: trainer activation bytes per sample of b_t
    kv_per_sample: float             # K_g: generator KV bytes per concurrent sequence
    mp_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    train_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    gen_batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    gen_weights: float = 0.0         # bytes of the generator's replica (0: W; fp8: W/2)

    def __post_init__(self):
        for name in ("gpus", "batch", "gpu_memory", "weights"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SplitProblem.{name}={getattr(self, name)!r}: must be > 0")
        for name in ("act_per_sample", "kv_per_sample", "gen_weights"):
            if getattr(self, name) < 0:
                raise ValueError(f"SplitProblem.{name}={getattr(self, name)!r}: must be >= 0")
        for name in ("mp_sizes", "train_batches", "gen_batches"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"SplitProblem.{name}={values!r}: need positive integers")


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str                  # "colocated" or "split"
    step_s: float              # seconds per RL step
    train_s: float             # the training phase's seconds (split: on its G_t GPUs)
    gen_s: float               # the generation phase's seconds
    mp_train: int
    mp_gen: int
    batch_train: int
    batch_gen: int
    gpus_train: int            # colocated: every GPU does both
    gpus_gen: int
    mem_train: float           # bytes per GPU (colocated: both phases' total)
    mem_gen: float


def trainer_memory(p: SplitProblem, b_t: int, m_t: int) -> float:
    return (4 * p.weights + p.act_per_sample * b_t) / m_t


def generator_memory(p: SplitProblem, b_g: int, m_g: int) -> float:
    return ((p.gen_weights or p.weights) + p.kv_per_sample * b_g) / m_g


def colocated_memory(p: SplitProblem, b_t: int, b_g: int, m: int) -> float:
    return (5 * p.weights + p.act_per_sample * b_t + p.kv_per_sample * b_g) / m


def _too_small(p: SplitProblem, what: str, need: float) -> ValueError:
    return ValueError(
        f"no {what} fits: the smallest needs {need / 1e9:.1f} GB per GPU at model-parallel "
        f"degree {max(p.mp_sizes)} (weights {p.weights / 1e9:.1f} GB), and a GPU holds "
        f"{p.gpu_memory / 1e9:.1f} GB")


def plan_colocated(p: SplitProblem, eta_t: PerSample, eta_g: PerSample) -> Plan:
    """The synchronous baseline's best configuration (Eq. 6)."""
    best = None
    for m in p.mp_sizes:
        if p.gpus % m:
            continue
        for b_t in p.train_batches:
            for b_g in p.gen_batches:
                mem = colocated_memory(p, b_t, b_g, m)
                if mem > p.gpu_memory:
                    continue
                train, gen = (p.batch * m / p.gpus * eta_t(b_t, m),
                              p.batch * m / p.gpus * eta_g(b_g, m))
                if best is None or train + gen < best.step_s:
                    best = Plan("colocated", train + gen, train, gen, m, m, b_t, b_g, p.gpus,
                                p.gpus, mem, mem)
    if best is None:
        raise _too_small(p, "colocated configuration", colocated_memory(
            p, min(p.train_batches), min(p.gen_batches), max(p.mp_sizes)))
    return best


def _best_side(sizes: Sequence[int], batches: Sequence[int], eta: PerSample,
               memory: Callable[[int, int], float], limit: float) -> dict[int, tuple]:
    """{m: (η(b)·m, b, bytes)}: each degree's best feasible batch size (Eq. 14 / 15)."""
    out = {}
    for m in sizes:
        options = [(eta(b, m) * m, b, memory(b, m)) for b in batches if memory(b, m) <= limit]
        if options:
            out[m] = min(options)
    return out


def plan_split(p: SplitProblem, eta_t: PerSample, eta_g: PerSample) -> Plan:
    """LlamaRL's best configuration (Eq. 7): each side its own degree and batch size under
    its own memory limit, and the trainer's GPU count that balances the two."""
    trainer = _best_side(p.mp_sizes, p.train_batches, eta_t,
                         lambda b, m: trainer_memory(p, b, m), p.gpu_memory)
    generator = _best_side(p.mp_sizes, p.gen_batches, eta_g,
                           lambda b, m: generator_memory(p, b, m), p.gpu_memory)
    if not trainer:
        raise _too_small(p, "trainer", trainer_memory(p, min(p.train_batches), max(p.mp_sizes)))
    if not generator:
        raise _too_small(p, "generator", generator_memory(p, min(p.gen_batches),
                                                           max(p.mp_sizes)))
    best = None
    for m_t, (cost_t, b_t, mem_t) in trainer.items():
        for m_g, (cost_g, b_g, mem_g) in generator.items():
            for g_t in range(m_t, p.gpus, m_t):
                g_g = p.gpus - g_t
                if g_g % m_g:
                    continue
                train, gen = p.batch * cost_t / g_t, p.batch * cost_g / g_g
                step = max(train, gen)
                if best is None or step < best.step_s:
                    best = Plan("split", step, train, gen, m_t, m_g, b_t, b_g, g_t, g_g,
                                mem_t, mem_g)
    if best is None:
        raise ValueError(f"{p.gpus} GPUs do not split into a trainer and a generator group "
                         f"of the model-parallel degrees {p.mp_sizes}")
    return best
