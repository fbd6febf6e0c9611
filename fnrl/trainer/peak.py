"""Peak resident memory of train steps of a random model, measured in this process.

    python -m fnrl.trainer.peak --rows 8 --length 1024 --logprob-chunk 1024 --remat full \
        --compute-dtype bfloat16            # Qwen2.5-0.5B-shaped, one JSON line out

Run one configuration per process: the peak (the kernel's VmHWM) is the process's.
It is reset after the state is built, so `step_peak_bytes` is what the steps add on
top of the state and runtime, and `peak_bytes` the process's whole peak.
lab/benchmarks/train_step.py imports `measure_train_step` for its memory column.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fnrl.config import AlgoConfig, LoraConfig, TrainerConfig
from fnrl.models.decoder import DecoderConfig, abstract_model, init_model
from fnrl.models.synthetic import QWEN25_05B
from fnrl.trainer.fit import compiled_plan
from fnrl.trainer.memory import trainer_memory
from fnrl.models.lora import split_adapters
from fnrl.trainer.platform import model_kernels, resolve_trainer, storage_dtype
from fnrl.trainer.step import compile_train_step, init_state, make_optimizer
from fnrl.trainer.xla_flags import use_memory_scheduler


def _status_bytes(key: str) -> int:
    """A `VmHWM` / `VmRSS` line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux clear_refs 5); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def random_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """An unpacked batch of random tokens: every position trained, mixed advantages."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length + 1)).astype(np.int32)
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:],
            "mask_BxT": np.ones((rows, length), np.float32),
            "behaviour_logp_BxT": np.full((rows, length), -np.log(vocab), np.float32),
            "adv_B": rng.standard_normal(rows).astype(np.float32)}


def _setup(model: DecoderConfig, trainer: TrainerConfig, algo: AlgoConfig, *, abstract: bool):
    trainer = resolve_trainer(trainer, platform=jax.default_backend(), model=model)[0]
    compute, param = jnp.dtype(trainer.compute_dtype), jnp.dtype(trainer.param_dtype)
    kernels = model_kernels(trainer)
    build = functools.partial(init_model, model, 0, dtype=compute, param_dtype=param, **kernels)
    optimizer = make_optimizer(algo)
    step = compile_train_step(build()[0] if not abstract else abstract_model(
        model, dtype=compute, param_dtype=param, **kernels)[0], optimizer, algo,
        None, None, micro_batches=trainer.micro_batches, logprob_chunk=trainer.logprob_chunk,
        matmul_precision=trainer.matmul_precision)
    base = jnp.dtype(storage_dtype(trainer))

    def state_and_frozen():
        """The state of the trained params; with LoRA the base apart, in its dtype."""
        params = build()[1]
        if not trainer.lora.enabled:
            return init_state(params, optimizer), None
        adapters, frozen = split_adapters(params)
        return init_state(adapters, optimizer), jax.tree.map(lambda x: x.astype(base), frozen)

    if abstract:
        state, frozen = jax.eval_shape(state_and_frozen)
    else:
        state, frozen = jax.jit(state_and_frozen)()
    return step, state, frozen


def compiled_memory(model: DecoderConfig, trainer: TrainerConfig, algo: AlgoConfig, *,
                    rows: int, length: int) -> dict:
    """XLA's own buffer plan for one train step, from compiling it on abstract inputs
    (nothing is allocated or run): arguments (the state and batch), outputs, what the
    donated state aliases, and the temporaries at the step's peak."""
    step, state, frozen = _setup(model, trainer, algo, abstract=True)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         random_batch(rows, length, model.vocab_size))
    return compiled_plan(step.lower(state, batch, None, None, frozen).compile())


def measure_train_step(model: DecoderConfig, trainer: TrainerConfig, algo: AlgoConfig, *,
                       rows: int, length: int, steps: int = 2) -> dict:
    """Builds a random `model` in trainer.param_dtype, runs `steps` train steps (the first
    compiles) of rows × length tokens, and returns the measured figures with the memory
    plan's estimate beside them (fnrl.trainer.memory)."""
    step, state, frozen = _setup(model, trainer, algo, abstract=False)
    batch = random_batch(rows, length, model.vocab_size)
    jax.block_until_ready(state)
    state_rss = _status_bytes("VmRSS")
    reset = _reset_peak()
    times, peaks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, None, None, frozen)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        peaks.append(_status_bytes("VmHWM"))
        _reset_peak()   # the first step's peak includes compiling it
    peak = max(peaks)
    plan = trainer_memory(model, trainer, algo, rows=rows, length=length)
    return {"rows": rows, "length": length, "logprob_chunk": trainer.logprob_chunk,
            "remat": trainer.remat, "compute_dtype": trainer.compute_dtype,
            "lora_rank": trainer.lora.rank,
            "param_dtype": trainer.param_dtype, "peak_bytes": peak,
            "state_rss_bytes": state_rss,
            "step_peak_bytes": peak - state_rss if reset else None,
            "step_peaks_bytes": peaks if reset else None,
            "plan_step_peak_bytes": plan.step_peak_bytes, "plan_peak_bytes": plan.peak_bytes, "step_s": times,
            "loss": float(metrics["loss"])}


def main() -> None:
    use_memory_scheduler()   # as the trainer role does; XLA_FLAGS may override it
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"])
    parser.add_argument("--logprob-chunk", type=int, default=0)
    parser.add_argument("--remat", default="none", choices=("auto", "none", "dots", "full"))
    parser.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"))
    parser.add_argument("--compute-dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--param-dtype", default="float32")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--compile-only", action="store_true",
                        help="XLA's buffer plan of the step only (nothing allocated or run)")
    args = parser.parse_args()
    fields = {f.name for f in dataclasses.fields(DecoderConfig)}
    model = DecoderConfig(**{**{k: v for k, v in QWEN25_05B.items() if k in fields},
                             "num_hidden_layers": args.layers})
    trainer = TrainerConfig(logprob_chunk=args.logprob_chunk, remat=args.remat,
                            attention=args.attention,
                            compute_dtype=args.compute_dtype, param_dtype=args.param_dtype,
                            micro_batches=args.micro_batches,
                            lora=LoraConfig(rank=args.lora_rank))
    if args.compile_only:
        out = compiled_memory(model, trainer, AlgoConfig(), rows=args.rows, length=args.length)
        out["plan_step_peak"] = trainer_memory(model, trainer, AlgoConfig(), rows=args.rows,
                                               length=args.length).step_peak_bytes
    else:
        out = measure_train_step(model, trainer, AlgoConfig(), rows=args.rows,
                                 length=args.length, steps=args.steps)
    print(json.dumps({"layers": args.layers, **out}))


if __name__ == "__main__":
    main()
