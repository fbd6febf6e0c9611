"""The two sides of lab/benchmarks/train_step.py: what each side's process runs.

    python -m lab.benchmarks.train_step --side fnrl --preset qwen0.5b   # one JSON line out

Each side builds the preset's model, runs `warmup` untimed steps and `steps` timed ones
(paced by its parent one step at a time, or back to back) and prints one JSON line:
step and CPU seconds, peak memory (device and host) and what it computed with. fnrl
runs as its trainer role does (fnrl.trainer.platform's defaults for the device found,
remat planned against its bytes_limit) and compiles the step ahead of time, so XLA's
memory plan is that of the executable timed; torch runs transformers' Qwen2ForCausalLM
eagerly (or torch.compile'd) under bfloat16 autocast where fnrl computes in bfloat16.
"""

from __future__ import annotations

import json
import os
import sys
import time

NOT_MODEL = ("batch", "seq", "dtype")
"""Preset keys that are not the model's config."""

def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trainer_xla_flags() -> None:
    """The XLA options the trainer role sets, so the step is measured as it runs there."""
    try:
        from fnrl.trainer.xla_flags import use_memory_scheduler
    except ImportError:  # a tree from before the trainer set any (a "before" figure)
        return
    use_memory_scheduler()


def _batch_numpy(p: dict, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, p["vocab_size"], (p["batch"], p["seq"] + 1)).astype(np.int32)
    mask = np.ones((p["batch"], p["seq"]), np.float32)
    mask[:, : p["seq"] // 4] = 0.0  # a prompt quarter: trained on the response only
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:], "mask_BxT": mask,
            "behaviour_logp_BxT": np.full(mask.shape, -8.0, np.float32) * mask,
            "adv_B": rng.standard_normal(p["batch"]).astype(np.float32)}


def _time_steps(step, steps: int, warmup: int, paced: bool):
    """(wall seconds of each timed step, CPU seconds of each (all threads), seconds of the
    first call, compile included unless compiled before).

    paced: the parent sends one line per step on stdin and reads each step's time
    back, so two sides' steps interleave (see `speed`); else the steps run back to back.
    """
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    if paced:
        print(json.dumps({"ready": first}), flush=True)
    times, cpu = [], []
    for _ in range(steps):
        if paced and sys.stdin.readline().strip() != "step":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if paced:
            print(json.dumps({"step_s": times[-1]}), flush=True)
    return times, cpu, first


def run_fnrl(p: dict, steps: int, warmup: int, paced: bool = False, *, remat: str = "auto",
             attention: str = "auto") -> dict:
    import jax
    import jax.numpy as jnp

    from fnrl.config import AlgoConfig, TrainerConfig
    from fnrl.models.decoder import DecoderConfig, abstract_model, init_model
    from fnrl.trainer.fit import compiled_plan, fit_remat
    from fnrl.trainer.memory import resolve_for_device, trainer_memory
    from fnrl.trainer.platform import describe, model_kernels
    from fnrl.trainer.step import compile_train_step, init_state, make_optimizer

    base_mb = _rss_mb()
    device = jax.devices()[0]
    # As the trainer role does: remat is planned against what the allocator may use.
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    cfg = DecoderConfig(**{k: v for k, v in p.items() if k not in NOT_MODEL})
    algo = AlgoConfig(learning_rate=1e-5)
    tc, why = resolve_for_device(TrainerConfig(compute_dtype=p["dtype"], remat=remat,
                                               attention=attention),
                                 platform=device.platform, model=cfg, algo=algo,
                                 rows=p["batch"], length=p["seq"], device_bytes=limit)
    optimizer = make_optimizer(algo)
    batch = jax.device_put(_batch_numpy(p))

    def model(tc):
        return init_model(cfg, seed=0, dtype=jnp.dtype(tc.compute_dtype),
                          param_dtype=jnp.dtype(tc.param_dtype), **model_kernels(tc))

    def build(tc):
        return compile_train_step(abstract_model(cfg, dtype=jnp.dtype(tc.compute_dtype),
                                                 param_dtype=jnp.dtype(tc.param_dtype),
                                                 **model_kernels(tc))[0],
                                  optimizer, algo, None, None, micro_batches=tc.micro_batches,
                                  logprob_chunk=tc.logprob_chunk,
                                  matmul_precision=tc.matmul_precision)

    # Compiled ahead of time, on shapes alone: XLA's memory plan of the very executable
    # that is timed. An automatic remat is fitted to the device's limit by that plan, as
    # the trainer role does (fnrl.trainer.fit).
    t0 = time.perf_counter()
    # (state, batch, ref_params, controls, frozen): no reference model, controls or LoRA base.
    args = (jax.eval_shape(lambda: init_state(model(tc)[1], optimizer)), batch, None, None, None)
    if remat == "auto" and limit:
        tc, why, _, compiled = fit_remat(tc, why, build=build, args=args, limit=limit)
    else:
        compiled = build(tc).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    kernels = describe(tc, why)
    print(kernels, file=sys.stderr, flush=True)
    params = model(tc)[1]
    state = jax.jit(lambda q: init_state(q, optimizer), donate_argnums=0)(params)
    del params
    box = {"state": state}
    del state

    def one():
        box["state"], box["metrics"] = compiled(box["state"], batch, *args[2:])
        jax.block_until_ready(box["metrics"])

    times, cpu, first = _time_steps(one, steps, warmup, paced)
    stats = device.memory_stats() or {}
    plan = trainer_memory(cfg, tc, algo, rows=p["batch"], length=p["seq"],
                          platform=device.platform, device=device.platform != "cpu")
    return {"step_s": times, "cpu_s": cpu, "first_call_s": first, "compile_s": compile_s,
            "loss": float(box["metrics"]["loss"]),
            "device": device.device_kind, "platform": device.platform, "kernels": kernels,
            "trainer": {k: getattr(tc, k) for k in ("compute_dtype", "param_dtype", "remat",
                                                    "attention", "matmul_precision",
                                                    "logprob_chunk")},
            "peak_device_mb": stats.get("peak_bytes_in_use", 0) / 2**20 if stats else None,
            "device_limit_mb": stats.get("bytes_limit", 0) / 2**20 if stats else None,
            "xla_plan": compiled_plan(compiled), "fnrl_plan_step_peak": plan.step_peak_bytes,
            "peak_rss_mb": _peak_rss_mb(), "base_rss_mb": base_mb,
            "threads": len(os.sched_getaffinity(0)),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")}


def run_torch(p: dict, steps: int, warmup: int, paced: bool = False, *, remat: str = "none",
              compile_model: bool = False) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base_mb = _rss_mb()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    # fnrl's "auto" computes in bfloat16 on an accelerator (fnrl.trainer.platform).
    bf16 = p["dtype"] == "bfloat16" or (p["dtype"] == "auto" and cuda)
    cfg = Qwen2Config(**{k: v for k, v in p.items() if k not in NOT_MODEL},
                      max_position_embeddings=max(p["seq"], 512), attn_implementation="sdpa")
    torch.manual_seed(0)
    with dev:  # initialised on the device: a 3B model's random init on CPU takes minutes
        model = Qwen2ForCausalLM(cfg)
    model = model.float().train()
    if remat == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    forward = torch.compile(model) if compile_model else model
    b = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in _batch_numpy(p).items()}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)
    box = {}

    def step():
        with amp:
            logits = forward(input_ids=b["input_BxT"].long(), use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, b["target_BxT"].long()[..., None])[..., 0]
        ratio = torch.exp(logp - b["behaviour_logp_BxT"])
        adv = b["adv_B"][:, None]
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
        mask = b["mask_BxT"]
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        box["loss"] = loss
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, cpu, first = _time_steps(step, steps, warmup, paced)
    return {"step_s": times, "cpu_s": cpu, "first_call_s": first, "loss": float(box["loss"]),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "platform": "gpu" if cuda else "cpu",
            "kernels": (f"torch {torch.__version__}: {'bfloat16 autocast' if bf16 else 'float32'}"
                        f" over float32 weights, SDPA, gradient checkpointing {remat}"
                        f"{', torch.compile' if compile_model else ''}"),
            "torch_remat": remat, "torch_compile": compile_model,
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "reserved_device_mb": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
            "peak_rss_mb": _peak_rss_mb(), "base_rss_mb": base_mb,
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}
